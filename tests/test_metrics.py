"""Rollout statistics: aborted samples are never averaged in as zeros, except in the 'launched'
mean."""

import dataclasses
import time

import pytest
import torch

from metrics import Summed, joined, length_stats, masked_mean, reduce_metrics, summed
from inflight import RolloutStats, check_failures
from rollout import filter_metrics, rollout_metrics
from sample import Sample, trajectories_of


def sample(trajectory_id, reward, length, masked=False, finish_reason="stop", turn=0):
    return Sample(
        [1],
        [5] * length,
        [0.0] * length,
        [1] * length,
        group_id=0,
        trajectory_id=trajectory_id,
        turn=turn,
        finish_reason=finish_reason,
        masked=masked,
        reward=reward,
    )


def test_completed_vs_launched_reward_means():
    """The completed reward mean averages survivors only, the launched mean counts aborted and
    failed samples as 0; counts, ratios, wasted tokens, lengths, throughput and the trained batch's
    figures come out as computed by hand. The throughput is what the engine generated in the rollout
    (`RolloutStats.generated_tokens`), not the tokens of the trajectories handed back: with partial
    rollout those are the complete groups', earlier steps' tokens in, this step's suspended out (an
    all-held step logged 0 tokens/s)."""
    samples = [
        sample(0, 1.0, 4),
        sample(1, 0.5, 6, finish_reason="length"),
        sample(2, 0.0, 30, masked=True, finish_reason="abort"),
        sample(3, 0.0, 0, masked=True, finish_reason="error"),
    ]
    stats = RolloutStats(rollout_s=2.0, generated_tokens=40, num_tool_calls=3)
    check_failures(samples, stats, max_failed_ratio=1.0)  # as Rollout.run counts them
    out = reduce_metrics(rollout_metrics(trajectories_of(samples), stats))
    assert out["rollout/reward_mean_completed"] == pytest.approx(0.75)  # survivors only
    assert out["rollout/reward_mean_launched"] == pytest.approx(1.5 / 4)  # unfinished count as 0
    assert out["rollout/aborted"] == 1 and out["rollout/failed"] == 1
    assert out["rollout/aborted_ratio"] == pytest.approx(0.25)
    assert out["rollout/wasted_tokens"] == 30 and out["rollout/aborted_len_max"] == 30
    assert out["rollout/response_len_mean"] == pytest.approx(5.0)
    assert out["perf/rollout_tokens_per_s"] == pytest.approx(40 / 2.0)
    assert out["rollout/truncated_ratio"] == 0.5  # of the finished
    assert out["rollout/tool_calls_per_trajectory"] == 0.75  # of the launched
    # the trained batch's figures: accuracy counts full rewards; the filter's truncated steps
    # only where it filters
    counts = {"kept_groups": 0, "zero_variance_all_correct": 0, "zero_variance_all_wrong": 0}
    trained = reduce_metrics(filter_metrics(trajectories_of(samples), counts, stats, 1, False))
    assert trained["train/accuracy"] == 0.5 and trained["train/reward_mean"] == 0.75
    assert trained["filter/truncated_steps"] == 0
    partial_credit = filter_metrics(trajectories_of([sample(0, 0.7, 4)]), counts, stats, 1, False)
    assert reduce_metrics(partial_credit)["train/accuracy"] == 0
    filtered = filter_metrics(trajectories_of(samples), counts, stats, 1, True)
    assert reduce_metrics(filtered)["filter/truncated_steps"] == 1
    held = RolloutStats(rollout_s=2.0, generated_tokens=5000, num_failed=2)
    assert reduce_metrics(rollout_metrics([], held))["perf/rollout_tokens_per_s"] == 2500
    # the rollout's own failures too (a reviewer found a held group's counted when it completed,
    # steps later)
    assert reduce_metrics(rollout_metrics([], held))["rollout/failed"] == 2


def test_multi_turn_trajectories_count_once():
    """A trajectory of several turns counts once in the launched count and in the reward mean,
    and its response length is every turn's tokens (a reviewer found only the last turn's: 2, not
    5, beside a budget for the whole trajectory). Turns per trajectory cover every launched one,
    as the tool calls do (a reviewer found them taken after dynamic sampling's filter, at merge:
    1.0 turn beside 1.0 tool call a trajectory when the many-turn groups were left out)."""
    samples = [sample(0, 1.0, 3, turn=0), sample(0, 1.0, 2, turn=1), sample(1, 0.0, 4)]
    out = reduce_metrics(rollout_metrics(trajectories_of(samples), RolloutStats(rollout_s=1.0)))
    assert out["rollout/launched"] == 2
    assert out["rollout/reward_mean_completed"] == pytest.approx(0.5)
    assert out["rollout/response_len_max"] == 5 and out["rollout/response_len_mean"] == 4.5
    assert out["rollout/turns_per_trajectory"] == 1.5


