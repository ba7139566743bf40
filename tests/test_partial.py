"""Partial rollout on the real engine: a cancelled sample continues from its token ids in a later
step with every token's log-prob and version aligned, within its budget; groups wait for their
slowest member; the staleness bound restarts old samples; old tokens are importance-weighted or
masked; the buffer survives a checkpoint."""

import dataclasses
import math
import os
import re
import shutil
import sys

import pytest

import sample
import torch

import update
import loss as losses
import merge
import rollout
from inflight import RolloutStats
import runtime.checkpoint as checkpoint
import train
from partial import PartialBuffer
from runtime.engine import EngineDiedError
from conftest import tiny_config
from cancel import plan_launch
from config import ConfigError
from sample import NOT_GENERATED, Sample
from metrics import local_values, reduce_metrics
from test_train import scalars

PROMPTS = [[1, 5, 12], [1, 6, 4, 12], [1, 7, 12], [1, 5, 5, 12]]  # "<bos>1:", "<bos>23:", ...
BUDGET = 64
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cancelling_plan(tmp_path, num_prompts, drop_rate=0.5):
    cfg = tiny_config(
        tmp_path,
        "rollout.cancel=count",
        f"rollout.drop_rate={drop_rate}",
        "rollout.partial=true",
        "train.tis_cap=2",
        f"rollout.max_new_tokens={BUDGET}",
    )
    return plan_launch(cfg.rollout, num_prompts)


def perturb_and_sync(engine, policy, version):
    """A new policy version in trainer and engine (as a training step would make)."""
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.update_weights(policy.named_parameters(), version=version)


def trainer_logprobs(policy, samples):
    batch = update.collate(samples, pad_id=0)
    with torch.no_grad():
        logprobs, _ = update.sequence_logprobs(policy, batch, temperature=1.0)
    return logprobs, batch


def aborted_samples(engine, tmp_path, min_tokens=2):
    """Real cancellations: half of 32 samples aborted inside the engine mid-generation."""
    samples, stats = engine.generate(
        PROMPTS, 8, 1.0, BUDGET, cancelling_plan(tmp_path, len(PROMPTS))
    )
    assert engine.num_in_flight() == 0
    aborted = [
        s for s in samples if s.finish_reason == "abort" and len(s.response_ids) >= min_tokens
    ]
    assert (
        len(aborted) >= 4
    ), f"only {len(aborted)} samples were cancelled with >= {min_tokens} tokens"
    return aborted


def test_resumed_sample_holds_every_token_aligned(engine, policy, tmp_path):
    """A sample cancelled under version 0 and resumed under version 1 keeps its prompt, its old
    tokens with their log-probs and versions, and goes on within its budget; the trainer's
    forward over all of it matches the engine's log-probs of the new tokens (a lost or doubled
    boundary token would shift them), not of the old ones."""
    partial = aborted_samples(engine, tmp_path)
    old_logprobs, batch = trainer_logprobs(policy, partial)  # the cancelled tokens, under version 0
    assert ((old_logprobs - batch["engine_logprobs"]).abs() * batch["loss_mask"]).max() < 1e-4
    perturb_and_sync(engine, policy, version=1)
    resumes = [dataclasses.replace(s, group_id=i, masked=False) for i, s in enumerate(partial)]
    resumed, stats = engine.generate([], 8, 1.0, BUDGET, resumes=resumes)
    assert engine.num_in_flight() == 0
    assert len(resumed) == len(partial)
    # what this rollout generated and launched: the new tokens only, and no new prompt
    new_tokens = sum(len(a.response_ids) - len(b.response_ids) for a, b in zip(resumed, partial))
    assert stats.generated_tokens == new_tokens and stats.prompts_launched == 0
    for before, after in zip(partial, resumed):
        k = len(before.response_ids)
        assert after.prompt_ids == before.prompt_ids  # the prompt, not prompt + partial
        assert after.response_ids[:k] == before.response_ids and len(after.response_ids) > k
        # the old tokens keep their engine log-probs ...
        assert after.logprobs[:k] == before.logprobs
        # ... and versions
        assert after.versions.tolist() == [0] * k + [1] * (len(after.response_ids) - k)
        assert (
            len(after.logprobs)
            == len(after.loss_mask)
            == len(after.versions)
            == len(after.response_ids)
        )
        assert after.loss_mask.tolist() == [1] * len(after.response_ids)
        assert after.times_resumed == 1 and after.finish_reason in ("stop", "length")
    # Under the new weights, the trainer's forward over prompt + all tokens gives the engine's
    # log-probs of the resumed tokens: a duplicated or lost boundary token would shift every one of
    # them.
    new_logprobs, batch = trainer_logprobs(policy, resumed)
    fresh = batch["loss_mask"] * (batch["versions"] == 1)
    assert fresh.sum() > 0
    assert ((new_logprobs - batch["engine_logprobs"]).abs() * fresh).max() < 1e-4
    stale = batch["loss_mask"] * (batch["versions"] == 0)
    # older policy's numbers
    assert ((new_logprobs - batch["engine_logprobs"]).abs() * stale).max() > 1e-3


