"""The real SGLang engine on CPU: generation from token ids, log-prob parity with the HF model,
weight sync, and tail cancellation (abort inside the engine, nothing left running)."""

import asyncio
import dataclasses
import logging
import math
import threading
import time
import types
import uuid

import pytest

import sample
import torch

import update
import rewards
import runtime.model as model
import train
import rollout
from conftest import tiny_config
from cancel import plan_launch
from config import ConfigError
from runtime.engine import RolloutError
from runtime.threads import DaemonPool
from assemble import trainer_only
from sample import Sample

PROMPTS = [[1, 5, 12], [1, 6, 4, 12], [1, 7, 12], [1, 5, 5, 12]]  # "<bos>1:", "<bos>23:", ...


def count_complete_groups(samples, group_size):
    """Groups all of whose `group_size` members finished (stopped or hit the length limit)."""
    counts = {}
    for s in samples:
        if not s.masked:
            counts[s.group_id] = counts.get(s.group_id, 0) + 1
    return sum(n == group_size for n in counts.values())


def trainer_logprobs(policy, samples):
    batch = update.collate(samples, pad_id=0)
    with torch.no_grad():
        logprobs, _ = update.sequence_logprobs(policy, batch, temperature=1.0)
    return logprobs, batch


def max_gap(policy, samples):
    logprobs, batch = trainer_logprobs(policy, samples)
    return ((logprobs - batch["engine_logprobs"]).abs() * batch["loss_mask"]).max().item()


def test_generates_from_token_ids_with_matching_logprobs(engine, policy):
    """The engine generates from token ids: each sample holds its prompt and aligned response
    tokens, log-probs and mask, stops on <eos> or at the length cap, and its log-probs are the
    trainer's (fp32, within 1e-4)."""
    samples, stats = engine.generate(PROMPTS, group_size=4, temperature=1.0, max_new_tokens=24)
    assert len(samples) == 16 and stats.num_cancelled == 0
    for s in samples:
        assert s.prompt_ids.tolist() == PROMPTS[s.group_id]
        assert 0 < len(s.response_ids) <= 24 and len(s.logprobs) == len(s.response_ids) == len(
            s.loss_mask
        )
        assert s.finish_reason in ("stop", "length") and not s.masked
        assert s.finish_reason == "length" or s.response_ids[-1] == 2  # stopped on <eos>
    assert max_gap(policy, samples) < 1e-4  # fp32 engine vs HF forward on the same weights


def test_top_p_samples_come_from_the_nucleus_the_trainer_scores(
    engine, policy, monkeypatch, tmp_path
):
    """The engine sampling at top_p 0.5: every sampled token is inside the nucleus (SGLang's rule,
    rebuilt here position by position from the HF model's softmax), the trainer's log-prob of it
    is log(p / nucleus mass), and the engine's own log-probs, of the full softmax, moved onto the
    nucleus (update.engine_logprobs_on_nucleus, from the full softmax's log-probs of the same head
    pass) agree with the trainer's to 1e-4."""
    monkeypatch.setattr(engine.cfg, "top_p", 0.5)
    # seeded, so a run samples what the last one did: unseeded, this test failed once
    # (2026-11-27, the output lost) and passed on every rerun; which assertion is not known
    samples, _ = engine.generate(PROMPTS, 8, 1.0, max_new_tokens=16, seed=3)
    batch = update.collate(samples, pad_id=0)
    with torch.no_grad():
        probs = policy(input_ids=batch["input_ids"]).logits[:, :-1].float().softmax(-1)
        nucleus, _, one_pass = update.sequence_logprobs(policy, batch, 1.0, top_p=0.5, full=True)
    mask = batch["loss_mask"].bool()
    sizes = []
    for p, target, lp in zip(probs[mask], batch["input_ids"][:, 1:][mask], nucleus[mask]):
        ordered, order = p.sort(descending=True)
        kept = order[ordered.cumsum(0) - ordered <= 0.5]  # SGLang: mass before it <= top_p
        sizes.append(len(kept))
        assert target in kept
        assert lp.item() == pytest.approx((p[target] / p[kept].sum()).log().item(), abs=1e-5)
    assert sum(sizes) / len(sizes) < probs.shape[-1] / 2  # the nucleus really cuts the vocabulary
    with torch.no_grad():
        full, _ = update.sequence_logprobs(policy, batch, 1.0)
    torch.testing.assert_close(one_pass, full)  # the nucleus's pass gives the full softmax's too
    assert ((full - batch["engine_logprobs"]).abs() * mask).max() < 1e-4  # SGLang: full softmax
    update.engine_logprobs_on_nucleus(batch, nucleus, one_pass)  # batch["engine_logprobs"] moved
    assert ((batch["engine_logprobs"] - nucleus).abs() * mask).max() < 1e-4


