"""Countdown data: rows {"prompt", "answer"} for data.task: chat. Each row gives 3 or 4 numbers and
a target reachable with them (built from a random equation over them: every row has a solution); the
answer is JSON {"target", "numbers"} for examples/countdown/reward.py.

Run from the repo root: `python examples/countdown/make_data.py` writes
examples/countdown/train.jsonl (10,000 rows) and test.jsonl (200 rows); `--out DIR --train N --test
N --seed S` change that.
"""

import argparse
import json
import os
import random

from fractions import Fraction

PROMPT = (
    "Using the numbers {numbers}, write an equation that equals {target}. "
    "Use each number exactly once, with + - * / and parentheses. "
    "Think it through, then give only the equation inside "
    "<answer></answer>, for example <answer>(1 + 2) * 3</answer>."
)


def solvable_row(rng):
    """Numbers and a positive integer target some equation over all of them reaches (exact
    arithmetic)."""
    while True:
        numbers = [rng.randint(1, 50) for _ in range(rng.choice((3, 4)))]
        order = rng.sample(numbers, len(numbers))
        value = Fraction(order[0])
        for n in order[1:]:
            op = rng.choice("+-*/")
            value = (
                value + n
                if op == "+"
                else value - n if op == "-" else value * n if op == "*" else value / n
            )
        if value.denominator == 1 and 0 < value <= 1000:
            return numbers, int(value)


def rows(count, rng):
    out = []
    for _ in range(count):
        numbers, target = solvable_row(rng)
        out.append(
            {
                "prompt": PROMPT.format(numbers=numbers, target=target),
                "answer": json.dumps({"target": target, "numbers": numbers}),
            }
        )
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--train", type=int, default=10_000)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    for name, count in (("train", args.train), ("test", args.test)):
        with open(os.path.join(args.out, f"{name}.jsonl"), "w") as f:
            for row in rows(count, rng):
                f.write(json.dumps(row) + "\n")
    print(f"wrote {args.train} train and {args.test} test rows to {args.out}")


if __name__ == "__main__":
    main()
