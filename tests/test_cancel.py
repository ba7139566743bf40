"""cancel.decide, the stop rule of every cancel policy, as a pure function of a rollout's progress:
no engine, no clock (tests/test_rollout.py checks the same rules on the real engine)."""

import pytest

from cancel import LaunchPlan, Progress, decide
from sample import Sample


def plan(cancel, **fields):
    """4 prompts x 2 samples: stop at 6 finished samples or 3 complete groups."""
    defaults = dict(num_prompts=4, group_size=2, target_samples=6, target_groups=3)
    return LaunchPlan(cancel=cancel, **(defaults | fields))


def finished(*groups_and_times, group_size=2):
    """Progress after trajectories of these group ids returned finished at these seconds."""
    progress = Progress(group_size=group_size)
    for group_id, seconds in groups_and_times:
        progress.returned([Sample([1], [2], [0.0], [1], group_id=group_id)], elapsed_s=seconds)
    return progress


def test_no_plan_and_policy_none_wait_for_every_request():
    """Validation (no plan) and `none` never stop early, only at the rollout timeout."""
    progress = finished(*[(g, 1.0) for g in range(4) for _ in range(2)])
    progress.elapsed_s = 99.0
    assert not decide(None, progress).stop
    assert not decide(plan("none"), progress).stop
    assert decide(plan("none"), progress, timeout_s=50.0).stop
    assert decide(None, finished(), timeout_s=50.0).wake_at_s == 50.0


def test_count_stops_at_the_target_of_finished_samples_and_ignores_failures():
    """count: 6 finished samples end the wait; aborted or failed returns do not count."""
    progress = finished((0, 1.0), (0, 1.0), (1, 1.0), (1, 1.0), (2, 1.0))
    assert not decide(plan("count"), progress).stop
    failed = Sample([1], [], [], [], group_id=3, masked=True, finish_reason="error")
    progress.returned([failed], elapsed_s=2.0)
    assert not decide(plan("count"), progress).stop
    progress.returned([Sample([1], [2], [0.0], [1], group_id=3)], elapsed_s=2.0)
    assert decide(plan("count"), progress).stop


def test_time_waits_factor_times_the_quantile_then_stops():
    """time: 80% of 6 is 5 samples; the 5th back at t=2 s sets the deadline 2 + 1.5 x 2 = 5 s."""
    policy = plan("time", time_quantile=0.8, time_factor=1.5)
    progress = finished((0, 1.0), (0, 1.0), (1, 1.5), (1, 1.5))
    progress.elapsed_s = 30.0
    assert not decide(policy, progress).stop  # 4 of 5: no deadline yet
    assert decide(policy, progress).wake_at_s is None
    progress.returned([Sample([1], [2], [0.0], [1], group_id=2)], elapsed_s=2.0)
    progress.elapsed_s = 4.9
    decision = decide(policy, progress)
    assert not decision.stop and decision.wake_at_s == 5.0
    progress.elapsed_s = 5.0
    assert decide(policy, progress).stop
    assert decide(policy, progress, timeout_s=3.0).stop  # the rollout timeout comes first


def test_group_stops_at_complete_groups_not_at_samples():
    """group: 3 complete groups end the wait; 6 samples spread over 4 groups do not."""
    spread = finished((0, 1.0), (0, 1.0), (1, 1.0), (1, 1.0), (2, 1.0), (3, 1.0))
    assert spread.complete_groups == [0, 1] and not decide(plan("group"), spread).stop
    spread.returned([Sample([1], [2], [0.0], [1], group_id=3)], elapsed_s=2.0)
    assert spread.complete_groups == [0, 1, 3] and decide(plan("group"), spread).stop
    assert decide(plan("group"), spread).keep_groups == {0, 1, 3}


def test_dynamic_sampling_stops_at_kept_groups_whatever_the_policy_but_none():
    """With the filter, only kept (informative) groups count; cancel none still waits for all."""
    progress = finished(*[(g, 1.0) for g in range(4) for _ in range(2)])
    progress.kept_groups = 2
    for policy in ("count", "time", "group"):
        assert not decide(plan(policy, filter_groups=True), progress).stop
    progress.kept_groups = 3
    for policy in ("count", "time", "group"):
        assert decide(plan(policy, filter_groups=True), progress).stop
    assert not decide(plan("none", filter_groups=True), progress).stop


def test_a_policy_name_no_policy_has_is_a_named_error():
    """A plan made in code (not checked at load) with an unknown policy raises, naming the known
    ones, instead of running as another policy."""
    with pytest.raises(ValueError, match="cancel policy 'nope': expected one of"):
        decide(plan("nope"), finished())