def test_weight_sync_matches_the_updated_trainer(engine, policy):
    """After the trainer's weights change, the engine's log-probs differ until update_weights
    pushes them (in several buckets); then they match and the samples carry the new version."""
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


def test_count_cancellation_aborts_the_tail_in_the_engine(engine, policy):
    """Count cancellation stops at 75% of the samples and aborts the rest inside the engine:
    aborted samples keep their partial tokens with matching log-probs, the abort lands within
    2 seconds, no request is left, and the engine serves the next rollout."""
    # random init emits <eos> with p ~ 1/16 per token: geometric lengths, a long tail up to the cap
    plan = _long_tail_plan("count", drop_rate=0.25)
    prompts = PROMPTS * 4
    samples, stats = engine.generate(prompts, 4, 1.0, 200, plan)
    finished = [s for s in samples if not s.masked]
    aborted = [s for s in samples if s.masked]
    assert len(finished) >= plan.target_samples == 48 and stats.num_cancelled == len(aborted) > 0
    assert all(s.finish_reason == "abort" for s in aborted)
    # SGLang decodes one more token after the abort: a sample it ended with its EOS finished
    ends = [s.response_ids[-1] for s in aborted if s.response_ids]
    assert engine.stop_ids and not set(ends) & engine.stop_ids, ends
    assert any(len(s.response_ids) > 0 for s in aborted)  # partial tokens are kept ...
    assert all(len(s.logprobs) == len(s.response_ids) for s in aborted)  # ... with their log-probs
    assert (
        max_gap(policy, [dataclasses.replace(s, masked=False) for s in aborted if s.response_ids])
        < 1e-4
    )
    assert 0 < stats.cancel_latency_s < 2.0
    assert engine.num_in_flight() == 0  # aborted inside the engine, not only as tasks
    # the engine is healthy afterwards
    again, _ = engine.generate(PROMPTS, 2, 1.0, 8)
    assert all(not s.masked for s in again)


def test_the_engine_reports_the_version_it_was_started_at(engine, policy):
    """set_version (assemble.start_engine: a resumed run's first step, without a push) stamps
    every request after it: a resumed full-weight run's first samples were version 0 (SGLang's
    "default"), so each token looked step-many versions stale and the step-0 gap check saw none."""
    engine.set_version(5)
    try:
        samples, _ = engine.generate(PROMPTS[:1], 2, 1.0, 4)
        assert {s.weight_version for s in samples} == {5}
    finally:
        engine.set_version(0)


def test_an_abort_cuts_only_its_own_requests(engine, policy):
    """Of two requests in the engine, aborting one, together with a rid the engine does not
    track yet (a request not sent), cuts that one alone: the other runs to its length."""
    kept, cut = uuid.uuid4().hex, uuid.uuid4().hex
    sampling = {"max_new_tokens": 64, "ignore_eos": True, "temperature": 1.0}

    async def two_requests():
        running = [
            asyncio.ensure_future(engine.request(r, PROMPTS[0], sampling)) for r in (kept, cut)
        ]
        while engine.num_in_flight() < 2:
            await asyncio.sleep(0.001)
        engine.abort([cut, uuid.uuid4().hex])
        return await asyncio.gather(*running)

    (kept_ids, _, kept_reason, *_), (_, _, cut_reason, *_) = engine._run(two_requests())
    assert (kept_reason, len(kept_ids), cut_reason) == ("length", 64, "abort")
    assert engine.num_in_flight() == 0


