"""Stage 3 of the step, training sequences: folds the step-wise turns of a tool-using trajectory
into as few sequences as possible (multi-turn merging), and chooses what the trainer trains on
(`training_sequences`).

Owns the prefix check, the per-token bookkeeping (tool observations get loss_mask 0, logprob 0.0),
the merge statistics, and which sequences train: finished ones within the model's length, each with
its trajectory's advantage (over-long and, with DAPO's overlong filtering, truncated ones are
dropped, counted). Does not tokenize, score or compute advantages. The idea follows SkyRL PR 1532
(prefix-aware merging); the code is our own. Speed comes from the per-token arrays (sample.Sample):
every copy and prefix compare below is a memcpy/memcmp.
"""

import array
import dataclasses
import warnings

from config import ConfigError, refuse_unread
from metrics import ratio, summed
from sample import NOT_GENERATED, PER_TOKEN_TYPECODES, Sample

# What a merged sequence takes from the last turn it merged: every field but the per-token arrays
# (PER_TOKEN_TYPECODES), the routing replay's `routed_experts` included: the last turn's cover
# the whole merged sequence
LAST_TURN_FIELDS = tuple(
    f.name for f in dataclasses.fields(Sample) if f.name not in PER_TOKEN_TYPECODES
)

# config.refuse_unread's table: merging has turns to merge only with tools' turns
READ_WHEN = {
    "rollout.merge_turns": (lambda cfg: cfg.rollout.max_turns > 1, "with rollout.max_turns > 1"),
}


def check(cfg):
    """rollout.merge_turns set where a trajectory is one turn is refused (assemble.load_config
    calls this at load), and so is a sequence-level loss over turns (`sequence_level_loss`)."""
    refuse_unread(cfg, READ_WHEN)
    if cfg.rollout.max_turns > 1 and not cfg.rollout.merge_turns and sequence_level_loss(cfg):
        raise ConfigError(
            f"rollout.merge_turns=false with train.loss_agg={cfg.train.loss_agg}: each turn would "
            "train as a sequence of its own and count as one in the loss's mean over sequences "
            "(GRPO's sequence is the trajectory): merge the turns, or use train.loss_agg=token-mean"
        )


def sequence_level_loss(cfg):
    """Whether the loss averages over sequences, so needs each trajectory in one: every
    train.loss_agg but token-mean (GSPO's ratio is one per sequence too). A trajectory in two
    rows would count twice; token-mean sums tokens, wherever they are."""
    return cfg.train.loss_agg != "token-mean"


# one observation token's entries: not sampled by the policy, not trained
NO_LOGPROB = array.array("f", [0.0])
NOT_TRAINED = array.array("B", [0])
NO_VERSION = array.array("i", [NOT_GENERATED])


class MergeError(ValueError):
    """The turns handed to the merger do not form one well-formed trajectory."""


@dataclasses.dataclass
class MergeStats:
    turns: int = 0  # turns seen, over all trajectories
    sequences_before: int = 0  # step-wise sequences (one per turn, so equal to `turns`)
    sequences_after: int = 0  # sequences after merging
    prefix_breaks: int = 0  # times a turn's prompt did not extend the previous sequence
    over_length: int = 0  # merged sequences longer than max_seq_len (returned, not truncated)

    @property
    def merge_ratio(self) -> float:
        """Step-wise sequences per merged sequence; 1.0 means nothing merged (or nothing to
        merge)."""
        return self.sequences_before / self.sequences_after if self.sequences_after else 1.0

    def __add__(self, other: "MergeStats") -> "MergeStats":
        # Field by field; dataclasses.astuple deep-copies and was the slowest line of merge_batch.
        return MergeStats(
            **{
                f.name: getattr(self, f.name) + getattr(other, f.name)
                for f in dataclasses.fields(self)
            }
        )


def _validate(turns: list[Sample]) -> None:
    """Raise MergeError unless `turns` are the in-order turns of one trajectory with aligned
    per-token arrays."""
    if not turns:
        raise MergeError("trajectory has no turns")
    prev = None
    for t in turns:  # one pass: this runs for every turn of every step
        if prev is not None and t.trajectory_id != prev.trajectory_id:
            raise MergeError(f"turns mix trajectories {prev.trajectory_id} and {t.trajectory_id}")
        if prev is not None and t.turn <= prev.turn:
            raise MergeError(
                f"trajectory {t.trajectory_id}: turn {t.turn} follows turn {prev.turn}"
            )
        if not len(t.response_ids) == len(t.logprobs) == len(t.loss_mask) == len(t.versions):
            lengths = (len(t.response_ids), len(t.logprobs), len(t.loss_mask), len(t.versions))
            raise MergeError(
                f"trajectory {t.trajectory_id} turn {t.turn}: "
                "response_ids/logprobs/loss_mask/versions "
                f"lengths {lengths} differ"
            )
        prev = t


