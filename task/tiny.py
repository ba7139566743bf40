"""The CPU demo's task: write N copies of a letter. Prompt "<bos>17:", target "a" * 17 then <eos>.
N is drawn with weight 1/N up to data.tiny_max_count, so most answers are short and a few are
long: the long-tailed length distribution RL rollouts have. A ~130k-parameter model learns it from
its reward in minutes on CPU.

Each built-in task is one module of task/ like this one, which task/data.py finds by data.task's
name: the config fields it reads, the characters its text needs, its prompts, its reward and what
eval votes on (task/reverse.py: the smallest complete one).
"""

import logging
import random

import rewards
from sample import Prompt

# the config fields it reads beyond those every task reads (task/data.py refuses the others)
FIELDS = {"data.tiny_max_count", "data.num_tiny_prompts"}
CHARS = "0123456789:a"  # its prompts' and answers' characters (the tiny model's vocabulary)
log = logging.getLogger("task")


def prompts(cfg, tokenizer, split, seed, tool=None):
    """data.num_tiny_prompts prompts for "train" (data.num_val_prompts for "val"), N up to
    data.tiny_max_count (`draw`)."""
    d = cfg.data
    number = d.num_tiny_prompts if split == "train" else d.num_val_prompts
    return draw(tokenizer, number, d.tiny_max_count, seed)


def draw(tokenizer, number, max_count, seed):
    """`number` prompts with N drawn with weight 1/N from 1..max_count, fixed by `seed`."""
    rng = random.Random(seed)
    counts = list(range(1, max_count + 1))
    weights = [1 / n for n in counts]
    out = []
    for n in rng.choices(counts, weights=weights, k=number):
        ids = [tokenizer.bos_token_id] + tokenizer(f"{n}:", add_special_tokens=False).input_ids
        out.append(Prompt(prompt_ids=ids, answer=str(n)))
    return out


def check(cfg):
    """Warn when some answers cannot fit what a sample may generate (N letters, then <eos>): they
    always score 0. A warning, not an error: a short budget is a fair way to run a quick test."""
    budget = cfg.rollout.max_trajectory_tokens()
    counts = range(1, cfg.data.tiny_max_count + 1)
    if budget <= counts[-1]:
        share = sum(1 / n for n in counts if n >= budget) / sum(1 / n for n in counts)
        log.warning(
            "data.tiny_max_count=%d: answers of %d or more letters need more tokens than the "
            "budget of %d (rollout.max_new_tokens, max_response_tokens) allows with <eos>; about "
            "%.0f%% of prompts always score 0",
            counts[-1],
            budget,
            budget,
            100 * share,
        )


def reward(response_text, answer, finished):
    """Positionwise credit for N copies of 'a': 1 for exact, 0 if the sample never emitted <eos>."""
    return rewards.positionwise(response_text, "a" * int(answer)) if finished else 0.0


def answer_of(text):
    """What eval's maj@k votes on: the whole response."""
    return text