def test_time_cancellation_waits_factor_times_the_quantile_time(engine, policy):
    """Once half of the 64 samples are back at time t, the rollout waits factor x t more, then
    cancels the rest: at least 32 finished, some cancelled, and the decision no earlier than
    (1 + factor) x t."""
    # time_factor must be > 0 (config.py). A tenth of t is about one decode step here, while the
    # slowest of 64 geometric lengths (mean ~16 tokens) needs several times the median: the tail
    # is still running at the deadline.
    plan = _long_tail_plan("time", time_quantile=0.5, time_factor=0.1)
    samples, stats = engine.generate(PROMPTS * 4, 4, 1.0, 200, plan)
    finished_s = sorted(s.latency_s for s in samples if not s.masked)
    assert len(finished_s) >= 32 and stats.num_cancelled > 0
    # the 32nd sample back sets t (its latency is stamped before the wait sees it)
    assert stats.decision_s >= (1 + plan.time_factor) * finished_s[31]
    assert engine.num_in_flight() == 0


def test_group_cancellation_keeps_whole_groups(engine, policy):
    """Group cancellation launches 24 prompts and keeps the first 16 groups to complete: every
    group is kept or dropped whole."""
    plan = _long_tail_plan("group", over_sample_rate=0.5)
    assert plan.num_prompts == 24 and plan.target_groups == 16
    samples, _ = engine.generate((PROMPTS * 6)[:24], 4, 1.0, 200, plan)
    kept = {s.group_id for s in samples if not s.masked}
    assert len(kept) == 16
    for group in range(24):
        members = [s for s in samples if s.group_id == group]
        # all kept or all dropped
        assert len(members) == 4 and len({s.masked for s in members}) == 1
    assert count_complete_groups([s for s in samples if not s.masked], 4) == 16
    assert engine.num_in_flight() == 0


def test_validation_never_cancels(engine, policy, tmp_path):
    """Validation ignores rollout.cancel and rollout.rollout_timeout_s: every one of its samples
    finishes, none is aborted (a reviewer found the timeout cutting validation and eval, each cut
    answer scored 0 in val/reward_mean and pass@k, and counted nowhere)."""
    cfg = tiny_config(
        tmp_path, "rollout.cancel=count", "rollout.drop_rate=0.5", "rollout.max_new_tokens=200"
    )
    run = train.setup(cfg, engine=engine)
    configured = engine.cfg
    engine.cfg = dataclasses.replace(configured, rollout_timeout_s=0.01)
    samples_seen = []
    original = engine.generate

    def spy(*args, **kwargs):
        samples, stats = original(*args, **kwargs)
        samples_seen.extend(samples)
        return samples, stats

    engine.generate = spy
    try:
        rollout.validate(run, version=0)
    finally:
        del engine.generate
        engine.cfg = configured
    assert len(samples_seen) == 2 * len(run.val_prompts) and not any(s.masked for s in samples_seen)


def test_failed_requests_are_counted_not_padded(engine, policy):
    """A request the engine rejects (a prompt over the context length) becomes an aborted sample
    marked "error" and counted, not padding; over max_failed_ratio the rollout raises a
    RolloutError."""
    too_long = [1] + [5] * 400  # beyond max_position_embeddings=256: the engine rejects it
    configured = engine.cfg
    try:
        engine.cfg = dataclasses.replace(configured, max_failed_ratio=0.5)
        samples, stats = engine.generate(PROMPTS + [too_long], 2, 1.0, 8)
        failed = [s for s in samples if s.finish_reason == "error"]
        assert stats.num_failed == len(failed) == 2 and all(s.masked for s in failed)
        assert all(s.finish_reason != "error" for s in samples if s.prompt_ids.tolist() != too_long)
        engine.cfg = dataclasses.replace(configured, max_failed_ratio=0.0)
        with pytest.raises(RolloutError, match="requests failed inside the engine"):
            engine.generate(PROMPTS + [too_long], 2, 1.0, 8)
    finally:
        engine.cfg = configured
    assert engine.num_in_flight() == 0


def test_mismatched_weight_sync_is_refused_before_it_reaches_the_engine(engine, policy):
    """A weight of the wrong shape or an unknown name is refused with a RolloutError before it is
    pushed, and the engine stays alive."""
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
    """Starting the engine leaves the trainer's loggers at WARNING (SGLang 0.5.23 set the root
    logger to ERROR when the engine started, silencing the trainer's warnings)."""
    assert logging.getLogger("rollout").isEnabledFor(logging.WARNING)
    assert logging.getLogger("tasks").isEnabledFor(logging.WARNING)


