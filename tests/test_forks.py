"""The README's "Fork it" recipes, run exactly as written there: each code block marked
`<!-- recipe: NAME -->` is loaded as if pasted into the module it forks (a file that star-imports
that module, then the recipe; the dict it extends is restored afterwards), then checked by
hand-computed values. A recipe that stops working fails
here. Also a policy that decides for one group, on the real engine."""

import dataclasses
import importlib.util
import os
import re

import pytest
import torch

import advantages
import cancel
import loss
import rewards
from cancel import Decision, LaunchPlan, Progress
from config import ConfigError
from assemble import load_config
from sample import Sample

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recipe(name):
    """The code block under `<!-- recipe: name -->` in README.md."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        text = f.read()
    match = re.search(rf"<!-- recipe: {name} -->\s*```python\n(.*?)```", text, re.S)
    assert match, f"README.md has no recipe {name!r}"
    return match.group(1)


@pytest.fixture
def forked(monkeypatch, tmp_path):
    """Load a recipe as if pasted into `module`: its names resolve to the module's, and its dict
    entries land in the module's fork point (a copy, undone after the test)."""

    def run(module, name, fork_point):
        monkeypatch.setattr(module, fork_point, dict(getattr(module, fork_point)))
        path = tmp_path / f"recipe_{name}.py"
        header = f"from {module.__name__} import *  # as if pasted into {module.__name__}.py\n\n"
        path.write_text(header + recipe(name))
        spec = importlib.util.spec_from_file_location(f"recipe_{name}", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))

    return run


def test_advantage_recipe_rloo(forked, tmp_path, monkeypatch):
    """RLOO by hand: group [1, 0, 1, 0] -> 1 - 1/3, 0 - 2/3; a failed member gets 0 and is left
    out of its group's baseline; `train.advantage=rloo` is a known choice only after the fork
    (also in a fork where the recipe is already pasted: the check starts from a copy without
    it)."""
    unforked = {k: v for k, v in advantages.ESTIMATORS.items() if k != "rloo"}
    monkeypatch.setattr(advantages, "ESTIMATORS", unforked)
    with pytest.raises(ConfigError, match="train.advantage"):
        load_config("configs/tiny.yaml", ["train.advantage=rloo", f"run.out={tmp_path}"])
    forked(advantages, "advantage", "ESTIMATORS")
    cfg = load_config("configs/tiny.yaml", ["train.advantage=rloo", f"run.out={tmp_path}"])
    rewards_ = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1])
    is_valid = torch.tensor([True, True, True, True, True, False])
    got = advantages.ESTIMATORS["rloo"](rewards_, group_ids, is_valid, cfg)
    assert got.tolist() == pytest.approx([2 / 3, -2 / 3, 2 / 3, -2 / 3, 0.0, 0.0])
    # through the stage: every turn of a trajectory carries its advantage
    groups = [
        [[Sample([1], [2], [0.0], [1], group_id=g, reward=r)] for r in (1.0, 0.0)] for g in (0, 1)
    ]
    trajectories, _ = advantages.compute(_trainer_stub(cfg), groups)
    assert [t[0].advantage for t in trajectories] == [1.0, -1.0, 1.0, -1.0]


def test_an_estimator_of_the_wrong_shape_is_named_not_trained_on(tmp_path, monkeypatch):
    """An estimator of yours that returns [N, 1] (a stray keepdim) made every sample's loss read
    every advantage ([B, B, T] after broadcasting): a gradient of ~0, no error. One that returns
    one value per group was cut short by zip. Both are a ValueError naming train.advantage."""
    cfg = load_config("configs/tiny.yaml", [f"run.out={tmp_path}"])
    groups = [
        [[Sample([1], [2], [0.0], [1], group_id=g, reward=r)] for r in (1.0, 0.0)] for g in (0, 1)
    ]
    for wrong in (lambda r, *_: r[:, None], lambda r, *_: r[:2], lambda r, *_: r.tolist()):
        monkeypatch.setitem(advantages.ESTIMATORS, "grpo", wrong)
        with pytest.raises(
            ValueError, match="train.advantage='grpo' returned .* expected a tensor"
        ):
            advantages.compute(_trainer_stub(cfg), groups)


