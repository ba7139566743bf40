"""Tests for merge.py: prefix-aware merging of multi-turn trajectories, on hand-built token arrays.

Checks merge shapes, per-token alignment, masking, validation, stats, and that token-mean quantities
are unchanged by merging. A model-based parity test lives elsewhere.
"""

import dataclasses
import os
import random
import re
import subprocess
import sys
import warnings

import pytest

from merge import MergeError, MergeStats, merge_batch, merge_trajectory, unmerged
from sample import Sample


def make_turns(
    responses: list[list[int]],
    observations: list[list[int]],
    breaks: frozenset[int] = frozenset(),
    trajectory_id: int = 7,
    group_id: int = 3,
) -> list[Sample]:
    """Turn i's prompt = turn i-1's prompt + response + observations[i-1], unless i is in `breaks`
    (then the history is rewritten: a fresh prompt that is not an extension)."""
    turns, prompt = [], [1, 2, 3]
    for i, response in enumerate(responses):
        if i > 0:
            prev = turns[-1]
            prompt = (
                [900 + i]
                if i in breaks
                else (prev.prompt_ids + prev.response_ids).tolist() + observations[i - 1]
            )
        logprobs = [-0.1 * (i + 1) - 0.01 * k for k in range(len(response))]  # distinct per token
        turns.append(
            Sample(
                prompt_ids=prompt,
                response_ids=response,
                logprobs=logprobs,
                loss_mask=[1] * len(response),
                group_id=group_id,
                trajectory_id=trajectory_id,
                turn=i,
                reward=float(i),
                finish_reason=f"stop{i}",
                weight_version=10 + i,
            )
        )
    return turns


RESPONSES = [[10, 11], [20, 21, 22], [30]]
OBSERVATIONS = [[50, 51], [60]]


def test_sample_per_token_fields_become_typed_arrays():
    """A Sample stores its per-token fields as typed arrays (int ids, float log-probs, byte
    masks) without copying arrays it is given, and refuses non-integer ids and negative masks."""
    s = Sample([1, 2], [3], [-0.5], [1], group_id=0)
    assert [
        (a.typecode, a.tolist()) for a in (s.prompt_ids, s.response_ids, s.logprobs, s.loss_mask)
    ] == [("i", [1, 2]), ("i", [3]), ("f", [-0.5]), ("B", [1])]
    # arrays are not copied
    assert Sample(s.prompt_ids, [], [], [], group_id=0).prompt_ids is s.prompt_ids
    with pytest.raises(TypeError):
        Sample([1.5], [], [], [], group_id=0)  # a token id must be an integer
    with pytest.raises(OverflowError):
        Sample([1], [3], [0.0], [-1], group_id=0)  # a mask is 0 or 1, never negative


def test_all_turns_merge():
    """Turns whose prompts extend the previous context merge into one sequence: the last turn's
    full context, with the observations masked out."""
    turns = make_turns(RESPONSES, OBSERVATIONS)
    (seq,), stats = merge_trajectory(turns, max_seq_len=100)
    assert seq.prompt_ids.tolist() == [1, 2, 3]
    assert seq.response_ids.tolist() == [10, 11, 50, 51, 20, 21, 22, 60, 30]
    assert seq.loss_mask.tolist() == [1, 1, 0, 0, 1, 1, 1, 0, 1]
    # The merged sequence is exactly the last turn's full context.
    assert seq.prompt_ids + seq.response_ids == turns[-1].prompt_ids + turns[-1].response_ids
    assert stats == MergeStats(
        turns=3, sequences_before=3, sequences_after=1, prefix_breaks=0, over_length=0
    )
    assert stats.merge_ratio == 3.0


def test_no_turns_merge():
    """When every later turn's prompt breaks the prefix, each turn stays a sequence of its own
    and each break is counted."""
    turns = make_turns(RESPONSES, OBSERVATIONS, breaks=frozenset({1, 2}))
    seqs, stats = merge_trajectory(turns, max_seq_len=100)
    assert [s.response_ids.tolist() for s in seqs] == RESPONSES
    assert [s.prompt_ids for s in seqs] == [t.prompt_ids for t in turns]
    assert (stats.sequences_after, stats.prefix_breaks, stats.merge_ratio) == (3, 2, 1.0)