def test_plan_launch_arithmetic():
    """plan_launch: cancel none launches and waits for the whole batch; drop_rate stops at
    ceil((1 - rate) x batch) samples or groups; over_sample_rate launches extra prompts and keeps
    the batch size."""
    cfg = tiny_config("/tmp").rollout  # 8 prompts per step x group_size 8
    none = plan_launch(cfg, 32)
    assert (none.cancel, none.num_prompts, none.target_samples) == ("none", 32, 256)
    drop = plan_launch(dataclasses.replace(cfg, cancel="count", drop_rate=0.2), 32)
    # ceil(0.8 x 256)
    assert (drop.num_prompts, drop.target_samples, drop.target_groups) == (32, 205, 26)
    # a drop_rate a hair under 1 still waits for one sample and one group (rounded, it was 0)
    nearly_all = plan_launch(dataclasses.replace(cfg, cancel="count", drop_rate=1 - 1e-12), 32)
    assert (nearly_all.target_samples, nearly_all.target_groups) == (1, 1)
    over = plan_launch(dataclasses.replace(cfg, cancel="group", over_sample_rate=0.25), 32)
    # keeps the batch size
    assert (over.num_prompts, over.target_samples, over.target_groups) == (40, 256, 32)


def _timed_rollout(engine, reward):
    """4 prompts x 4 samples of up to 200 tokens, the last quarter cancelled."""
    rollout_cfg = dataclasses.replace(
        tiny_config("/tmp").rollout, cancel="count", group_size=4, drop_rate=0.25
    )
    return engine.generate(PROMPTS, 4, 1.0, 200, plan_launch(rollout_cfg, 4), reward=reward)


def test_a_slow_reward_does_not_stall_the_cancellation(engine, policy):
    """A reward that takes 200 ms (a parser, a sandbox, a judge), run in the reward threads as
    Rewards.for_rollout runs it: the cancellation lands about as fast as with an instant reward
    (within 20%, or 100 ms on this noisy machine: 50 ms failed once under load), and every finished
    trajectory gets its value; an `async def` reward is awaited as well. The same slow reward run
    on the event loop itself (as before rewards went off it) delays the cancellation past that
    bound, by whole rewards: the check has teeth."""

    def slow(text, answer, finished):
        time.sleep(0.2)
        return 0.5

    async def slow_async(text, answer, finished):
        await asyncio.sleep(0.2)
        return 0.25

    pool = DaemonPool(4, "reward")  # as rewards.Rewards holds one

    def off_loop(fn):
        async def reward(turns):
            return await rewards.call_reward_off_loop(fn, "text", "answer", True, pool)

        return reward

    _, instant = _timed_rollout(engine, off_loop(lambda text, answer, finished: 1.0))
    samples, offloaded = _timed_rollout(engine, off_loop(slow))
    finished = [s for s in samples if not s.masked]
    assert finished and all(s.reward == 0.5 for s in finished)
    margin = max(0.2 * instant.cancel_latency_s, 0.1)  # a blocking reward costs > 0.2 s
    assert offloaded.cancel_latency_s <= instant.cancel_latency_s + margin, (instant, offloaded)
    samples, awaited = _timed_rollout(engine, off_loop(slow_async))
    assert all(s.reward == 0.25 for s in samples if not s.masked)
    assert awaited.cancel_latency_s <= instant.cancel_latency_s + margin, (instant, awaited)
    _, blocking = _timed_rollout(engine, lambda turns: slow("text", "answer", True))
    # the bound the offloaded rewards meet, failed (it asked for a whole reward on top of the
    # instant run's latency, where one reward blocking adds 0.2 s less noise: 0.2009 s failed)
    assert blocking.cancel_latency_s > instant.cancel_latency_s + margin, (instant, blocking)


