"""The real SGLang engine on CPU: generation from token ids, log-prob parity with the HF model,
weight sync, and tail cancellation (abort inside the engine, nothing left running)."""

import asyncio
import dataclasses
import logging

import pytest
import torch

import batching
import train
from conftest import tiny_config
from cancel import count_complete_groups, plan_launch
from rollout import RolloutError

PROMPTS = [[1, 5, 12], [1, 6, 4, 12], [1, 7, 12], [1, 5, 5, 12]]  # "<bos>1:", "<bos>23:", ...


@pytest.fixture
def policy(engine, tmp_path):
    """A fresh seeded tiny policy, pushed into the shared engine so both hold the same weights."""
    cfg = tiny_config(tmp_path)
    policy, tokenizer = train.build_policy(cfg, None)
    engine.update_weights(policy.named_parameters(), version=0)
    return policy


def trainer_logprobs(policy, samples):
    batch = batching.collate(samples, pad_id=0)
    with torch.no_grad():
        logprobs, _ = batching.sequence_logprobs(policy, batch, temperature=1.0)
    return logprobs, batch


def max_gap(policy, samples):
    logprobs, batch = trainer_logprobs(policy, samples)
    return ((logprobs - batch["engine_logprobs"]).abs() * batch["loss_mask"]).max().item()


def test_generates_from_token_ids_with_matching_logprobs(engine, policy):
    samples, stats = engine.generate(PROMPTS, group_size=4, temperature=1.0, max_new_tokens=24)
    assert len(samples) == 16 and stats.num_cancelled == 0
    for s in samples:
        assert s.prompt_ids.tolist() == PROMPTS[s.group_id]
        assert 0 < len(s.response_ids) <= 24 and len(s.logprobs) == len(s.response_ids) == len(
            s.loss_mask
        )
        assert s.finish_reason in ("stop", "length") and not s.is_aborted
        assert s.finish_reason == "length" or s.response_ids[-1] == 2  # stopped on <eos>
    assert max_gap(policy, samples) < 1e-4  # fp32 engine vs HF forward on the same weights


def test_weight_sync_matches_the_updated_trainer(engine, policy):
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    before, _ = engine.generate(PROMPTS, 2, 1.0, 16)
    assert max_gap(policy, before) > 1e-3  # the engine still holds the old weights
    # several buckets
    engine.update_weights(policy.named_parameters(), version=7, bucket_bytes=64 << 10)
    after, _ = engine.generate(PROMPTS, 2, 1.0, 16)
    assert max_gap(policy, after) < 1e-4
    assert {s.weight_version for s in after} == {7}


def _long_tail_plan(cancel, **kwargs):
    rollout_cfg = dataclasses.replace(
        tiny_config("/tmp").rollout, cancel=cancel, group_size=4, **kwargs
    )
    return plan_launch(rollout_cfg, 16)


def _assert_nothing_left_running(engine):
    ours = [
        t for t in asyncio.all_tasks(engine.engine.loop) if "_generate_one" in repr(t.get_coro())
    ]
    assert ours == [] and engine.num_in_flight() == 0


def test_count_cancellation_aborts_the_tail_in_the_engine(engine, policy):
    # random init emits <eos> with p ~ 1/16 per token: geometric lengths, a long tail up to the cap
    plan = _long_tail_plan("count", drop_rate=0.25)
    prompts = PROMPTS * 4
    samples, stats = engine.generate(prompts, 4, 1.0, 200, plan)
    finished = [s for s in samples if not s.is_aborted]
    aborted = [s for s in samples if s.is_aborted]
    assert len(finished) >= plan.target_samples == 48 and stats.num_cancelled == len(aborted) > 0
    assert all(s.finish_reason == "abort" for s in aborted)
    assert any(len(s.response_ids) > 0 for s in aborted)  # partial tokens are kept ...
    assert all(len(s.logprobs) == len(s.response_ids) for s in aborted)  # ... with their log-probs
    assert (
        max_gap(
            policy, [dataclasses.replace(s, is_aborted=False) for s in aborted if s.response_ids]
        )
        < 1e-4
    )
    assert 0 < stats.cancel_latency_s < 2.0
    _assert_nothing_left_running(engine)
    # the engine is healthy afterwards
    again, _ = engine.generate(PROMPTS, 2, 1.0, 8)
    assert all(not s.is_aborted for s in again)


