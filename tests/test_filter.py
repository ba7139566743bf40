"""Dynamic sampling (DAPO) on the real engine: groups judged as their last member finishes
(scripted rewards make chosen groups zero-variance), the rollout ending at the kept-group target
with the rest aborted inside the engine, refills launched while other requests run, the prompt
bound truncating a step, held groups of partial rollout judged whole; and the keep rule itself."""

import dataclasses
import re
import statistics

import pytest

import sample
import rollout
import train
from metrics import reduce_metrics
from cancel import GroupFilter, informative, informative_groups, plan_launch
from inflight import RolloutStats
from conftest import tiny_config
from config import ConfigError
from rollout import filter_metrics
from test_partial import PROMPTS, TAIL_SMOKE, aborted_samples

PROMPT = [1, 5, 12]  # "<bos>1:"


def filtering_plan(tmp_path, *sets):
    cfg = tiny_config(
        tmp_path,
        "rollout.cancel=count",
        "rollout.filter_groups=true",
        "rollout.group_size=4",
        "rollout.prompts_per_step=4",
        *sets
    )
    return plan_launch(cfg.rollout, cfg.rollout.prompts_per_step)


def scripted(is_zero_variance):
    """Reward 1.0 for every member of a group `is_zero_variance(group id)` picks (all correct),
    else the trajectory id's parity: a group's members have consecutive ids, so its rewards
    differ."""
    return lambda turns: (
        1.0 if is_zero_variance(turns[-1].group_id) else float(turns[-1].trajectory_id % 2)
    )


def member(group_id, reward=None, finish_reason="stop"):
    """A trajectory's last turn as the filter sees it: finished with `reward`, or failed
    (None)."""
    return sample.Sample(
        [1],
        [4],
        [0.0],
        [1],
        group_id,
        finish_reason=finish_reason,
        masked=reward is None,
        reward=reward or 0.0,
    )


def test_keep_rule_is_a_float64_std_with_a_threshold():
    """A group is informative when the float64 std of its rewards exceeds 1e-6: equal rewards
    that float arithmetic set apart, a single reward and none are not."""
    assert informative([0.0, 1.0]) and informative([0.5, 0.5, 0.5 + 1e-5])
    assert not informative([1.0, 1.0, 1.0]) and not informative([0.7]) and not informative([])
    near = [0.1 + 0.2, 0.3, 0.3]  # equal shaped rewards that float arithmetic set apart
    assert statistics.pstdev(near) > 0 and not informative(near)


def test_group_filter_judges_a_group_when_its_last_member_returns_on_its_survivors():
    """A group is judged once its last launched member returns, on its finished members' rewards
    (a failed member counts nowhere), a held group together with its members that finished
    before."""
    groups = GroupFilter(held={7: [member(7, 0.0), member(7, 1.0)]})
    for group_id in (0, 0, 0, 1, 1, 7):
        groups.launched(group_id)
    groups.returned(member(0, 1.0))
    groups.returned(member(0))  # failed: counts nowhere
    assert (groups.kept, groups.possible()) == (0, 3)
    groups.returned(member(0, 1.0))  # whole: survivors 1.0, 1.0, not kept
    assert (groups.kept, groups.possible()) == (0, 2)
    groups.returned(member(1, 0.0))
    groups.returned(member(1, 1.0))
    groups.returned(member(7, 1.0))  # a held group: with its members of earlier steps
    assert (groups.kept, groups.possible()) == (2, 0)


