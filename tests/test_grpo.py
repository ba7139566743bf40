"""GRPO math against hand-computed values, and "masked equals removed" for every loss mode."""

import math
import types

import pytest
import torch

import advantages
import loss as losses
from advantages import group_advantages
from assemble import load_config
from sample import Sample

MODES = losses.LOSS_AGG_MODES


def test_group_advantages_hand_computed():
    """Group advantages are (reward - group mean) / unbiased group std, 0 for a group of equal
    rewards; Dr. GRPO's variant leaves out the division."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    valid = torch.ones(6, dtype=torch.bool)
    adv, degenerate = group_advantages(rewards, groups, valid)
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 1: identical rewards -> 0
    expected = 0.5 / math.sqrt(1 / 3)
    assert adv.tolist() == pytest.approx([expected, -expected, expected, -expected, 0, 0], abs=1e-5)
    assert degenerate == 0
    adv, _ = group_advantages(rewards, groups, valid, scale_by_std=False)  # Dr. GRPO
    assert adv.tolist() == pytest.approx([0.5, -0.5, 0.5, -0.5, 0, 0])
    # equal rewards that float32 cannot hold exactly (the tiny task's k / N): exactly 0, not an
    # ulp of mean over an ulp of std (0.056 for every member of 8 x 5/7 in float32 statistics)
    for value, size in ((5 / 7, 8), (0.806, 8), (0.895, 16)):
        equal = torch.full((size,), value)
        ones = torch.ones(size, dtype=torch.bool)
        adv, _ = group_advantages(equal, torch.zeros(size, dtype=torch.long), ones)
        assert adv.dtype == torch.float32 and torch.equal(adv, torch.zeros(size)), value


def test_group_statistics_use_survivors_only():
    """An aborted member is left out of its group's mean and std and gets advantage 0: the
    survivors get the advantages of the group without it."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    valid = torch.tensor([True, True, True, False])
    adv, _ = group_advantages(rewards, torch.zeros(4, dtype=torch.long), valid)
    # survivors [1, 0, 1]: mean 2/3, unbiased std sqrt(1/3); the aborted member gets 0
    std = math.sqrt(1 / 3)
    assert adv.tolist() == pytest.approx(
        [(1 / 3) / std, -(2 / 3) / std, (1 / 3) / std, 0.0], abs=1e-5
    )
    same, _ = group_advantages(rewards[:3], torch.zeros(3, dtype=torch.long), valid[:3])
    assert adv[:3].tolist() == pytest.approx(same.tolist())


def test_the_advantage_stage_leaves_a_cancelled_member_out_of_its_group(tmp_path):
    """advantages.compute, the stage the step calls, on groups as the rollout hands them back:
    an aborted member (masked, reward 0) is out of its group's statistics and gets 0, and a group
    left with one survivor is logged in train/degenerate_groups (a reviewer found both reached
    only through group_advantages: every test of the stage had nothing masked)."""
    cfg = load_config("configs/tiny.yaml", [f"run.out={tmp_path}"])
    trainer = types.SimpleNamespace(cfg=cfg)  # without a KL reference compute reads the config

    def member(group_id, reward, masked=False):
        reason = "abort" if masked else "stop"
        return [
            Sample(
                [1],
                [2],
                [0.0],
                [1],
                group_id=group_id,
                reward=reward,
                masked=masked,
                finish_reason=reason,
            )
        ]

    groups = [
        [member(0, 1.0), member(0, 1.0), member(0, 0.0), member(0, 0.0, masked=True)],
        [member(1, 1.0), member(1, 0.0, masked=True)],  # one survivor: degenerate
    ]
    trajectories, metrics = advantages.compute(trainer, groups)
    got = [turns[-1].advantage for turns in trajectories]
    # group 0's survivors [1, 1, 0]: mean 2/3, unbiased std sqrt(1/3)
    std = math.sqrt(1 / 3)
    expected = [(1 / 3) / std, (1 / 3) / std, -(2 / 3) / std, 0.0, 0.0, 0.0]
    assert got == pytest.approx(expected, abs=1e-5)
    assert metrics["train/degenerate_groups"].value == 1
    # near-equal rewards that dynamic sampling keeps (float64, as scored) stay apart in the
    # stage: float32 rounded 100 and 100.000003 together, every advantage 0 (a reviewer's)
    near = [[member(2, r) for r in (100.0, 100.000003, 100.0, 100.000003)]]
    trajectories, _ = advantages.compute(trainer, near)
    got = [turns[-1].advantage for turns in trajectories]
    assert got == pytest.approx([-0.549, 0.549, -0.549, 0.549], abs=1e-3)


