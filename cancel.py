"""Tail cancellation: how many prompts a training rollout launches, when it stops waiting, and
which groups it keeps (the group policy; dynamic sampling's filter).

Owns the decision: each policy in `POLICIES` (`rollout.cancel`) is a pure function of what the
rollout has seen so far (`Progress`: finished trajectories and when, their tokens, complete groups,
kept groups, time since launch) returning a `Decision`: stop the whole rollout, cancel some groups'
running members while the rest go on, keep only some groups. `decide` adds what every policy
shares (the rollout timeout, dynamic sampling's stop). Also the over-sampling and refill
arithmetic (`plan_launch`, `GroupFilter.wanted`) and the group bookkeeping. Does not wait, launch
or abort (inflight.py applies each Decision inside the engine's event loop), nor score (rewards.py).

To add a policy: a function `(plan, progress) -> Decision` below and its entry in POLICIES
(README "Fork it"; tests/test_forks.py follows that recipe, with no engine).
"""

import dataclasses
import math
import statistics

from config import ConfigError, refuse_unread


@dataclasses.dataclass
class LaunchPlan:
    """What to launch for one training rollout and when to stop waiting (validation uses none)."""

    cancel: str  # a name in POLICIES
    num_prompts: int  # prompts to launch (more than the batch when over-sampling)
    group_size: int
    target_samples: int  # count/time: finished samples that end the rollout
    target_groups: int  # group, dynamic sampling: finished (kept) groups that end the rollout
    time_quantile: float = 0.8
    time_factor: float = 1.5
    # cancelled samples are suspended and resumed later (partial.py), not dropped
    partial: bool = False
    # dynamic sampling: the rollout ends at `target_groups` informative groups
    filter_groups: bool = False
    # filter: prompts launched at a time while kept + possible groups fall short
    refill_prompts: int = 0
    max_prompts: int = 0  # filter: new prompts a step may launch in all
    # tokens one trajectory may hold (RolloutConfig.max_trajectory_tokens)
    max_trajectory_tokens: int = 0
    # train.mask_truncated: a member cut at the budget trains nothing, so the filter keeps a group
    # only if one of its survivors was not (`keeps`)
    mask_truncated: bool = False


def ceil(x):
    """math.ceil of a product of counts and rates, taken as the decimal the config wrote: 10 x (1 -
    0.7) is 3.0000000000000004 in floats, whose ceil would launch or wait for one more."""
    return math.ceil(round(x, 9))


def plan_launch(r, num_prompts, mask_truncated=False):
    """The LaunchPlan of a rank launching `num_prompts` prompts (`r`: the RolloutConfig;
    `mask_truncated`: train.mask_truncated, which dynamic sampling's keep rule reads).
    `over_sample_rate` launches extra prompts and stops at the batch size; `drop_rate` launches the
    batch and stops once all but its slowest fraction (samples or groups) finished."""
    batch = num_prompts * r.group_size
    plan = LaunchPlan(
        cancel=r.cancel,
        num_prompts=num_prompts,
        group_size=r.group_size,
        target_samples=batch,
        target_groups=num_prompts,
        time_quantile=r.time_quantile,
        time_factor=r.time_factor,
        partial=r.resumes(),
        max_trajectory_tokens=r.max_trajectory_tokens(),
        mask_truncated=mask_truncated,
    )
    if r.filter_groups:
        # the config's counts are for all ranks: this rank launches its share of them
        share = num_prompts / r.prompts_per_step
        plan.num_prompts = ceil(num_prompts * (1 + r.over_sample_rate))
        plan.filter_groups = True
        refill = r.refill_prompts or r.prompts_per_step // 4
        plan.refill_prompts = max(ceil(refill * share), 1)
        bound = int(round((r.max_prompts_per_step or 4 * r.prompts_per_step) * share, 9))
        plan.max_prompts = max(bound, plan.num_prompts)
    elif r.cancel != "none" and r.over_sample_rate > 0:
        plan.num_prompts = ceil(num_prompts * (1 + r.over_sample_rate))
    elif r.cancel != "none":
        keep = 1 - r.drop_rate
        # at least one: a drop_rate so near 1 that batch x (1 - drop_rate) rounds (`ceil`) to 0
        # would stop the rollout before anything returned
        plan.target_samples = max(ceil(batch * keep), 1)
        plan.target_groups = max(ceil(num_prompts * keep), 1)
    return plan