def test_partial_merge_with_mismatch_in_the_middle():
    """A break in the middle closes the merged sequence; the next one starts from the rewritten
    prompt."""
    responses = [[10], [20], [30], [40]]
    turns = make_turns(responses, [[50], [60], [70]], breaks=frozenset({2}))
    seqs, stats = merge_trajectory(turns, max_seq_len=100)
    assert [s.response_ids.tolist() for s in seqs] == [[10, 50, 20], [30, 70, 40]]
    # the second sequence starts from the rewritten prompt
    assert seqs[1].prompt_ids.tolist() == [902]
    assert [s.turn for s in seqs] == [1, 3]
    assert (stats.sequences_after, stats.prefix_breaks) == (2, 1)


def test_response_mismatch_is_a_break():
    """A next prompt that re-tokenized the previous response differently is not a prefix: a
    break, two sequences."""
    turns = make_turns(RESPONSES[:2], OBSERVATIONS)
    turns[1] = dataclasses.replace(
        turns[1], prompt_ids=turns[0].prompt_ids.tolist() + [10, 99] + OBSERVATIONS[0]
    )
    seqs, stats = merge_trajectory(turns, max_seq_len=100)
    assert len(seqs) == 2 and stats.prefix_breaks == 1


def test_single_turn_passthrough():
    """A single turn comes back as an equal copy; the input is left untouched."""
    (turn,) = make_turns([[10, 11]], [])
    (seq,), stats = merge_trajectory([turn], max_seq_len=100)
    assert seq == turn and seq.response_ids is not turn.response_ids  # equal copy, input untouched
    assert stats == MergeStats(turns=1, sequences_before=1, sequences_after=1)


def test_per_token_alignment_and_observation_masking():
    """Random turns merge with every response token's log-prob and mask in place, and every
    observation token masked with log-prob 0."""
    rng = random.Random(0)
    responses = [[rng.randrange(1000) for _ in range(rng.randint(1, 6))] for _ in range(5)]
    observations = [[rng.randrange(1000) for _ in range(rng.randint(0, 4))] for _ in range(4)]
    turns = make_turns(responses, observations)
    (seq,), _ = merge_trajectory(turns, max_seq_len=1000)
    assert len(seq.response_ids) == len(seq.logprobs) == len(seq.loss_mask)
    pos = 0
    for i, turn in enumerate(turns):
        end = pos + len(turn.response_ids)
        assert seq.response_ids[pos:end] == turn.response_ids
        assert seq.logprobs[pos:end] == turn.logprobs
        assert seq.loss_mask[pos:end] == turn.loss_mask
        if i < len(observations):
            obs_end = end + len(observations[i])
            assert seq.response_ids[end:obs_end].tolist() == observations[i]
            assert seq.loss_mask[end:obs_end].tolist() == [0] * len(observations[i])
            assert seq.logprobs[end:obs_end].tolist() == [0.0] * len(observations[i])
            end = obs_end
        pos = end
    assert pos == len(seq.response_ids)


def test_scalar_fields_come_from_last_merged_turn():
    """A merged sequence takes turn, reward, finish reason and weight version from its last turn,
    and keeps its trajectory and group ids."""
    (seq,), _ = merge_trajectory(make_turns(RESPONSES, OBSERVATIONS), max_seq_len=100)
    assert (seq.turn, seq.reward, seq.finish_reason, seq.weight_version) == (2, 2.0, "stop2", 12)
    # credit: every sequence keeps its trajectory
    assert (seq.trajectory_id, seq.group_id) == (7, 3)


def test_validation_errors():
    """merge_trajectory refuses no turns, turns of two trajectories, turns out of order,
    per-token fields of unequal lengths and a max_seq_len of 0, each with a MergeError naming the
    problem."""
    turns = make_turns(RESPONSES, OBSERVATIONS)
    with pytest.raises(MergeError, match="no turns"):
        merge_trajectory([], max_seq_len=100)
    with pytest.raises(MergeError, match="mix trajectories"):
        merge_trajectory(
            [turns[0], make_turns(RESPONSES, OBSERVATIONS, trajectory_id=8)[1]], max_seq_len=100
        )
    with pytest.raises(MergeError, match="follows turn"):
        merge_trajectory([turns[1], turns[0]], max_seq_len=100)
    turns[1].logprobs = turns[1].logprobs[:-1]
    with pytest.raises(MergeError, match="lengths"):
        merge_trajectory(turns, max_seq_len=100)
    with pytest.raises(MergeError, match="lengths"):
        unmerged([turns])
    with pytest.raises(MergeError, match="max_seq_len"):
        merge_trajectory(turns[:1], max_seq_len=0)


