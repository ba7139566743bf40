"""Stage 2 of the step: each trajectory's advantage, from the rewards of its GRPO group.

Owns the advantage estimators (`ESTIMATORS`, picked by `train.advantage`: a fork point), masking
aborted and failed members out of the group statistics, and what shapes the reward the advantage
reads: DAPO's soft overlong punishment (`train.overlong_penalty`) and the KL to the reference as a
cost (`train.kl_in: reward`, verl's use_kl_in_reward; the switch and its check sit in loss.py,
beside the KL term it replaces). Does not own the rewards (rewards.py, the task's score, scored in
the rollout: what dynamic sampling, accuracy and the logged reward read) nor the loss (loss.py).

To add an estimator: a function `(rewards, group_ids, is_valid, cfg) -> advantages` below, its
entry in ESTIMATORS, and `train.advantage: <name>` picks it (README "Fork it";
tests/test_forks.py follows that recipe). The rewards come in float64: build its tensors with
`rewards.new_zeros` or `dtype=rewards.dtype`. They are this rank's groups only (a group never
spans ranks): a statistic over the whole batch (REINFORCE++'s batch-wide baseline, say) needs
runtime.parallel.all_reduce, which every rank must call at every step.
"""

import torch

import loss
import update
from config import ConfigError, refuse_unread
from metrics import ratio, summed


def group_advantages(rewards, group_ids, is_valid, scale_by_std=True, eps=1e-6):
    """GRPO outcome advantage (Shao et al. 2024, eq. 3): reward minus the mean of its group, / std.

    rewards: [B] float, group_ids: [B] long in [0, G), is_valid: [B] bool (False = aborted/failed).
    Statistics use only the valid members of each group; a group with fewer than 2 valid members
    has no baseline to compare against, so its advantage is 0 (Dr. GRPO's `scale_by_std=False`
    drops the std division, which it shows biases toward easy/hard questions).
    Returns (advantages [B] in the rewards' dtype, `degenerate_groups`).
    """
    # in float64 (compute's rewards already are): a float32 mean of equal rewards (8 x 5/7) can
    # land an ulp off them, and that ulp over a std of an ulp (+ eps) gave every member an
    # advantage of ~0.05-0.2, all one sign; a float64 sum of float32 values is exact, so a float32
    # caller's equal rewards deviate by exactly 0 too
    dtype, rewards = rewards.dtype, rewards.double()
    num_groups = int(group_ids.max()) + 1 if len(group_ids) else 0
    weight = is_valid.to(rewards.dtype)
    count = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, group_ids, weight)
    total = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, group_ids, rewards * weight)
    mean = total / count.clamp(min=1)
    deviation = (rewards - mean[group_ids]) * weight
    # unbiased std over survivors, like torch.std; clamp keeps 1-member groups finite (they get 0
    # below)
    sum_sq = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, group_ids, deviation**2)
    std = (sum_sq / (count - 1).clamp(min=1)).sqrt()
    advantages = deviation / (std[group_ids] + eps) if scale_by_std else deviation
    has_baseline = count[group_ids] >= 2
    advantages = torch.where(has_baseline & is_valid, advantages, torch.zeros_like(advantages))
    return advantages.to(dtype), degenerate_groups(group_ids, is_valid)


def degenerate_groups(group_ids, is_valid):
    """Groups with fewer than 2 valid members: no baseline, so nothing is learned from them."""
    num_groups = int(group_ids.max()) + 1 if len(group_ids) else 0
    # both sides in torch's default dtype: index_add_ needs one (float32 into a float64 default
    # raised)
    count = torch.zeros(num_groups).index_add_(0, group_ids, is_valid.to(torch.get_default_dtype()))
    launched = torch.zeros(num_groups).index_add_(0, group_ids, torch.ones(len(group_ids)))
    return int(((launched > 0) & (count < 2)).sum())


def grpo(rewards, group_ids, is_valid, cfg):
    """GRPO's (Dr. GRPO's with train.scale_by_std false)."""
    return group_advantages(rewards, group_ids, is_valid, cfg.train.scale_by_std)[0]


# train.advantage -> (rewards [N] float64, group_ids [N], is_valid [N], cfg) -> advantages [N]
ESTIMATORS = {"grpo": grpo}

# config.refuse_unread's table: the fields only some estimators read (an estimator of yours that
# reads one adds its name here), and what only the overlong penalty reads
READ_WHEN = {
    "train.scale_by_std": (lambda cfg: cfg.train.advantage in ("grpo",), "by train.advantage=grpo"),
    "train.overlong_buffer": (
        lambda cfg: cfg.train.overlong_penalty > 0,
        "with train.overlong_penalty > 0",
    ),
}


def check(cfg):
    """train.advantage's choice, the overlong penalty's limits, and no field set that only another
    estimator reads (assemble.load_config calls this at load)."""
    t = cfg.train
    if t.advantage not in ESTIMATORS:
        raise ConfigError(f"train.advantage={t.advantage!r}: expected one of {tuple(ESTIMATORS)}")
    budget = cfg.rollout.max_trajectory_tokens()
    if t.overlong_penalty and cfg.rollout.max_turns > 1:
        raise ConfigError(
            "train.overlong_penalty is single-turn: with rollout.max_turns > 1 tool observations "
            "share the token budget with what the model wrote"
        )
    if t.overlong_penalty and not 0 < t.overlong_buffer <= budget:
        raise ConfigError(
            f"train.overlong_penalty needs 0 < train.overlong_buffer <= {budget} (the generation "
            f"budget), got {t.overlong_buffer}"
        )
    refuse_unread(cfg, READ_WHEN)