@dataclasses.dataclass
class Progress:
    """What a rollout has seen so far, as `decide` reads it (inflight.py records each return):
    counts, times and tokens, no rewards. A policy of yours that needs more (say, the rewards of
    each group's returned members) adds a field here and fills it in `returned`, which sees every
    returned trajectory's turns, rewards on them."""

    group_size: int = 0
    elapsed_s: float = 0.0  # since launch
    # seconds after launch at which each finished trajectory returned (failed, cancelled: not)
    finish_times_s: list = dataclasses.field(default_factory=list)
    # groups all of whose group_size members finished, in the order they completed
    complete_groups: list = dataclasses.field(default_factory=list)
    kept_groups: int = 0  # dynamic sampling: groups judged informative (GroupFilter.kept)
    # finished members per group id: a held group of partial rollout starts at those that
    # finished in earlier steps (`held`), so it completes with its resumed members
    finished_per_group: dict = dataclasses.field(default_factory=dict)
    # response tokens of the trajectories returned so far (every turn; a resumed sample's earlier
    # ones too). Not the engine's output: what is still in flight is not counted
    returned_tokens: int = 0

    def returned(self, turns, elapsed_s):
        """A trajectory returned (its turns), `elapsed_s` after launch."""
        self.returned_tokens += sum(len(turn.response_ids) for turn in turns)
        last_turn = turns[-1]
        if last_turn.masked:
            return
        self.finish_times_s.append(elapsed_s)
        group_id = last_turn.group_id
        count = self.finished_per_group.get(group_id, 0) + 1
        self.finished_per_group[group_id] = count
        if count == self.group_size:
            self.complete_groups.append(group_id)


@dataclasses.dataclass
class Decision:
    stop: bool = False  # abort everything still running; the rollout ends
    wake_at_s: float | None = None  # decide again then (seconds after launch), whatever returns
    # abort these groups' running members now; the rollout goes on (partial rollout resumes them)
    cancel_groups: frozenset = frozenset()
    # at the end, only these groups' finished members are kept (the others are dropped, masked like
    # an abort); None keeps every finished trajectory
    keep_groups: frozenset | None = None


# ---------------------------------------------------------------- the policies
def wait_for_all(plan, progress):
    """none: wait for every request."""
    return Decision()


def count(plan, progress):
    """count: stop at `target_samples` finished trajectories."""
    return Decision(stop=len(progress.finish_times_s) >= plan.target_samples)


def time_limit(plan, progress):
    """time: as count, or once `time_quantile` of that target finished at t, at t + factor * t:
    the quantile came back at t, so the rest get at most factor * t more."""
    num_finished = len(progress.finish_times_s)
    if num_finished >= plan.target_samples:
        return Decision(stop=True)
    quantile_count = max(ceil(plan.time_quantile * plan.target_samples), 1)
    if num_finished < quantile_count:
        return Decision()
    t = progress.finish_times_s[quantile_count - 1]
    deadline = t + plan.time_factor * t
    return Decision(stop=progress.elapsed_s >= deadline, wake_at_s=deadline)


def group(plan, progress):
    """group: stop at `target_groups` complete groups, and train the first `target_groups` to
    complete only: every other sample is dropped, so group sizes never shrink (the alternative
    to per-sample dropping)."""
    complete = progress.complete_groups
    return Decision(
        stop=len(complete) >= plan.target_groups,
        keep_groups=frozenset(complete[: plan.target_groups]),
    )


# rollout.cancel -> (LaunchPlan, Progress) -> Decision
POLICIES = {"none": wait_for_all, "count": count, "time": time_limit, "group": group}


def _tail_cut_by_count(cfg):
    r = cfg.rollout
    return r.cancel != "none" and not r.filter_groups and not r.over_sample_rate