def test_time_cancellation_waits_factor_times_the_quantile_time(engine, policy):
    # cancel as soon as half are back
    plan = _long_tail_plan("time", time_quantile=0.5, time_factor=0.0)
    samples, stats = engine.generate(PROMPTS * 4, 4, 1.0, 200, plan)
    assert sum(not s.is_aborted for s in samples) >= 32 and stats.num_cancelled > 0
    _assert_nothing_left_running(engine)


def test_group_cancellation_keeps_whole_groups(engine, policy):
    # launch 24 prompts, keep the first 16 groups
    plan = _long_tail_plan("group", over_sample_rate=0.5)
    assert plan.num_prompts == 24 and plan.target_groups == 16
    samples, _ = engine.generate((PROMPTS * 6)[:24], 4, 1.0, 200, plan)
    kept = {s.group_id for s in samples if not s.is_aborted}
    assert len(kept) == 16
    for group in range(24):
        members = [s for s in samples if s.group_id == group]
        # all kept or all dropped
        assert len(members) == 4 and len({s.is_aborted for s in members}) == 1
    assert count_complete_groups([s for s in samples if not s.is_aborted], 4) == 16
    _assert_nothing_left_running(engine)


def test_validation_never_cancels(engine, policy, tmp_path):
    cfg = tiny_config(
        tmp_path, "rollout.cancel=count", "rollout.drop_rate=0.5", "rollout.max_new_tokens=200"
    )
    run = train.setup(cfg, engine=engine)
    samples_seen = []
    original = engine.generate

    def spy(*args, **kwargs):
        samples, stats = original(*args, **kwargs)
        samples_seen.extend(samples)
        return samples, stats

    engine.generate = spy
    try:
        train.validate(run)
    finally:
        del engine.generate
    assert len(samples_seen) == 2 * len(run.val_prompts) and not any(
        s.is_aborted for s in samples_seen
    )


def test_failed_requests_are_counted_not_padded(engine, policy):
    too_long = [1] + [5] * 400  # beyond max_position_embeddings=256: the engine rejects it
    configured = engine.cfg
    try:
        engine.cfg = dataclasses.replace(configured, max_failed_ratio=0.5)
        samples, stats = engine.generate(PROMPTS + [too_long], 2, 1.0, 8)
        failed = [s for s in samples if s.finish_reason == "error"]
        assert stats.num_failed == len(failed) == 2 and all(s.is_aborted for s in failed)
        assert all(s.finish_reason != "error" for s in samples if s.prompt_ids.tolist() != too_long)
        engine.cfg = dataclasses.replace(configured, max_failed_ratio=0.0)
        with pytest.raises(RolloutError, match="requests failed inside the engine"):
            engine.generate(PROMPTS + [too_long], 2, 1.0, 8)
    finally:
        engine.cfg = configured
    _assert_nothing_left_running(engine)


def test_mismatched_weight_sync_is_refused_before_it_reaches_the_engine(engine, policy):
    wrong = [
        ("model.embed_tokens.weight", torch.zeros(3, 64)),
        ("model.no_such.weight", torch.zeros(1)),
    ]
    for name, tensor in wrong:
        with pytest.raises(RolloutError, match="does not match the engine's model"):
            engine.update_weights([(name, tensor)], version=1)
    samples, _ = engine.generate(PROMPTS, 1, 1.0, 4)  # the engine is still alive
    assert len(samples) == 4


def test_engine_start_leaves_the_trainers_logging_alone(engine):
    # SGLang 0.5.23 set the root logger to ERROR when the engine started, silencing the trainer's
    # warnings.
    assert logging.getLogger("rollout").isEnabledFor(logging.WARNING)
    assert logging.getLogger("tasks").isEnabledFor(logging.WARNING)


def test_plan_launch_arithmetic():
    cfg = tiny_config("/tmp").rollout  # 8 prompts per step x group_size 8
    none = plan_launch(cfg, 32)
    assert (none.cancel, none.num_prompts, none.target_samples) == ("none", 32, 256)
    drop = plan_launch(dataclasses.replace(cfg, cancel="count", drop_rate=0.2), 32)
    # ceil(0.8 x 256)
    assert (drop.num_prompts, drop.target_samples, drop.target_groups) == (32, 205, 26)
    over = plan_launch(dataclasses.replace(cfg, cancel="group", over_sample_rate=0.25), 32)
    # keeps the batch size
    assert (over.num_prompts, over.target_samples, over.target_groups) == (40, 256, 32)