def test_means_over_samples_weigh_every_sample_alike_over_ranks(monkeypatch):
    """Two ranks' rollouts reduced: rank 0 finished 8 samples of reward 1, rank 1 one of reward
    0 and cancelled 7. The means over samples are those of the 16 launched together (9 finished:
    8/9, not the ranks' means averaged, (1 + 0) / 2), and so are the length quantiles and the
    reward's standard deviation (1/3; each rank's own is 0); a rank with no finished sample adds
    nothing to them."""
    import metrics

    rank0 = [sample(i, 1.0, 4) for i in range(8)]
    rank1 = [sample(0, 0.0, 2)] + [
        sample(i, 0.0, 9, masked=True, finish_reason="abort") for i in range(1, 8)
    ]
    per_rank = [
        rollout_metrics(trajectories_of(samples), RolloutStats(rollout_s=1.0))
        for samples in (rank0, rank1)
    ]
    monkeypatch.setattr(metrics.parallel, "gather_objects", lambda local: per_rank)
    out = reduce_metrics(per_rank[0])
    assert out["rollout/reward_mean_completed"] == pytest.approx(8 / 9)
    assert out["rollout/reward_mean_launched"] == pytest.approx(8 / 16)
    assert out["rollout/aborted_ratio"] == pytest.approx(7 / 16)
    assert out["rollout/response_len_mean"] == pytest.approx((8 * 4 + 2) / 9)
    # the 9 lengths' quantiles: each rank's averaged, they were (4 + 2) / 2
    assert out["rollout/response_len_p50"] == out["rollout/response_len_p90"] == 4.0
    per_rank[1] = rollout_metrics(trajectories_of(rank1[1:]), RolloutStats(rollout_s=1.0))
    assert reduce_metrics(per_rank[0])["rollout/reward_mean_completed"] == 1.0
    # the trained batch's statistics (here everything finished was trained on) pool alike
    counts = {"kept_groups": 1, "zero_variance_all_correct": 0, "zero_variance_all_wrong": 0}
    per_rank[:] = [
        filter_metrics(trajectories_of(samples), counts, RolloutStats(), 1, False)
        for samples in (rank0, rank1)
    ]
    out = reduce_metrics(per_rank[0])
    assert out["train/accuracy"] == out["train/reward_mean"] == pytest.approx(8 / 9)
    assert out["train/reward_std"] == pytest.approx(1 / 3)


def test_a_throughput_over_ranks_is_every_ranks_tokens_over_the_slowest_ranks_seconds(
    monkeypatch,
):
    """perf/rollout_tokens_per_s (and perf/train_tokens_per_s, made alike in train.py) is the
    job's: all ranks' tokens over the phase's time, the slowest rank's. A reviewer found each
    rank's own rate summed: a rank done in 0.3 s counted as generating the whole 3 s, 3,667
    tokens/s logged for 2,000 tokens in 3 s (667)."""
    import metrics

    per_rank = [
        rollout_metrics([], RolloutStats(rollout_s=seconds, generated_tokens=1000))
        for seconds in (0.3, 3.0)
    ]
    monkeypatch.setattr(metrics.parallel, "gather_objects", lambda local: per_rank)
    assert reduce_metrics(per_rank[0])["perf/rollout_tokens_per_s"] == pytest.approx(2000 / 3.0)
    assert metrics.rate(5, 0).value == 0.0  # one rank's own, over no time


def test_with_dynamic_sampling_the_train_reward_figures_are_the_trained_batchs():
    """train/reward_mean, train/accuracy and train/reward_std describe the groups trained on; with
    rollout.filter_groups a reviewer found accuracy and std computed over every finished
    trajectory (an all-solved group filtered out, one of 1, 0, 0, 0 trained: accuracy 0.625
    against a reward mean of 0.25). The rollout-wide means are rollout/reward_mean_completed
    and _launched."""
    from cancel import informative_groups

    solved = [sample(i, 1.0, 4) for i in range(4)]
    mixed = [dataclasses.replace(sample(i, r, 4), group_id=1) for i, r in enumerate([1, 0, 0, 0])]
    for i, s in enumerate(mixed):
        s.trajectory_id = 4 + i
    trajectories = trajectories_of(solved + mixed)
    metrics = rollout_metrics(trajectories, RolloutStats(rollout_s=1.0))
    groups, counts = informative_groups([trajectories[:4], trajectories[4:]], drop=True)
    trained = [turns for group in groups for turns in group]
    metrics |= filter_metrics(trained, counts, RolloutStats(), 2, True)
    out = reduce_metrics(metrics)
    assert out["train/reward_mean"] == out["train/accuracy"] == pytest.approx(0.25)
    assert out["train/reward_std"] == pytest.approx(0.5)
    assert out["rollout/reward_mean_completed"] == pytest.approx(0.625)


