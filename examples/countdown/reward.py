"""Countdown's reward (data.reward: examples/countdown/reward.py:countdown_reward): reach the target
with the given numbers, each used exactly once, and + - * / and parentheses, the equation inside
<answer></answer>.

The model's equation is untrusted text: it is checked character by character, its numbers are
compared with the row's, and it is evaluated by the trainer's calculator (Python's `ast`, bounded;
never `eval`).
"""

import json
import math
import re

from task.tools import calculator

# no '**', no decimals, no exponents: the game's four operations
ALLOWED = frozenset("0123456789+-*/() ")
FORMAT_CREDIT = 0.1  # an answer in the asked-for form that is not a correct equation


def countdown_reward(response_text, answer, finished):
    """1.0 for a correct equation, FORMAT_CREDIT for a well-formed wrong one, 0.0 otherwise.
    `answer` is the row's JSON {"target": int, "numbers": [int, ...]}; `finished` is not used (a
    correct equation counts wherever the response ended)."""
    row = json.loads(answer)
    # the last complete <answer>...</answer>, found in linear time (a non-greedy findall rescans
    # the rest of the text after every unclosed "<answer>": quadratic on hostile text)
    end = response_text.rfind("</answer>")
    start = response_text.rfind("<answer>", 0, end) if end >= 0 else -1
    if start < 0:
        return 0.0
    equation = (
        response_text[start + len("<answer>") : end].split("=")[0].strip()
    )  # "3 * 8 = 24" is accepted: the left side is checked
    if (
        not equation
        or len(equation) > 200
        or set(equation) - ALLOWED
        or "**" in equation
        or "//" in equation
    ):
        return 0.0
    if sorted(int(n) for n in re.findall(r"\d+", equation)) != sorted(row["numbers"]):
        return FORMAT_CREDIT  # a number missing, reused, or not given
    result = calculator(equation)
    if result.startswith("error"):
        return FORMAT_CREDIT
    return 1.0 if math.isclose(float(result), row["target"], abs_tol=1e-6) else FORMAT_CREDIT
