"""The per-sample record every stage passes on: engine output (tokens, log-probs, versions, flags) for one
sequence or one turn, as the trainer, the merger and the metrics read it.

Owns the record's fields and their storage (typed arrays per token). Does not own how samples are made
(rollout.py), merged (merge.py) or trained on (train.py).
"""
import array
import dataclasses

# Per-token fields are typed arrays, not lists: 4 bytes a token (a list holds an 8-byte pointer to a 28-byte
# int), copied and compared at memcpy speed, and invisible to the garbage collector. merge.py depends on it.
PER_TOKEN_TYPECODES = {"prompt_ids": "i", "response_ids": "i", "logprobs": "f", "loss_mask": "B"}


@dataclasses.dataclass
class Sample:
    """One generated sequence (or one turn of a multi-turn trajectory), as the trainer sees it.
    Per-token fields given as lists are converted to arrays (a float token id or a negative mask raises)."""
    prompt_ids: array.array      # int32: tokens the engine was given
    response_ids: array.array    # int32: tokens the engine produced (plus tool observations once merged)
    logprobs: array.array        # float32: engine log-prob per response token (0.0 on observation tokens)
    loss_mask: array.array       # uint8 per response token: 1 = trained, 0 = observation / not trained
    group_id: int                # index of the prompt this sample answers (GRPO group)
    trajectory_id: int = 0       # multi-turn: turns of one trajectory share this id
    turn: int = 0                # multi-turn: index of the turn inside its trajectory
    finish_reason: str = "stop"  # "stop" | "length" | "abort" | "error"
    is_aborted: bool = False     # cancelled before finishing: masked out of loss and reward means
    weight_version: int = 0      # policy version that generated the tokens
    reward: float = 0.0
    latency_s: float = 0.0       # launch -> returned

    def __post_init__(self):
        for name, typecode in PER_TOKEN_TYPECODES.items():
            value = getattr(self, name)
            if not (isinstance(value, array.array) and value.typecode == typecode):
                setattr(self, name, array.array(typecode, value))
