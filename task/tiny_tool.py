"""The multi-turn tool demo: prompt "<bos>37*85-3141=", answer "4". A product minus a number just
below it, so the answer is a digit from 2 to 9 that depends jointly on the last digits of all
three numbers (no pair of them tells it) and not at all on the leading ones. A ~130k-parameter
model does not learn that from its reward in minutes: without the tool it guesses (1 in 8). The
call is one token, "?", ending a turn: the calculator (`tool`) evaluates the question and the
rollout appends "=4"; the model answers by repeating the digit. Random init ends its first turn
with "?" in about a quarter of the samples, so calls are found by sampling. A task module as
task/tiny.py describes.
"""

import random

import rewards
from sample import Prompt
import task.tools as tools

FIELDS = {"data.tiny_operand_digits", "data.num_tiny_prompts"}
CHARS = "0123456789*-=?"


def prompts(cfg, tokenizer, split, seed, tool=None):
    """data.num_tiny_prompts questions for "train" (data.num_val_prompts for "val"), operands of
    data.tiny_operand_digits digits (`draw`)."""
    d = cfg.data
    number = d.num_tiny_prompts if split == "train" else d.num_val_prompts
    return draw(tokenizer, number, d.tiny_operand_digits, seed)


def draw(tokenizer, number, digits, seed):
    """`number` questions "a*b-c=" with a, b of `digits` digits and a digit answer, by `seed`."""
    rng = random.Random(seed)
    out = []
    for _ in range(number):
        a, b = rng.randint(10 ** (digits - 1), 10**digits - 1), rng.randint(
            10 ** (digits - 1), 10**digits - 1
        )
        answer = rng.randint(2, 9)
        ids = [tokenizer.bos_token_id] + tokenizer(
            f"{a}*{b}-{a * b - answer}=", add_special_tokens=False
        ).input_ids
        out.append(Prompt(prompt_ids=ids, answer=str(answer)))
    return out


def tool(cfg, tokenizer):
    """Its multi-turn trajectories' tool (rollout.max_turns > 1): "?" asks the calculator."""
    return tools.QuestionCalculator(tokenizer)


def reward(response_text, answer, finished):
    """Positionwise credit of the final answer (the last turn's text), whether or not it ended: 1
    for exactly the digit. A last turn that is a call ("...?") was never answered: 0."""
    if response_text.endswith("?"):
        return 0.0
    return rewards.positionwise(response_text, answer)


def answer_of(text):
    """What eval's maj@k votes on: the final turn's whole text."""
    return text