def test_the_stage_logs_its_reward_shaping_over_trained_members_only(tmp_path, monkeypatch):
    """The overlong penalty and the KL cost in the reward are logged as means over the members
    that train: not a cancelled one, and under train.mask_truncated not one cut at the budget
    (the cut one's shaped reward stays in its group's statistics). Demo budget 48, buffer 16: 40
    tokens -0.5, 44 -0.75, 48 -1."""
    cfg = load_config(
        "configs/tiny.yaml",
        [
            f"run.out={tmp_path}",
            "train.overlong_penalty=1.0",
            "train.overlong_buffer=16",
            "train.mask_truncated=true",
            "train.kl_in=reward",
            "train.kl_coef=0.5",
        ],
    )
    # the KL each trajectory would have to the reference
    kl = torch.tensor([1.0, 2.0, 3.0, 8.0], dtype=torch.float64)
    monkeypatch.setattr(advantages, "reference_kl", lambda trainer, trajectories: kl)

    def member(length, reason, masked=False):
        turn = Sample([1], [2] * length, [0.0] * length, [1] * length, group_id=0, reward=1.0)
        turn.finish_reason, turn.masked = reason, masked
        return [turn]

    group = [
        member(40, "stop"),
        member(48, "length"),  # cut: trains nothing under mask_truncated
        member(44, "abort", masked=True),  # cancelled
        member(36, "stop"),  # -0.25
    ]
    _, metrics = advantages.compute(types.SimpleNamespace(cfg=cfg), [group])
    assert metrics["train/overlong_penalty"].value == pytest.approx((-0.5 - 0.25) / 2)
    assert metrics["train/reward_kl_cost"].value == pytest.approx(0.5 * (1 + 8) / 2)


def test_groups_with_fewer_than_two_survivors_get_zero_and_are_counted():
    """Groups with fewer than two survivors get advantage 0 (finite) and are counted as
    degenerate; with every sample aborted, all groups are."""
    rewards = torch.tensor([1.0, 0.0, 0.3, 0.9, 0.2, 0.4])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    # group 0: 1 survivor, group 1: none
    valid = torch.tensor([True, False, False, False, True, True])
    adv, degenerate = group_advantages(rewards, groups, valid)
    assert torch.isfinite(adv).all()
    assert adv[:4].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert degenerate == 2
    all_aborted, degenerate = group_advantages(rewards, groups, torch.zeros(6, dtype=torch.bool))
    assert all_aborted.tolist() == [0.0] * 6 and degenerate == 3


def test_aggregate_modes_hand_computed():
    """Each loss aggregation mode against hand-computed values, and its divisor (what update.py
    weights micro-batches by); an unknown mode raises in both, so a mode added to `aggregate`
    alone is not weighted by another mode's divisor (it was: by the sequence count)."""
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert losses.aggregate(per_token, mask, "token-mean").item() == pytest.approx(15 / 5)
    assert losses.aggregate(per_token, mask, "seq-mean-token-sum").item() == pytest.approx(
        (6 + 9) / 2
    )
    assert losses.aggregate(per_token, mask, "seq-mean-token-mean").item() == pytest.approx(
        (2 + 4.5) / 2
    )
    assert losses.aggregate(
        per_token, mask, "seq-mean-token-sum-norm", norm_length=4
    ).item() == pytest.approx(15 / 8)
    divisors = {mode: losses.aggregation_count(mask, mode).item() for mode in MODES}
    assert divisors == {"token-mean": 5} | {mode: 2 for mode in MODES[1:]}
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        losses.aggregate(per_token, mask, "mean")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        losses.aggregation_count(mask, "mean")