class Handout:
    """Prompts handed out in order: what PartialBuffer.launch reads new prompts from (a rank's
    PromptStream in training)."""

    def __init__(self, prompts):
        self.prompts = list(prompts)

    def take(self, count):
        taken, self.prompts = self.prompts[:count], self.prompts[count:]
        return taken


def test_buffer_holds_groups_and_never_exceeds_the_budget(engine, policy, tmp_path):
    """Six steps of launch -> generate (half cancelled) -> collect, a version bump between them:
    only unfinished samples and new prompts are launched, no sample exceeds the budget, a group is
    handed back only when complete, and every trained sample is the one that finished, once."""
    plan = cancelling_plan(tmp_path, num_prompts=2)
    buffer = PartialBuffer(group_size=8, max_staleness=10, budget=BUDGET)
    stream = Handout(sample.Prompt(ids, str(i)) for i, ids in enumerate(PROMPTS * 3))
    finished_seen = {}
    trained = []
    resumed_any = 0
    for step in range(6):
        if step:
            perturb_and_sync(engine, policy, version=step)
        resumes, new, held = buffer.launch(stream, plan.num_prompts, version=step)
        # every resume counted (times_resumed > 0 counted only a sample cancelled twice: none in
        # six steps failed the suite once)
        resumed_any += len(resumes)
        # the batch stays the same size: unfinished samples take new prompts' places (the first
        # step's 16 requests; a reviewer found no test held the count of new prompts)
        launched = len(resumes) + 8 * len(new)
        assert 8 * (plan.num_prompts - 1) < launched <= 8 * plan.num_prompts
        samples, _ = engine.generate(
            [p.prompt_ids for p in new], 8, 1.0, BUDGET, plan, resumes=resumes
        )
        assert engine.num_in_flight() == 0
        # only unfinished samples and new prompts were launched: finished members are never
        # regenerated
        assert len(samples) == len(resumes) + 8 * len(new)
        for s in samples:
            assert len(s.response_ids) <= BUDGET  # every resume together stays within the budget
            assert s.finish_reason != "length" or len(s.response_ids) == BUDGET
            if s.finish_reason != "abort":
                finished_seen[id(s)] = (s.response_ids.tolist(), s.versions.tolist())
        complete = buffer.collect(samples, new + held)
        out = [turn for group in complete for turns in group for turn in turns]
        trained += out
        for group in buffer.groups:  # a held group has at least one member still waiting
            assert any(m[-1].finish_reason == "abort" for m in group.members)
        assert not any(s.finish_reason == "abort" for s in out)  # a trained group is complete
        assert all(len(group) == 8 for group in complete)
    assert resumed_any > 0 and trained
    # every trained sample is the one that finished (same object, tokens unchanged)
    for s in trained:
        assert finished_seen[id(s)] == (s.response_ids.tolist(), s.versions.tolist())
    assert len({id(s) for s in trained}) == len(trained)  # nothing trained twice
    assert max(s.times_resumed for s in trained) >= 1


