"""Tail cancellation: how many prompts a training rollout launches, when it stops waiting, and
which groups survive the group policy or dynamic sampling's filter.

Owns the decision: `decide(plan, progress)` is a pure function of what the rollout has seen
(finished trajectories and when, complete groups, kept groups, time since launch) that says whether
to stop, for every policy. Also the over-sampling and refill arithmetic (`plan_launch`,
`GroupFilter.wanted`) and the group bookkeeping. Does not wait, launch or abort (rollout.py does,
inside the engine's event loop), nor score (rewards.py).

To add a policy: name it in CANCEL_POLICIES, give it a rule in `decide` (and, if it over-samples,
its launch arithmetic in `plan_launch`); tests/test_cancel.py shows how to test it without an
engine.
"""

import dataclasses
import math
import statistics

CANCEL_POLICIES = ("none", "count", "time", "group")  # rollout.cancel


@dataclasses.dataclass
class LaunchPlan:
    """What to launch for one training rollout and when to stop waiting (validation uses none)."""

    cancel: str  # one of CANCEL_POLICIES
    num_prompts: int  # prompts to launch (more than the batch when over-sampling)
    group_size: int
    target_samples: int  # count/time: finished samples that end the rollout
    target_groups: int  # group, dynamic sampling: finished (kept) groups that end the rollout
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
    """The LaunchPlan of a rank launching `num_prompts` prompts (`cfg`: RolloutConfig).
    `over_sample_rate` launches extra prompts and stops at the batch size; `drop_rate` launches the
    batch and stops once all but its slowest fraction (samples or groups) finished."""
    batch = num_prompts * cfg.group_size
    plan = LaunchPlan(
        cancel=cfg.cancel,
        num_prompts=num_prompts,
        group_size=cfg.group_size,
        target_samples=batch,
        target_groups=num_prompts,
        time_quantile=cfg.time_quantile,
        time_factor=cfg.time_factor,
        partial=cfg.partial and cfg.max_staleness > 0,
    )
    if cfg.filter_groups:
        # the config's counts are for all ranks: this rank launches its share of them
        share = num_prompts / cfg.prompts_per_step
        plan.num_prompts = math.ceil(num_prompts * (1 + cfg.over_sample_rate))
        plan.filter_groups = True
        refill = cfg.refill_prompts or cfg.prompts_per_step // 4
        plan.refill_prompts = max(math.ceil(refill * share), 1)
        bound = int((cfg.max_prompts_per_step or 4 * cfg.prompts_per_step) * share)
        plan.max_prompts = max(bound, plan.num_prompts)
    elif cfg.cancel != "none" and cfg.over_sample_rate > 0:
        plan.num_prompts = math.ceil(num_prompts * (1 + cfg.over_sample_rate))
    elif cfg.cancel != "none":
        keep = 1 - cfg.drop_rate
        plan.target_samples = math.ceil(batch * keep)
        plan.target_groups = math.ceil(num_prompts * keep)
    return plan


@dataclasses.dataclass
class Progress:
    """What a rollout has seen so far, as `decide` reads it (rollout.py records each return)."""

    group_size: int = 0
    elapsed_s: float = 0.0  # since launch
    # seconds after launch at which each finished trajectory returned (failed, cancelled: not)
    finish_times_s: list = dataclasses.field(default_factory=list)
    complete_groups: int = 0  # groups all of whose group_size members finished
    kept_groups: int = 0  # dynamic sampling: groups judged informative (GroupFilter.kept)
    finished_per_group: dict = dataclasses.field(default_factory=dict)

    def returned(self, last_turn, elapsed_s):
        """A trajectory returned (its last turn), `elapsed_s` after launch."""
        if last_turn.is_aborted:
            return
        self.finish_times_s.append(elapsed_s)
        group_id = last_turn.group_id
        count = self.finished_per_group.get(group_id, 0) + 1
        self.finished_per_group[group_id] = count
        self.complete_groups += count == self.group_size


@dataclasses.dataclass
class Decision:
    stop: bool
    wake_at_s: float | None = None  # decide again then (seconds after launch), whatever returns


def decide(plan, progress, timeout_s=0.0):
    """Whether the rollout stops now (aborting what is still running), and when to look again.

    - no plan (validation) or `none`: wait for every request;
    - dynamic sampling (any policy but none): stop at `target_groups` kept groups;
    - `group`: stop at `target_groups` complete groups;
    - `count`: stop at `target_samples` finished trajectories;
    - `time`: as count, or once `time_quantile` of that target finished at t, at t + factor * t;
    - any: stop at `timeout_s` after launch (rollout.rollout_timeout_s; 0 = never).
    """
    if timeout_s and progress.elapsed_s >= timeout_s:
        return Decision(stop=True)
    wake = timeout_s or None
    if plan is None or plan.cancel == "none":
        return Decision(stop=False, wake_at_s=wake)
    if plan.filter_groups:
        return Decision(stop=progress.kept_groups >= plan.target_groups, wake_at_s=wake)
    if plan.cancel == "group":
        return Decision(stop=progress.complete_groups >= plan.target_groups, wake_at_s=wake)
    num_finished = len(progress.finish_times_s)
    if num_finished >= plan.target_samples:
        return Decision(stop=True)
    quantile_count = max(math.ceil(plan.time_quantile * plan.target_samples), 1)
    if plan.cancel == "count" or num_finished < quantile_count:
        return Decision(stop=False, wake_at_s=wake)
    # time: the quantile came back at t, so the rest get at most factor * t more
    t = progress.finish_times_s[quantile_count - 1]
    deadline = t + plan.time_factor * t
    if wake is not None:
        deadline = min(deadline, wake)
    return Decision(stop=progress.elapsed_s >= deadline, wake_at_s=deadline)


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
    done_count = {}
    kept = []
    for s in finished:  # completion order
        if not s.is_aborted:
            done_count[s.group_id] = done_count.get(s.group_id, 0) + 1
            if done_count[s.group_id] == group_size and len(kept) < num_groups:
                kept.append(s.group_id)
    for s in samples:
        if s.group_id not in kept and not s.is_aborted:
            s.is_aborted = True
            s.finish_reason = "abort"


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


def filter_groups(groups, drop=True):
    """Dynamic sampling over scored groups (each a list of trajectories, each a list of turns):
    with `drop`, only the informative groups; without, all of them. And the counts: kept groups,
    and zero-variance ones split into all-solved and all-unsolved. A group with no survivor (all
    cancelled or failed) is neither, and trains nothing anyway."""
    kept = []
    counts = {"kept_groups": 0, "zero_variance_all_correct": 0, "zero_variance_all_wrong": 0}
    for members in groups:
        rewards = [turns[-1].reward for turns in members if not turns[-1].is_aborted]
        if informative(rewards):
            counts["kept_groups"] += 1
            kept.append(members)
        elif rewards:
            kind = "zero_variance_all_correct" if solved(rewards) else "zero_variance_all_wrong"
            counts[kind] += 1
    counts["zero_variance_groups"] = (
        counts["zero_variance_all_correct"] + counts["zero_variance_all_wrong"]
    )
    return (kept if drop else groups), counts