def test_over_length_is_counted_and_not_truncated():
    """A merged sequence over max_seq_len warns and is counted, never truncated; exactly at the
    limit there is no warning."""
    turns = make_turns(RESPONSES, OBSERVATIONS)  # merged length 3 + 9 = 12
    with pytest.warns(UserWarning, match="exceed max_seq_len=10"):
        (seq,), stats = merge_trajectory(turns, max_seq_len=10)
    assert stats.over_length == 1 and len(seq.prompt_ids) + len(seq.response_ids) == 12
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exactly at the limit: no warning
        merge_trajectory(turns, max_seq_len=12)


def test_batch_sums_stats_and_unmerged_is_step_wise():
    """merge_batch sums its trajectories' statistics, and unmerged() returns every turn as a
    sequence of its own, in order."""
    batch = [
        make_turns(RESPONSES, OBSERVATIONS, trajectory_id=0),
        make_turns(RESPONSES, OBSERVATIONS, breaks=frozenset({1}), trajectory_id=1),
        make_turns([[5]], [], trajectory_id=2),
    ]
    seqs, stats = merge_batch(batch, max_seq_len=100)
    assert stats == MergeStats(
        turns=7, sequences_before=7, sequences_after=4, prefix_breaks=1, over_length=0
    )
    assert stats == sum((merge_trajectory(t, 100)[1] for t in batch), MergeStats())
    assert stats.merge_ratio == 7 / 4
    assert [s.trajectory_id for s in seqs] == [0, 1, 1, 2]
    flat = unmerged(batch)
    assert len(flat) == 7 and flat[3] is batch[1][0]


def token_mean(samples: list[Sample], per_token) -> float:
    """Token-mean loss aggregation: sum over trained tokens of per_token(context, token, logprob)
    / #trained."""
    total, count = 0.0, 0
    for s in samples:
        context = list(s.prompt_ids)
        for token, logprob, mask in zip(s.response_ids, s.logprobs, s.loss_mask):
            if mask:
                total += per_token(context, token, logprob)
                count += 1
            context.append(token)
    return total / count


def toy_causal_model(context: list[int], token: int, logprob: float) -> float:
    """A stand-in for a causal LM's per-token loss: depends on the whole context, like a real one
    would."""
    return logprob * (hash((tuple(context), token)) % 997) / 997


def random_trajectory(rng, trajectory_id, max_turns, vocab, response_lengths, break_prob):
    """A trajectory of 1..max_turns turns with random responses/observations; each later turn breaks
    the prefix with probability `break_prob`."""
    n = rng.randint(1, max_turns)
    responses = [
        [rng.randrange(vocab) for _ in range(rng.randint(*response_lengths))] for _ in range(n)
    ]
    observations = [[rng.randrange(vocab) for _ in range(rng.randint(0, 3))] for _ in range(n - 1)]
    breaks = frozenset(i for i in range(1, n) if rng.random() < break_prob)
    return make_turns(responses, observations, breaks, trajectory_id=trajectory_id)


@pytest.mark.parametrize("per_token", [lambda context, token, logprob: logprob, toy_causal_model])
def test_token_mean_loss_equal_merged_and_unmerged(per_token):
    """Merging keeps each trained token, its log-prob and its context, so random batches have the
    same token-mean loss merged and unmerged. (Sequence-mean aggregations differ: merging changes
    the number of sequences.)"""
    rng = random.Random(1)
    batch = [
        random_trajectory(
            rng, traj, max_turns=4, vocab=1000, response_lengths=(1, 5), break_prob=0.3
        )
        for traj in range(6)
    ]
    merged, stats = merge_batch(batch, max_seq_len=1000)
    assert stats.sequences_after < stats.sequences_before  # the batch really exercises merging
    assert token_mean(merged, per_token) == pytest.approx(
        token_mean(unmerged(batch), per_token), rel=1e-12
    )