def test_staleness_bound_restarts_old_samples(engine, policy, tmp_path):
    """A suspended sample within max_staleness versions is continued; an older one restarts from
    its prompt (counted, its tokens wasted) and then holds current-version tokens only;
    max_staleness 0 turns the buffer off."""
    partial = aborted_samples(engine, tmp_path)
    buffer = PartialBuffer(group_size=8, max_staleness=2, budget=BUDGET)
    buffer.collect(partial, [sample.Prompt(ids, "1") for ids in PROMPTS])  # group ids index PROMPTS
    assert len(buffer.waiting) == len(partial)
    state = buffer.state_dict()
    # 2 versions old: within the bound, continued
    resumes, _, _ = buffer.launch(Handout([]), 0, version=2)
    assert [len(s.response_ids) for s in resumes] == [len(s.response_ids) for s in partial]
    assert buffer.counters["restarts"] == 0
    buffer.load_state_dict(state)  # as if not launched then: 3 versions old now
    resumes, _, _ = buffer.launch(Handout([]), 0, version=3)
    assert [len(s.response_ids) for s in resumes] == [0] * len(partial)  # restarted from the prompt
    # unfinished until the engine continues them (cancelled before being sent, they stay so)
    assert all(s.finish_reason == "abort" and s.masked for s in resumes)
    assert buffer.counters["restarts"] == len(partial)
    assert buffer.counters["wasted_tokens"] == sum(len(s.response_ids) for s in partial)
    perturb_and_sync(engine, policy, version=3)
    restarted, _ = engine.generate([], 8, 1.0, BUDGET, resumes=resumes)
    assert engine.num_in_flight() == 0
    assert all(set(s.versions) == {3} for s in restarted)  # only tokens of the current policy
    assert all(not s.masked and s.finish_reason != "abort" for s in restarted)
    assert all(s.prompt_ids == p.prompt_ids for s, p in zip(restarted, partial))
    # max_staleness 0 is plain dropping: no buffer
    cfg = tiny_config(
        tmp_path,
        "rollout.cancel=count",
        "rollout.drop_rate=0.2",
        "rollout.partial=true",
        "rollout.max_staleness=0",
    )
    assert not plan_launch(cfg.rollout, 8).partial


def continue_and_cancel(resumes, version, tokens=10):
    """What the engine hands back for `resumes` when the cancel cuts each again after `tokens`
    more (as inflight.Rollout.continue_partial returns them: the launch index as trajectory id)."""
    return [
        r.continued_by(
            Sample(
                r.prompt_ids + r.response_ids,
                [7] * tokens,
                [-1.0] * tokens,
                [1] * tokens,
                r.group_id,
                trajectory_id=i,
                weight_version=version,
                finish_reason="abort",
                masked=True,
            )
        )
        for i, r in enumerate(resumes)
    ]


def test_a_restarted_sample_too_old_again_is_given_up_and_its_group_trains():
    """A member that needs more rollouts than max_staleness allows restarts once; too old again,
    it is given up (masked, counted, its tokens wasted) and its group trains on the member that
    finished, whose tokens are then 2 x (max_staleness + 1) versions old, instead of being held
    (with a slot of every batch) forever. Restarting it again and again was the bug."""
    prompt = sample.Prompt([1, 2], "1")
    buffer = PartialBuffer(group_size=2, max_staleness=2, budget=BUDGET)
    finished = Sample([1, 2], [5] * 10, [-1.0] * 10, [1] * 10, 0, reward=1.0)
    cut = Sample([1, 2], [6] * 10, [-1.0] * 10, [1] * 10, 0, trajectory_id=1)
    cut = dataclasses.replace(cut, finish_reason="abort", masked=True)
    assert buffer.collect([finished, cut], [prompt]) == []
    counters = []
    for version in range(1, 6):
        resumes, new, held = buffer.launch(Handout([]), 0, version)
        # what dynamic sampling judges the held group on: its finished member, not the one
        # resumed (still the aborted sample in the group)
        assert buffer.held_survivors() == {resumes[0].group_id: [finished]}
        assert (
            len(resumes) == 1 and buffer.collect(continue_and_cancel(resumes, version), held) == []
        )
        counters.append(dict(buffer.counters))
        # the lengths logged for the cancelled: this step's suspended sample's
        group, index = buffer.waiting[0]
        logged = reduce_metrics(buffer.metrics())
        assert logged["rollout/aborted_len_max"] == len(group.members[index][-1].response_ids)
        assert logged["rollout/aborted_ratio"] == 1.0  # the one launched was cancelled again
    # version 6, a batch of one group: the sample is given up, not launched, and a new prompt takes
    # its place
    other = sample.Prompt([1, 3], "2")
    resumes, new, held = buffer.launch(Handout([other]), 1, 6)
    assert resumes == [] and new == [other] and held == []
    counters.append(dict(buffer.counters))
    answers = [Sample([1, 3], [8], [-1.0], [1], 0, trajectory_id=t) for t in range(2)]
    [[[kept], [given_up]], fresh] = buffer.collect(answers, new)
    assert fresh == [[a] for a in answers] and not buffer.waiting and not buffer.groups
    # nothing suspended this step: no length for the cancelled (the given-up member's 30 tokens,
    # in a group that completed, were logged as this step's: a reviewer's)
    complete = [[kept], [given_up], *fresh]
    stats = RolloutStats()
    logged = reduce_metrics(rollout.rollout_metrics(complete, stats) | buffer.metrics())
    assert logged["rollout/aborted"] == 0 and "rollout/aborted_len_max" not in logged
    # versions 1, 2: continued; 3: restarted (30 tokens of versions 0-2 wasted); 4, 5: continued;
    # 6: given up (the 30 tokens since its restart wasted)
    assert [c["resumed"] for c in counters] == [1, 1, 0, 1, 1, 0]
    assert [c["restarts"] for c in counters] == [0, 0, 1, 0, 0, 0]
    assert [c["given_up"] for c in counters] == [0, 0, 0, 0, 0, 1]
    assert [c["wasted_tokens"] for c in counters] == [0, 0, 30, 0, 0, 30]
    assert kept is finished and not kept.masked and set(kept.versions) == {0}
    assert given_up.masked and given_up.finish_reason == "abort"
    assert given_up.times_restarted == 1 and set(given_up.versions) == {3, 4, 5}
    # the count survives a checkpoint (Sample.to_state), and a state from before it loads as 0
    assert Sample.from_state(given_up.to_state()).times_restarted == 1
    state = given_up.to_state()
    del state["times_restarted"]
    assert Sample.from_state(state).times_restarted == 0