def test_a_group_whose_survivors_were_all_cut_is_not_kept_under_mask_truncated():
    """train.mask_truncated trains no member cut at the budget: a group whose every survivor was
    cut trains nothing, whatever its rewards (GSM8K scores cut-off text), so the filter neither
    counts it toward the target nor hands it back; one survivor that ended is enough. Without
    mask_truncated the cut members train and the group is kept. A group with one survivor is not
    zero-variance: it has no variance to judge."""
    cut = [member(0, 1.0, "length"), member(0, 0.0, "length"), member(0, 1.0, "length")]
    one_ended = cut[:2] + [member(0, 1.0)]
    for survivors, mask_truncated, kept in (
        (cut, True, 0),
        (one_ended, True, 1),
        (cut, False, 1),
    ):
        groups = GroupFilter(mask_truncated=mask_truncated)
        for turn in survivors:
            groups.launched(0)
        for turn in survivors:
            groups.returned(turn)
        assert groups.kept == kept, (survivors, mask_truncated)
        trajectories = [[turn] for turn in survivors]
        handed, counts = informative_groups([trajectories], mask_truncated=mask_truncated)
        assert counts["kept_groups"] == len(handed) == kept
        assert counts["zero_variance_groups"] == 0
    lone = [[member(0, 1.0)], [member(0)], [member(0)]]
    assert informative_groups([lone])[1]["zero_variance_groups"] == 0


def test_a_group_whose_trained_members_all_sit_at_its_mean_is_not_kept():
    """Under train.mask_truncated the cut members stay in their group's mean but do not train: a
    partial-credit group whose one uncut member is at that mean (0.5 beside a cut 0 and 1) trains
    nothing (advantage 0), so it is not kept (a reviewer found it counted toward the target).
    Without mask_truncated every member trains and it is; an uncut member off the mean keeps it;
    and the trained batch's logged rewards leave the cut members out, as the step does."""
    at_mean = [member(0, 0.5), member(0, 0.0, "length"), member(0, 1.0, "length")]
    off_mean = [member(0, 1.0), member(0, 0.0, "length"), member(0, 0.5, "length")]
    for survivors, mask_truncated, kept in (
        (at_mean, True, 0),
        (at_mean, False, 1),
        (off_mean, True, 1),
    ):
        trajectories = [[turn] for turn in survivors]
        handed, counts = informative_groups([trajectories], mask_truncated=mask_truncated)
        assert counts["kept_groups"] == len(handed) == kept, (survivors, mask_truncated)
    stats = RolloutStats()
    trained = [[turn] for turn in off_mean]
    logged = reduce_metrics(filter_metrics(trained, counts, stats, 1, True, mask_truncated=True))
    assert logged["train/reward_mean"] == 1.0 and logged["train/accuracy"] == 1.0
    logged = reduce_metrics(filter_metrics(trained, counts, stats, 1, True))
    assert logged["train/reward_mean"] == 0.5