def test_break_after_tentative_append_leaves_no_trace():
    """A re-templated history longer than the open sequence whose first token changed: the merger
    undoes the tail it appended, so the closed sequence is exactly the first turn."""
    turns = make_turns(RESPONSES[:2], OBSERVATIONS)
    turns[1] = dataclasses.replace(turns[1], prompt_ids=[99] + turns[1].prompt_ids[1:].tolist())
    first, second = merge_trajectory(turns, max_seq_len=100)[0]
    assert (first.prompt_ids, first.response_ids, first.logprobs, first.loss_mask) == (
        turns[0].prompt_ids,
        turns[0].response_ids,
        turns[0].logprobs,
        turns[0].loss_mask,
    )
    assert (second.prompt_ids, second.response_ids) == (turns[1].prompt_ids, turns[1].response_ids)


def reference_merge(turns: list[Sample]) -> list[tuple]:
    """The merge spelled out plainly on lists (slow): extend while prompt + response prefixes the
    next prompt."""
    sequences = []
    for turn in turns:
        prompt_ids, response_ids = turn.prompt_ids.tolist(), turn.response_ids.tolist()
        logprobs, loss_mask = turn.logprobs.tolist(), turn.loss_mask.tolist()
        if sequences:
            prompt, response, merged_logprobs, mask, _ = sequences[-1]
            context = prompt + response
            if prompt_ids[: len(context)] == context:
                observation = prompt_ids[len(context) :]
                sequences[-1] = (
                    prompt,
                    response + observation + response_ids,
                    merged_logprobs + [0.0] * len(observation) + logprobs,
                    mask + [0] * len(observation) + loss_mask,
                    turn.turn,
                )
                continue
        sequences.append((prompt_ids, response_ids, logprobs, loss_mask, turn.turn))
    return sequences


def test_parity_with_reference_merge():
    """On 200 random trajectories, some with a rewritten or truncated history, merge_batch gives
    exactly what a plain list-based merge gives, breaks included."""
    rng = random.Random(2)
    batch = []
    for traj in range(200):
        turns = random_trajectory(
            rng, traj, max_turns=5, vocab=50, response_lengths=(0, 4), break_prob=0.2
        )
        for i, t in enumerate(turns[1:], start=1):
            # a rewritten token somewhere in the history, or a truncated history
            if rng.random() < 0.1:
                truncated = t.prompt_ids[: rng.randrange(len(t.prompt_ids) + 1)].tolist()
                turns[i] = dataclasses.replace(t, prompt_ids=truncated + [999])
        batch.append(turns)
    merged, stats = merge_batch(batch, max_seq_len=1000)
    expected = [s for turns in batch for s in reference_merge(turns)]
    assert [
        (
            s.prompt_ids.tolist(),
            s.response_ids.tolist(),
            s.logprobs.tolist(),
            s.loss_mask.tolist(),
            s.turn,
        )
        for s in merged
    ] == expected
    assert stats.prefix_breaks == len(expected) - len(batch) > 0