def test_partial_rollout_with_tools_turns_is_refused_and_its_checkpoint_not_resumed(
    tmp_path, caplog
):
    """The engine continues one request, so a trajectory with tools' turns cannot be resumed:
    partial rollout with rollout.max_turns > 1 was accepted and silently dropped every cancelled
    trajectory (plain dropping; under rollout.cancel=group the groups it promises whole shrank),
    while max_staleness and the resumed tokens' refusals looked in effect. It is a ConfigError.
    A partial-rollout checkpoint of single-turn samples resumed with tools' turns (partial then
    off) is not resumed, and says so."""
    from assemble import load_config, partial_buffer

    sets = [f"run.out={tmp_path}", "rollout.cancel=group", "rollout.drop_rate=0.25"]
    with pytest.raises(ConfigError, match="partial rollout resumes single-turn samples only"):
        load_config("configs/tiny_tool.yaml", sets + ["rollout.partial=true"])
    single = PartialBuffer(group_size=2, max_staleness=4, budget=BUDGET)
    cut = Sample([1, 2], [6], [-1.0], [1], 0, trajectory_id=1, finish_reason="abort", masked=True)
    finished = Sample([1, 2], [5], [-1.0], [1], 0, reward=1.0)
    assert single.collect([finished, cut], [sample.Prompt([1, 2], "1")]) == [] and single.waiting
    with caplog.at_level("WARNING"):
        assert (
            partial_buffer(load_config("configs/tiny_tool.yaml", sets), single.state_dict()) is None
        )
    assert "holds 1 partial-rollout groups; rollout.partial is off: not resumed" in caplog.text
    # without tools' turns the same state resumes its sample
    cfg = load_config("configs/tiny.yaml", sets + ["rollout.partial=true", "train.tis_cap=2"])
    assert len(partial_buffer(cfg, single.state_dict()).waiting) == 1


def test_a_sample_that_fills_a_smaller_budget_restarts():
    """A run resumed with a smaller response budget than its buffered samples already hold
    restarts them from their prompts (counted), instead of the rollout refusing the resume."""
    prompt = sample.Prompt([1, 2], "1")
    larger = PartialBuffer(group_size=1, max_staleness=4, budget=BUDGET)
    cut = Sample([1, 2], [6] * 40, [-1.0] * 40, [1] * 40, 0, finish_reason="abort", masked=True)
    larger.collect([cut], [prompt])
    smaller = PartialBuffer(group_size=1, max_staleness=4, budget=32)
    smaller.load_state_dict(larger.state_dict())
    [restarted], _, _ = smaller.launch(Handout([]), 0, version=1)
    assert len(restarted.response_ids) == 0 and restarted.times_restarted == 1
    assert smaller.counters["restarts"] == 1 and smaller.counters["wasted_tokens"] == 40
    [resumed], _, _ = larger.launch(Handout([]), 0, version=1)  # within its own budget: continued
    assert len(resumed.response_ids) == 40 and larger.counters["resumed"] == 1