def test_clipped_ratio_and_kl_hand_computed():
    """PPO clipping at ratio 1.5: with A > 0 the loss is clipped at 1.2 and passes no gradient;
    with A < 0 min() keeps the unclipped term and its gradient. The KL estimate is exp(d) - d - 1
    with d = ref - logp, added to the loss at its coefficient, with its gradient."""
    old = torch.zeros(1, 1)
    logprobs = torch.full((1, 1), math.log(1.5), requires_grad=True)  # ratio 1.5, beyond 1 + 0.2
    mask = torch.ones(1, 1)
    loss, stats = losses.policy_loss(logprobs, old, torch.tensor([1.0]), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-1.2) and stats["clip_frac"].item() == 1.0
    assert stats["clip_frac_high"].item() == 1.0  # clipped at the top
    assert stats["ppo_kl"].item() == pytest.approx(-math.log(1.5))  # log(pi_old / pi)
    loss.backward()
    assert logprobs.grad.item() == 0.0  # clipped: no push further in the same direction
    logprobs.grad = None
    loss, _ = losses.policy_loss(logprobs, old, torch.tensor([-1.0]), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(1.5)  # min() keeps the pessimistic unclipped term
    loss.backward()
    assert logprobs.grad.item() == pytest.approx(1.5)
    ref = torch.full((1, 1), math.log(1.5) + math.log(2.0))  # ref - logp = log 2
    logprobs.grad = None
    loss, stats = losses.policy_loss(
        logprobs, old, torch.tensor([1.0]), mask, ref_logprobs=ref, terms={"kl": 0.1}
    )
    assert stats["kl"].item() == pytest.approx(2 - math.log(2) - 1)
    # in the loss at its coefficient, and its gradient the loss's only one (the clipped surrogate
    # passes none): d/dlogp (e^d - d - 1) = 1 - e^d = -1
    assert loss.item() == pytest.approx(-1.2 + 0.1 * (1 - math.log(2)))
    loss.backward()
    assert logprobs.grad.item() == pytest.approx(0.1 * (1 - 2))


def test_the_loss_statistics_read_trained_tokens_only():
    """Beside one trained token, a masked one (padding, an aborted or stale token) with wild
    values moves none of the logged statistics: clip fractions, ppo_kl, the reference's KL and
    each term's mean are over the trained tokens (a reviewer found kl, ppo_kl and term_<name>
    untested with a mask: a plain mean passed)."""
    old = torch.zeros(1, 2)
    logprobs = torch.tensor([[math.log(1.5), 3.0]])
    ref = torch.tensor([[math.log(3.0), -5.0]])
    entropy = torch.tensor([[0.5, 9.0]])
    loss, stats = losses.policy_loss(
        logprobs,
        old,
        torch.tensor([-1.0]),
        torch.tensor([[1.0, 0.0]]),
        ref_logprobs=ref,
        entropy=entropy,
        terms={"kl": 0.1, "entropy": 0.01},
    )
    assert stats["kl"].item() == pytest.approx(2 - math.log(2) - 1)  # k3 at ref - logp = log 2
    assert stats["ppo_kl"].item() == pytest.approx(-math.log(1.5))
    assert stats["term_entropy"].item() == pytest.approx(-0.5)
    assert stats["clip_frac"].item() == 0.0  # A < 0: min() keeps the unclipped term


def test_clip_higher_hand_computed_and_symmetric_by_default():
    """DAPO's clip-higher: ratio 1.25 with A > 0 is inside [0.8, 1.28] (gradient flows), outside
    [0.8, 1.2]; without clip_eps_high the clip is symmetric, and the low side keeps clip_eps."""
    old, mask = torch.zeros(1, 1), torch.ones(1, 1)
    for high, expected_loss, expected_grad in (
        (0.28, -1.25, -1.25),
        (None, -1.2, 0.0),
        (0.2, -1.2, 0.0),
    ):
        logprobs = torch.full((1, 1), math.log(1.25), requires_grad=True)
        loss, stats = losses.policy_loss(
            logprobs, old, torch.tensor([1.0]), mask, clip_eps=0.2, clip_eps_high=high
        )
        loss.backward()
        assert loss.item() == pytest.approx(
            expected_loss
        ) and logprobs.grad.item() == pytest.approx(expected_grad)
        assert stats["clip_frac"].item() == (expected_grad == 0.0)
    # the low side keeps clip_eps: ratio 0.7 with A < 0 is clipped at 0.8 whatever clip_eps_high is
    logprobs = torch.full((1, 1), math.log(0.7), requires_grad=True)
    loss, stats = losses.policy_loss(
        logprobs, old, torch.tensor([-1.0]), mask, clip_eps=0.2, clip_eps_high=0.28
    )
    loss.backward()
    assert loss.item() == pytest.approx(0.8) and logprobs.grad.item() == 0.0
    assert stats["clip_frac"].item() == 1.0 and stats["clip_frac_high"].item() == 0.0


def test_sequence_ratio_hand_computed():
    """GSPO: sequence 0 has token ratios 1.1 and 0.9 (and a masked token), so s = sqrt(0.99) =
    0.99499, below 1 - 3e-4; with A = 1, min() keeps the unclipped -s, whose gradient is spread
    evenly over its two trained tokens. Sequence 1: one token of ratio 1.01 > 1 + 4e-4 with A =
    1, clipped: -(1 + 4e-4), no gradient. The loss is the mean over the two sequences."""
    logprobs = torch.tensor(
        [[math.log(1.1), math.log(0.9), 5.0], [math.log(1.01), 0.0, 0.0]], requires_grad=True
    )
    old, mask = torch.zeros(2, 3), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, stats = losses.policy_loss(
        logprobs,
        old,
        torch.tensor([1.0, 1.0]),
        mask,
        clip_eps=3e-4,
        clip_eps_high=4e-4,
        agg_mode="seq-mean-token-mean",
        ratio_level="sequence",
    )
    s = math.sqrt(1.1 * 0.9)
    assert loss.item() == pytest.approx(-(s + 1 + 4e-4) / 2)
    loss.backward()
    torch.testing.assert_close(
        logprobs.grad, torch.tensor([[-s / 4, -s / 4, 0.0], [0.0, 0.0, 0.0]])
    )
    assert stats["clip_frac"].item() == pytest.approx(1 / 3)  # sequence 1's one token
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        losses.policy_loss(
            logprobs,
            old,
            torch.tensor([1.0, 1.0]),
            mask,
            agg_mode="token-mean",
            ratio_level="sequence",
        )


def test_sequence_ratio_of_one_token_sequences_is_the_token_ratio():
    """With one trained token per sequence the two ratio levels are the same loss and gradient."""
    logits = torch.randn(4, 3, 6)
    old, adv = torch.randn(4, 3) * 0.1 - 1.7, torch.randn(4)
    mask = torch.zeros(4, 3)
    mask[torch.arange(4), torch.tensor([0, 2, 1, 2])] = 1
    results = []
    for level in ("token", "sequence"):
        leaf = logits.clone().requires_grad_(True)
        logprobs, _ = losses.token_logprobs(leaf, torch.zeros(4, 3, dtype=torch.long))
        loss, _ = losses.policy_loss(
            logprobs,
            old,
            adv,
            mask,
            clip_eps=0.2,
            agg_mode="seq-mean-token-mean",
            ratio_level=level,
        )
        loss.backward()
        results.append((loss.detach(), leaf.grad))
    torch.testing.assert_close(results[0], results[1])


def test_truncated_importance_weights_hand_computed():
    """Truncated importance sampling: weights pi_old / mu of 0.5, 1 and 4 (capped at 2; a masked
    token's 100 is ignored) scale the loss and each token's gradient, and their mean and capped
    share are reported; mu == pi_old gives the plain loss; a cap under 1 raises."""
    old = torch.zeros(1, 4)
    engine = torch.tensor([[math.log(2.0), 0.0, -math.log(4.0), -math.log(100.0)]])  # mu per token
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # ratio pi / pi_old = 1: unclipped, surrogate = -A
    logprobs = torch.zeros(1, 4, requires_grad=True)
    loss, stats = losses.policy_loss(
        logprobs, old, torch.tensor([1.0]), mask, engine_logprobs=engine, tis_cap=2.0
    )
    assert loss.item() == pytest.approx(-(0.5 + 1.0 + 2.0) / 3)
    assert stats["tis_weight"].item() == pytest.approx(3.5 / 3)
    assert stats["tis_capped_frac"].item() == pytest.approx(1 / 3)
    loss.backward()
    # weights scale gradients
    assert logprobs.grad[0].tolist() == pytest.approx([-0.5 / 3, -1 / 3, -2 / 3, 0.0])
    # mu == pi_old: every weight is 1, the loss is the plain one
    plain, _ = losses.policy_loss(logprobs, old, torch.tensor([1.0]), mask)
    same, stats = losses.policy_loss(
        logprobs, old, torch.tensor([1.0]), mask, engine_logprobs=old, tis_cap=2.0
    )
    assert same.item() == plain.item() and stats["tis_weight"].item() == 1.0
    with pytest.raises(ValueError, match="tis_cap"):
        losses.policy_loss(
            logprobs, old, torch.tensor([1.0]), mask, engine_logprobs=engine, tis_cap=0.5
        )


def test_token_logprobs_temperature():
    """Log-probs and entropies are those of log_softmax(logits / temperature)."""
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    logprobs, entropy = losses.token_logprobs(logits, targets, temperature=0.7)
    reference = torch.log_softmax(logits / 0.7, -1)
    assert torch.allclose(logprobs, reference.gather(-1, targets[..., None])[..., 0])
    assert torch.allclose(entropy, -(reference.exp() * reference).sum(-1))


def _full_size_token_logprobs(logits, target_ids, temperature):
    """The log-prob path before chunking (bench/train_memory.py keeps it too): the reference
    values."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_probs.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1), -(
        log_probs.exp() * log_probs
    ).sum(-1)


@pytest.mark.parametrize("seed", range(5))
def test_chunked_head_logprobs_equal_the_full_size_path(seed):
    """For random shapes and chunk sizes, the chunked head gives the log-probs, entropies and
    gradients (to the hidden states and the head's weight) of the path before chunking."""
    torch.manual_seed(seed)
    batch, length, vocab = (int(x) for x in torch.randint(1, 9, (3,)) * torch.tensor([1, 7, 13]))
    # chunks of 1 position up to all of them
    hidden_size, chunk_tokens = 8, int(torch.randint(1, 40, (1,)))
    hidden, weight = torch.randn(batch, length, hidden_size), torch.randn(vocab, hidden_size)
    targets = torch.randint(0, vocab, (batch, length))
    weights = torch.randn(batch, length)
    results = []
    for chunked in (False, True):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if chunked:
            logprobs, entropy = losses.head_logprobs(
                h, w, None, targets, 0.8, chunk_tokens=chunk_tokens
            )
        else:
            logprobs, entropy = _full_size_token_logprobs(h @ w.T, targets, 0.8)
        (logprobs * weights).sum().backward()
        results.append((logprobs.detach(), entropy.detach(), h.grad, w.grad))
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)


def test_entropy_carries_no_autograd_graph():
    """Entropy comes back detached (a metric, never differentiated) while log-probs are fp32 and
    keep their graph, on the full and on the chunked path."""
    logits = torch.randn(2, 6, 11, requires_grad=True)
    logprobs, entropy = losses.token_logprobs(logits, torch.zeros(2, 6, dtype=torch.long))
    assert logprobs.requires_grad and logprobs.dtype == torch.float32
    assert not entropy.requires_grad and entropy.grad_fn is None
    weight = torch.randn(11, 3, requires_grad=True)
    logprobs, entropy = losses.head_logprobs(
        torch.randn(2, 6, 3), weight, None, torch.zeros(2, 6, dtype=torch.long), chunk_tokens=4
    )
    assert logprobs.requires_grad and not entropy.requires_grad


def _loss_grad(logits, old, adv, mask, mode, ref=None):
    logits = logits.clone().requires_grad_(True)
    targets = torch.zeros(logits.shape[:2], dtype=torch.long)
    logprobs, _ = losses.token_logprobs(logits, targets)
    loss, _ = losses.policy_loss(
        logprobs,
        old,
        adv,
        mask,
        agg_mode=mode,
        norm_length=7,
        ref_logprobs=ref,
        terms={"kl": 0.05} if ref is not None else None,
    )
    loss.backward()
    return loss.detach(), logits.grad


@pytest.mark.parametrize("mode", MODES)
def test_aborted_rows_masked_equals_removed(mode):
    """In every loss mode, aborted rows masked out give the loss and gradients of the batch
    without them, and no gradient of their own."""
    batch = 6
    width = 7
    vocab = 5
    logits = torch.randn(batch, width, vocab)
    old = torch.randn(batch, width) * 0.1 - 1.5
    ref = torch.randn(batch, width) * 0.1 - 1.5
    adv = torch.randn(batch)
    mask = (torch.rand(batch, width) > 0.3).float()
    mask[:, 0] = 1  # every completed row has at least one trained token
    aborted = torch.tensor([False, True, False, False, True, False])
    masked = mask.clone()
    masked[aborted] = 0  # how collate() marks aborted rows
    keep = ~aborted
    loss_masked, grad_masked = _loss_grad(logits, old, adv, masked, mode, ref)
    loss_removed, grad_removed = _loss_grad(
        logits[keep], old[keep], adv[keep], mask[keep], mode, ref[keep]
    )
    assert loss_masked.item() == pytest.approx(loss_removed.item(), rel=1e-6)
    assert torch.allclose(grad_masked[keep], grad_removed, atol=1e-7)
    assert grad_masked[aborted].abs().max() == 0


@pytest.mark.parametrize("mode", MODES)
def test_all_aborted_batch_gives_finite_zero(mode):
    """In every loss mode, a batch with nothing to train gives loss 0 and zero, finite gradients."""
    loss, grad = _loss_grad(
        torch.randn(3, 4, 5), torch.zeros(3, 4), torch.randn(3), torch.zeros(3, 4), mode
    )
    assert loss.item() == 0.0 and torch.isfinite(grad).all() and grad.abs().max() == 0


@pytest.mark.parametrize("mode", MODES)
def test_micro_batch_weighting_equals_one_batch(mode):
    """Micro-batch losses scaled by aggregation_count(mb) / aggregation_count(batch), as train.py
    scales them, add up to the gradients of the whole batch in every loss mode."""
    logits = torch.randn(6, 5, 4)
    old, adv = torch.randn(6, 5) * 0.1 - 1.4, torch.randn(6)
    mask = (torch.rand(6, 5) > 0.4).float()
    mask[2] = 0
    _, full_grad = _loss_grad(logits, old, adv, mask, mode)
    total = losses.aggregation_count(mask, mode)
    leaf = logits.clone().requires_grad_(True)
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6)):
        logprobs, _ = losses.token_logprobs(leaf[rows], torch.zeros(2, 5, dtype=torch.long))
        loss, _ = losses.policy_loss(
            logprobs, old[rows], adv[rows], mask[rows], agg_mode=mode, norm_length=7
        )
        (loss * losses.aggregation_count(mask[rows], mode) / total).backward()
    assert torch.allclose(leaf.grad, full_grad, atol=1e-7)