def test_a_prompt_bound_below_the_first_launch_is_refused(tmp_path):
    """rollout.max_prompts_per_step bounds the new prompts a step launches: one below the
    over-sampled first launch (32 x 2 = 64 > 40) was silently raised to it; it is a ConfigError,
    for each rank's share too (10 prompts at 0.25 over 2 ranks: each launches ceil(6.25) = 7, past
    its share 6 of a bound of 13 that one rank meets). Totals that rounding each rank's share
    moves from one rank's are said (assemble.setup logs the line on rank 0)."""
    import cancel

    # (naming the least it can be: a bound below prompts_per_step was "below 32", and 32 was
    # then refused as below the first launch)
    with pytest.raises(ConfigError, match="below the first launch alone.*64 > 40; .* at least 64"):
        filtering_plan(
            tmp_path,
            "rollout.over_sample_rate=1.0",
            "rollout.max_prompts_per_step=40",
            "rollout.prompts_per_step=32",
        )
    plan = filtering_plan(
        tmp_path,
        "rollout.over_sample_rate=1.0",
        "rollout.max_prompts_per_step=64",
        "rollout.prompts_per_step=32",
    )
    assert plan.num_prompts == plan.max_prompts == 64
    sets = ["rollout.prompts_per_step=10", "rollout.over_sample_rate=0.25"]
    cfg = tiny_config(
        tmp_path,
        "rollout.cancel=count",
        "rollout.filter_groups=true",
        "rollout.max_prompts_per_step=13",
        *sets
    )
    cancel.check_shares(cfg.rollout, 1)
    with pytest.raises(ConfigError, match="each of 2 ranks .*rounded up: 7 > 6"):
        cancel.check_shares(cfg.rollout, 2)
    # each rank's share rounded moves the totals: said (39 on 8 ranks bounded at 32 in silence);
    # nothing on one rank, nor where the rounding moves nothing
    sets = ["rollout.max_prompts_per_step=100", "rollout.refill_prompts=2"]
    cfg = tiny_config(tmp_path, "rollout.cancel=count", "rollout.filter_groups=true", *sets)
    assert cancel.rounded_shares(cfg.rollout, 1) is None
    assert cancel.rounded_shares(cfg.rollout, 8) == (
        "dynamic sampling on 8 ranks, each its share rounded: prompt bound 96 (one rank: 100), "
        "refill 8 (one rank: 2)"
    )
    sets = ["rollout.prompts_per_step=16", "rollout.over_sample_rate=0.1"]
    cfg = tiny_config(tmp_path, "rollout.cancel=count", "rollout.filter_groups=true", *sets)
    assert cancel.rounded_shares(cfg.rollout, 8).startswith(
        "dynamic sampling on 8 ranks, each its share rounded: first launch 24 (one rank: 18)"
    )
    cfg = tiny_config(tmp_path, "rollout.cancel=count", "rollout.filter_groups=true")
    assert cancel.rounded_shares(cfg.rollout, 2) is None  # the demo's counts on 2 ranks


def test_refill_asks_for_prompts_while_kept_and_possible_groups_fall_short_within_the_bound(
    tmp_path,
):
    """Refills are asked for only while kept plus in-flight groups fall short of the target,
    refill_prompts at a time, and never past the step's prompt bound."""
    plan = filtering_plan(tmp_path, "rollout.refill_prompts=2", "rollout.max_prompts_per_step=7")
    groups = GroupFilter()
    for group_id in (0, 1, 2, 3):
        groups.launched(group_id)
    assert groups.wanted(plan, prompts_launched=4) == 0  # 4 in flight may yet make the target of 4
    groups.returned(member(0, 1.0))
    groups.returned(member(1, 1.0))  # two zero-variance groups: 0 kept + 2 possible < 4
    assert groups.wanted(plan, prompts_launched=4) == 2
    assert groups.wanted(plan, prompts_launched=6) == 1  # the bound of 7 new prompts leaves one
    assert groups.wanted(plan, prompts_launched=7) == 0


def test_groups_are_filtered_on_completion_and_the_rest_aborted_at_the_target(
    engine, policy, tmp_path
):
    """16 prompts launched for 4 kept groups, every even group zero-variance: the rollout stops
    at 4 kept groups and aborts the rest inside the engine; every finished trajectory was scored,
    and informative_groups keeps exactly the informative groups, renumbered for the advantages."""
    plan = filtering_plan(tmp_path, "rollout.over_sample_rate=3.0")
    assert (plan.num_prompts, plan.target_groups, plan.max_prompts) == (16, 4, 16)
    samples, stats = engine.generate(
        PROMPTS * 4, 4, 1.0, 200, plan, reward=scripted(lambda g: g % 2 == 0)
    )
    assert engine.num_in_flight() == 0  # nothing left running inside the engine
    # at least the target: groups whose last members return in the same wake-up of the rollout
    # are judged together before the stop (seen once in a loaded full run: 5)
    assert stats.kept_groups >= 4 and stats.num_cancelled > 0
    assert [s.trajectory_id for s in samples] == list(range(len(samples)))
    trajectories = sample.trajectories_of(samples)
    for turns in trajectories:  # scored by the rollout as each finished; cancelled ones never
        last = turns[-1]
        assert last.reward == (
            0.0 if last.masked else 1.0 if last.group_id % 2 == 0 else last.trajectory_id % 2
        )
    kept_groups, counts = informative_groups(sample.groups_of(trajectories))
    kept = [turns for group in kept_groups for turns in group]
    complete = {
        g for g in range(16) if all(not t[-1].masked for t in trajectories if t[-1].group_id == g)
    }
    # the target, plus any that finished before the abort landed
    assert len([g for g in complete if g % 2]) >= 4
    survivors = {}  # group id -> parities of its finished members' trajectory ids
    for turns in trajectories:
        if not turns[-1].masked:
            survivors.setdefault(turns[-1].group_id, set()).add(turns[-1].trajectory_id % 2)
    expected = {g for g, parities in survivors.items() if g % 2 and parities == {0, 1}}
    assert {t[-1].group_id for t in kept} == expected and counts["kept_groups"] == len(expected)
    # ids are left as the rollout made them (the advantages are aligned with the groups)
    assert all(t[-1].trajectory_id == t[0].trajectory_id for t in kept)
    # zero-variance: the other groups with two survivors or more (one has no variance to judge)
    finished = [t[-1].group_id for t in trajectories if not t[-1].masked]
    judged = {g for g in survivors if finished.count(g) > 1}
    assert counts["zero_variance_groups"] == len(judged - expected)