def test_old_tokens_are_importance_weighted_or_masked(engine, policy, tmp_path):
    """Tokens an older version sampled are weighted by min(pi_old / mu, cap) in the statistics
    and in the loss (fresh tokens by 1), or with max_staleness 0 masked out of the loss."""
    partial = aborted_samples(engine, tmp_path)
    perturb_and_sync(engine, policy, version=1)
    resumes = [dataclasses.replace(s, group_id=i) for i, s in enumerate(partial)]
    resumed, _ = engine.generate([], 8, 1.0, BUDGET, resumes=resumes)
    batch = update.collate(resumed, pad_id=0)
    with torch.no_grad():
        batch["old_logprobs"], _ = update.sequence_logprobs(policy, batch, temperature=1.0)
    update.mask_stale_tokens([batch], version=1, max_staleness=-1)
    log_ratio = batch["old_logprobs"] - batch["engine_logprobs"]
    stale = (batch["staleness"] > 0) & (batch["loss_mask"] > 0)
    fresh = (batch["staleness"] == 0) & (batch["loss_mask"] > 0)
    for cap in (1.0, 2.0):
        stats = local_values(update.offpolicy_stats([batch], cap))
        expected = log_ratio[stale].exp().clamp(max=cap)
        assert stats["train/stale_is_weight"] == pytest.approx(expected.mean().item(), rel=1e-5)
        assert stats["train/stale_is_capped_frac"] == pytest.approx(
            (log_ratio[stale].exp() > cap).float().mean().item()
        )
        # the loss weights tokens the same way: 1 where engine and trainer agree, min(ratio, cap) on
        # old ones
        _, loss_stats = losses.policy_loss(
            batch["old_logprobs"],
            batch["old_logprobs"],
            torch.ones(len(resumed)),
            fresh,
            engine_logprobs=batch["engine_logprobs"],
            tis_cap=cap,
        )
        assert loss_stats["tis_weight"].item() == pytest.approx(1.0, abs=1e-4)
        _, loss_stats = losses.policy_loss(
            batch["old_logprobs"],
            batch["old_logprobs"],
            torch.ones(len(resumed)),
            stale,
            engine_logprobs=batch["engine_logprobs"],
            tis_cap=cap,
        )
        assert loss_stats["tis_weight"].item() == pytest.approx(expected.mean().item(), rel=1e-5)
    assert update.offpolicy_stats([batch], 1.0)["train/stale_is_capped_frac"].value > 0
    # at top_p < 1 the weight would need the older weights' nucleus mass: not logged (a reviewer
    # found the full softmax's ratio logged as it, 1.17 for a true 0.94)
    nucleus = update.offpolicy_stats([batch], 2.0, top_p=0.9)
    assert "train/stale_is_weight" not in nucleus and nucleus["train/stale_token_frac"].count
    num_stale = int(stale.sum())
    assert num_stale > 0 and stats["train/stale_token_frac"] == pytest.approx(
        num_stale / int(batch["loss_mask"].sum())
    )
    # masking instead: tokens more than 0 versions old leave the loss
    masked = update.mask_stale_tokens([batch], version=1, max_staleness=0)
    assert masked["staleness/masked_tokens"].value == num_stale
    assert batch["loss_mask"][stale].sum() == 0 and batch["loss_mask"][fresh].sum() == fresh.sum()