def test_kl_estimators_hand_computed():
    """Schulman's estimators at log pi = -1.0, log pi_ref = -1.2 (r = -0.2): k1 0.2, k2 0.02,
    k3 = exp(-0.2) + 0.2 - 1; low_var_kl is k3 until verl's clamps bite (r clamped to 20 before
    exp, the estimate to 10). Their gradients in log pi: k1 1, k2 -r = 0.2, k3 1 - exp(r)."""
    logprobs = torch.tensor([[-1.0, -31.0, -1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.2, -1.0, -16.0]], dtype=torch.float64)  # then r = 30 and r = -15
    k3 = math.exp(-0.2) + 0.2 - 1
    expected = {"k1": 0.2, "k2": 0.02, "k3": k3, "low_var_kl": k3}
    grads = {"k1": 1.0, "k2": 0.2, "k3": 1 - math.exp(-0.2), "low_var_kl": 1 - math.exp(-0.2)}
    for name in losses.KL_ESTIMATORS:
        kl = losses.kl_estimate(logprobs, ref, name)
        assert kl[0, 0].item() == pytest.approx(expected[name], abs=1e-12), name
        (grad,) = torch.autograd.grad(kl[0, 0], logprobs)
        assert grad[0, 0].item() == pytest.approx(grads[name], abs=1e-12), name
    assert losses.kl_estimate(logprobs, ref, "k3")[0, 1].item() == pytest.approx(math.exp(30) - 31)
    assert losses.kl_estimate(logprobs, ref, "low_var_kl")[0, 1].item() == 10.0
    # r = -15: k3 = e^-15 + 14, clamped to 10 (r clamped to -10 first would give e^-10 + 9)
    assert losses.kl_estimate(logprobs, ref, "low_var_kl")[0, 2].item() == 10.0
    with pytest.raises(ValueError, match="k4"):
        losses.kl_estimate(logprobs, ref, "k4")


