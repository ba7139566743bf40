"""Reverse a string: prompt "<bos>cab=", target "bac" then <eos>. The smallest complete task
module, an example to copy: a new built-in task is a module like this one in task/ (data.task
names it), a config (configs/tiny_reverse.yaml) and a test (tests/test_task_reverse.py), and no
other file changes. Its letters are not in the demo's vocabulary: `CHARS` adds them to the tiny
model's (task.data.vocabulary). A setting of its own would be a field of config.DataConfig,
listed in FIELDS; this one reuses data.num_tiny_prompts.
"""

import random

import rewards
from sample import Prompt

# the config fields it reads beyond data.task, data.reward, data.max_prompt_len and
# data.num_val_prompts (any other set is refused at load: task/data.py)
FIELDS = {"data.num_tiny_prompts"}
LETTERS = "abcdef"
MAX_LENGTH = 4
CHARS = LETTERS + "="  # what its text is made of: the tiny model's vocabulary gains "bcdef"


def prompts(cfg, tokenizer, split, seed, tool=None):
    """data.num_tiny_prompts strings for "train" (data.num_val_prompts for "val"): each of 1 to
    MAX_LENGTH letters, drawn by `seed`; the answer is the string reversed."""
    rng = random.Random(seed)
    number = cfg.data.num_tiny_prompts if split == "train" else cfg.data.num_val_prompts
    out = []
    for _ in range(number):
        text = "".join(rng.choices(LETTERS, k=rng.randint(1, MAX_LENGTH)))
        ids = [tokenizer.bos_token_id] + tokenizer(f"{text}=", add_special_tokens=False).input_ids
        out.append(Prompt(prompt_ids=ids, answer=text[::-1]))
    return out


def reward(response_text, answer, finished):
    """Positionwise credit against the reversed string: 1 for exactly it, 0 if the sample never
    emitted <eos>."""
    return rewards.positionwise(response_text, answer) if finished else 0.0


def answer_of(text):
    """What eval's maj@k votes on: the whole response."""
    return text