def test_partial_training_checkpoints_its_buffer(engine, tmp_path):
    """A partial-rollout run's checkpoint holds its suspended samples; the resumed run restores
    the buffer, continues exactly those samples first, and trains tokens that version 1 sampled.
    An engine death in a step's rollout leaves a checkpoint of the step's start."""
    sets = [
        "rollout.cancel=count",
        "rollout.drop_rate=0.3",
        "rollout.partial=true",
        "train.tis_cap=2",
        "run.val_every=100",
        "run.checkpoint_every=0",
        # a KV pool of about ten requests: the tail queues behind the first ones and is still in
        # the engine at the count. With the default pool all 64 ran at once, and on a loaded
        # machine (the suite's background runs) the engine once finished them all before the
        # trainer's decision reached it: nothing suspended (1 of 5 runs under 4 busy processes)
        "rollout.max_total_tokens=512",
    ]
    steps = 2
    run = train.setup(tiny_config(tmp_path, f"train.steps={steps}", *sets), engine=engine)
    train.train(run)
    # still, once in three suites at 2-core load, every request finished before the count reached
    # the engine: then one more step, resumed, until something is suspended at a step's end
    while not run.buffer.state_dict()["waiting"] and steps < 5:
        steps += 1
        config = tiny_config(tmp_path, f"train.steps={steps}", *sets)
        run = train.setup(config, resume=True, engine=engine)
        train.train(run)
    assert engine.num_in_flight() == 0
    saved = run.buffer.state_dict()
    assert saved["waiting"], "nothing was suspended: the test would prove nothing"
    config = tiny_config(tmp_path, f"train.steps={steps + 1}", *sets)
    resumed = train.setup(config, resume=True, engine=engine)
    assert resumed.start_step == steps and resumed.buffer.state_dict() == saved
    # an engine death after step 2's rollout, before its update: the checkpoint it leaves holds
    # the suspended samples and the prompt position as step 2 found them, not as its rollout left
    # them (waiting emptied, prompts taken)
    before = train.data_before_step(resumed)
    rollout.collect(resumed, steps)
    assert resumed.buffer.state_dict() != saved
    # (the checkpoint resumed from holds that state already, and would not be written again:
    # removed, so the one read below is the one save_after_failure writes)
    shutil.rmtree(tmp_path / "checkpoints")
    train.save_after_failure(resumed, EngineDiedError("the engine died"), before)
    state = checkpoint.read_trainer_state(checkpoint.latest(str(tmp_path)))
    assert state["step"] == steps and state["buffer"] == saved | {"ranks": [len(saved["groups"])]}
    assert state["prompt_positions"] == [before["position"]]
    train.train(resumed)  # and that step runs from them
    values = scalars(tmp_path)
    assert len(values["train/loss"]) == steps + 1
    # the resumed step continued exactly the suspended samples of the checkpoint, first
    assert values["partial/resumed"][-1] + values["partial/restarts"][-1] == len(saved["waiting"])
    assert values["staleness/tokens_1"][-1] > 0  # and trained tokens that version 1 sampled
    # fresh tokens: engine == trainer, to rounding (> 0: measured, not over no token; a step that
    # trained no fresh token, every group still held, logs 0)
    gaps = values["train/logprob_gap"]
    assert all(v < 1e-4 for v in gaps) and max(gaps) > 0


def test_each_rank_resumes_the_groups_it_held():
    """A checkpoint's buffer merges every rank's held groups; resumed at the same world size each
    rank gets back its own (rank 0 held 3, rank 1 one: an even split gave rank 1 one of rank 0's),
    at another size an even share, and a state from before ranks were recorded splits evenly."""
    from partial import merge_states, share_state

    def state(*names):
        groups = [{"prompt": {"prompt_ids": [1], "answer": n}, "members": []} for n in names]
        return {"groups": groups, "waiting": [(i, 0) for i in range(len(names))]}

    merged = merge_states([state("a", "b", "c"), state("d")])

    def answers(share):
        return [g["prompt"]["answer"] for g in share["groups"]], share["waiting"]

    assert answers(share_state(merged, 0, 2)) == (["a", "b", "c"], [(0, 0), (1, 0), (2, 0)])
    assert answers(share_state(merged, 1, 2)) == (["d"], [(0, 0)])
    assert answers(share_state(merged, 0, 1)) == (["a", "b", "c", "d"], [(i, 0) for i in range(4)])
    assert [answers(share_state(merged, r, 4))[0] for r in range(4)] == [["a"], ["b"], ["c"], ["d"]]
    # five held by ranks of 3 and 2, resumed on 3 ranks: even contiguous shares, none twice
    five = merge_states([state("a", "b", "c"), state("d", "e")])
    assert [answers(share_state(five, r, 3))[0] for r in range(3)] == [
        ["a"],
        ["b", "c"],
        ["d", "e"],
    ]
    old = {key: merged[key] for key in ("groups", "waiting")}
    assert answers(share_state(old, 1, 2))[0] == ["c", "d"]


def test_a_sample_state_written_before_the_masked_rename_loads():
    """Checkpoints and replay dumps hold samples as `Sample.to_state` dicts; one written when
    `masked` was called `is_aborted` loads as the same sample (a resume across the rename)."""
    s = Sample([1, 5, 12], [3, 4], [-0.5, -0.25], [1, 1], group_id=2, masked=True)
    state = s.to_state()
    assert Sample.from_state(state) == s
    state["is_aborted"] = state.pop("masked")
    assert Sample.from_state(state) == s