def test_rewards_stuck_past_their_limit_never_use_the_pool_up():
    """A reward that hangs, given up at its time limit as often as there are
    rollout.reward_workers, leaves the next reward a thread: it is scored. A reviewer found each
    hung call kept its thread for good, so after `workers` hangs spread over a long run every
    reward waited out its limit behind them and failed, and the run ended. At most `workers`
    threads are written off at a time (a slow judge past its limit would otherwise get ever more
    calls at once: another reviewer): past that a stuck call keeps its thread. Should a
    written-off call return after all, its thread ends."""
    release = threading.Event()
    pool = DaemonPool(2, "stuck_reward")

    def hangs(text, answer, finished):
        release.wait(30)
        return 0.0

    def call(fn, timeout_s):
        return asyncio.run(rewards.call_reward_off_loop(fn, "t", "a", True, pool, timeout_s))

    def quick(value):
        return lambda text, answer, finished: value

    for _ in range(2):
        with pytest.raises(rewards.RewardError, match="longer than rollout.reward_timeout_s"):
            call(hangs, 0.05)
    assert call(quick(1.0), 5.0) == 1.0
    assert pool.written_off == 2 and len(pool.threads) == 2 + 2
    for _ in range(2):  # past the cap: they keep their threads
        with pytest.raises(rewards.RewardError):
            call(hangs, 0.05)
    assert pool.written_off == 2 and len(pool.threads) == 4  # twice `workers` at most
    with pytest.raises(rewards.RewardError):
        call(quick(1.0), 0.2)  # every thread held
    release.set()  # the hung calls return: the replaced threads end, the pool keeps its two
    deadline = time.monotonic() + 10
    while len(pool.threads) > 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(pool.threads) == 2 and not pool.abandoned
    assert call(quick(0.5), 5.0) == 0.5


def test_reward_timeouts_and_errors_off_the_loop_are_counted_failures():
    """Off the loop as on it: a reward over rollout.reward_timeout_s, one that raises, one that
    returns NaN or a bool, each becomes a RewardError naming it (the rollout counts them)."""
    pool = DaemonPool(2, "reward")

    def sleepy(text, answer, finished):
        time.sleep(0.5)
        return 1.0

    async def broken(text, answer, finished):
        raise KeyError("judge down")

    cases = [
        (sleepy, 0.1, "longer than rollout.reward_timeout_s=0.1"),
        (broken, 0, "raised KeyError"),
        (lambda text, answer, finished: math.nan, 0, "not a finite number"),
        (lambda text, answer, finished: True, 0, "not a finite number"),
    ]
    for fn, timeout_s, message in cases:
        with pytest.raises(rewards.RewardError, match=message):
            asyncio.run(rewards.call_reward_off_loop(fn, "text", "answer", True, pool, timeout_s))


def test_overlong_penalty_hand_computed_and_shaping_only_the_advantage(tmp_path):
    """DAPO's soft overlong punishment: 0 up to budget - buffer, then linear to -factor at the
    budget (1,024 and 256: 700 tokens 0, 896 tokens -0.5, 1,024 tokens -1). advantages.compute adds
    it to the reward the advantage reads (the demo's 48-token budget, buffer 16: 40 tokens -> 1 -
    0.5), and only there: two right answers of different lengths keep reward 1 (accuracy, the
    logged reward) and are one zero-variance group to dynamic sampling, as the paper filters on
    accuracy; the penalty had been added to the reward itself, so such a group was kept and
    counted half wrong. A buffer larger than the budget is a ConfigError."""
    import advantages
    import cancel

    assert advantages.overlong_penalty(700, 1024, 256, 1.0) == 0.0
    assert advantages.overlong_penalty(896, 1024, 256, 1.0) == -0.5
    assert advantages.overlong_penalty(1024, 1024, 256, 0.5) == -0.5
    cfg = tiny_config(tmp_path, "train.overlong_penalty=1.0", "train.overlong_buffer=16")
    judge = rewards.Rewards(lambda text, answer, finished: 1.0, model.build_char_tokenizer(), cfg)
    group = [[Sample([1, 5], [4] * n, [0.0] * n, [1] * n, group_id=0)] for n in (40, 20)]
    prompts = [sample.Prompt(prompt_ids=[1, 5], answer="3")]
    for turns in group:
        turns[-1].reward = asyncio.run(judge.for_rollout(prompts)(turns))
    assert [turns[-1].reward for turns in group] == [1.0, 1.0]
    kept, counts = cancel.informative_groups([group])
    assert kept == [] and counts["zero_variance_all_correct"] == 1
    trajectories, metrics = advantages.compute(types.SimpleNamespace(cfg=cfg), [group])
    # rewards the advantage read: 0.5 and 1.0, mean 0.75, unbiased std 0.354
    first, second = (turns[-1].advantage for turns in trajectories)
    assert first == pytest.approx(-0.25 / (0.5**0.5 / 2 + 1e-6)) and second == pytest.approx(-first)
    assert metrics["train/overlong_penalty"].value == -0.25
    with pytest.raises(ConfigError, match="overlong_buffer <= 48"):
        tiny_config(tmp_path, "train.overlong_penalty=1.0", "train.overlong_buffer=64")