def test_cispo_keeps_the_gradient_of_a_clipped_token():
    """CISPO at ratio e^1.5 = 4.48 with A = 1 and the weight range [0, 3]: the term is
    -sg(3) * A * log pi, so its gradient in log pi is -3 (PPO's clip gives 0 there), its value
    -3 * log pi; a ratio inside the range weighs by the ratio itself; clipped tokens are counted."""
    old = torch.tensor([[0.0, 0.0]])
    logprobs = torch.tensor([[1.5, math.log(2.0)]], requires_grad=True)
    mask = torch.ones(1, 2)
    loss, stats = losses.policy_loss(
        logprobs,
        old,
        torch.tensor([1.0]),
        mask,
        clip_eps=1.0,
        clip_eps_high=2.0,
        ratio_level="cispo",
    )
    # token-mean of -3 * 1.5 and -2 * log 2
    assert loss.item() == pytest.approx((-3 * 1.5 - 2 * math.log(2)) / 2)
    loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([-3 / 2, -2 / 2])
    assert stats["clip_frac"].item() == 0.5
    with pytest.raises(ValueError, match="token-mean"):
        losses.policy_loss(
            logprobs,
            old,
            torch.tensor([1.0]),
            mask,
            agg_mode="seq-mean-token-mean",
            ratio_level="cispo",
        )


