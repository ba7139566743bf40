"""Partial rollout: samples a training rollout cancelled, kept and continued in later steps, and the
GRPO groups they hold back until every member has finished.

Owns what a training rollout launches when partial rollout is on (unfinished samples first, in the
order they were suspended, then new prompts up to the batch), the staleness rule (too old: restart
from the prompt, once; too old again: given up), when a group is complete, the counters, and the
buffer's checkpoint form. Does not own the engine (inflight.Rollout.continue_partial continues a
sample from its token ids) nor how old tokens are weighted or masked in the loss (update.py,
loss.py). Validation never comes here:
only rollout.collect uses this buffer.
"""

import dataclasses
import math

from metrics import length_stats, ratio, summed
import runtime.parallel as parallel
from sample import Prompt, Sample, trajectories_of

COUNTERS = (
    "launched",
    "suspended",
    "resumed",
    "restarts",
    "given_up",
    "wasted_tokens",
    "completed_groups",
)


@dataclasses.dataclass
class HeldGroup:
    """A prompt whose group is not complete: each member is a trajectory (its list of turns)."""

    prompt: Prompt
    members: list  # list[list[Sample]]; a member waiting in `PartialBuffer.waiting` ends "abort"


class PartialBuffer:
    """Unfinished samples and the groups they belong to, carried from one training rollout to the
    next.

    Each step: `launch` says which unfinished samples to continue (and restarts the stale ones) and
    which new prompts fill the batch; the engine generates; `collect` files every returned
    trajectory under its group, suspends the ones cancelled again, and hands back the groups now
    complete. A group is trained once, whole, when its slowest member has finished or been given up
    (`give_up`); a finished member is never regenerated. Single-turn samples only: with tools'
    turns partial rollout is refused at load (cancel.check).
    """

    def __init__(self, group_size, max_staleness, budget):
        # budget: the tokens a response may hold (rollout.max_trajectory_tokens)
        self.group_size = group_size
        self.max_staleness = max_staleness
        self.budget = budget
        self.groups = []  # HeldGroup, in arrival order
        # (group, member index) of unfinished single-turn samples, in suspension order
        self.waiting = []
        self._launched = []  # what this step's resumes were, in launch order (set by `launch`)
        self.resumed = {}  # group id -> HeldGroup of this step's resumes (set by `launch`)
        self.counters = dict.fromkeys(COUNTERS, 0)  # this step's; reset by `launch`
        self.suspended_lengths = []  # this step's suspended samples' tokens; reset by `launch`

    def new_prompts_needed(self, num_prompts):
        """How many new prompts fill a batch of `num_prompts` groups beside the unfinished
        samples."""
        return max(num_prompts - math.ceil(len(self.waiting) / self.group_size), 0)

    def launch(self, stream, num_prompts, version):
        """(unfinished samples to continue, new prompts to launch, the held groups' prompts) for
        a rollout under weight `version`; the new prompts are read from `stream`.

        Continued samples go first; new prompts fill the batch of `num_prompts` groups, so the
        launched request count stays about the same. A sample whose oldest token is more than
        `max_staleness` versions old is restarted from its prompt (an empty response), counted;
        so is one whose tokens already fill the budget (a run resumed with a smaller one). A
        restarted sample that grows too old again is given up (`give_up`). Group ids: the new
        prompts' are 0.., and each held group gets one after them, in the order of the held
        prompts returned, so the engine never mixes it with a fresh group and dynamic sampling
        judges it whole (`held_survivors`). The rollout's refills number on from there.
        """
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.suspended_lengths = []
        # first, so that new prompts take the places of the samples given up
        self.waiting = [
            (g, i) for g, i in self.waiting if not self.give_up(g.members[i][-1], version)
        ]
        new_prompts = stream.take(self.new_prompts_needed(num_prompts))
        resumes = []
        self.resumed = {}
        group_ids = {}  # id(held group) -> its group id this step
        for group, index in self.waiting:
            sample = group.members[index][-1]
            if self.too_old(sample, version) or len(sample.response_ids) >= self.budget:
                self.counters["restarts"] += 1
                self.counters["wasted_tokens"] += len(sample.response_ids)
                # unfinished, like the sample it replaces: should the rollout cancel it before
                # it is sent, it stays suspended, never an empty response taken as finished
                sample = Sample(
                    sample.prompt_ids,
                    [],
                    [],
                    [],
                    sample.group_id,
                    times_resumed=sample.times_resumed,
                    times_restarted=sample.times_restarted + 1,
                    finish_reason="abort",
                    masked=True,
                )
            else:
                self.counters["resumed"] += 1
            group_id = group_ids.setdefault(id(group), len(new_prompts) + len(group_ids))
            self.resumed[group_id] = group
            resumes.append(dataclasses.replace(sample, group_id=group_id))
        self._launched = self.waiting
        self.waiting = []
        return resumes, new_prompts, [group.prompt for group in self.resumed.values()]

    def too_old(self, sample, version):
        """Whether a waiting sample's oldest token is over `max_staleness` versions older than
        `version` (a restarted sample not yet sent holds none)."""
        return bool(sample.versions) and version - min(sample.versions) > self.max_staleness

    def give_up(self, sample, version):
        """Whether to give up a waiting sample (counted): one restarted already and too old again.
        It needs more rollouts than `max_staleness` allows its tokens, and restarting it once more
        would hold its group, and a place in every batch, forever. It stays as it is, cancelled
        and masked: out of the loss and of its group's statistics, as a cancelled sample is
        without partial rollout. Its group is complete once no other member waits, and trains on
        the members that finished; they waited for it, so their tokens are at most
        2 x (max_staleness + 1) versions old."""
        if not (sample.times_restarted and self.too_old(sample, version)):
            return False
        self.counters["given_up"] += 1
        self.counters["wasted_tokens"] += len(sample.response_ids)
        return True

    def held_survivors(self):
        """{group id: last turns of its finished members} of the held groups this step resumes:
        the members that finished in earlier steps were scored then (failed ones count nowhere,
        the resumed ones are still aborted here)."""
        return {
            group_id: [m[-1] for m in group.members if not m[-1].masked]
            for group_id, group in self.resumed.items()
        }

    def collect(self, samples, prompts_by_group):
        """File this rollout's trajectories (resumes first, then `group_size` per new prompt, as
        RolloutEngine.generate returns them) and return the groups now complete, in arrival
        order: each a list of its trajectories (lists of turns). Ids are left as the rollout made
        them: a group's members may come from different steps, so the groups are the structure.
        `prompts_by_group` is indexed by group id (dynamic sampling's refills included); the held
        groups' ids (`resumed`) are skipped."""
        trajectories = trajectories_of(samples)
        self.counters["launched"] = len(trajectories)
        fresh = {
            group_id: HeldGroup(prompt, [])
            for group_id, prompt in enumerate(prompts_by_group)
            if group_id not in self.resumed
        }
        for turns in trajectories:
            launch_index = turns[0].trajectory_id
            if launch_index < len(self._launched):  # a resumed (or restarted) sample
                group, index = self._launched[launch_index]
                group.members[index] = turns
            else:
                group = fresh[turns[0].group_id]
                index = len(group.members)
                group.members.append(turns)
            if turns[-1].finish_reason != "abort":
                continue  # finished (or failed inside the engine: final, masked like any failure)
            self.counters["suspended"] += 1
            self.suspended_lengths.append(len(turns[-1].response_ids))
            self.waiting.append((group, index))
        self._launched = []
        self.resumed = {}
        self.groups += fresh.values()
        waiting = {id(group) for group, _ in self.waiting}
        complete = [g for g in self.groups if id(g) not in waiting]
        self.groups = [g for g in self.groups if id(g) in waiting]
        self.counters["completed_groups"] = len(complete)  # (dynamic sampling may drop some)
        return [group.members for group in complete]

    def metrics(self):
        """This step's counters and the buffer's size after it (all summed over ranks). Its
        rollout/* keys replace rollout_metrics' (which sees only the complete groups):
        `rollout/aborted` counts the samples cancelled (suspended) this step and
        `rollout/aborted_len_*` their lengths, `rollout/wasted_tokens` the tokens generated and
        then thrown away."""
        c = self.counters
        return {f"partial/{name}": summed(value) for name, value in c.items()} | {
            "partial/buffer_samples": summed(len(self.waiting)),
            "partial/held_groups": summed(len(self.groups)),
            "rollout/launched": summed(c["launched"]),
            "rollout/aborted": summed(c["suspended"]),
            "rollout/aborted_ratio": ratio(c["suspended"], c["launched"]),
            **length_stats(self.suspended_lengths, "rollout/aborted_len"),
            "rollout/wasted_tokens": summed(c["wasted_tokens"]),
        }

    # ------------------------------------------------------------------ checkpoint form
    def checkpoint_state(self):
        """Every rank's `state_dict`, merged into the one a checkpoint holds (a collective: every
        rank calls it; runtime/checkpoint.py writes what rank 0 gets)."""
        return merge_states(parallel.gather_objects(self.state_dict()))

    def state_dict(self):
        """Plain lists, strings and numbers (checkpoint.py loads them with weights_only=True)."""
        index = {id(group): i for i, group in enumerate(self.groups)}
        return {
            "groups": [
                {
                    "prompt": dataclasses.asdict(g.prompt),
                    "members": [[turn.to_state() for turn in turns] for turns in g.members],
                }
                for g in self.groups
            ],
            "waiting": [(index[id(group)], member) for group, member in self.waiting],
        }

    def load_state_dict(self, state):
        self.groups = [
            HeldGroup(
                Prompt(**g["prompt"]),
                [[Sample.from_state(turn) for turn in turns] for turns in g["members"]],
            )
            for g in state["groups"]
        ]
        self.waiting = [(self.groups[group], member) for group, member in state["waiting"]]


def merge_states(states):
    """One buffer state from several ranks' (checkpoint.py writes one file), groups in rank
    order, and how many each rank held (`ranks`)."""
    merged = {"groups": [], "waiting": [], "ranks": []}
    for state in states:
        offset = len(merged["groups"])
        merged["groups"] += state["groups"]
        merged["waiting"] += [(offset + group, member) for group, member in state["waiting"]]
        merged["ranks"].append(len(state["groups"]))
    return merged


def share_state(state, rank, world_size):
    """This rank's share of a merged state's groups, with their waiting entries in order: at the
    world size that wrote it, the groups this rank held (its steps go on as they would have);
    at another, a contiguous even share."""
    held = state.get("ranks", [])  # (a state written before ranks were recorded: even shares)
    if len(held) == world_size:
        lo = sum(held[:rank])
        hi = lo + held[rank]
    else:
        num = len(state["groups"])
        lo = rank * num // world_size
        hi = (rank + 1) * num // world_size
    return {
        "groups": state["groups"][lo:hi],
        "waiting": [(group - lo, member) for group, member in state["waiting"] if lo <= group < hi],
    }
