"""Shared test fixtures: one real SGLang engine per test session (starting one costs ~20-50 s on CPU)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import checkpoint  # noqa: E402
import train  # noqa: E402
from config import load_config  # noqa: E402


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The first 100 rows of GSM8K's train split (MIT, tests/data/GSM8K_LICENSE): shipped so the tests need no download.
GSM8K_TRAIN = os.path.join(REPO, "tests", "data", "gsm8k_train_100.jsonl")


def tiny_config(out_dir, *sets):
    """The CPU demo config, smaller and faster, writing under `out_dir`."""
    return load_config("configs/tiny.yaml", [f"run.out={out_dir}", "rollout.prompts_per_step=8",
                                             "data.num_val_prompts=16", *sets])


@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    """A real SGLang engine serving the seeded tiny model; tests that change its weights restore them
    by syncing a fresh policy (train.setup does that when given this engine)."""
    os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path_factory.mktemp("engine")
    cfg = tiny_config(out)
    policy, tokenizer = train.build_policy(cfg, None)
    model_dir = checkpoint.export_for_engine(policy, tokenizer, str(out))
    engine = train.RolloutEngine(model_dir, cfg.rollout, dtype="float32", seed=0)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def qwen_tiny_dir(tmp_path_factory):
    """A small Qwen2.5-shaped model folder (tests/qwen_tiny.py), built once per session (~15 s of supervised
    steps on the shipped GSM8K rows, so it stops at <|im_end|> and writes tool calls)."""
    import qwen_tiny

    folder = tmp_path_factory.mktemp("qwen_tiny")
    qwen_tiny.build(str(folder), GSM8K_TRAIN, steps=90)
    return str(folder)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