def overlong_penalty(length, max_length, buffer, factor):
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to max_length - buffer
    tokens, then falling linearly to -factor at max_length (the generation budget, which no
    response exceeds). Added to the reward the advantage reads (train.overlong_penalty,
    train.overlong_buffer), as verl's DAPO reward manager does: min(-(length - (max_length -
    buffer)) / buffer * factor, 0). Worked example, budget 1,024, buffer 256, factor 1: 700 tokens
    0; 896 tokens -0.5."""
    return min(-(length - (max_length - buffer)) / buffer * factor, 0.0)


def compute(trainer, groups):
    """Every trajectory of `groups` (lists of trajectories, each a list of turns), its advantage
    written on each of its turns (`Sample.advantage`), with the stage's metrics. The reward it
    reads is the task's (`Sample.reward`) plus DAPO's overlong penalty when on: the paper filters
    groups and counts accuracy on the task's score, and shapes only the advantage. With
    train.kl_in=reward, kl_coef x its KL to the reference is subtracted from it too (that needs
    the trainer's memory back: the step calls this after MemoryPhases.to_train)."""
    cfg = trainer.cfg
    trajectories = [turns for group in groups for turns in group]
    last_turns = [turns[-1] for turns in trajectories]
    # each trajectory's group as its position in `groups`, 0..G-1 (Sample.group_id numbers the
    # launch, which may have gaps: filtered or held groups)
    group_ids = torch.tensor([g for g, group in enumerate(groups) for _ in group], dtype=torch.long)
    # explicit dtypes: a partial-rollout step where no group completed has no trajectories at
    # all. float64, as the rewards were scored and dynamic sampling judged them: near-equal
    # rewards stay apart (float32 rounded 100 and 100.000003 together: a kept group that trained
    # nothing)
    rewards = torch.tensor([s.reward for s in last_turns], dtype=torch.float64)
    is_valid = torch.tensor([not s.masked for s in last_turns], dtype=torch.bool)
    t = cfg.train
    # what the logged means read: the members that train (with train.mask_truncated a cut one is
    # in its group's statistics but trains nothing)
    trained = is_valid & ~torch.tensor(
        [s.overlong_filtered(t.mask_truncated) for s in last_turns], dtype=torch.bool
    )
    metrics = {}
    if t.overlong_penalty:  # single-turn (`check`): the response is the last turn's
        budget = cfg.rollout.max_trajectory_tokens()
        penalty = torch.tensor(
            [
                overlong_penalty(len(s.response_ids), budget, t.overlong_buffer, t.overlong_penalty)
                for s in last_turns
            ],
            dtype=torch.float64,
        )
        metrics["train/overlong_penalty"] = ratio((penalty * trained).sum(), trained.sum())
        rewards = rewards + penalty
    if t.kl_in == "reward":
        kl_cost = t.kl_coef * reference_kl(trainer, trajectories)
        metrics["train/reward_kl_cost"] = ratio((kl_cost * trained).sum(), trained.sum())
        rewards = rewards - kl_cost
    advantages = ESTIMATORS[cfg.train.advantage](rewards, group_ids, is_valid, cfg)
    # an estimator of yours: one advantage per trajectory, or the update would broadcast a [N, 1]
    # (every sample's loss against every advantage: a gradient of ~0) or zip would cut [G] short
    if not isinstance(advantages, torch.Tensor) or advantages.shape != rewards.shape:
        got = advantages.shape if isinstance(advantages, torch.Tensor) else type(advantages)
        raise ValueError(
            f"train.advantage={t.advantage!r} returned {got}: expected a tensor of shape "
            f"{tuple(rewards.shape)}, one advantage per trajectory (like the rewards it was given)"
        )
    for turns, advantage in zip(trajectories, advantages.tolist()):
        for turn in turns:
            turn.advantage = advantage
    metrics["train/degenerate_groups"] = summed(degenerate_groups(group_ids, is_valid))
    return trajectories, metrics


def reference_kl(trainer, trajectories):
    """Each trajectory's KL to the frozen reference, summed over the tokens the model wrote (every
    turn's): train.kl_estimator of the log-probs that sampled them (the engine's) against the
    reference's, one forward pass without grad, in padded micro-batches of train.micro_batch_size
    (packing would reorder the samples). Unfinished (aborted, failed) trajectories get 0 and no
    forward: they train nothing (the sequences stage drops them) and count in no reward mean, and
    they are often the longest. For the KL as a cost in the reward, as verl's use_kl_in_reward
    does (ray_trainer.py apply_kl_penalty; its GRPO advantage sums the token rewards)."""
    t = trainer.cfg.train
    finished = [i for i, turns in enumerate(trajectories) if not turns[-1].masked]
    samples = [turn for i in finished for turn in trajectories[i]]
    owner = torch.tensor([i for i in finished for _ in trajectories[i]], dtype=torch.long)
    # padded micro-batches keep the samples' order (packing would not); padding ones come last
    batches, _ = update.micro_batches(samples, t.micro_batch_size, trainer.pad_id)
    temperature = trainer.cfg.rollout.temperature
    per_sample = []
    with torch.no_grad():
        for mb in batches:
            mb = {key: value.to(trainer.device) for key, value in mb.items()}
            reference, _ = update.sequence_logprobs(
                trainer.reference, mb, temperature, trainer.autocast_dtype
            )
            kl = loss.kl_estimate(mb["engine_logprobs"], reference, t.kl_estimator)
            per_sample += (kl * mb["loss_mask"]).sum(-1).tolist()
    total = torch.zeros(len(trajectories), dtype=torch.float64)  # as compute's rewards
    return total.index_add_(0, owner, torch.tensor(per_sample[: len(samples)], dtype=total.dtype))
