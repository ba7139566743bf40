"""Rollout: generation and tail cancellation on the engine (sglang_engine.py owns the engine
itself).

Samples group_size trajectories per prompt (single- or multi-turn with a tool, or continuing partial
rollout's suspended samples), one asyncio task per trajectory, each scored by the caller's reward
function as it finishes; decides on every completion when enough have finished (with dynamic
sampling: enough informative groups, launching more prompts while too few can still be) and cancels
the rest inside the engine, awaiting every task. Does not own how text becomes a reward (train.py's
`score`), losses, or which samples are suspended (buffer.py).
"""

import array
import asyncio
import dataclasses
import logging
import time
import uuid

from cancel import GroupFilter, count_complete_groups, keep_first_complete_groups
from sglang_engine import Engine, RolloutError
from sample import Sample
from tasks import RewardError

log = logging.getLogger("rollout")


@dataclasses.dataclass
class RolloutStats:
    rollout_s: float = 0.0  # launch -> every request returned
    # launch -> cancellation decided (= rollout_s when nothing cancelled)
    decision_s: float = 0.0
    cancel_latency_s: float = 0.0  # decision -> every cancelled request returned from the engine
    num_cancelled: int = 0
    num_failed: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    num_timed_out: int = 0  # requests aborted by rollout.rollout_timeout_s
    prompts_launched: int = 0  # new prompts (resumed samples not counted), refills included
    generated_tokens: int = 0  # tokens the engine generated, cancelled ones included
    # dynamic sampling: groups judged informative before the decision
    kept_groups: int = 0
    # trajectories whose reward function raised or returned a non-number
    num_reward_errors: int = 0


