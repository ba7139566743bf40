"""Multi-turn merging: folds the step-wise turns of a tool-using trajectory into as few sequences as possible.

Owns the prefix check, the per-token bookkeeping (tool observations get loss_mask 0, logprob 0.0) and the
merge statistics. Does not tokenize, score, compute advantages, or drop over-length sequences: the trainer
drops those, counted. The idea follows SkyRL PR 1532 (prefix-aware merging); the code is our own.
"""
import contextlib
import dataclasses
import gc
import warnings

from rollout import Sample


class MergeError(ValueError):
    """The turns handed to the merger do not form one well-formed trajectory."""


@dataclasses.dataclass
class MergeStats:
    turns: int = 0              # turns seen, over all trajectories
    sequences_before: int = 0   # step-wise sequences (one per turn, so equal to `turns`)
    sequences_after: int = 0    # sequences after merging
    prefix_breaks: int = 0      # times a turn's prompt did not extend the previous sequence
    over_length: int = 0        # merged sequences longer than max_seq_len (returned, not truncated)

    @property
    def merge_ratio(self) -> float:
        """Step-wise sequences per merged sequence; 1.0 means nothing merged (or nothing to merge)."""
        return self.sequences_before / self.sequences_after if self.sequences_after else 1.0

    def __add__(self, other: "MergeStats") -> "MergeStats":
        # Field by field; dataclasses.astuple deep-copies. (merge_batch adds in place instead: cheaper still.)
        return MergeStats(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                             for f in dataclasses.fields(self)})


@contextlib.contextmanager
def _gc_paused():
    """Pause the cyclic garbage collector, then restore its previous state.

    Merging allocates only acyclic objects (lists of ints/floats, Samples): reference counting frees all
    of them, so the collector has nothing to find, yet with it on it walked every slot of every growing
    token list, again and again (~1/3 of merge_batch's time). The output is walked once, by the first
    collection after we return, as any new object would be.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _validate(turns: list[Sample]) -> None:
    """Raise MergeError unless `turns` are the in-order turns of one trajectory with aligned per-token lists."""
    if not turns:
        raise MergeError("trajectory has no turns")
    for prev, cur in zip(turns, turns[1:]):
        if cur.trajectory_id != prev.trajectory_id:
            raise MergeError(f"turns mix trajectories {prev.trajectory_id} and {cur.trajectory_id}")
        if cur.turn <= prev.turn:
            raise MergeError(f"trajectory {cur.trajectory_id}: turn {cur.turn} follows turn {prev.turn}")
    for t in turns:
        if not len(t.response_ids) == len(t.logprobs) == len(t.loss_mask):  # no tuple/set: runs per turn
            lengths = (len(t.response_ids), len(t.logprobs), len(t.loss_mask))
            raise MergeError(f"trajectory {t.trajectory_id} turn {t.turn}: response_ids/logprobs/loss_mask "
                             f"lengths {lengths} differ")


def _extends(prompt: list[int], response: list[int], next_prompt: list[int]) -> bool:
    """True if prompt + response is a token prefix of next_prompt; two slice compares, no concatenation.

    This is the merge's main cost: one pass over every token of every prompt. Token-in-token-out prompts
    share int objects with the previous turn, so list == mostly takes CPython's identity shortcut.
    """
    split, end = len(prompt), len(prompt) + len(response)
    return len(next_prompt) >= end and next_prompt[:split] == prompt and next_prompt[split:end] == response


def _merge_into(turns: list[Sample], max_seq_len: int, sequences: list[Sample], stats: MergeStats) -> None:
    """Append the merged sequences of one trajectory to `sequences` and add its counts to `stats`."""
    if max_seq_len <= 0:
        raise MergeError(f"max_seq_len must be positive, got {max_seq_len}")
    _validate(turns)
    stats.turns += len(turns)
    stats.sequences_before += len(turns)
    first = turns[0]
    # The open sequence: its prompt, and per-token lists that grow by extend (linear in total length).
    prompt = list(first.prompt_ids)
    response, logprobs, mask = list(first.response_ids), list(first.logprobs), list(first.loss_mask)
    last = first

    def close() -> None:
        # Per-turn scalars (reward, finish_reason, weight_version, ...) come from the last merged turn;
        # trajectory_id/group_id are shared by all turns, so each sequence keeps its trajectory's credit.
        sequences.append(dataclasses.replace(last, prompt_ids=prompt, response_ids=response,
                                             logprobs=logprobs, loss_mask=mask))
        stats.sequences_after += 1
        stats.over_length += len(prompt) + len(response) > max_seq_len

    for turn in turns[1:]:
        if _extends(prompt, response, turn.prompt_ids):
            observation = turn.prompt_ids[len(prompt) + len(response):]  # tool output + chat template glue
            response += observation
            response += turn.response_ids
            logprobs += [0.0] * len(observation)  # not sampled by the policy: no logprob, not trained
            logprobs += turn.logprobs
            mask += [0] * len(observation)
            mask += turn.loss_mask
        else:
            # History was rewritten (truncated, re-templated): the turn must be trained on its own context.
            stats.prefix_breaks += 1
            close()
            prompt = list(turn.prompt_ids)
            response, logprobs, mask = list(turn.response_ids), list(turn.logprobs), list(turn.loss_mask)
        last = turn
    close()


def _warn_over_length(stats: MergeStats, max_seq_len: int) -> None:
    if stats.over_length:
        warnings.warn(f"{stats.over_length} merged sequence(s) exceed max_seq_len={max_seq_len}; "
                      f"returned untruncated, the trainer drops them (counted)", stacklevel=3)


def merge_trajectory(turns: list[Sample], max_seq_len: int) -> tuple[list[Sample], MergeStats]:
    """Greedily merge consecutive turns of one trajectory while each sequence is a prefix of the next prompt.

    Every returned sequence keeps its trajectory's trajectory_id and group_id, so the trainer must give each
    one the trajectory's advantage. (Known bug elsewhere: step-wise training gave the advantage only to the
    last step, so earlier steps of a trajectory were never credited.)
    """
    sequences, stats = [], MergeStats()
    with _gc_paused():
        _merge_into(turns, max_seq_len, sequences, stats)
    _warn_over_length(stats, max_seq_len)
    return sequences, stats


def merge_batch(trajectories: list[list[Sample]], max_seq_len: int) -> tuple[list[Sample], MergeStats]:
    """merge_trajectory over a batch; one warning for the whole batch if any sequence is over length."""
    sequences, stats = [], MergeStats()
    with _gc_paused():  # for the whole batch: pausing per trajectory would let a collection run in between
        for turns in trajectories:
            _merge_into(turns, max_seq_len, sequences, stats)
    _warn_over_length(stats, max_seq_len)
    return sequences, stats


def unmerged(trajectories: list[list[Sample]]) -> list[Sample]:
    """The step-wise path (`merge_turns: false`): every turn is its own sequence, validated the same way."""
    for turns in trajectories:
        _validate(turns)
    return [turn for turns in trajectories for turn in turns]
