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
    # the deadline stays the quantile's: a later return (below the target) does not move it on
    # (with the target one past the quantile, as above, no such return exists)
    policy = plan("time", target_samples=10, time_quantile=0.5, time_factor=1.5)
    progress.returned([Sample([1], [2], [0.0], [1], group_id=3)], elapsed_s=4.0)
    progress.elapsed_s = 5.0
    assert len(progress.finish_times_s) == 6 and decide(policy, progress).wake_at_s == 5.0
    assert decide(policy, progress).stop


def test_group_stops_at_complete_groups_not_at_samples():
    """group: 3 complete groups end the wait; 6 samples spread over 4 groups do not."""
    spread = finished((0, 1.0), (0, 1.0), (1, 1.0), (1, 1.0), (2, 1.0), (3, 1.0))
    assert spread.complete_groups == [0, 1] and not decide(plan("group"), spread).stop
    spread.returned([Sample([1], [2], [0.0], [1], group_id=3)], elapsed_s=2.0)
    assert spread.complete_groups == [0, 1, 3] and decide(plan("group"), spread).stop
    assert decide(plan("group"), spread).keep_groups == {0, 1, 3}
    # several returns can come back at once (asyncio.wait): a group complete past the target is
    # not kept, whatever its id
    spread.returned([Sample([1], [2], [0.0], [1], group_id=2)], elapsed_s=2.0)
    assert spread.complete_groups == [0, 1, 3, 2]
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


def test_the_rollout_timeout_keeps_the_group_policys_whole_groups():
    """At rollout.rollout_timeout_s the group policy still names the groups to keep: the complete
    ones, so no group trains short of members."""
    progress = finished((0, 1.0), (0, 1.0), (1, 1.0))
    progress.elapsed_s = 60.0
    decision = decide(plan("group"), progress, timeout_s=50.0)
    assert decision.stop and decision.keep_groups == {0}


def test_a_held_group_completes_with_its_resumed_members():
    """Partial rollout with the group policy (target 1 group): a held group whose other member
    finished in an earlier step (`held`) is complete once its resumed member returns, and the
    wait stops there, the fresh group's members still running (before, a held group never
    completed, so the policy waited for every fresh group)."""
    import asyncio
    import time

    from inflight import wait_for_enough

    async def member(group_id, seconds):
        await asyncio.sleep(seconds)
        return [Sample([1], [2], [0.0], [1], group_id=group_id)]

    async def rollout():
        tasks = {asyncio.ensure_future(member(g, s)) for g, s in ((5, 0.01), (0, 0.02), (0, 5))}
        policy = plan("group", target_groups=1, partial=True)
        pending, decision = await wait_for_enough(tasks, policy, time.perf_counter(), held={5: 1})
        for task in pending:
            task.cancel()
        return len(pending), decision.stop

    assert asyncio.run(rollout()) == (2, True)


def test_the_wait_hooks_each_task_once_not_at_every_wake_up():
    """wait_for_enough over 300 requests that finish one at a time hooks each one once, and all
    300 return: asyncio.wait over every pending task at each wake-up hooked them 22,650 times
    here (O(n^2): 5.7 s of the event loop's CPU at 4,096 requests, RESULTS "The rollout's
    wait")."""
    import asyncio
    import time

    from inflight import wait_for_enough

    class Counted(asyncio.Future):
        hooks = 0

        def add_done_callback(self, fn, *, context=None):
            Counted.hooks += 1
            super().add_done_callback(fn, context=context)

    async def rollout():
        futures = [Counted() for _ in range(300)]
        returned = []

        def on_return(turns):
            returned.append(turns[0].group_id)
            return set()

        async def finish_one_at_a_time():
            for i, future in enumerate(futures):
                await asyncio.sleep(0)
                future.set_result([Sample([1], [2], [0.0], [1], group_id=i)])

        finishing = asyncio.ensure_future(finish_one_at_a_time())
        pending, _ = await wait_for_enough(
            set(futures),
            plan("count", target_samples=300),
            time.perf_counter(),
            on_return=on_return,
        )
        await finishing
        return pending, sorted(returned)

    pending, returned = asyncio.run(rollout())
    assert not pending and returned == list(range(300))
    assert Counted.hooks <= 300


def test_groups_done_by_one_wake_up_are_kept_in_launch_order():
    """The group policy keeps the first complete groups: of those that complete by one wake-up
    (one engine decode step), the first launched, whatever order the engine returns them in (it
    was that order: the groups trained changed between runs of one seed). Refills included."""
    import asyncio
    import time

    from inflight import wait_for_enough

    async def rollout(finishing_order):
        go = {g: asyncio.Event() for g in range(4)}

        async def member(group_id):
            await go[group_id].wait()
            return [Sample([1], [2], [0.0], [1], group_id=group_id)]

        tasks = [asyncio.ensure_future(member(g)) for g in range(4) for _ in range(2)]
        await asyncio.sleep(0)  # each waits on its group's Event
        for group_id in finishing_order:  # each wakes its members in this order, in one pass
            go[group_id].set()
        _, decision = await wait_for_enough(
            tasks, plan("group", target_groups=2), time.perf_counter()
        )
        return decision.keep_groups

    assert asyncio.run(rollout([0, 1, 2, 3])) == asyncio.run(rollout([3, 2, 1, 0])) == {0, 1}

    # and with refills (dynamic sampling's on_return): a refill launched after a task still
    # running comes after it (an index freed by a returned task was given again to a refill)
    async def refilled():
        go = {g: asyncio.Event() for g in range(5)}
        taken = []

        async def member(group_id):
            await go[group_id].wait()
            return [Sample([1], [2], [0.0], [1], group_id=group_id)]

        def on_return(turns):
            taken.append(turns[0].group_id)
            if turns[0].group_id < 2:  # groups 0 and 1 each refill one: 3 and 4
                return [asyncio.ensure_future(member(turns[0].group_id + 3))]
            return []

        async def engine():
            await asyncio.sleep(0)
            go[0].set(), go[1].set()
            for _ in range(5):  # they return, and their refills wait on their Events
                await asyncio.sleep(0)
            for group_id in (3, 2, 4):  # 3 before 2 by the same wake-up
                go[group_id].set()

        tasks = [asyncio.ensure_future(member(g)) for g in range(3)]
        driving = asyncio.ensure_future(engine())
        await wait_for_enough(
            tasks, plan("count", target_samples=5), time.perf_counter(), on_return=on_return
        )
        await driving
        return taken

    assert asyncio.run(refilled()) == [0, 1, 2, 3, 4]