def test_refills_launch_while_other_requests_are_in_flight(engine, policy, tmp_path):
    """With the 4 launched groups all zero-variance, refill prompts are launched one at a time
    under new group ids while other requests still run, until 4 groups are kept within the prompt
    bound."""
    plan = filtering_plan(tmp_path, "rollout.refill_prompts=1")
    refills = []

    def more_prompts(count, first_group_id):
        refills.append(
            (list(range(first_group_id, first_group_id + count)), engine.num_in_flight())
        )
        return [PROMPT] * count

    # the 4 launched groups are all zero-variance: every kept group comes from a refill
    samples, stats = engine.generate(
        PROMPTS, 4, 1.0, 200, plan, reward=scripted(lambda g: g < 4), more_prompts=more_prompts
    )
    assert engine.num_in_flight() == 0
    # cancelled before sending too
    assert [s.trajectory_id for s in samples] == list(range(len(samples)))
    assert [ids for ids, _ in refills] == [[4 + k] for k in range(len(refills))]
    assert any(in_flight > 0 for _, in_flight in refills)  # launched without waiting for the rest
    assert stats.kept_groups == 4 and stats.prompts_launched == 4 + len(refills) <= plan.max_prompts
    assert {s.group_id for s in samples} == set(range(4 + len(refills)))


def test_the_prompt_bound_truncates_the_step_without_error(engine, policy, tmp_path):
    """When every group is zero-variance, the rollout stops at the prompt bound (6 prompts)
    without error, keeps no group, and the step is logged as truncated."""
    plan = filtering_plan(tmp_path, "rollout.refill_prompts=1", "rollout.max_prompts_per_step=6")
    samples, stats = engine.generate(
        PROMPTS,
        4,
        1.0,
        24,
        plan,
        reward=scripted(lambda g: True),
        more_prompts=lambda count, first_group_id: [PROMPT] * count,
    )
    assert engine.num_in_flight() == 0
    assert stats.prompts_launched == 6 and stats.kept_groups == 0 and len(samples) == 6 * 4
    kept, counts = informative_groups(sample.groups_of(sample.trajectories_of(samples)))
    assert kept == [] and counts["zero_variance_groups"] == 6
    logged = reduce_metrics(filter_metrics(kept, counts, stats, plan.target_groups, filtering=True))
    assert logged["filter/truncated_steps"] == 1 and logged["filter/prompts_launched"] == 6