def _merge_run(turns: list[Sample], start: int) -> tuple[Sample, int]:
    """Merge turns[start], turns[start + 1], ... while each turn's prompt extends the sequence
    built so far. Returns the merged sequence and the index of the first turn it did not take (a
    prefix break, or the end)."""
    first = turns[start]
    # the sequence so far: prompt, then response (a copy)
    context = first.prompt_ids + first.response_ids
    logprobs = first.logprobs[:]
    mask = first.loss_mask[:]
    versions = first.versions[:]
    end = start + 1
    for turn in turns[start + 1 :]:
        # The turn extends the sequence iff its prompt = context + something (tool output, template
        # glue). Append that something, then compare whole arrays: one typed C loop, no prefix copy.
        seen = len(context)
        context += turn.prompt_ids[seen:]
        if context != turn.prompt_ids:
            # History was rewritten (truncated, re-templated): this turn is trained on its own
            # context.
            del context[seen:]  # undo the tentative append
            break
        num_observation = len(context) - seen
        context += turn.response_ids
        # observation tokens were not sampled by the policy ...
        logprobs += NO_LOGPROB * num_observation
        logprobs += turn.logprobs
        mask += NOT_TRAINED * num_observation  # ... and are not trained
        mask += turn.loss_mask
        versions += NO_VERSION * num_observation
        versions += turn.versions
        end += 1
    split = len(first.prompt_ids)
    prompt = context[:split]
    del context[:split]  # what is left is the response: moved down in place
    # Per-turn scalars (reward, finish_reason, weight_version, ...) come from the last merged turn;
    # trajectory_id/group_id are shared by all turns, so each sequence keeps its trajectory's
    # credit.
    last = turns[end - 1]  # built directly: dataclasses.replace costs twice as much
    return (
        Sample(
            prompt_ids=prompt,
            response_ids=context,
            logprobs=logprobs,
            loss_mask=mask,
            versions=versions,
            **{name: getattr(last, name) for name in LAST_TURN_FIELDS},
        ),
        end,
    )


def _merge_into(
    turns: list[Sample], max_seq_len: int, sequences: list[Sample], stats: MergeStats
) -> None:
    """Merge one trajectory's turns: append its sequences to `sequences` and add its counts to
    `stats`."""
    if max_seq_len <= 0:
        raise MergeError(f"max_seq_len must be positive, got {max_seq_len}")
    _validate(turns)
    stats.turns += len(turns)
    stats.sequences_before += len(turns)
    start = 0
    while start < len(turns):
        # a sequence that does not start at turn 0 starts at a prefix break
        stats.prefix_breaks += start > 0
        sequence, start = _merge_run(turns, start)
        sequences.append(sequence)
        stats.sequences_after += 1
        stats.over_length += len(sequence.prompt_ids) + len(sequence.response_ids) > max_seq_len


def _warn_over_length(stats: MergeStats, max_seq_len: int) -> None:
    if stats.over_length:
        warnings.warn(
            f"{stats.over_length} sequence(s) exceed max_seq_len={max_seq_len}; returned "
            f"untruncated, training_sequences drops their trajectories (counted)",
            stacklevel=3,
        )


def merge_trajectory(turns: list[Sample], max_seq_len: int) -> tuple[list[Sample], MergeStats]:
    """Greedily merge consecutive turns of one trajectory while each sequence is a prefix of the
    next prompt.

    Every returned sequence keeps its trajectory's trajectory_id and group_id, so the trainer must
    give each one the trajectory's advantage. (Known bug elsewhere: step-wise training gave the
    advantage only to the last step, so earlier steps of a trajectory were never credited.)
    """
    sequences, stats = [], MergeStats()
    _merge_into(turns, max_seq_len, sequences, stats)
    _warn_over_length(stats, max_seq_len)
    return sequences, stats