def test_entropy_bonus_subtracts_coef_times_entropy_with_its_gradient():
    """entropy_coef c: the loss drops by c x the aggregated entropy (token-mean: its mean over
    trained tokens), and each trained token's entropy gets gradient -c / N (masked ones 0)."""
    logprobs = torch.zeros(1, 3, requires_grad=True)
    entropy = torch.tensor([[0.5, 1.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    base, _ = losses.policy_loss(logprobs, torch.zeros(1, 3), torch.tensor([1.0]), mask)
    loss, _ = losses.policy_loss(
        logprobs,
        torch.zeros(1, 3),
        torch.tensor([1.0]),
        mask,
        entropy=entropy,
        terms={"entropy": 0.1},
    )
    assert loss.item() == pytest.approx(base.item() - 0.1 * 0.75)
    loss.backward()
    assert entropy.grad.tolist()[0] == pytest.approx([-0.05, -0.05, 0.0])
    # its logged value is the mean over trained tokens whatever the loss's aggregation: sequences
    # of 1 and 3 trained tokens, entropies 1 and 2, 2, 2: 7/4 (the mean of the sequence means
    # would be 1.5)
    _, stats = losses.policy_loss(
        torch.zeros(2, 3),
        torch.zeros(2, 3),
        torch.tensor([1.0, 1.0]),
        torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]),
        agg_mode="seq-mean-token-mean",
        entropy=torch.tensor([[1.0, 5.0, 5.0], [2.0, 2.0, 2.0]]),
        terms={"entropy": 0.1},
    )
    assert stats["term_entropy"].item() == pytest.approx(-7 / 4)


def test_token_entropy_has_a_graph_only_when_asked():
    """The entropy bonus needs d entropy / d logits: token_logprobs keeps the graph with
    entropy_grad, and its gradient is the analytic one, -p * (log p + H) per logit."""
    logits = torch.tensor([[[1.0, 2.0, 0.5]]], dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[1]])
    assert not losses.token_logprobs(logits, targets)[1].requires_grad
    _, entropy = losses.token_logprobs(logits, targets, entropy_grad=True)
    entropy.sum().backward()
    p = torch.softmax(logits.detach(), -1)
    h = -(p * p.log()).sum()
    torch.testing.assert_close(logits.grad, -p * (p.log() + h))