def test_a_held_group_is_judged_whole_with_its_earlier_members_rewards(engine, policy, tmp_path):
    """Partial rollout: suspended members are resumed under one group id; the rollout judges
    their group on the rewards its members earned before (held) and now, so the same resumed
    rewards keep the group or not depending on the held ones."""
    partial = aborted_samples(engine, tmp_path)[:3]
    resumes = [dataclasses.replace(s, group_id=0) for s in partial]
    sets = ["rollout.max_new_tokens=64", "rollout.partial=true", "train.tis_cap=2"]
    plan = filtering_plan(tmp_path, *sets)
    plan = dataclasses.replace(plan, target_groups=1)
    for prior, kept in (([0.0, 0.0], 1), ([1.0, 1.0], 0)):
        samples, stats = engine.generate(
            [],
            4,
            1.0,
            64,
            plan,
            resumes=resumes,
            reward=lambda turns: 1.0,
            held_survivors={0: [member(0, reward) for reward in prior]},
        )
        assert engine.num_in_flight() == 0
        assert stats.kept_groups == kept and all(not s.masked and s.reward == 1.0 for s in samples)


def test_partial_rollout_with_filtering_trains_only_whole_informative_groups(
    engine, policy, tmp_path
):
    """Steps of the trainer's own rollout (partial on, filter on) until a step resumed what an
    earlier one suspended (when the target is met, hence what is suspended, depends on timing: at
    most six steps), under its held group's id; every group handed back is whole (all its
    members, of one prompt, none aborted), and the groups dynamic sampling keeps have rewards that
    differ."""
    cfg = tiny_config(
        tmp_path,
        "rollout.cancel=count",
        "rollout.over_sample_rate=2.0",
        "rollout.partial=true",
        "train.tis_cap=2",
        "rollout.filter_groups=true",
        "rollout.prompts_per_step=4",
        # groups of 2 finish at spread-out times: one of 8 nearly always waits for a member at the
        # token cap, so all groups finished at one decode step, on a loaded machine before the
        # abort arrived (nothing suspended in six steps)
        "rollout.group_size=2",
        "rollout.max_new_tokens=64",
    )
    run = train.setup(cfg, engine=engine)
    # half the groups of 2 informative: 12 launched (and refills) meet the target of 4
    run.rewards.reward_fn = lambda text, answer, finished: float(len(text) % 2)
    suspended = resumed = 0
    for step in range(6):
        groups, metrics = rollout.collect(run, step)
        assert engine.num_in_flight() == 0
        suspended += run.buffer.counters["suspended"]
        resumed += run.buffer.counters["resumed"]
        # whole groups only (group_size members of one prompt, none aborted: a member resumed
        # from an earlier step keeps that step's group id, so the prompt is what they share), and
        # the ones dynamic sampling kept have rewards that differ
        assert all(t[-1].finish_reason != "abort" for group in groups for t in group)
        assert all(len(group) == cfg.rollout.group_size for group in groups)
        assert all(len({t[0].prompt_ids.tobytes() for t in group}) == 1 for group in groups)
        for group in groups:
            assert informative([t[-1].reward for t in group if not t[-1].masked])
        counts = reduce_metrics(metrics)
        assert counts["filter/kept_groups"] == len(groups)
        # the groups completed, those the filter dropped too (named `trained_groups`, it read as
        # the groups trained: 432 for 241 in a reviewer's 30 steps)
        completed = counts["partial/completed_groups"]
        assert completed >= len(groups) + counts["filter/zero_variance_groups"]
        if resumed:
            break
    assert suspended > 0 and resumed > 0


@pytest.mark.background("tail_bench_smoke", TAIL_SMOKE)
def test_tail_bench_filter_runs_end_to_end_and_reports_its_figures(background_runs):
    """bench/tail.py --filter runs its three arms on a small workload and ends with the issue's
    line: both speedups and the kept groups, as numbers (their values are not checked at this
    size)."""
    lines = background_runs.lines("tail_bench_smoke")
    assert re.fullmatch(
        r"filter: speedup_vs_rounds=[\d.]+ speedup_vs_wait_all=[\d.]+ kept_groups=\d+", lines[-1]
    )