# config.refuse_unread's table: the rollout fields only some policies and modes read (plan_launch);
# a policy of yours that reads one (the time fields, say) adds itself to that field's condition
READ_WHEN = {
    "rollout.drop_rate": (_tail_cut_by_count, "with a cancel policy, no over-sampling or filter"),
    "rollout.over_sample_rate": (
        lambda cfg: cfg.rollout.cancel != "none" or cfg.rollout.filter_groups,
        "with a cancel policy or rollout.filter_groups",
    ),
    "rollout.time_quantile": (lambda cfg: cfg.rollout.cancel == "time", "by rollout.cancel=time"),
    "rollout.time_factor": (lambda cfg: cfg.rollout.cancel == "time", "by rollout.cancel=time"),
    "rollout.max_staleness": (lambda cfg: cfg.rollout.partial, "with rollout.partial"),
    "rollout.refill_prompts": (lambda cfg: cfg.rollout.filter_groups, "with rollout.filter_groups"),
    "rollout.max_prompts_per_step": (
        lambda cfg: cfg.rollout.filter_groups,
        "with rollout.filter_groups",
    ),
    # one turn never exceeds max_new_tokens (config.max_trajectory_tokens)
    "rollout.max_response_tokens": (
        lambda cfg: cfg.rollout.max_turns > 1
        or cfg.rollout.max_response_tokens < cfg.rollout.max_new_tokens,
        "with tools' turns (rollout.max_turns > 1) or below rollout.max_new_tokens",
    ),
}


# the policies that mean something under dynamic sampling, whose kept groups decide the stop:
# none waits for every request; of the others only a keep_groups is read (`decide`)
FILTER_POLICIES = ("none", "count", "group")


def check(cfg):
    """rollout.cancel's choice and the rollout's combinations (assemble.load_config calls
    this at load); a field only other policies or modes read is refused (READ_WHEN)."""
    r = cfg.rollout
    if r.cancel not in POLICIES:
        raise ConfigError(f"rollout.cancel={r.cancel!r}: expected one of {tuple(POLICIES)}")
    if r.drop_rate > 0 and r.over_sample_rate > 0:
        raise ConfigError(
            f"rollout.drop_rate={r.drop_rate} with rollout.over_sample_rate={r.over_sample_rate}: "
            "set one, not both"
        )
    if r.partial and r.cancel == "none":
        raise ConfigError(
            "rollout.partial=true suspends cancelled samples, but rollout.cancel=none cancels "
            f"nothing: choose a cancel policy ({', '.join(p for p in POLICIES if p != 'none')})"
        )
    if r.partial and r.max_turns > 1:
        # the engine continues one request: a tool call in a continuation would go unanswered, so
        # every cancelled trajectory would be dropped (plain dropping, the group policy's groups
        # shrunk) while partial's settings looked in effect
        raise ConfigError(
            f"rollout.partial=true with rollout.max_turns={r.max_turns}: partial rollout resumes "
            "single-turn samples only; with tools' turns set rollout.partial=false"
        )
    if r.filter_groups and r.cancel not in FILTER_POLICIES:
        raise ConfigError(
            f"rollout.cancel={r.cancel!r} with rollout.filter_groups: there the kept groups decide "
            "the stop (`decide`), so a policy's own stop is never read; choose one of "
            f"{FILTER_POLICIES} (count keeps every finished member, group complete groups only)"
        )
    refuse_unread(cfg, READ_WHEN)
    if (
        r.cancel in ("count", "group")
        and not r.filter_groups
        and r.drop_rate == r.over_sample_rate == 0
        and not r.rollout_timeout_s  # at the timeout group keeps whole groups, partial resumes
    ):
        raise ConfigError(
            f"rollout.cancel={r.cancel} cuts nothing without rollout.drop_rate, "
            "rollout.over_sample_rate or rollout.rollout_timeout_s (it would wait for every "
            "request, as none does): set one"
        )
    check_shares(r, 1)  # (a bound below the first launch, itself at least prompts_per_step)
    # the policy's first decision, as the rollout asks it before anything returned: a fork's that
    # returns no Decision fails here, not after the engine's start-up
    plan = plan_launch(r, r.prompts_per_step, cfg.train.mask_truncated)
    policy_decision(plan, Progress(group_size=plan.group_size))


def policy_decision(plan, progress):
    """`plan.cancel`'s Decision on `progress`; a policy that returns anything else is named."""
    decision = POLICIES[plan.cancel](plan, progress)
    if not isinstance(decision, Decision):
        raise ConfigError(
            f"rollout.cancel={plan.cancel!r}: its policy returned {decision!r}, where a policy "
            "returns a cancel.Decision (e.g. Decision(stop=...))"
        )
    return decision