def test_top_p_log_probs_are_those_of_the_nucleus_hand_computed():
    """With top_p 0.7 over probabilities (0.5, 0.3, 0.15, 0.05), SGLang keeps a token while the
    mass before it is <= 0.7: tokens 0 and 1. A kept token's log-prob is log(p / 0.8), the
    entropy that of (0.625, 0.375), and the gradient finite; a target outside the nucleus (the
    engine drew it at the edge) stays in its own row's nucleus instead of scoring -inf."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    leaf = probs.log().expand(3, 4).clone().requires_grad_(True)
    logits = leaf[None]  # [1, 3, 4]
    targets = torch.tensor([[0, 1, 2]])
    logprobs, entropy = losses.token_logprobs(logits, targets, top_p=0.7, entropy_grad=True)
    expected = [math.log(0.5 / 0.8), math.log(0.3 / 0.8), math.log(0.15 / 0.95)]
    assert logprobs[0].tolist() == pytest.approx(expected, abs=1e-6)
    kept = torch.tensor([0.625, 0.375])
    assert entropy[0, 0].item() == pytest.approx(-(kept * kept.log()).sum().item(), abs=1e-6)
    (logprobs.sum() + entropy.sum()).backward()
    assert torch.isfinite(leaf.grad).all()
    full, _ = losses.token_logprobs(logits, targets, top_p=1.0)  # top_p 1: the full softmax
    assert full[0].tolist() == pytest.approx(probs.log()[[0, 1, 2]].tolist(), abs=1e-6)
    hidden, weight = torch.ones(1, 3, 1), probs.log()[:, None]  # logits: log(probs) everywhere
    chunked, _ = losses.head_logprobs(hidden, weight, None, targets, top_p=0.7, chunk_tokens=1)
    assert chunked[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_degenerate_groups_under_a_float64_default_dtype():
    """advantages.degenerate_groups counts groups with fewer than 2 valid members whatever torch's
    default dtype (float64 made index_add_ raise)."""
    from advantages import degenerate_groups

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        count = degenerate_groups(torch.tensor([0, 0, 1, 1, 2]), torch.tensor([1, 1, 1, 0, 1]) > 0)
    finally:
        torch.set_default_dtype(default)
    assert count == 2  # group 1 has one valid member, group 2 one
