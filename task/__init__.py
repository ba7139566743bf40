"""What a run trains on: a module per task (tiny.py, tiny_tool.py, gsm8k.py, chat.py, reverse.py:
its prompts and reward), data.py, which finds the one data.task names and streams its prompts, and
the tools a multi-turn trajectory may call (tools.py)."""