def check_shares(r, world):
    """Dynamic sampling's prompt bound against the first launch of each of `world` ranks: its
    share of prompts_per_step x (1 + over_sample_rate), rounded up (`plan_launch`), must fit its
    share of rollout.max_prompts_per_step, or the bound would be silently raised to it. `check`
    asks for one rank at load, assemble.setup for the run's ranks."""
    if not r.filter_groups:
        return
    plan = plan_launch(r, r.prompts_per_step // world)
    bound = int(round(r.max_prompts_per_step / world, 9))
    if r.max_prompts_per_step and plan.num_prompts > bound:
        raise ConfigError(
            f"rollout.max_prompts_per_step={r.max_prompts_per_step} is below the first launch "
            f"alone: each of {world} ranks launches rollout.prompts_per_step="
            f"{r.prompts_per_step} / {world} x (1 + rollout.over_sample_rate="
            f"{r.over_sample_rate}), rounded up: {plan.num_prompts} > {bound}; set it to at "
            f"least {plan.num_prompts * world} (on {world} ranks: each rounds its share up)"
        )


def rounded_shares(r, world):
    """Where rounding each of `world` ranks' share of dynamic sampling's counts moves their
    totals from one rank's (the first launch, the prompt bound, the refill): a line saying so
    (assemble.setup logs it), else None. 39 prompts on 8 ranks bounded at 32, so no refill
    ever ran; a refill of 2 was 8, one a rank."""
    if not r.filter_groups or world == 1:
        return None
    one, each = plan_launch(r, r.prompts_per_step), plan_launch(r, r.prompts_per_step // world)
    counts = {
        "num_prompts": "first launch",
        "max_prompts": "prompt bound",
        "refill_prompts": "refill",
    }
    moved = [
        f"{what} {getattr(each, name) * world} (one rank: {getattr(one, name)})"
        for name, what in counts.items()
        if getattr(each, name) * world != getattr(one, name)
    ]
    if not moved:
        return None
    return f"dynamic sampling on {world} ranks, each its share rounded: " + ", ".join(moved)


def decide(plan, progress, timeout_s=0.0):
    """Whether the rollout stops now (aborting what is still running), and when to look again:
    the policy's Decision, with what every policy shares.

    - no plan (validation, eval): wait for every request (`RolloutEngine.generate` gives them
      no timeout);
    - dynamic sampling (any policy but none; `check` allows count and group): stop at
      `target_groups` kept groups (the group policy then keeps every complete group: the filter
      judges each);
    - partial rollout: nothing is dropped (the finished members of an incomplete group wait);
    - any: stop at `timeout_s` after launch (rollout.rollout_timeout_s; 0 = never), with the
      policy's `keep_groups` (the group policy's whole groups stay whole).
    """
    timed_out = bool(timeout_s) and progress.elapsed_s >= timeout_s
    if plan is None:
        return Decision(stop=timed_out, wake_at_s=timeout_s or None)
    if plan.cancel not in POLICIES:  # a plan made in code, not checked at load
        raise ValueError(f"cancel policy {plan.cancel!r}: expected one of {tuple(POLICIES)}")
    decision = policy_decision(plan, progress)
    if plan.filter_groups and plan.cancel != "none":
        keep = decision.keep_groups
        decision = dataclasses.replace(
            decision,
            stop=progress.kept_groups >= plan.target_groups,
            wake_at_s=None,
            keep_groups=None if keep is None else frozenset(progress.complete_groups),
        )
    if plan.partial:
        decision.keep_groups = None
    if timeout_s:
        decision.stop = decision.stop or timed_out
        decision.wake_at_s = min(decision.wake_at_s or timeout_s, timeout_s)
    return decision


def drop_other_groups(samples, keep_groups):
    """A Decision's `keep_groups` applied at the end of a rollout: every finished sample of any
    other group is masked out (`masked`) with finish_reason "dropped": it finished, so it is
    neither counted as aborted (rollout/dropped counts it) nor resumed by partial rollout.
    Returns how many of them had been cut at the token budget (finish_reason "length", replaced:
    rollout/truncated_ratio counts them)."""
    cut = 0
    for s in samples:
        if s.group_id not in keep_groups and not s.masked:
            cut += s.finish_reason == "length"
            s.masked = True
            s.finish_reason = "dropped"
    return cut


def informative(rewards):
    """Dynamic sampling's keep rule: a group's surviving rewards differ. The population std in
    float64 (Python's floats) against 1e-6, not `std == 0` in float32, where equal shaped rewards
    can round apart and near-equal ones can round together (OpenRLHF issue 1270: filters that
    missed non-binary groups)."""
    return len(rewards) > 1 and statistics.pstdev(rewards) > 1e-6


def keeps(survivors, mask_truncated):
    """Dynamic sampling's keep rule on a group's survivors (the last turns of its finished
    members): their rewards differ (`informative`), and one of them trains something. With
    train.mask_truncated a member cut at the budget does not train (merge.training_sequences) but
    stays in its group's mean, so a group whose uncut members all sit at that mean (partial
    credit: 0.5 uncut beside 0 and 1 cut) trains nothing whatever its rewards, and must not count
    toward the target. (The rewards are the task's: DAPO's overlong penalty shapes only the
    advantage.)"""
    rewards = [s.reward for s in survivors]
    if not informative(rewards):
        return False
    mean = statistics.fmean(rewards)
    # (without mask_truncated every survivor trains, and one is off the mean: the std says so)
    return any(
        abs(s.reward - mean) > 1e-6 for s in survivors if not s.overlong_filtered(mask_truncated)
    )


def solved(rewards):
    """A zero-variance group's kind: every survivor solved it (reward >= 1, as `val/accuracy`
    counts)."""
    return bool(rewards) and min(rewards) >= 1.0


class GroupFilter:
    """Dynamic sampling's tally during one rollout: members in flight and survivors, per group id.
    A group is judged (`keeps`) once every member launched this step has returned, on its
    survivors: its finished members (with, for a held group of partial rollout, those that
    finished in earlier steps: `held`); failed members count nowhere, like in the advantages.
    Members cancelled at the end are never judged here (inflight.py stops feeding the filter at
    its decision)."""

    def __init__(self, held=None, whole=0, mask_truncated=False):
        self.survivors = {group_id: list(turns) for group_id, turns in (held or {}).items()}
        # the group policy trains complete groups only: there a kept group has `whole` survivors
        self.whole = whole
        self.mask_truncated = mask_truncated
        self.in_flight = {}
        self.kept = 0

    def launched(self, group_id):
        self.in_flight[group_id] = self.in_flight.get(group_id, 0) + 1
        self.survivors.setdefault(group_id, [])

    def returned(self, last_turn):
        """A member came back, `last_turn` its trajectory's last: finished, or failed (masked)."""
        group_id = last_turn.group_id
        if not last_turn.masked:
            self.survivors[group_id].append(last_turn)
        self.in_flight[group_id] -= 1
        if self.in_flight[group_id] == 0:
            del self.in_flight[group_id]
            survivors = self.survivors[group_id]
            # with fewer than `whole`, a member failed: the group policy drops the group
            if len(survivors) >= self.whole and keeps(survivors, self.mask_truncated):
                self.kept += 1

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


def informative_groups(groups, drop=True, mask_truncated=False):
    """Dynamic sampling over scored groups (each a list of trajectories, each a list of turns):
    with `drop`, only the groups it keeps (`keeps`); without, all of them. And the counts: kept
    groups, and zero-variance ones split into all-solved and all-unsolved. A group with fewer than
    two survivors (the rest cancelled or failed) is neither: it has no variance to judge, and
    trains nothing anyway; nor is one whose uncut survivors (train.mask_truncated) are none or
    all at its mean (`keeps`)."""
    kept = []
    counts = {"kept_groups": 0, "zero_variance_all_correct": 0, "zero_variance_all_wrong": 0}
    for members in groups:
        survivors = [turns[-1] for turns in members if not turns[-1].masked]
        rewards = [s.reward for s in survivors]
        if keeps(survivors, mask_truncated):
            counts["kept_groups"] += 1
            kept.append(members)
        elif len(rewards) > 1 and not informative(rewards):
            kind = "zero_variance_all_correct" if solved(rewards) else "zero_variance_all_wrong"
            counts[kind] += 1
    counts["zero_variance_groups"] = (
        counts["zero_variance_all_correct"] + counts["zero_variance_all_wrong"]
    )
    return (kept if drop else groups), counts
