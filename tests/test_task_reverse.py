"""The reverse-a-string task (task/reverse.py), the example of a built-in task as one module: its
config loads and refuses the fields it does not read, its letters extend the tiny vocabulary
without moving the demo's token ids, its prompts, reward and eval vote are right, and its config
trains end to end on the real engine (3 steps, a background run: conftest.BackgroundRuns; its own
engine, as its model's vocabulary differs from the shared engine's)."""

import logging
import os
import sys

import pytest

import extras.eval as evaluate
import runtime.model as model
import task.data as tasks
import task.reverse as reverse
from assemble import load_config
from config import ConfigError
from conftest import REPO, scratch
from test_train import scalars

CONFIG = os.path.join(REPO, "configs", "tiny_reverse.yaml")
RUN = scratch("reverse")
RUN_SETS = ["train.steps=3", "run.val_every=3", "data.num_val_prompts=16", f"run.out={RUN}"]
RUN_COMMAND = [sys.executable, "train.py", "--config", CONFIG]
for item in RUN_SETS:
    RUN_COMMAND += ["--set", item]


def test_the_reverse_task_is_one_module_with_its_own_letters(caplog):
    cfg = load_config(CONFIG, ["data.num_tiny_prompts=300"])
    assert "reverse" in tasks.task_names()
    chars = tasks.vocabulary(cfg, model.TINY_CHARS)
    # the demo's characters first, unmoved; the letters it adds after them
    assert chars == model.TINY_CHARS + "bcdef"
    tokenizer = model.build_char_tokenizer(chars)
    demo = model.build_char_tokenizer()
    assert tokenizer("17:a").input_ids == demo("17:a").input_ids
    task = tasks.build_task(cfg, tokenizer)
    assert len(task.train_prompts) == 300 and len(task.val_prompts) == cfg.data.num_val_prompts
    for prompt in task.train_prompts[:50]:
        text = tokenizer.decode(prompt.prompt_ids, skip_special_tokens=True)
        assert text.endswith("=") and prompt.answer == text[:-1][::-1]
        assert 1 <= len(prompt.answer) <= reverse.MAX_LENGTH
    # validation strings are never training strings (drawn from one pool, 228 of 256 were)
    trained = {p.answer for p in task.train_prompts}
    assert not trained & {p.answer for p in task.val_prompts}
    assert all(reverse.held_out(p.answer[::-1]) for p in task.val_prompts)
    assert task.reward_fn("cba", "cba", True) == 1.0
    assert task.reward_fn("cba", "cba", False) == 0.0  # never emitted <eos>
    assert task.reward_fn("cbd", "cba", True) == pytest.approx(2 / 3)
    assert task.tool is None
    assert evaluate.answer_of("reverse", "cba") == "cba"
    # a budget too short for the longest answers is named at load (they would always score 0)
    with caplog.at_level(logging.WARNING, logger="task"):
        load_config(CONFIG, ["rollout.max_new_tokens=4"])
    assert "a budget of 4 tokens" in caplog.text
    assert "answers of 4 or more letters need more with <eos>" in caplog.text
    # a field only the demo tasks read is refused, named
    with pytest.raises(ConfigError, match="data.tiny_max_count=5 is read only by"):
        load_config(CONFIG, ["data.tiny_max_count=5"])


@pytest.mark.background("reverse_run", RUN_COMMAND)
def test_the_reverse_config_trains_on_the_real_engine(background_runs):
    """configs/tiny_reverse.yaml, 3 steps: the model built with the task's vocabulary, served by
    its own engine, trained and validated; rewards are scored (not all zero: the model already
    emits some letters right by chance)."""
    background_runs.lines("reverse_run")
    logged = scalars(RUN)
    assert len(logged["train/reward_mean"]) == 3
    assert "val/reward_mean" in logged and logged["rollout/reward_errors"] == [0, 0, 0]
    assert max(logged["train/reward_mean"]) > 0