def test_merge_bench_reports_that_merging_trains_fewer_tokens():
    """bench/merge.py on a small synthetic batch (no engine) ends with the line issue 5 checks,
    in which merged 5-turn trajectories train fewer tokens than unmerged ones."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [
            sys.executable,
            "bench/merge.py",
            "--trajectories",
            "16",
            "--repeats",
            "1",
            "--demo-steps",
            "0",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    match = re.fullmatch(
        r"merge: trajectories=16 turns=5 ms=[\d.]+ ms_2x=[\d.]+ ms_4x=[\d.]+ "
        r"tokens_merged=(\d+) tokens_unmerged=(\d+)",
        out.strip().splitlines()[-1],
    )
    assert match, out
    assert 0 < int(match[1]) < int(match[2])  # 5-turn trajectories: merging trains fewer tokens


def test_mask_truncated_masks_a_cut_trajectory_whole_merged_or_not(tmp_path):
    """train.mask_truncated (DAPO's overlong filtering) leaves out every sequence of a trajectory
    whose last turn was cut at the budget ("length"), earlier turns too, whether its turns are
    merged into one sequence or trained one by one; a finished trajectory stays whole."""
    import merge
    from assemble import load_config

    cut = make_turns(RESPONSES, OBSERVATIONS, trajectory_id=0)
    finished = make_turns(RESPONSES, OBSERVATIONS, trajectory_id=1)
    for turns, last in ((cut, "length"), (finished, "stop")):
        for t in turns:
            t.finish_reason = "stop"  # the earlier turns ended in a tool call
        turns[-1].finish_reason = last
    base = [f"run.out={tmp_path}", "data.task=tiny_tool", "rollout.max_turns=3"]
    for merge_turns in ("true", "false"):
        sets = base + [f"rollout.merge_turns={merge_turns}"]
        kept, _ = merge.training_sequences([cut, finished], load_config(None, sets), 256)
        assert {s.trajectory_id for s in kept} == {0, 1}
        sets += ["train.mask_truncated=true"]
        kept, metrics = merge.training_sequences([cut, finished], load_config(None, sets), 256)
        assert {s.trajectory_id for s in kept} == {1}, merge_turns
        assert metrics["train/truncated_masked"].value == (1 if merge_turns == "true" else 3)


def test_an_over_long_trajectory_is_dropped_whole_merged_or_not(tmp_path):
    """One sequence over the model's length drops its trajectory whole, as merging does: trained
    turn by turn (rollout.merge_turns false), the tool call's turn trained on with the advantage
    of the answer that was dropped. Counted and warned alike."""
    import merge
    from assemble import load_config

    long = make_turns(RESPONSES, OBSERVATIONS, trajectory_id=0)
    short = make_turns(RESPONSES[:1], [], trajectory_id=1)
    last = long[-1]
    max_seq_len = len(last.prompt_ids) + len(last.response_ids) - 1  # the last turn only is over
    assert all(len(t.prompt_ids) + len(t.response_ids) <= max_seq_len for t in long[:-1])
    base = [f"run.out={tmp_path}", "data.task=tiny_tool", "rollout.max_turns=3"]
    for merge_turns in ("true", "false"):
        cfg = load_config(None, base + [f"rollout.merge_turns={merge_turns}"])
        with pytest.warns(UserWarning, match="exceed max_seq_len"):
            kept, metrics = merge.training_sequences([long, short], cfg, max_seq_len)
        assert {s.trajectory_id for s in kept} == {1}, merge_turns
        dropped = 1 if merge_turns == "true" else len(long)
        assert metrics["merge/over_length_dropped"].value == dropped
        # dropped for its length, not masked as cut at the budget
        assert metrics["train/truncated_masked"].value == 0


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_a_mean_over_sequences_needs_each_trajectory_in_one(tmp_path, loss_agg):
    """GRPO's sequence is the trajectory: every train.loss_agg but token-mean averages over
    sequences, so a trajectory trained as two (its turns unmerged, or a turn whose prompt does not
    extend the tokens before it) would count twice, and a many-turn one weigh more. Turns
    unmerged are refused at load; a prefix break at the merge is a MergeError naming the
    trajectory; token-mean trains both layouts, the break as two sequences."""
    import merge
    from assemble import load_config
    from config import ConfigError

    base = [f"run.out={tmp_path}", "data.task=tiny_tool", "rollout.max_turns=3"]
    with pytest.raises(ConfigError, match=f"merge_turns=false with train.loss_agg={loss_agg}"):
        load_config(None, base + ["rollout.merge_turns=false", f"train.loss_agg={loss_agg}"])
    load_config(None, base + ["rollout.merge_turns=false"])  # token-mean: any layout
    whole = make_turns(RESPONSES, OBSERVATIONS, trajectory_id=0)
    broken = make_turns(RESPONSES, OBSERVATIONS, breaks=frozenset({2}), trajectory_id=1)
    cfg = load_config(None, base + [f"train.loss_agg={loss_agg}"])
    kept, _ = merge.training_sequences([whole], cfg, 256)
    assert len(kept) == 1
    with pytest.raises(merge.MergeError, match="trajectory 1 trains as 2 sequences"):
        merge.training_sequences([whole, broken], cfg, 256)
    kept, metrics = merge.training_sequences([whole, broken], load_config(None, base), 256)
    assert [s.trajectory_id for s in kept] == [0, 1, 1]
    assert metrics["merge/prefix_breaks"].value == 1
