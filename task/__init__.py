"""What a run trains on: prompts from the tiny demos, GSM8K or your own rows (data.py), and the
tools a multi-turn trajectory may call (tools.py). The rewards that judge them are rewards.py's."""
