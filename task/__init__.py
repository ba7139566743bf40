"""What a run trains on: a module per task (its prompts and reward; the built-in ones: tiny.py,
tiny_tool.py, gsm8k.py, chat.py, reverse.py, and any module added here), data.py, which finds the
one data.task names and streams its prompts, and the tools a multi-turn trajectory may call
(tools.py)."""