def test_cancellation_counts_whole_trajectories_and_dropped_groups_at_their_reward():
    """Cut trajectories are counted whole (every turn's tokens in aborted_len and wasted_tokens; a
    reviewer found them per turn), a trajectory that failed in its second turn is a failure, not
    a cut one (its first turn, masked with "stop", counted as cancelled), and the finished
    members of a group a cancel policy dropped count at their reward in both reward means (left
    out of the completed one, a reviewer found it below the launched one: the survivor bias's
    gap reversed) and their tokens as wasted."""
    samples = [
        sample(0, 1.0, 4),
        sample(1, 0.0, 2, masked=True, turn=0),  # cut in its second turn: 2 + 3 tokens
        sample(1, 0.0, 3, masked=True, finish_reason="abort", turn=1),
        sample(2, 0.0, 7, masked=True, turn=0),  # failed in its second turn
        sample(2, 0.0, 1, masked=True, finish_reason="error", turn=1),
        sample(3, 1.0, 6, masked=True, finish_reason="dropped"),  # keep_groups left it out
    ]
    stats = RolloutStats(rollout_s=1.0)
    check_failures(samples, stats, max_failed_ratio=1.0)
    out = reduce_metrics(rollout_metrics(trajectories_of(samples), stats))
    assert out["rollout/aborted"] == 1 and out["rollout/failed"] == 1
    assert out["rollout/dropped"] == 1
    assert out["rollout/aborted_len_max"] == 5 and out["rollout/aborted_len_mean"] == 5
    assert out["rollout/wasted_tokens"] == 5 + 6  # the cut trajectory and the dropped one
    assert out["rollout/reward_mean_completed"] == 1.0
    assert out["rollout/reward_mean_launched"] == pytest.approx((1.0 + 1.0) / 4)
    # the reviewer's case: group 0 kept (rewards 1, 0), group 1 finished whole and dropped (1, 1)
    kept = [sample(0, 1.0, 2), sample(1, 0.0, 2)]
    dropped = [sample(i, 1.0, 2, masked=True, finish_reason="dropped") for i in (2, 3)]
    out = reduce_metrics(rollout_metrics(trajectories_of(kept + dropped), RolloutStats()))
    assert out["rollout/reward_mean_completed"] == out["rollout/reward_mean_launched"] == 0.75


def test_a_dropped_groups_finished_members_count_in_the_lengths_and_the_truncated_share():
    """rollout/response_len_* and rollout/truncated_ratio cover every finished trajectory, as
    rollout/reward_mean_completed does: a reviewer found the members of a group a cancel policy's
    keep_groups dropped (the last groups to finish, often the longest) left out, and their cut at
    the token budget lost with the finish_reason "dropped" replaced (lengths 10 and 10 logged
    where the four finished were 10, 10, 64 cut and 60)."""
    from cancel import drop_other_groups

    samples = [sample(0, 1.0, 10), sample(1, 0.0, 10)]
    samples += [sample(2, 1.0, 64, finish_reason="length"), sample(3, 0.0, 60)]
    for s in samples[2:]:
        s.group_id = 1
    stats = RolloutStats(rollout_s=1.0)
    stats.num_dropped_truncated = drop_other_groups(samples, keep_groups=frozenset({0}))
    assert stats.num_dropped_truncated == 1
    out = reduce_metrics(rollout_metrics(trajectories_of(samples), stats))
    assert out["rollout/dropped"] == 2 and out["rollout/reward_mean_completed"] == 0.5
    assert out["rollout/response_len_mean"] == (10 + 10 + 64 + 60) / 4
    assert out["rollout/response_len_max"] == 64
    assert out["rollout/truncated_ratio"] == 1 / 4


def test_a_metric_two_stages_report_is_named_not_replaced():
    """The step joined its stages' metrics with `|`: a fork's metric under a name a stage
    already logs (train/reward_std, say) silently replaced it. `joined` names it instead."""
    rollout, update = {"train/reward_std": 0.5}, {"train/loss": 1.0}
    assert joined(rollout, update) == {"train/reward_std": 0.5, "train/loss": 1.0}
    with pytest.raises(ValueError, match=r"\['train/reward_std'\] come from two stages"):
        joined(rollout, update, {"train/reward_std": 0.1})