def test_the_staleness_histogram_and_stale_weights_hand_computed():
    """update.offpolicy_stats over the trained tokens: staleness 0, 0, 1, 2, 5 (and one untrained
    token of staleness 3) count one bin each, 4+ holding the 5; the stale tokens' importance
    weight pi_old / pi_engine capped at tis_cap 2: e^0.5 = 1.65 and e^1 capped at 2 and 1, mean
    (1.6487 + 2 + 1) / 3, one capped of three."""
    mb = {
        "loss_mask": torch.tensor([[1, 1, 1, 1, 1, 0]]),
        "staleness": torch.tensor([[0, 0, 1, 2, 5, 3]]),
        "old_logprobs": torch.tensor([[-1.0, -1.0, -1.0, -1.0, -1.0, -1.0]]),
        "engine_logprobs": torch.tensor([[-1.0, -1.0, -1.5, -2.5, -1.0, -9.0]]),
    }
    out = reduce_metrics(update.offpolicy_stats([mb], tis_cap=2.0))
    bins = [out[f"staleness/tokens_{k}"] for k in ("0", "1", "2", "3", "4+")]
    assert bins == [2, 1, 1, 0, 1] and out["train/stale_token_frac"] == pytest.approx(3 / 5)
    assert out["train/stale_is_weight"] == pytest.approx((math.exp(0.5) + 2 + 1) / 3)
    assert out["train/stale_is_capped_frac"] == pytest.approx(1 / 3)


def test_merged_turns_carry_their_token_versions():
    """Merged turns keep each generated token's weight version; observation tokens are marked not
    generated and masked."""
    first = Sample(
        [1, 2], [3, 4], [-0.1, -0.2], [1, 1], group_id=0, weight_version=5, versions=[4, 5]
    )
    second = Sample([1, 2, 3, 4, 9, 9], [6], [-0.3], [1], group_id=0, turn=1, weight_version=6)
    (merged,), _ = merge.merge_trajectory([first, second], max_seq_len=64)
    assert merged.response_ids.tolist() == [3, 4, 9, 9, 6]
    # observations: no version
    assert merged.versions.tolist() == [4, 5, NOT_GENERATED, NOT_GENERATED, 6]
    assert merged.loss_mask.tolist() == [1, 1, 0, 0, 1]


# --partial and --filter in one process (tests/test_filter.py reads the filter line): one engine
# start, not two
TAIL_SMOKE = [
    sys.executable,
    "bench/tail.py",
    "--partial",
    "--filter",
    "--prompts",
    "4",
    "--group-size",
    "4",
    "--steps",
    "2",
    "--max-new-tokens",
    "32",
    "--repeats",
    "1",
]


@pytest.mark.background("tail_bench_smoke", TAIL_SMOKE)
def test_tail_bench_partial_runs_end_to_end_and_reports_its_figures(background_runs):
    """bench/tail.py --partial runs its three arms on a small workload and prints one summary
    line: both speedups and the wasted tokens, as numbers (their values are not checked at this
    size)."""
    lines = background_runs.lines("tail_bench_smoke")
    summary = [line for line in lines if line.startswith("partial: speedup")]
    assert len(summary) == 1
    assert re.fullmatch(
        r"partial: speedup_vs_baseline=[\d.]+ speedup_vs_drop=[\d.]+ wasted_tokens=\d+", summary[0]
    )


@pytest.mark.background(
    "learning_bench",
    [
        sys.executable,
        "bench/learning.py",
        "--seeds",
        "0",
        "--arms",
        "baseline,dapo",
        "--steps",
        "2",
        "--set",
        "data.num_val_prompts=16",
    ],
)
def test_learning_bench_runs_both_arms_and_reports_its_figures(background_runs):
    """bench/learning.py runs train.py once per arm (baseline and dapo, each with its own engine)
    and ends with the issue's line: both arms' sampled validation reward and step time, as numbers
    (their values are not checked at this size). (The baseline,partial line comes from the same
    loop, read at the same step; a third run cost the suite 25 s.)"""
    lines = background_runs.lines("learning_bench")
    assert re.fullmatch(
        r"learning: baseline_val_sampled=[\d.]+ dapo_val_sampled=[\d.]+ "
        r"baseline_step_s=[\d.]+ dapo_step_s=[\d.]+",
        lines[-1],
    )
