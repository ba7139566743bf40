"""Tail cancellation's plan: how many prompts to launch, how many finished samples or groups end the wait,
and which groups survive the group policy.

Owns the over-sampling arithmetic and the group bookkeeping, plain functions of the config and of
samples. Does not own waiting or aborting (rollout.py's `_wait_for_enough` and `_generate_all` do both
inside the engine's event loop).
"""
import dataclasses
import math


@dataclasses.dataclass
class LaunchPlan:
    """What to launch for one training rollout and when to stop waiting (validation uses none)."""
    cancel: str           # none | count | time | group
    num_prompts: int      # prompts to launch (more than the batch when over-sampling)
    group_size: int
    target_samples: int   # count/time: finished samples that end the rollout
    target_groups: int    # group: entirely finished groups that end the rollout
    time_quantile: float = 0.8
    time_factor: float = 1.5
    partial: bool = False  # cancelled samples are suspended and resumed later (buffer.py), not dropped


def plan_launch(cfg, num_prompts):
    """Over-sampling arithmetic. `over_sample_rate` launches extra prompts and stops at the batch size;
    `drop_rate` launches the batch and stops once all but its slowest fraction (samples or groups) finished."""
    batch, group_size = num_prompts * cfg.group_size, cfg.group_size
    extra = (cfg.time_quantile, cfg.time_factor, cfg.partial and cfg.max_staleness > 0)
    if cfg.cancel == "none":
        return LaunchPlan("none", num_prompts, group_size, batch, num_prompts, *extra)
    if cfg.over_sample_rate > 0:
        launched = math.ceil(num_prompts * (1 + cfg.over_sample_rate))
        return LaunchPlan(cfg.cancel, launched, group_size, batch, num_prompts, *extra)
    keep = 1 - cfg.drop_rate
    return LaunchPlan(cfg.cancel, num_prompts, group_size, math.ceil(batch * keep), math.ceil(num_prompts * keep), *extra)


def count_complete_groups(samples, group_size):
    """Groups all of whose `group_size` members finished (stopped or hit the length limit)."""
    counts = {}
    for s in samples:
        if not s.is_aborted:
            counts[s.group_id] = counts.get(s.group_id, 0) + 1
    return sum(n == group_size for n in counts.values())


def keep_first_complete_groups(samples, finished, group_size, num_groups):
    """Group policy: keep the first `num_groups` groups to complete; mark every other sample dropped,
    so group sizes never shrink (the alternative to per-sample dropping)."""
    done_count, kept = {}, []
    for s in finished:  # completion order
        if not s.is_aborted:
            done_count[s.group_id] = done_count.get(s.group_id, 0) + 1
            if done_count[s.group_id] == group_size and len(kept) < num_groups:
                kept.append(s.group_id)
    for s in samples:
        if s.group_id not in kept and not s.is_aborted:
            s.is_aborted, s.finish_reason = True, "abort"
