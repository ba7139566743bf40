"""Reverse a string: prompt "<bos>cab=", target "bac" then <eos>. The smallest complete task
module, an example to copy: a new built-in task is a module like this one in task/ (data.task
names it), a config (configs/tiny_reverse.yaml) and a test (tests/test_task_reverse.py), and no
other file changes. Its letters are not in the demo's vocabulary: `CHARS` adds them to the tiny
model's (task.data.vocabulary). A setting of its own would be a field of config.DataConfig,
listed in FIELDS; this one reuses data.num_tiny_prompts.
"""

import hashlib
import logging
import random

import rewards
from sample import Prompt

# the config fields it reads beyond data.task, data.reward, data.max_prompt_len and
# data.num_val_prompts (any other set is refused at load: task/data.py)
FIELDS = {"data.num_tiny_prompts"}
LETTERS = "abcdef"
MAX_LENGTH = 4
CHARS = LETTERS + "="  # what its text is made of: the tiny model's vocabulary gains "bcdef"
log = logging.getLogger("task")


def prompts(cfg, tokenizer, split, seed, tool=None):
    """data.num_tiny_prompts strings for "train" (data.num_val_prompts for "val"): each of 1 to
    MAX_LENGTH letters, drawn by `seed` from its split's strings (`held_out`: validation's have 2
    or more); the answer is the string reversed."""
    rng = random.Random(seed)
    number = cfg.data.num_tiny_prompts if split == "train" else cfg.data.num_val_prompts
    out = []
    while len(out) < number:
        text = "".join(rng.choices(LETTERS, k=rng.randint(1, MAX_LENGTH)))
        if held_out(text) != (split == "val"):
            continue
        ids = [tokenizer.bos_token_id] + tokenizer(f"{text}=", add_special_tokens=False).input_ids
        out.append(Prompt(prompt_ids=ids, answer=text[::-1]))
    return out


def held_out(text):
    """Is `text` a validation string? A fixed fifth of the strings of two or more letters, chosen
    by a hash of the text, so validation measures strings never trained on (drawn from one pool,
    228 of 256 validation strings were also training strings). The six of one letter, each its
    own reverse, all train."""
    return len(text) > 1 and hashlib.blake2b(text.encode(), digest_size=1).digest()[0] % 5 == 0


def check(cfg):
    """Warn when the longest answers cannot fit what a sample may generate (the letters, then
    <eos>): they always score 0."""
    budget = cfg.rollout.max_trajectory_tokens()
    if budget <= MAX_LENGTH:
        log.warning(
            "a budget of %d tokens (rollout.max_new_tokens, max_response_tokens): answers of %d or "
            "more letters need more with <eos>, and always score 0",
            budget,
            budget,
        )


def reward(response_text, answer, finished):
    """Positionwise credit against the reversed string: 1 for exactly it, 0 if the sample never
    emitted <eos>."""
    return rewards.positionwise(response_text, answer) if finished else 0.0


def answer_of(text):
    """What eval's maj@k votes on: the whole response."""
    return text