def test_masked_mean_is_never_nan_and_a_mean_over_nothing_is_left_out(monkeypatch):
    """An all-masked mean is 0, not NaN. A mean, quantile or spread over no item on any rank (a
    spread: over fewer than two) is left out of the reduced metrics (a reviewer found a step with
    nothing finished logged reward 0 and length 0, read as every answer wrong), and one rank's
    items decide where the other has none."""
    import metrics
    import torch

    assert masked_mean(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0])).item() == 0.0
    assert reduce_metrics(length_stats([], "x") | {"r": metrics.ratio(0, 0)}) == {}
    assert reduce_metrics({"s": metrics.spread([]), "n": summed(0)}) == {"n": 0}
    # one item has no deviation: a reviewer found 0 logged, read as "every reward equal"
    assert reduce_metrics({"s": metrics.spread([0.5])}) == {}
    assert reduce_metrics({"s": metrics.spread([0.5, 1.5])}) == {"s": pytest.approx(0.5**0.5)}
    per_rank = [length_stats([], "x"), length_stats([3, 5], "x")]
    monkeypatch.setattr(metrics.parallel, "gather_objects", lambda local: per_rank)
    assert reduce_metrics(per_rank[0]) == {"x_mean": 4.0, "x_p50": 4.0, "x_p90": 4.8, "x_max": 5.0}


def test_a_metrics_reduction_rule_cannot_be_lost_by_arithmetic():
    """summed(3) + summed(4) raises instead of becoming a plain 7 that would then be averaged over
    ranks; reduce_metrics turns each marker into a plain number by its rule."""
    with pytest.raises(TypeError):
        summed(3) + summed(4)
    with pytest.raises(TypeError):
        summed(3) / 2
    assert isinstance(summed(torch.tensor(2.0)), Summed)
    assert reduce_metrics({"a": summed(3), "b": 0.5}) == {"a": 3, "b": 0.5}


def test_a_resumed_run_shows_each_step_once_in_tensorboard(tmp_path):
    """A run that logged steps 0-4 and died, resumed from its step-2 checkpoint, logs steps 2-3
    again: TensorBoard shows each step once, with the resumed run's values (it showed both)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from config import read_config
    from metrics import Logger

    for first_step, steps, offset in ((0, range(5), 0.0), (2, range(2, 4), 10.0)):
        # event files sort by name: the second second, as a resumed process's would be (in one
        # second, the names' unpadded counter may sort 10 before 9)
        time.sleep(1.0 if first_step else 0)
        logger = Logger(str(tmp_path), read_config(), first_step=first_step)
        for step in steps:
            logger.log(step, {"x": offset + step}, echo=lambda line: None)
        logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("x")] == [(0, 0), (1, 1), (2, 12), (3, 13)]


def test_the_console_prints_the_rollout_wide_reward_means_only_where_they_differ(tmp_path):
    """With nothing cancelled or filtered, the trained, completed and launched reward means are
    one number: the console line prints it once; where the tail was cut they differ and are
    printed beside it (TensorBoard logs all three either way)."""
    from config import read_config
    from metrics import Logger

    lines = []
    logger = Logger(str(tmp_path), read_config(), first_step=0)
    same = {
        "train/reward_mean": 0.25,
        "rollout/reward_mean_completed": 0.25,
        "rollout/reward_mean_launched": 0.25,
    }
    logger.log(0, same, echo=lines.append)
    logger.log(1, same | {"rollout/reward_mean_launched": 0.2}, echo=lines.append)
    logger.close()
    assert lines == [
        "step    0 | reward 0.250",
        "step    1 | reward 0.250 | launched 0.200",
    ]


def test_a_token_mean_over_no_token_is_left_out():
    """A step with nothing to train (dynamic sampling kept no group; every group held by partial
    rollout) has no token: its entropy, clip fraction and KL are left out, not logged as 0 (an
    entropy of 0 reads as a collapsed policy)."""
    import torch

    from metrics import TokenMeans

    means = TokenMeans()
    means.add("train/entropy", torch.tensor(0.0), torch.tensor(0))
    means.add("train/clip_frac", torch.tensor(0.5), torch.tensor(4))
    means.add("train/clip_frac", torch.tensor(0.0), torch.tensor(0))
    assert means.means() == {"train/clip_frac": 0.5}
