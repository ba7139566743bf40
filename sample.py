"""The records every stage passes on: a prompt, and a sample (engine output: tokens, log-probs,
versions, flags; its reward and advantage) for one sequence or one turn, as the stages read it.

Owns the records' fields and their storage (typed arrays per token), and grouping turns into
trajectories and trajectories into groups. Does not own how samples are made (inflight.py), scored
(rewards.py), merged (merge.py) or trained on (update.py).
"""

import array
import dataclasses

# Per-token fields are typed arrays, not lists: 4 bytes a token (a list holds an 8-byte pointer to a
# 28-byte int), copied and compared at memcpy speed, and invisible to the garbage collector.
# merge.py depends on it.
PER_TOKEN_TYPECODES = {
    "prompt_ids": "i",
    "response_ids": "i",
    "logprobs": "f",
    "loss_mask": "B",
    "versions": "i",
}
NOT_GENERATED = -1  # the `versions` entry of a token no policy sampled (a tool observation)


@dataclasses.dataclass
class Prompt:
    prompt_ids: list[int]
    # what the reward compares against: tiny: the count N; gsm8k: the gold number; chat: the row's
    # answer
    answer: str


@dataclasses.dataclass
class Sample:
    """One generated sequence (or one turn of a multi-turn trajectory), as the trainer sees it.
    Per-token fields given as lists are converted to arrays (a float token id or a negative mask
    raises)."""

    prompt_ids: array.array  # int32: tokens the engine was given
    # int32: tokens the engine produced (plus tool observations once merged)
    response_ids: array.array
    # float32: engine log-prob per response token (0.0 on observation tokens)
    logprobs: array.array
    # uint8 per response token: 1 = trained, 0 = observation / not trained
    loss_mask: array.array
    group_id: int  # index of the prompt this sample answers (GRPO group)
    trajectory_id: int = 0  # multi-turn: turns of one trajectory share this id
    turn: int = 0  # multi-turn: index of the turn inside its trajectory
    # "stop" | "length" | "abort" | "error" (in the engine) | "reward_error" (its reward failed) |
    # "dropped" (finished, in a group a cancel policy's keep_groups left out)
    finish_reason: str = "stop"
    # masked out of the loss and of reward means: cancelled before finishing ("abort"), failed in
    # the engine ("error"), its reward failed ("reward_error"), or finished but dropped with its
    # group ("dropped"); finish_reason says which, and rollout/aborted counts only the first
    masked: bool = False
    weight_version: int = 0  # policy version that generated the tokens
    reward: float = 0.0
    # the trajectory's advantage (advantages.py), carried by every turn and merged sequence
    advantage: float = 0.0
    latency_s: float = 0.0  # launch -> returned
    # int32 per response token: the weight version that sampled it. A sample resumed across steps
    # (partial rollout, partial.py) mixes versions; left empty, every token gets `weight_version`.
    versions: array.array = dataclasses.field(default_factory=lambda: array.array("i"))
    # partial rollout: steps this sample was continued in after a cancellation, and times it was
    # restarted from its prompt (partial.py: a sample restarts once at most)
    times_resumed: int = 0
    times_restarted: int = 0
    # multi-turn: 1 = this turn ended in a well-formed tool call (the tool ran, whatever it
    # returned), -1 = a malformed one
    tool_call: int = 0
    # routing replay (train.routing_replay, runtime/routing.py): int16, the experts the engine
    # routed each token to, [tokens - 1, layers, top-k] flattened (it computes every token but the
    # last). A continuation's, or a merged sequence's last turn's, covers the whole sequence: its
    # prompt held everything before (a continuation's: prefilled under the newer weights)
    routed_experts: array.array = dataclasses.field(default_factory=lambda: array.array("h"))

    def __post_init__(self):
        for name, typecode in PER_TOKEN_TYPECODES.items():
            value = getattr(self, name)
            if not (isinstance(value, array.array) and value.typecode == typecode):
                setattr(self, name, array.array(typecode, value))
        routes = self.routed_experts
        if not (isinstance(routes, array.array) and routes.typecode == "h"):
            self.routed_experts = array.array("h")
            if isinstance(routes, bytes):  # as `to_state` writes them
                self.routed_experts.frombytes(routes)
            elif routes is not None:
                self.routed_experts.fromlist(list(routes))
        if not self.versions and self.response_ids:
            self.versions = array.array("i", [self.weight_version]) * len(self.response_ids)

    def overlong_filtered(self, mask_truncated):
        """Whether this last turn's trajectory is left out of training by DAPO's overlong
        filtering (train.mask_truncated): cut at the token budget. It stays in its group's
        statistics; merge.training_sequences drops it, and what counts the trained batch
        (dynamic sampling's keep rule, the logged rewards, the overlong penalty) leaves it out."""
        return mask_truncated and self.finish_reason == "length"

    def prompt_key(self):
        """What samples computing their prompt once (train.shared_prefix) must have in common:
        its tokens and, with routing replay, the experts the engine routed them to (computed
        once, they are replayed once; a held group's member resumed under newer weights was
        prefilled, so routed, under those: update.route_table gave it another's)."""
        tokens = len(self.prompt_ids) + len(self.response_ids) - 1  # the routed ones
        width = len(self.routed_experts) // tokens if tokens > 0 else 0
        prompt_routes = self.routed_experts[: (len(self.prompt_ids) - 1) * width]
        return self.prompt_ids.tobytes(), prompt_routes.tobytes()

    def continued_by(self, more):
        """This unfinished sample followed by `more`, which the engine generated from prompt +
        this response: one sample holding every token with its own log-prob and version. The
        group and the restart count are this sample's (the resume count goes up by one); the other
        scalars (finish reason, version, trajectory id, latency) and the routed experts (which
        cover the whole sequence) are the continuation's. Token ids are concatenated, never
        re-tokenised."""
        return dataclasses.replace(
            more,
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids + more.response_ids,
            logprobs=self.logprobs + more.logprobs,
            loss_mask=self.loss_mask + more.loss_mask,
            versions=self.versions + more.versions,
            group_id=self.group_id,
            times_resumed=self.times_resumed + 1,
            times_restarted=self.times_restarted,
        )

    def to_state(self):
        """Plain lists and values (what `torch.load(weights_only=True)` reads back);
        `Sample.from_state` inverts it."""
        state = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "routed_experts":
                # layers x top-k numbers a token: as bytes, and none as None (empty bytes pickle as
                # a call of `bytes`, which weights_only refuses)
                state[field.name] = value.tobytes() or None
            else:
                state[field.name] = value.tolist() if isinstance(value, array.array) else value
        return state

    @classmethod
    def from_state(cls, state):
        """The Sample `to_state` wrote, also one written before `masked` had that name (a partial
        rollout buffer in an older checkpoint, an older replay dump: resumed, not refused)."""
        state = dict(state)
        if "is_aborted" in state:
            state["masked"] = state.pop("is_aborted")
        return cls(**state)


def trajectories_of(samples: list[Sample]) -> list[list[Sample]]:
    """Samples (turns) as trajectories: lists of turns in turn order, ordered by trajectory_id
    (a rollout's launch order). The one place turns are grouped into trajectories."""
    trajectories = {}
    for s in samples:
        trajectories.setdefault(s.trajectory_id, []).append(s)
    return [trajectories[i] for i in sorted(trajectories)]


def groups_of(trajectories: list[list[Sample]]) -> list[list[list[Sample]]]:
    """Trajectories of one rollout as GRPO groups (lists of trajectories sharing a group_id), in
    order of first appearance. Groups that span steps (partial rollout) come from partial.py."""
    groups = {}
    for turns in trajectories:
        groups.setdefault(turns[-1].group_id, []).append(turns)
    return list(groups.values())