def merge_each(
    trajectories: list[list[Sample]], max_seq_len: int
) -> tuple[list[list[Sample]], MergeStats]:
    """merge_trajectory over a batch: each trajectory's sequences, in a list aligned with
    `trajectories`, each sequence carrying its trajectory's advantage (LAST_TURN_FIELDS); one
    warning for the whole batch if any sequence is over length."""
    per_trajectory, stats = [], MergeStats()
    for turns in trajectories:
        sequences = []
        _merge_into(turns, max_seq_len, sequences, stats)
        per_trajectory.append(sequences)
    _warn_over_length(stats, max_seq_len)
    return per_trajectory, stats


def merge_batch(
    trajectories: list[list[Sample]], max_seq_len: int
) -> tuple[list[Sample], MergeStats]:
    """merge_each, flattened: every merged sequence of the batch."""
    per_trajectory, stats = merge_each(trajectories, max_seq_len)
    return [s for sequences in per_trajectory for s in sequences], stats


def unmerged(trajectories: list[list[Sample]]) -> list[Sample]:
    """The step-wise path (`merge_turns: false`): every turn is its own sequence, validated the
    same way."""
    for turns in trajectories:
        _validate(turns)
    return [turn for turns in trajectories for turn in turns]


# ---------------------------------------------------------------- what the trainer trains on
def training_sequences(trajectories, cfg, max_seq_len):
    """Stage 3 of the step: the sequences to train on, merged turns (or one per turn) of finished
    trajectories, each carrying its *trajectory's* advantage (set on every turn by
    advantages.compute). Over-long ones are dropped and counted, and with
    `train.mask_truncated` (DAPO's overlong filtering) the ones cut at the budget. Without
    `rollout.merge_turns`, or with one-turn trajectories (`rollout.max_turns` 1, the default:
    nothing to merge), every turn is its own sequence. Returns (sequences, metrics)."""
    merge_turns = cfg.rollout.merge_turns and cfg.rollout.max_turns > 1  # as READ_WHEN says
    mask_truncated = cfg.train.mask_truncated
    if merge_turns:
        per_trajectory, stats = merge_each(trajectories, max_seq_len)
    else:
        per_trajectory = [unmerged([turns]) for turns in trajectories]  # validated
        num_turns = sum(len(turns) for turns in trajectories)
        stats = MergeStats(turns=num_turns, sequences_before=num_turns, sequences_after=num_turns)
        stats.over_length = sum(
            len(s.prompt_ids) + len(s.response_ids) > max_seq_len
            for turns in trajectories
            for s in turns
        )
        _warn_over_length(stats, max_seq_len)
    sequences = []
    num_finished = 0
    num_fitting = 0
    for turns, candidates in zip(trajectories, per_trajectory):
        # Cancelled and failed rows train nothing (all-zero loss mask, no advantage) but would
        # still cost the old-log-prob pass, the forward and the backward, and they are the
        # longest rows: they stop here.
        finished = [s for s in candidates if not s.masked]
        num_finished += len(finished)
        # a trajectory trains whole or not at all, merged or not: with one sequence over the
        # model's length, or cut at the budget (train.mask_truncated), its others go too (they
        # carry the advantage of the answer that is not trained)
        if any(len(s.prompt_ids) + len(s.response_ids) > max_seq_len for s in finished):
            continue
        num_fitting += len(finished)
        if turns[-1].overlong_filtered(mask_truncated):
            continue
        if len(finished) > 1 and merge_turns and sequence_level_loss(cfg):
            # a turn that does not extend the tokens before it (a tool loop of your own that
            # re-renders the history) starts a second sequence: refused, not counted twice
            raise MergeError(
                f"trajectory {turns[0].trajectory_id} trains as {len(finished)} sequences (a "
                f"turn's prompt does not extend the tokens before it), which train.loss_agg="
                f"{cfg.train.loss_agg} would count as {len(finished)}: keep each turn's prompt "
                "the earlier tokens plus the observation (tools.multi_turn does), or use "
                "train.loss_agg=token-mean"
            )
        sequences += finished
    metrics = {
        "merge/sequences_before": summed(stats.sequences_before),
        "merge/sequences_after": summed(stats.sequences_after),
        "merge/ratio": ratio(stats.sequences_before, stats.sequences_after),  # none: left out
        "merge/prefix_breaks": summed(stats.prefix_breaks),
        "train/truncated_masked": summed(num_fitting - len(sequences)),
        "merge/over_length_dropped": summed(num_finished - num_fitting),
    }
    return sequences, metrics
