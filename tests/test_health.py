"""Run health (memory.py, the weight sync's checks) on the real CPU engine: a weight push that
silently drops or corrupts a tensor is caught at the next check, an engine computing another model
(here: another rope) is caught at step 0 by the log-prob gap, and a gap that stays high stops the
run."""

import copy
import math

import pytest
import torch

import memory as health
import inflight
import rollout
import train
from assemble import load_config
from conftest import tiny_config
from runtime.engine import RolloutError

DROPPED = "model.layers.1.mlp.down_proj.weight"


def test_weight_check_passes_a_true_push_and_names_a_corrupted_tensor(engine, policy, tmp_path):
    """Every engine tensor is checked, and together they cover every trained parameter (the
    fused qkv and gate_up projections, the padded vocabulary, the norms); one changed element of
    a tensor of each kind is found, by the engine's name."""
    sums = engine.weight_checksums()
    assert health.check_weights(engine, policy.named_parameters()) == len(sums)
    params = dict(policy.named_parameters())
    read = set()
    for name in sums:
        parts = health.trainer_name(name, params)
        read |= set(parts) if isinstance(parts, list) else {parts}
    assert set(params) <= read, set(params) - read
    for trained, engine_name in [
        ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.qkv_proj.weight"),
        ("model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"),
        ("model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("model.layers.0.post_attention_layernorm.weight", "post_attention_layernorm.weight"),
        ("model.norm.weight", "model.norm.weight"),
    ]:
        corrupted = {name: p.detach().clone() for name, p in params.items()}
        corrupted[trained].view(-1)[5] += 1e-3
        engine.update_weights(corrupted.items(), version=0)
        with pytest.raises(health.WeightMismatchError, match=rf"1 of \d+ .*{engine_name}"):
            health.check_weights(engine, policy.named_parameters())
    engine.update_weights(policy.named_parameters(), version=0)  # as the fixture left it


def test_a_push_that_drops_a_tensor_stops_the_run_at_the_next_check(engine, tmp_path, monkeypatch):
    """A push that leaves one tensor out (the engine keeps the old one, and reports success) ends
    training after the first update with WeightMismatchError naming the tensor and the last
    checkpoint."""
    run = train.setup(tiny_config(tmp_path, "train.steps=2", "run.val_every=100"), engine=engine)
    push = engine.update_weights

    def dropping_push(named_params, *args, **kwargs):
        kept = [(name, p) for name, p in named_params if name != DROPPED]
        return push(kept, *args, **kwargs)

    monkeypatch.setattr(engine, "update_weights", dropping_push)
    with pytest.raises(health.WeightMismatchError, match=f"{DROPPED}.*Last checkpoint: none yet"):
        train.train(run)
    monkeypatch.undo()
    engine.update_weights(run.trainer.policy.named_parameters(), version=0)


def test_an_engine_computing_another_model_is_caught_at_step_0(engine, tmp_path):
    """The trainer's rotary frequencies halved (as a rope_theta the engine did not load): equal
    weights, so the weight check passes, but the first step's log-prob gap is far above fp32's
    bound and the run stops there."""
    run = train.setup(tiny_config(tmp_path, "train.steps=2", "run.val_every=100"), engine=engine)
    rotary = run.trainer.policy.model.rotary_emb
    rotary.inv_freq = rotary.inv_freq / 2
    with pytest.raises(health.LogprobGapError, match=r"step 0: .*by 0.000[1-9].*float32.*rope"):
        train.train(run)


def test_a_gap_above_the_bound_for_k_steps_in_a_row_stops_the_run(tmp_path):
    """GapWatch: the first step against the dtype's bound, then `run.max_logprob_gap` for
    `run.max_logprob_gap_steps` steps in a row (a step below resets the count; 0 turns it off).
    A resumed process's first step in bf16 is held to the looser of the two: a bf16 gap of 0.03
    trained on uninterrupted and stopped the resume (2e-2 at every resumed first step); fp32's
    bound holds at any step."""
    cfg = load_config(
        "configs/tiny.yaml",
        [f"run.out={tmp_path}", "run.max_logprob_gap=0.05", "run.max_logprob_gap_steps=3"],
    )
    watch = health.GapWatch(cfg, first_step=5)
    for step, gap in enumerate([1e-7, 0.1, 0.1, 0.01, 0.1, 0.1], start=5):
        watch.observe(step, gap)
    with pytest.raises(health.LogprobGapError, match="above run.max_logprob_gap=0.05 for 3 steps"):
        watch.observe(11, 0.2)
    with pytest.raises(health.LogprobGapError, match="step 0"):
        health.GapWatch(cfg, first_step=0).observe(0, 1e-3)  # fp32 allows 1e-4
    with pytest.raises(health.LogprobGapError, match="step 5"):
        health.GapWatch(cfg, first_step=5).observe(5, 1e-3)  # resumed too, in fp32
    cfg.model.engine_dtype = "bfloat16"
    health.GapWatch(cfg, first_step=0).observe(0, 1e-3)  # bf16 allows more
    with pytest.raises(health.LogprobGapError, match="step 0"):
        health.GapWatch(cfg, first_step=0).observe(0, 0.03)  # not 0.03
    health.GapWatch(cfg, first_step=150).observe(150, 0.03)  # resumed: the run's 0.05
    with pytest.raises(health.LogprobGapError, match="step 150: .*allowed: 0.05"):
        health.GapWatch(cfg, first_step=150).observe(150, 0.06)
    cfg.run.max_logprob_gap_steps = 0
    off = health.GapWatch(cfg, first_step=0)
    for step in range(1, 10):
        off.observe(step, 1.0)


def test_a_step_with_no_fresh_token_is_not_observed(tmp_path):
    """A step whose trained tokens the current weights did not sample (partial rollout's, all
    resumed) compares nothing: its gap, a Ratio over no token, used to reach GapWatch as 0, which
    passed the first step's check and ended a streak. It is not observed now."""
    from metrics import ratio

    cfg = load_config(
        "configs/tiny.yaml",
        [f"run.out={tmp_path}", "run.max_logprob_gap=0.05", "run.max_logprob_gap_steps=3"],
    )
    watch = health.GapWatch(cfg, first_step=5)
    watch.observe_ranks(5, ratio(0.0, 0.0))
    assert watch.over == 0
    with pytest.raises(health.LogprobGapError, match="step 6"):  # the first step it observes
        # gets the first step's check (fp32 allows 1e-4)
        copy.copy(watch).observe_ranks(6, ratio(2e-3, 2.0))
    watch.observe_ranks(6, ratio(1e-5, 2.0))
    for step in (7, 8):
        watch.observe_ranks(step, ratio(0.2, 2.0))
    watch.observe_ranks(9, ratio(0.0, 0.0))  # no measurement: the streak of 2 stands
    with pytest.raises(health.LogprobGapError, match="for 3 steps in a row"):
        watch.observe_ranks(10, ratio(0.2, 2.0))


def test_a_nan_from_the_engine_is_the_worst_gap_and_a_left_out_token_counts_nowhere(tmp_path):
    """An engine log-prob NaN made the gap NaN, which the health check read as no measurement: a
    reviewer's wrong engine (2.2 nats a token off, one NaN among 24 tokens) passed step 0's
    check. A -inf on a token the gap leaves out (masked, or stale) made it NaN too (inf x 0).
    Now the left-out token counts nowhere and an engine's NaN is the worst gap, inf; a NaN of the
    trainer's own (its update skipped and counted) still measures nothing, not blamed on the
    engine."""
    import update

    cfg = load_config("configs/tiny.yaml", [f"run.out={tmp_path}"])
    mb = {
        "loss_mask": torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
        "staleness": torch.tensor([[0, 0, 1, 0]]),
        "old_logprobs": torch.full((1, 4), -1.0),
        "engine_logprobs": torch.tensor([[-1.0, -1.0, -math.inf, -math.inf]]),
    }
    gap = update.logprob_gap([mb])["train/logprob_gap"]
    assert (gap.value, gap.count) == (0.0, 2.0)
    mb["old_logprobs"][0, 0] = math.nan  # the trainer's
    watch = health.GapWatch(cfg, first_step=0)
    watch.observe_ranks(0, update.logprob_gap([mb])["train/logprob_gap"])
    assert watch.first_step == 1  # not measured: the check moves to the next step
    mb["engine_logprobs"][0, 0] = math.nan  # top_p < 1: the trainer's, added in (on_nucleus)
    assert math.isnan(update.logprob_gap([mb])["train/logprob_gap"].value)  # still the trainer's
    mb["old_logprobs"][0, 0] = mb["engine_logprobs"][0, 0] = -1.0
    mb["engine_logprobs"][0, 1] = math.nan  # the engine's
    engine_nan = update.logprob_gap([mb])["train/logprob_gap"]
    assert engine_nan.value == math.inf
    with pytest.raises(health.LogprobGapError, match="step 1: .* by inf per token \\(a NaN"):
        watch.observe_ranks(1, engine_nan)


def test_weights_are_checked_every_push_at_first_then_every_n_steps(tmp_path):
    cfg = load_config("configs/tiny.yaml", [f"run.out={tmp_path}"])
    cfg.run.check_weights_first, cfg.run.check_weights_every = 3, 10
    checked = [step for step in range(40) if health.should_check_weights(step, cfg.run)]
    assert checked == [0, 1, 2, 9, 19, 29, 39]
    cfg.run.check_weights_every = 0
    assert [s for s in range(40) if health.should_check_weights(s, cfg.run)] == [0, 1, 2]


def test_every_request_carries_its_own_sampling_seed(engine, policy, sent_seeds):
    """Reproducible rollouts: with a rollout seed, each request the engine receives carries a
    sampling_seed, distinct for every member of every group (a shared seed would make a group
    sample alike and train nothing), and the same seed gives the same seeds again."""
    sent = sent_seeds
    prompts = [[1, 5, 6, 2], [1, 7, 2]]
    for _ in range(2):
        engine.generate(prompts, 4, 1.0, 4, seed=rollout.rollout_seed(0, step=3))
    first, again = sent[:8], sent[8:]
    assert None not in first and len(set(first)) == 8 and sorted(first) == sorted(again)
    assert rollout.rollout_seed(0, 3) != rollout.rollout_seed(0, 4) != rollout.rollout_seed(1, 4)
    seeds = {inflight.request_seed(7, index, turn) for index in range(512) for turn in range(4)}
    assert len(seeds) == 512 * 4 and max(seeds) < 2**31


def test_deterministic_inference_is_refused_on_cpu_with_the_reason(tmp_path):
    """rollout.deterministic: SGLang's deterministic mode has no CPU attention backend; the
    engine is refused before it starts, naming the SGLang file that says so."""
    cfg = tiny_config(tmp_path, "rollout.deterministic=true")
    with pytest.raises(RolloutError, match="overrides.py"):
        rollout.RolloutEngine(str(tmp_path), cfg.rollout)


def test_the_gap_the_check_reads_is_logged_beside_the_mean(monkeypatch):
    """`train/logprob_gap` is the mean over every rank's fresh tokens; the health check reads the
    largest rank's own mean, which TensorBoard now shows as `train/logprob_gap_max` (a reviewer's
    run stopped on a gap of 0.1 while the logged one read 0.001: rank 0's 40 tokens at 0.1
    diluted in rank 1's 3,960 at 0)."""
    import metrics
    import update

    def micro_batch(tokens, gap):
        return {
            "loss_mask": torch.ones(1, tokens),
            "staleness": torch.zeros(1, tokens),
            "old_logprobs": torch.full((1, tokens), -1.0),
            "engine_logprobs": torch.full((1, tokens), -1.0 - gap),
        }

    per_rank = [
        update.logprob_gap([micro_batch(40, 0.1)]),
        update.logprob_gap([micro_batch(3960, 0)]),
    ]
    monkeypatch.setattr(metrics.parallel, "gather_objects", lambda local: per_rank)
    out = metrics.reduce_metrics(per_rank[0])
    assert out["train/logprob_gap"] == pytest.approx(0.001)
    assert out["train/logprob_gap_max"] == pytest.approx(0.1)
    # a step with no fresh token to measure (partial rollout's, all sampled by older weights):
    # nothing is logged, not a gap of 0 (a perfect match)
    stale = micro_batch(40, 0.1) | {"staleness": torch.ones(1, 40)}
    per_rank = [update.logprob_gap([stale])]
    assert metrics.reduce_metrics(per_rank[0]) == {}
