"""Tail cancellation's plan: how many prompts to launch, how many finished samples or groups end the
wait, and which groups survive the group policy or dynamic sampling's filter.

Owns the over-sampling and refill arithmetic and the group bookkeeping, plain functions of the
config and of samples (and GroupFilter, the filter's tally during one rollout). Does not own
waiting, launching or aborting (rollout.py's `wait_for_enough` and `_generate_all` do all three
inside the engine's event loop) nor rewards (train.py's `score`).
"""

import dataclasses
import math
import statistics


@dataclasses.dataclass
class LaunchPlan:
    """What to launch for one training rollout and when to stop waiting (validation uses none)."""

    cancel: str  # none | count | time | group
    num_prompts: int  # prompts to launch (more than the batch when over-sampling)
    group_size: int
    target_samples: int  # count/time: finished samples that end the rollout
    target_groups: int  # group: entirely finished groups that end the rollout
    time_quantile: float = 0.8
    time_factor: float = 1.5
    # cancelled samples are suspended and resumed later (buffer.py), not dropped
    partial: bool = False
    # dynamic sampling: the rollout ends at `target_groups` informative groups
    filter_groups: bool = False
    # filter: prompts launched at a time while kept + possible groups fall short
    refill_prompts: int = 0
    max_prompts: int = 0  # filter: new prompts a step may launch in all


def plan_launch(cfg, num_prompts):
    """Over-sampling arithmetic. `over_sample_rate` launches extra prompts and stops at the batch
    size; `drop_rate` launches the batch and stops once all but its slowest fraction (samples or
    groups) finished."""
    batch, group_size = num_prompts * cfg.group_size, cfg.group_size
    extra = (cfg.time_quantile, cfg.time_factor, cfg.partial and cfg.max_staleness > 0)
    # the config's counts are for all ranks: this rank launches its share of them
    if cfg.filter_groups:
        launched = math.ceil(num_prompts * (1 + cfg.over_sample_rate))
        share = num_prompts / cfg.prompts_per_step
        refill = max(math.ceil((cfg.refill_prompts or cfg.prompts_per_step // 4) * share), 1)
        bound = max(int((cfg.max_prompts_per_step or 4 * cfg.prompts_per_step) * share), launched)
        return LaunchPlan(
            cfg.cancel, launched, group_size, batch, num_prompts, *extra, True, refill, bound
        )
    if cfg.cancel == "none":
        return LaunchPlan("none", num_prompts, group_size, batch, num_prompts, *extra)
    if cfg.over_sample_rate > 0:
        launched = math.ceil(num_prompts * (1 + cfg.over_sample_rate))
        return LaunchPlan(cfg.cancel, launched, group_size, batch, num_prompts, *extra)
    keep = 1 - cfg.drop_rate
    return LaunchPlan(
        cfg.cancel,
        num_prompts,
        group_size,
        math.ceil(batch * keep),
        math.ceil(num_prompts * keep),
        *extra
    )


def count_complete_groups(samples, group_size):
    """Groups all of whose `group_size` members finished (stopped or hit the length limit)."""
    counts = {}
    for s in samples:
        if not s.is_aborted:
            counts[s.group_id] = counts.get(s.group_id, 0) + 1
    return sum(n == group_size for n in counts.values())


def keep_first_complete_groups(samples, finished, group_size, num_groups):
    """Group policy: keep the first `num_groups` groups to complete; mark every other sample
    dropped, so group sizes never shrink (the alternative to per-sample dropping)."""
    done_count, kept = {}, []
    for s in finished:  # completion order
        if not s.is_aborted:
            done_count[s.group_id] = done_count.get(s.group_id, 0) + 1
            if done_count[s.group_id] == group_size and len(kept) < num_groups:
                kept.append(s.group_id)
    for s in samples:
        if s.group_id not in kept and not s.is_aborted:
            s.is_aborted, s.finish_reason = True, "abort"


def informative(rewards):
    """Dynamic sampling's keep rule: a group's surviving rewards differ. The population std in
    float64 (Python's floats) against 1e-6, not `std == 0` in float32, where equal shaped rewards
    can round apart and near-equal ones can round together (OpenRLHF issue 1270: filters that
    missed non-binary groups)."""
    return len(rewards) > 1 and statistics.pstdev(rewards) > 1e-6


def solved(rewards):
    """A zero-variance group's kind: every survivor solved it (reward >= 1, as `val/accuracy`
    counts)."""
    return bool(rewards) and min(rewards) >= 1.0


class GroupFilter:
    """Dynamic sampling's tally during one rollout: members in flight and rewards, per group id.
    A group is judged once every member launched this step has returned, on its survivors:
    finished members' rewards (with, for a held group of partial rollout, those its members
    earned in earlier steps); failed members count nowhere, like in the advantages. Members
    cancelled at the end are never judged here (rollout.py stops feeding the filter at its
    decision)."""

    def __init__(self, prior_rewards=None):
        self.rewards = {group_id: list(r) for group_id, r in (prior_rewards or {}).items()}
        self.in_flight = {}
        self.kept, self.zero_variance = 0, 0

    def launched(self, group_id):
        self.in_flight[group_id] = self.in_flight.get(group_id, 0) + 1
        self.rewards.setdefault(group_id, [])

    def returned(self, group_id, reward=None):
        """A member came back: finished with `reward`, or failed (None)."""
        if reward is not None:
            self.rewards[group_id].append(reward)
        self.in_flight[group_id] -= 1
        if self.in_flight[group_id] == 0:
            del self.in_flight[group_id]
            if informative(self.rewards[group_id]):
                self.kept += 1
            else:
                self.zero_variance += 1

    def possible(self):
        """Groups still in flight: each may yet be kept."""
        return len(self.in_flight)

    def wanted(self, plan, prompts_launched):
        """New prompts to launch now: `plan.refill_prompts` while the kept groups and those still
        in flight (each may yet be kept) fall short of the target, within `plan.max_prompts` for
        the step. (Counting in-flight groups at the share kept so far instead keeps a surplus in
        flight for the abort to cut: on CPU, where decoding is compute-bound, it measured slower,
        bench/tail.py --filter and README.)"""
        if self.kept + self.possible() >= plan.target_groups:
            return 0
        return max(min(plan.refill_prompts, plan.max_prompts - prompts_launched), 0)


def filter_groups(trajectories, drop=True):
    """Dynamic sampling over finished trajectories (lists of turns, scored): with `drop`, only
    the trajectories of informative groups, their ids renumbered 0.. (train.py indexes advantages
    by them); without, all of them. And the counts: kept groups, and zero-variance ones split
    into all-solved and all-unsolved. A group with no survivor (all cancelled or failed) is
    neither, and trains nothing anyway."""
    by_group = {}
    for turns in trajectories:
        by_group.setdefault(turns[-1].group_id, []).append(turns)
    kept, counts = [], {
        "kept_groups": 0,
        "zero_variance_all_correct": 0,
        "zero_variance_all_wrong": 0,
    }
    for members in by_group.values():
        rewards = [turns[-1].reward for turns in members if not turns[-1].is_aborted]
        if informative(rewards):
            counts["kept_groups"] += 1
            kept += members
        elif rewards:
            counts[
                "zero_variance_all_correct" if solved(rewards) else "zero_variance_all_wrong"
            ] += 1
    counts["zero_variance_groups"] = (
        counts["zero_variance_all_correct"] + counts["zero_variance_all_wrong"]
    )
    if not drop:
        return trajectories, counts
    for trajectory_id, turns in enumerate(kept):
        for turn in turns:
            turn.trajectory_id = trajectory_id
    return kept, counts