class RolloutEngine(Engine):
    """The engine, generating the trainer's rollouts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._cancelling = set()  # rids this side aborted on purpose (any other abort is a failure)

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts,
        group_size,
        temperature,
        max_new_tokens,
        plan=None,
        tool=None,
        max_turns=1,
        max_response_tokens=0,
        resumes=(),
        reward=None,
        refill=None,
        prior_rewards=None,
    ):
        """Sample `group_size` trajectories per prompt; with a `plan`, cancel the tail per
        `plan.cancel`.

        prompts: list of token-id lists. A trajectory is one turn, or with a `tool` ((response ids,
        the trajectory's prompt ids) -> (observation ids, is_error), run on a turn ending in
        `tool.call_end_id`) up to `max_turns` turns within `max_response_tokens` generated +
        observation tokens. `resumes` (partial rollout, single-turn only): unfinished samples
        launched first, each continued from its prompt + partial response with what is left of the
        budget; the caller gives them group ids after the new prompts' (0..), one per held group.
        `reward` (turns -> float) scores each finished trajectory as it returns, every turn getting
        the value. With `plan.filter_groups` (dynamic sampling), `refill` (new group ids -> token-id
        lists) supplies more prompts, and `prior_rewards` ({group id: rewards}) are what a held
        group's finished members earned before. Returns (every turn of every trajectory in launch
        order, resumes first, refills last, with `trajectory_id` numbering the trajectories 0..,
        RolloutStats).
        """
        sampling = {
            "temperature": temperature,
            "top_p": self.cfg.top_p if temperature > 0 else 1.0,
            "max_new_tokens": max_new_tokens,
        }
        if tool is not None:
            # pause generation at the end of a tool call
            sampling["stop_token_ids"] = [tool.call_end_id]
        budget = max_response_tokens or max_new_tokens * max_turns
        units = [(s.group_id, s.prompt_ids, s) for s in resumes]
        units += [
            (group_id, ids, None) for group_id, ids in enumerate(prompts) for _ in range(group_size)
        ]
        check_launch(units, max_new_tokens, budget, tool is not None, self.cfg.max_total_tokens)
        groups = GroupFilter(prior_rewards) if plan is not None and plan.filter_groups else None
        return self._run(
            self._generate_all(
                units, sampling, plan, tool, max_turns, budget, group_size, reward, groups, refill
            )
        )

    async def _generate_all(
        self, units, sampling, plan, tool, max_turns, budget, group_size, reward, groups, refill
    ):
        stats, start = RolloutStats(), time.perf_counter()
        stats.prompts_launched = len(
            {group_id for group_id, _, resumed in units if resumed is None}
        )
        self._current_rid, self._cancelled = {}, set()
        tasks, next_group = {}, max((group_id for group_id, _, _ in units), default=-1) + 1

        def launch(new_units):
            new = set()
            for group_id, ids, partial in new_units:
                i = len(tasks)
                work = (
                    self._resume(i, partial, sampling, budget, start)
                    if partial is not None
                    else self._trajectory(
                        i, ids, group_id, sampling, tool, max_turns, budget, stats, start
                    )
                )
                task = asyncio.create_task(scored(work, reward, stats))
                tasks[task] = i
                new.add(task)
                if groups is not None:
                    groups.launched(group_id)
            return new

        def returned(turns):
            """Dynamic sampling, on every completion before the decision: tally the group, then
            launch the prompts the filter asks for (the in-flight ones go on)."""
            nonlocal next_group
            groups.returned(turns[-1].group_id, None if turns[-1].is_aborted else turns[-1].reward)
            new = set()
            while refill is not None and (count := groups.wanted(plan, stats.prompts_launched)) > 0:
                prompts = refill(list(range(next_group, next_group + count)))
                if not prompts:
                    break
                new |= launch(
                    [
                        (next_group + k, ids, None)
                        for k, ids in enumerate(prompts)
                        for _ in range(group_size)
                    ]
                )
                next_group, stats.prompts_launched = next_group + len(
                    prompts
                ), stats.prompts_launched + len(prompts)
            return new

        pending, finished = launch(units), []
        # a hung request must not hang the run: it is aborted
        timeout = self.cfg.rollout_timeout_s or None
        try:
            # only dynamic sampling tallies and refills
            on_return = returned if groups is not None else None
            pending = await wait_for_enough(
                pending, finished, plan, start, timeout, on_return, groups
            )
        # a reward function or a refill raised: nothing may keep running in the engine
        except BaseException:
            await self._abort([t for t in tasks if not t.done()], tasks, raise_if_stuck=False)
            raise
        stats.decision_s = time.perf_counter() - start
        stats.kept_groups = groups.kept if groups is not None else 0
        if pending and timeout and stats.decision_s >= timeout:
            stats.num_timed_out = len(pending)
            log.warning(
                "rollout.rollout_timeout_s=%s reached: aborting %d requests (treated as cancelled)",
                timeout,
                len(pending),
            )
        if pending:
            await self._abort(pending, tasks)
            stats.cancel_latency_s = time.perf_counter() - start - stats.decision_s
            # a request can finish on its own between the decision and the abort: it is kept
            stats.num_cancelled = sum(t.result()[-1].is_aborted for t in pending)
        # every task is done here; re-raises nothing (errors became samples)
        await asyncio.gather(*tasks)
        stats.rollout_s = time.perf_counter() - start
        samples = [turn for t in tasks for turn in t.result()]
        # a resumed sample's earlier tokens: not now
        stats.generated_tokens = sum(len(s.response_ids) for s in samples) - sum(
            len(partial.response_ids) for _, _, partial in units if partial is not None
        )
        # partial: finished ones wait
        if plan is not None and plan.cancel == "group" and not plan.partial:
            # the group policy trains complete groups only; dynamic sampling then judges every one
            # of them
            keep_first_complete_groups(
                samples,
                finished,
                plan.group_size,
                len(finished) if groups is not None else plan.target_groups,
            )
        check_failures(samples, stats, self.cfg.max_failed_ratio)
        return samples, stats

    async def _abort(self, pending, tasks, raise_if_stuck=True):
        """Abort inside the engine (not only the asyncio task): a cancelled task alone leaves the
        request decoding in the scheduler, burning the compute we wanted back. Returns once every
        task is done."""
        # and no cancelled trajectory starts a turn
        self._cancelled.update(tasks[t] for t in pending)
        # SGLang drops an abort for a rid it does not track yet (managers/tokenizer_manager.py,
        # abort_request): a request sent just before the decision (a refill, a multi-turn
        # trajectory's next turn) must reach the engine first, or it would run to its end unaborted
        deadline = time.perf_counter() + self.cfg.abort_timeout_s
        tracked = self.tokenizer_manager.rid_to_state
        while time.perf_counter() < deadline and any(
            not t.done() and self._current_rid.get(tasks[t]) not in tracked for t in pending
        ):
            await asyncio.sleep(0.002)
        rids = [self._current_rid[tasks[t]] for t in pending if not t.done()]
        self._cancelling.update(rids)
        self.abort(rids)
        _, stuck = await asyncio.wait(pending, timeout=self.cfg.abort_timeout_s)
        for task in stuck:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)  # no task outlives the rollout
        self._cancelling.difference_update(rids)
        if stuck and raise_if_stuck:
            raise RolloutError(
                f"{len(stuck)} aborted requests did not return within "
                f"{self.cfg.abort_timeout_s}s (rids {rids[:3]}...)"
            )

    async def _trajectory(
        self, trajectory_id, prompt_ids, group_id, sampling, tool, max_turns, budget, stats, start
    ):
        """Turns of one trajectory: generate, run the tool on a tool call, append its
        observation, go on. Each turn's prompt is the previous prompt + response + observation,
        so turns merge (merge.py)."""
        turns, context = [], array.array("i", prompt_ids)
        for turn in range(max_turns):
            # cancelled before its first request, or while its tool ran
            if trajectory_id in self._cancelled:
                if not turns:
                    cancelled = failed_sample(
                        prompt_ids, group_id, self.weight_version, start, reason="abort"
                    )
                    return [dataclasses.replace(cancelled, trajectory_id=trajectory_id)]
                turns[-1].finish_reason = "abort"  # unfinished
                break
            remaining = budget - (len(context) - len(prompt_ids))
            if remaining <= 0:  # token budget spent on earlier turns and observations
                turns[-1].finish_reason = "length"  # its last call is never answered: truncated
                break
            # uuid: SGLang aborts by rid *prefix*
            rid = self._current_rid[trajectory_id] = uuid.uuid4().hex
            turn_sampling = {
                **sampling,
                "max_new_tokens": min(sampling["max_new_tokens"], remaining),
            }
            sample = await self._generate_one(rid, context, group_id, turn_sampling, start)
            sample.trajectory_id, sample.turn = trajectory_id, turn
            turns.append(sample)
            if (
                tool is None
                or sample.finish_reason != "stop"
                or sample.response_ids[-1:].tolist() != [tool.call_end_id]
            ):
                break  # an answer, a length cut, an abort or an error ends the trajectory
            if turn == max_turns - 1:
                # a call with no turn left to read the result: truncated, not an answer
                sample.finish_reason = "length"
                break
            observation_ids, is_error = tool(sample.response_ids, prompt_ids)
            stats.num_tool_calls += 1
            stats.num_tool_errors += is_error
            sample.tool_call = -1 if is_error else 1
            # a new array, not +=: the turn just generated keeps `context` as its prompt_ids
            context = context + sample.response_ids + array.array("i", observation_ids)
        if any(t.is_aborted or t.finish_reason == "abort" for t in turns):
            for t in turns:  # a trajectory is trained whole or not at all
                t.is_aborted = True
        return turns

    async def _resume(self, trajectory_id, partial, sampling, budget, start):
        """Continue an unfinished single-turn sample: its prompt + partial response go in as
        token ids, `max_new_tokens` is what is left of the budget, and the result holds every
        token of both."""
        # cancelled before its request was sent: stays suspended
        if trajectory_id in self._cancelled:
            return [dataclasses.replace(partial, trajectory_id=trajectory_id)]
        # > 0: checked at launch
        remaining = min(sampling["max_new_tokens"], budget) - len(partial.response_ids)
        rid = self._current_rid[trajectory_id] = uuid.uuid4().hex
        more = await self._generate_one(
            rid,
            partial.prompt_ids + partial.response_ids,
            partial.group_id,
            {**sampling, "max_new_tokens": remaining},
            start,
        )
        more.trajectory_id = trajectory_id
        return [partial.continued_by(more)]

    async def _generate_one(self, rid, prompt_ids, group_id, sampling, start):
        """One request; an engine exception becomes a sample marked "error" (counted, logged,
        dropped)."""
        try:
            output_ids, logprobs, reason, detail, version = await asyncio.wait_for(
                self.request(rid, prompt_ids, sampling), timeout=self.cfg.request_timeout_s or None
            )
        # abort it inside the engine too, and wait until the engine let it go
        except asyncio.TimeoutError:
            await self.abort_and_wait(rid, self.cfg.abort_timeout_s)
            log.error(
                "request %s timed out after rollout.request_timeout_s=%s",
                rid,
                self.cfg.request_timeout_s,
            )
            return failed_sample(prompt_ids, group_id, self.weight_version, start)
        except (
            Exception
        ) as e:  # noqa: BLE001 - counted and logged: never silently turned into padding
            log.error("request %s failed inside the engine: %r", rid, e)
            return failed_sample(prompt_ids, group_id, self.weight_version, start)
        if reason == "abort" and rid not in self._cancelling:
            # the engine aborted it by itself (e.g. context overflow): a failure, not our
            # cancellation
            log.error("request %s aborted by the engine: %s", rid, detail)
            reason = "error"
        response_ids = array.array("i", output_ids)
        if reason == "abort" and len(response_ids) >= sampling["max_new_tokens"]:
            # the abort came after its last token: complete (and a resume would have no budget)
            reason = "length"
        logprobs = array.array("f", logprobs)
        assert len(logprobs) == len(
            response_ids
        ), f"rid {rid}: {len(logprobs)} log-probs for {len(response_ids)} tokens"
        return Sample(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            logprobs=logprobs,
            loss_mask=array.array("B", [1]) * len(response_ids),
            group_id=group_id,
            finish_reason=reason,
            is_aborted=reason in ("abort", "error"),
            weight_version=version,
            latency_s=time.perf_counter() - start,
        )


async def wait_for_enough(pending, finished, plan, start, limit_s=None, returned=None, groups=None):
    """Event-driven: wake on each completion (or a deadline), decide, return what is left.
    `finished` collects the last turn of each finished trajectory, in completion order;
    `returned(turns)` sees each one first and hands back tasks it launched. Without a plan (or
    cancel none and no filter), waits for all."""
    deadline = None  # the time policy's, once set
    hard_deadline = start + limit_s if limit_s else None  # rollout.rollout_timeout_s
    policy = plan.cancel if plan is not None else "none"
    while pending:
        now = time.perf_counter()
        if hard_deadline is not None and now >= hard_deadline:
            break
        deadlines = [d for d in (deadline, hard_deadline) if d is not None]
        timeout = max(min(deadlines) - now, 0) if deadlines else None
        done, pending = await asyncio.wait(
            pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        for task in done:
            finished.append(task.result()[-1])
            pending |= returned(task.result()) if returned else set()
        num_ok = sum(not s.is_aborted for s in finished)
        # dynamic sampling: enough kept groups end any policy but none's wait
        if groups is not None:
            if policy != "none" and groups.kept >= plan.target_groups:
                break
            continue
        if policy == "group":
            if count_complete_groups(finished, plan.group_size) >= plan.target_groups:
                break
        elif policy in ("count", "time") and num_ok >= plan.target_samples:
            break
        now = time.perf_counter()
        if (
            policy == "time"
            and deadline is None
            and num_ok >= plan.time_quantile * plan.target_samples
        ):
            # q of the target back at t: wait factor*t more
            deadline = now + plan.time_factor * (now - start)
        if deadline is not None and now >= deadline:
            break
    return pending


async def scored(work, reward, stats):
    """A trajectory's turns, each given the trajectory's reward once it finished (aborted,
    failed: none). A reward function that fails on it fails the trajectory: logged, counted, kept
    out like an abort."""
    turns = await work
    if reward is not None and not turns[-1].is_aborted:
        try:
            value = reward(turns)
        except RewardError as e:
            log.error("trajectory %d: %s", turns[-1].trajectory_id, e)
            stats.num_reward_errors += 1
            for turn in turns:
                turn.is_aborted, turn.finish_reason = True, "error"
            return turns
        for turn in turns:
            turn.reward = value
    return turns


def check_launch(units, max_new_tokens, budget, multi_turn, max_total_tokens):
    """Before anything is sent: a resume needs budget left and a single-turn task (a
    RolloutError: a caller's bug, since a sample cut exactly at the budget ends "length", never
    "abort"); and a launch larger than the KV pool gets a warning, since SGLang admits a request
    only if the pool can reserve most of its max_new_tokens: the rest queue, and a "tail"
    cancellation would then cancel requests that never started."""
    for group_id, _, partial in units:
        if partial is not None and (
            len(partial.response_ids) >= min(max_new_tokens, budget) or multi_turn
        ):
            raise RolloutError(
                f"cannot resume a sample of group {group_id} with {len(partial.response_ids)} "
                f"tokens (budget {min(max_new_tokens, budget)}, multi-turn: {multi_turn})"
            )
    if max_total_tokens and len(units) * max_new_tokens > max_total_tokens:
        log.warning(
            "%d requests x %d new tokens exceed rollout.max_total_tokens=%d: requests will queue",
            len(units),
            max_new_tokens,
            max_total_tokens,
        )


def failed_sample(prompt_ids, group_id, version, start, reason="error"):
    """The sample of a request that failed or timed out ("error": counted), or was cancelled
    before it was sent ("abort"): no tokens, masked out."""
    return Sample(
        prompt_ids,
        [],
        [],
        [],
        group_id,
        finish_reason=reason,
        is_aborted=True,
        weight_version=version,
        latency_s=time.perf_counter() - start,
    )


def check_failures(samples, stats, max_failed_ratio):
    """Count the failed requests; raise when reward failures or engine failures exceed
    `max_failed_ratio` of the rollout (a few are logged and skipped; many mean a broken reward
    function or engine, not bad luck)."""
    num_trajectories = len({s.trajectory_id for s in samples})
    if stats.num_reward_errors > max_failed_ratio * num_trajectories:
        raise RewardError(
            f"the reward function failed on {stats.num_reward_errors}/{num_trajectories} trajectories "
            f"(rollout.max_failed_ratio={max_failed_ratio}); see the log for each"
        )
    stats.num_failed = sum(s.finish_reason == "error" for s in samples)
    if stats.num_failed > max_failed_ratio * len(samples):
        raise RolloutError(
            f"{stats.num_failed}/{len(samples)} requests failed inside the engine "
            f"(rollout.max_failed_ratio={max_failed_ratio}); see the log for rids"
        )
