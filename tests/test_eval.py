"""Judging and replaying a run: eval.py's metrics against hand-computed examples, and, on one short
demo run of its own (in the background: its own engine, then eval.py's, then a replay with none),
the eval line, training's val/pass@k, and a dumped step's update replayed exactly."""

import json
import os
import re
import sys
import tempfile

import pytest

import eval as evaluation
from test_train import scalars

EVAL_RUN = os.path.join(tempfile.mkdtemp(prefix="eval-run-"), "run")
EVAL_COMMAND = " && ".join(
    [
        f"{sys.executable} train.py --out {EVAL_RUN} --set train.steps=3 --set run.val_every=2 "
        "--set run.val_samples=4 --set run.dump_rollouts=true --set run.checkpoint_every=1 "
        "--set rollout.prompts_per_step=8 --set data.num_val_prompts=8 >/dev/null 2>&1",
        f"{sys.executable} eval.py --run {EVAL_RUN} --samples 4 --k 1,2,4 2>/dev/null",
        f"{sys.executable} train.py --replay {EVAL_RUN}/rollouts/step_000002 2>/dev/null",
    ]
)


def test_pass_at_k_is_the_unbiased_estimator():
    """1 - C(n-c, k) / C(n, k), by hand: n=5, c=2: pass@1 = 2/5, pass@2 = 1 - 3/10; no correct
    sample gives 0, and k > n - c gives 1."""
    assert evaluation.pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert evaluation.pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert evaluation.pass_at_k(5, 0, 3) == 0.0 and evaluation.pass_at_k(4, 2, 3) == 1.0
    assert evaluation.pass_at_k(200, 10, 5) == pytest.approx(
        1 - (190 * 189 * 188 * 187 * 186) / (200 * 199 * 198 * 197 * 196)
    )
    with pytest.raises(ValueError):
        evaluation.pass_at_k(2, 1, 4)


def test_majority_vote_and_bootstrap_interval():
    """maj@k: the most frequent answer decides (no answer never wins); the interval holds the
    mean and narrows with more prompts."""
    assert evaluation.majority_correct(["7", "8", "7", None], [True, False, True, False]) == 1.0
    assert evaluation.majority_correct(["8", "7", "8"], [False, True, False]) == 0.0
    assert evaluation.majority_correct([None, None], [False, False]) == 0.0
    few = evaluation.bootstrap_interval([0.0, 1.0] * 5)
    many = evaluation.bootstrap_interval([0.0, 1.0] * 200)
    assert few[0] < 0.5 < few[1] and many[0] < 0.5 < many[1]
    assert many[1] - many[0] < few[1] - few[0]


@pytest.mark.background("eval_run", ["bash", "-c", EVAL_COMMAND])
def test_eval_command_training_pass_at_k_and_an_exact_replay(background_runs):
    """A 3-step demo run with run.val_samples=4 logs val/pass@1..4 (non-decreasing in k);
    `eval.py --run` on its last checkpoint prints the eval line (pass@k non-decreasing, each
    inside its interval) and writes every sample with its reward; `train.py --replay` of the
    dumped step 2 reproduces its logged loss and gradient norm exactly, with no engine."""
    lines = background_runs.lines("eval_run")
    logged = scalars(EVAL_RUN)
    passes = [logged[f"val/pass@{k}"][-1] for k in (1, 2, 4)]
    assert passes == sorted(passes) and len(logged["val/pass@1"]) == 3  # steps 0, 2, final
    line = next(line for line in lines if line.startswith("eval: "))
    match = re.fullmatch(
        r"eval: n=8 pass@1=([\d.]+) \[([\d.]+),([\d.]+)\] pass@2=([\d.]+) \[[\d.,]+\] "
        r"pass@4=([\d.]+) \[[\d.,]+\] maj@1=[\d.]+ \[[\d.,]+\] maj@2=[\d.]+ \[[\d.,]+\] "
        r"maj@4=[\d.]+ \[[\d.,]+\] greedy=[\d.]+ \[[\d.,]+\] mean_reward=[\d.]+",
        line,
    )
    assert match, line
    p1, low, high, p2, p4 = map(float, match.groups())
    assert low <= p1 <= high and p1 <= p2 <= p4
    with open(os.path.join(EVAL_RUN, "checkpoints", "step_000003", "eval.jsonl")) as f:
        records = [json.loads(row) for row in f]
    assert len(records) == 8 * 5 and {"response", "reward", "answer"} <= set(records[0])
    replayed = next(line for line in lines if line.startswith("replay: "))
    assert replayed.endswith("exact=True"), replayed