def test_launch_targets_are_exact_where_floats_are_not():
    """plan_launch's ceilings of rates the config wrote as decimals: 10 x (1 - 0.7) is 3 groups,
    not 4 (3.0000000000000004 in floats); 100 x 1.1 launches 110, not 111."""
    from assemble import load_config
    from cancel import plan_launch

    def launched(*sets):
        return load_config(None, ["rollout.group_size=4", "rollout.prompts_per_step=120", *sets])

    drop = plan_launch(launched("rollout.cancel=count", "rollout.drop_rate=0.7").rollout, 10)
    assert (drop.target_groups, drop.target_samples) == (3, 12)
    over = launched("rollout.cancel=count", "rollout.over_sample_rate=0.1").rollout
    assert plan_launch(over, 100).num_prompts == 110


def test_under_the_group_policy_a_group_with_a_failed_member_is_not_kept():
    """Dynamic sampling with the group policy: a group whose member failed is dropped at the end
    (only complete groups train), so the filter does not count it kept; with count it is kept on
    its survivors."""
    from cancel import GroupFilter
    from test_filter import member

    for whole, kept in ((3, 0), (0, 1)):
        tally = GroupFilter(whole=whole)
        for _ in range(3):
            tally.launched(0)
        tally.returned(member(0, 1.0))
        tally.returned(member(0, 0.0))
        tally.returned(member(0))  # failed
        assert tally.kept == kept


def test_what_the_filter_and_partial_rollout_change_in_the_group_policys_decision():
    """The group policy trains the first `target_groups` complete groups; with dynamic sampling
    every complete group goes to the filter (it judges each: the target counts kept ones), and
    with partial rollout nothing is dropped (an incomplete group's finished members wait)."""
    progress = finished((0, 1.0), (0, 1.0), (1, 1.0), (1, 1.0), (3, 1.0), (3, 1.0), (2, 1.0))
    progress.returned([Sample([1], [2], [0.0], [1], group_id=2)], elapsed_s=2.0)
    assert progress.complete_groups == [0, 1, 3, 2]
    assert decide(plan("group"), progress).keep_groups == {0, 1, 3}
    assert decide(plan("group", filter_groups=True), progress).keep_groups == {0, 1, 2, 3}
    assert decide(plan("group", partial=True), progress).keep_groups is None


def test_the_rollout_timeout_is_the_latest_wake_up():
    """A policy's own wake-up later than rollout.rollout_timeout_s (time's deadline of 5 s,
    a timeout of 3 s) wakes at the timeout, to stop there."""
    policy = plan("time", time_quantile=0.8, time_factor=1.5)
    progress = finished((0, 1.0), (0, 1.0), (1, 1.5), (1, 1.5), (2, 2.0))
    progress.elapsed_s = 2.5
    assert decide(policy, progress).wake_at_s == 5.0
    decision = decide(policy, progress, timeout_s=3.0)
    assert not decision.stop and decision.wake_at_s == 3.0


def test_progress_counts_every_turns_tokens_and_dropping_keeps_an_abort_an_abort():
    """Progress.returned_tokens (what a token-budget policy of yours reads) counts every turn of a
    returned trajectory, cancelled ones too; drop_other_groups masks the finished members of the
    groups not kept as "dropped" and leaves a cancelled one "abort" (rollout/aborted counts it)."""
    from cancel import drop_other_groups

    progress = Progress(group_size=2)
    turns = [
        Sample([1], [2, 3, 4], [0.0] * 3, [1] * 3, 0),
        Sample([1], [5, 6], [0.0] * 2, [1] * 2, 0),
    ]
    progress.returned(turns, elapsed_s=1.0)
    progress.returned([Sample([1], [7], [0.0], [1], 0, masked=True, finish_reason="abort")], 1.0)
    assert progress.returned_tokens == 6
    done = Sample([1], [2], [0.0], [1], group_id=1)
    cut = Sample([1], [2], [0.0], [1], group_id=1, masked=True, finish_reason="abort")
    kept = Sample([1], [2], [0.0], [1], group_id=0)
    drop_other_groups([done, cut, kept], keep_groups=frozenset({0}))
    assert (done.masked, done.finish_reason) == (True, "dropped")
    assert cut.finish_reason == "abort" and (kept.masked, kept.finish_reason) == (False, "stop")


def test_a_zero_variance_group_is_all_correct_only_at_full_reward():
    """informative_groups' zero-variance kinds: every survivor at reward 1 is all-correct; equal
    partial credit (0.7 each) is not."""
    from cancel import informative_groups

    def group(reward):
        return [[Sample([1], [2], [0.0], [1], 0, reward=reward)] for _ in range(2)]

    _, counts = informative_groups([group(1.0), group(0.7), group(0.0)])
    assert counts["zero_variance_all_correct"] == 1 and counts["zero_variance_all_wrong"] == 2