def test_a_per_sample_value_reaches_a_loss_term_shaped_per_sample(forked):
    """A term of yours that reads a per-sample value: `inputs["advantages"]` is [B, 1], so it
    scales each row's tokens (as [B] it broadcast along T: with B == T a wrong loss, no error);
    and every micro-batch carries it, a rank's padding ones too (they were built apart, without
    it: a KeyError on a rank with nothing to train)."""
    import update

    monkeypatch_terms = dict(loss.TERMS)
    loss.TERMS["advantage_weighted"] = lambda inputs: inputs["advantages"] * inputs["logprobs"]
    try:
        logprobs = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
        mask = torch.ones(2, 2)
        value, _ = loss.policy_loss(
            logprobs, logprobs, torch.tensor([1.0, 0.0]), mask, terms={"advantage_weighted": 1.0}
        )
    finally:
        loss.TERMS.clear()
        loss.TERMS.update(monkeypatch_terms)
    # surrogate -A: (-1 -1 + 0 + 0) / 4; the term: row 0's log-probs x 1, row 1's x 0
    assert value.item() == pytest.approx((-2.0 + (-1.0 - 2.0)) / 4)
    real = Sample([1], [2, 3], [0.0, 0.0], [1, 1], group_id=0, advantage=0.5)
    # collate builds every micro-batch: where a per-sample value of yours is added (and then passed
    # into policy_loss's `inputs`, whose keys are fixed)
    assert update.collate([real], 0)["advantages"].tolist() == [0.5]
    for max_tokens in (0, 8):
        mbs, _ = update.micro_batches([real], 1, 0, max_tokens)
        assert mbs[0]["advantages"].tolist() == [0.5]
    filler, _ = update.micro_batches([], 1, 0, 8)  # a rank with nothing: one padding batch
    assert filler[0]["advantages"].tolist() == [0.0] * 4 and "filler" in filler[0]


def test_a_term_or_a_policy_of_the_wrong_kind_is_named(tmp_path, monkeypatch):
    """A loss term returning [B] (a per-sample value without its keepdim) failed with a
    broadcast error naming neither the term nor the shape, and where B == T (or as a scalar) it
    trained silently; a cancel policy returning a bool failed after the engine's start-up with
    `'bool' object has no attribute 'stop'`. Each is named now: the term at its first micro-batch,
    the policy at load (its first decision is asked then, on an empty Progress)."""
    logprobs, mask = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]]), torch.ones(2, 2)
    for wrong in (lambda i: i["logprobs"].sum(-1), lambda i: i["logprobs"].sum(), lambda i: 1.0):
        monkeypatch.setitem(loss.TERMS, "wrong", wrong)
        with pytest.raises(ValueError, match=r"loss term 'wrong' returned .* \[B, T\] = \(2, 2\)"):
            loss.policy_loss(logprobs, logprobs, torch.tensor([1.0, 0.0]), mask, terms={"wrong": 1})
    monkeypatch.setitem(cancel.POLICIES, "hopeless", lambda plan, progress: False)
    with pytest.raises(ConfigError, match="rollout.cancel='hopeless': its policy returned False"):
        load_config("configs/tiny.yaml", [f"run.out={tmp_path}", "rollout.cancel=hopeless"])


def _trainer_stub(cfg):
    """What advantages.compute reads without a KL reference: only the config."""

    class Stub:
        pass

    stub = Stub()
    stub.cfg = cfg
    return stub


def test_cancel_recipe_halves(forked, tmp_path):
    """The README's policy stops exactly when `target_groups` groups each have half their members
    finished (2 groups of 4: the stop comes with group 1's second member, not with group 0's
    fourth; a failed return counts nowhere), scripted with no engine. With dynamic sampling its
    stop would never be read (the kept groups decide): refused at load, as the README says."""
    forked(cancel, "cancel", "POLICIES")
    load_config("configs/tiny.yaml", ["rollout.cancel=halves", f"run.out={tmp_path}"])
    with pytest.raises(ConfigError, match="rollout.cancel='halves' with rollout.filter_groups"):
        load_config("configs/tiny.yaml", ["rollout.cancel=halves", "rollout.filter_groups=true"])
    plan = cancel.plan_launch(load_config("configs/tiny.yaml").rollout, 2)
    plan = dataclasses.replace(plan, cancel="halves", group_size=4, target_groups=2)
    progress = Progress(group_size=4)
    returns = [(0, False), (0, False), (1, False), (1, True), (0, False), (0, False)]
    for group_id, failed in returns:
        turn = Sample([1], [3, 3], [0.0, 0.0], [1, 1], group_id=group_id, masked=failed)
        progress.returned([turn], 1.0)
        assert cancel.decide(plan, progress).stop is False
    progress.returned([Sample([1], [3], [0.0], [1], group_id=1)], 1.0)
    assert cancel.decide(plan, progress).stop is True


def test_cancel_recipe_fires_on_the_cpu_demo(forked, tmp_path):
    """On configs/tiny.yaml's launch (32 groups of 8) the policy stops before every sample is
    back: once each group has 4, whatever the other 4 are doing."""
    forked(cancel, "cancel", "POLICIES")
    cfg = load_config("configs/tiny.yaml", ["rollout.cancel=halves", f"run.out={tmp_path}"])
    plan = cancel.plan_launch(cfg.rollout, cfg.rollout.prompts_per_step)
    progress = Progress(group_size=plan.group_size)
    stops = []
    for member in range(plan.group_size):
        for group_id in range(plan.num_prompts):
            progress.returned([Sample([1], [3], [0.0], [1], group_id=group_id)], 1.0)
            stops.append(cancel.decide(plan, progress).stop)
    # round-robin returns: every group has half its 8 at return 4 x 32 = 128 of 256
    assert stops.index(True) + 1 == plan.group_size // 2 * plan.num_prompts == len(stops) // 2


def test_loss_recipe_length_penalty(forked):
    """The length term by hand: token-mean of coef x logprob x length / budget, added to the
    surrogate (zero here: zero advantages)."""
    forked(loss, "loss", "TERMS")
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    value, stats = loss.policy_loss(
        logprobs,
        logprobs.detach(),
        torch.zeros(2),
        mask,
        norm_length=4,
        terms={"length_penalty": 0.1},
    )
    # row 0: length 2 -> (-1 - 2) * 2/4; row 1: length 1 -> -0.5 * 1/4; 3 trained tokens
    expected = 0.1 * ((-3.0 * 0.5) + (-0.5 * 0.25)) / 3
    assert value.item() == pytest.approx(expected)
    assert "term_length_penalty" in stats


def test_reward_recipe(tmp_path):
    """The README's reward, saved as a file and named by data.reward, judges three strings."""
    path = tmp_path / "my_reward.py"
    path.write_text(recipe("reward"))
    fn = rewards.load_reward(f"{path}:ends_with_answer")
    assert rewards.call_reward(fn, "so it is 42", "42", finished=True) == 1.0
    assert rewards.call_reward(fn, "so it is 42", "42", finished=False) == 0.0
    assert rewards.call_reward(fn, "41", "42", finished=True) == 0.0


def test_a_policy_can_cancel_one_group_while_the_rest_go_on(engine, policy, forked, tmp_path):
    """A Decision's `cancel_groups` on the real engine: group 0's members are aborted inside the
    engine at once, the other groups run to their end, and the engine holds nothing after."""

    def first_group_only(plan, progress):
        return Decision(cancel_groups=frozenset({0}))

    cfg = load_config("configs/tiny.yaml", [f"run.out={tmp_path}"])
    cancel.POLICIES["first_group_only"] = first_group_only
    try:
        plan = LaunchPlan(
            cancel="first_group_only",
            num_prompts=3,
            group_size=4,
            target_samples=12,
            target_groups=3,
        )
        prompts = [[1, 5, 6, 14], [1, 7, 14], [1, 6, 14]]  # "<bos>12:", "<bos>3:", "<bos>2:"
        samples, stats = engine.generate(prompts, 4, 1.0, cfg.rollout.max_new_tokens, plan)
    finally:
        del cancel.POLICIES["first_group_only"]
    by_group = {g: [s for s in samples if s.group_id == g] for g in range(3)}
    # aborted right after launch: a member can only have finished first by stopping at once
    assert all(s.finish_reason == "abort" or len(s.response_ids) <= 2 for s in by_group[0])
    assert sum(s.finish_reason == "abort" for s in by_group[0]) >= 2
    assert not any(s.masked for g in (1, 2) for s in by_group[g])
    assert engine.num_in_flight() == 0


def test_keep_groups_drops_finished_groups_without_calling_them_aborted(engine, tmp_path):
    """A Decision's `keep_groups` on the real engine: the other groups' finished members are masked
    out with finish_reason "dropped", counted in rollout/dropped and not in rollout/aborted; the
    policy, asked at each return, sees `returned_tokens` grow to every returned token."""
    import rollout
    import sample

    seen = []

    def keep_first(plan, progress):
        seen.append(progress.returned_tokens)
        return Decision(keep_groups=frozenset({0}))

    cfg = load_config("configs/tiny.yaml", [f"run.out={tmp_path}"])
    cancel.POLICIES["keep_first"] = keep_first
    try:
        plan = LaunchPlan(
            cancel="keep_first", num_prompts=3, group_size=4, target_samples=12, target_groups=3
        )
        prompts = [[1, 5, 6, 14], [1, 7, 14], [1, 6, 14]]
        samples, stats = engine.generate(prompts, 4, 1.0, cfg.rollout.max_new_tokens, plan)
    finally:
        del cancel.POLICIES["keep_first"]
    assert not any(s.masked for s in samples if s.group_id == 0)
    others = [s for s in samples if s.group_id != 0]
    assert len(others) == 8 and all(s.masked and s.finish_reason == "dropped" for s in others)
    for s in samples:
        s.reward = 0.0
    metrics = rollout.rollout_metrics(sample.trajectories_of(samples), stats)
    assert metrics["rollout/dropped"].value == 8 and metrics["rollout/aborted"].value == 0
    assert seen == sorted(seen) and seen[-1] == sum(len(s.response_ids) for s in samples)
