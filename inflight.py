"""A rollout in flight on the engine, the machinery under stage 1 (rollout.py): every request an
asyncio task (`Rollout`), each trajectory scored as it returns (`with_reward`); after each return
cancel.decide is asked whether enough have finished (`wait_for_enough`), dynamic sampling launches
refills as it goes (`Rollout.filter_and_refill`), and at the decision what still runs is aborted
inside the engine and awaited (`Rollout.abort`), so no request outlives the rollout. A single-turn
trajectory is generated here; a multi-turn one runs task/tools.py's loop through this rollout.
Does not own the stop rules (cancel.py), the rewards (rewards.py) or what the stage launches.
`Rollout` reads top-down: one request's path first (run, launch, trajectory, generate_one), then
what the features add.
"""

import array
import asyncio
import collections
import dataclasses
import inspect
import logging
import time
import uuid

import cancel
from cancel import Progress
from rewards import RewardError
from runtime.engine import RolloutError
import runtime.seeds as seeds
from sample import Sample
from task.tools import multi_turn

log = logging.getLogger("rollout")


# ---------------------------------------------------------------- in flight on the engine
@dataclasses.dataclass
class RolloutStats:
    rollout_s: float = 0.0  # launch -> every request returned
    # launch -> cancellation decided (= rollout_s when nothing cancelled)
    decision_s: float = 0.0
    cancel_latency_s: float = 0.0  # decision -> every cancelled request returned from the engine
    num_cancelled: int = 0  # trajectories cancelled (ended "abort")
    num_failed: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    # per tool name (every name the tool answers to, 0 if not called: the same keys on every rank)
    tool_calls: dict = dataclasses.field(default_factory=dict)
    tool_errors: dict = dataclasses.field(default_factory=dict)
    num_timed_out: int = 0  # trajectories cut by rollout.rollout_timeout_s's abort
    # finished samples a Decision's keep_groups dropped that had been cut at the token budget
    num_dropped_truncated: int = 0
    prompts_launched: int = 0  # new prompts (resumed samples not counted), refills included
    generated_tokens: int = 0  # tokens the engine generated, cancelled ones included
    # dynamic sampling: groups judged informative before the decision
    kept_groups: int = 0
    # trajectories whose reward function raised or returned a non-number
    num_reward_errors: int = 0


@dataclasses.dataclass
class Request:
    """One trajectory to generate: from its prompt, or (partial rollout) continuing `resumed`."""

    index: int  # launch order, 0..: the trajectory_id of every turn it makes
    group_id: int
    prompt_ids: list[int]
    resumed: Sample | None = None  # an unfinished sample of an earlier step, continued here


@dataclasses.dataclass
class Settings:
    """What every request of one rollout shares (RolloutEngine.generate's arguments, checked)."""

    sampling: dict  # SGLang sampling params: temperature, top_p, max_new_tokens, stop_token_ids
    group_size: int
    budget: int  # generated + observation tokens per trajectory
    max_turns: int = 1
    # async (response ids, prompt ids) -> tools.Observation, or None for no call; see task/tools.py
    tool: object = None
    # turns -> float (or an awaitable of one), called as each trajectory finishes
    reward: object = None
    plan: cancel.LaunchPlan | None = None  # None: wait for every request (validation)
    # dynamic sampling: (count, first_group_id=) -> up to `count` more prompts' token ids, whose
    # group ids are first_group_id, first_group_id + 1, ...
    more_prompts: object = None
    timeout_s: float = 0.0  # rollout.rollout_timeout_s: what is left then is aborted
    # partial rollout: {held group id: its members that finished in earlier steps}
    held: dict = dataclasses.field(default_factory=dict)
    seed: int | None = None  # this rollout's: each request's sampling_seed derives from it


def request_seed(rollout_seed, index, turn):
    """The sampling_seed of turn `turn` of request `index` (its launch order: the prompt's place in
    this step's draw from the data stream, then the member) in the rollout seeded `rollout_seed`
    (`rollout_seed`: the run's seed and the step). Distinct for every request and turn, so no
    two members of a group sample alike; below 2**31 (SGLang stores it as int64)."""
    return seeds.derive(rollout_seed, "request", index, turn)


class Rollout:
    """One rollout in flight: each request an asyncio task, scored as it returns; refills for
    dynamic sampling; at cancel.decide's stop, the rest aborted inside the engine. Lives for one
    call of RolloutEngine.generate."""

    def __init__(self, engine, settings, group_filter):
        self.engine = engine
        self.cfg = engine.cfg  # RolloutConfig: timeouts, failure ratio
        self.settings = settings
        self.stats = RolloutStats()
        self.start = time.perf_counter()
        # every request's path: its task, its rid in the engine, and the abort at the decision
        self.tasks = {}  # asyncio task -> its request's index
        self.generated = {}  # request index -> Event: its turns are back (its reward may still run)
        self.current_rid = {}  # request index -> rid of its request in the engine now
        self.cancelled = set()  # request indices cancelled: no new turn starts
        self.cancelling = set()  # rids this side aborted on purpose (any other abort: a failure)
        self.group_of = {}  # request index -> its group id
        # what features add (each empty, or unused, with the feature off)
        self.group_filter = group_filter  # dynamic sampling's GroupFilter, or None
        self.next_group = 0  # dynamic sampling: the group id a refill gets next
        self.cancelled_groups = set()  # groups a policy's Decision cancelled (the rest went on)
        # tools: request index -> the Event that stops waiting for its tool (`abort` sets it):
        # nothing of theirs in the engine to abort or wait for
        self.in_tool = {}
        for name in settings.tool.names if settings.tool is not None else ():
            self.stats.tool_calls[name] = self.stats.tool_errors[name] = 0

    async def run(self, requests):
        """Launch every request, wait until cancel.decide stops the rollout (or all returned),
        abort the rest. Returns (samples, RolloutStats) as RolloutEngine.generate does."""
        stats = self.stats
        stats.prompts_launched = len({r.group_id for r in requests if r.resumed is None})
        self.next_group = max((r.group_id for r in requests), default=-1) + 1
        pending = self.launch(requests)
        try:
            pending, decision = await wait_for_enough(
                pending,
                plan=self.settings.plan,
                start=self.start,
                timeout_s=self.settings.timeout_s,
                group_filter=self.group_filter,
                on_return=self.filter_and_refill if self.group_filter is not None else None,
                cancel_groups=self.cancel_groups,
                held=self.settings.held,
            )
            stats.decision_s = time.perf_counter() - self.start
            stats.kept_groups = self.group_filter.kept if self.group_filter is not None else 0
            if pending:
                await self.cancel_the_rest(pending)
            # every task is done here (the rewards of the last trajectories too)
            await asyncio.gather(*self.tasks)
        except BaseException:
            # a reward function, a refill, the abort or a request raised: nothing may keep
            # running in the engine, and no task outlives the rollout
            await self.stop_every_task()
            raise
        # cut by the decision or with their group (a request can finish on its own between the
        # decision and the abort: it is kept; a failure is a failure)
        cut = [t for t in self.tasks if t.result()[-1].finish_reason == "abort"]
        stats.num_cancelled = len(cut)
        if self.timed_out():  # those the timeout's abort cut (not a reward still running then)
            stats.num_timed_out = sum(t in pending for t in cut)
        stats.rollout_s = time.perf_counter() - self.start
        samples = [turn for t in self.tasks for turn in t.result()]
        # a resumed sample's earlier tokens were generated in an earlier step, not now
        earlier = sum(len(r.resumed.response_ids) for r in requests if r.resumed is not None)
        stats.generated_tokens = sum(len(s.response_ids) for s in samples) - earlier
        if decision.keep_groups is not None:  # e.g. the group policy: complete groups only
            stats.num_dropped_truncated = cancel.drop_other_groups(samples, decision.keep_groups)
        check_failures(samples, stats, self.cfg.max_failed_ratio)
        return samples, stats

    def launch(self, requests):
        """Start each request's trajectory as a task; returns the new tasks, in launch order."""
        new = []
        for request in requests:
            if request.resumed is not None:
                work = self.continue_partial(request)
            else:
                work = self.trajectory(request)
            self.generated[request.index] = asyncio.Event()  # set before its reward is computed
            task = asyncio.create_task(
                with_reward(work, self.settings.reward, self.stats, self.generated[request.index])
            )
            self.tasks[task] = request.index
            self.group_of[request.index] = request.group_id
            new.append(task)
            if self.group_filter is not None:
                self.group_filter.launched(request.group_id)
        return new

    async def trajectory(self, request):
        """One trajectory from its prompt: a single turn, or with a tool the multi-turn loop of
        task/tools.py (`multi_turn`), which sends each turn and each call through this rollout
        (`generate_one`, `run_tool`), so both are cancelled alike."""
        settings = self.settings
        if settings.tool is not None:
            return await multi_turn(self, request, settings)
        if request.index in self.cancelled:  # cancelled before its request was sent
            return [self.failed(request, reason="abort")]
        max_new_tokens = min(settings.sampling["max_new_tokens"], settings.budget)
        sampling = {**settings.sampling, "max_new_tokens": max_new_tokens}
        return [await self.generate_one(request, array.array("i", request.prompt_ids), sampling)]

    async def generate_one(self, request, prompt_ids, sampling, turn=0):
        """One request of `request`'s trajectory; an engine exception becomes a sample marked
        "error" (counted, logged, dropped)."""
        if self.settings.seed is not None:  # read by the engine only with rollout.deterministic
            seed = request_seed(self.settings.seed, request.index, turn)
            sampling = {**sampling, "sampling_seed": seed}
        # uuid: SGLang aborts by rid *prefix*
        rid = uuid.uuid4().hex
        self.current_rid[request.index] = rid
        timeout_s = self.cfg.request_timeout_s or None
        try:
            output_ids, logprobs, reason, detail, version, routes = await asyncio.wait_for(
                self.engine.request(rid, prompt_ids, sampling), timeout=timeout_s
            )
        except asyncio.TimeoutError:
            log.error("request %s timed out after rollout.request_timeout_s=%s", rid, timeout_s)
            # abort it inside the engine too, and wait until the engine let it go (a RolloutError
            # if it does not, as the decision's abort raises: the run saves and ends)
            await self.engine.abort_and_wait(rid, self.cfg.abort_timeout_s)
            return self.failed(request, prompt_ids=prompt_ids, turn=turn)
        except Exception as e:  # noqa: BLE001 - counted and logged, never silently padding
            log.error("request %s failed inside the engine: %r", rid, e)
            return self.failed(request, prompt_ids=prompt_ids, turn=turn)
        if reason == "abort" and rid not in self.cancelling:
            # the engine aborted it by itself (e.g. context overflow): a failure, not our
            # cancellation
            log.error("request %s aborted by the engine: %s", rid, detail)
            reason = "error"
        response_ids = array.array("i", output_ids)
        stops = self.engine.stop_ids.union(sampling.get("stop_token_ids") or ())
        if reason == "abort" and response_ids and response_ids[-1] in stops:
            # SGLang lets an aborted request decode one more token, then ends it "abort" without
            # looking at that token (managers/schedule_batch.py, update_finish_state: `to_finish`
            # before the EOS check): ended by its EOS, it finished, and resumed it would go on
            # past its end; ended by a tool call, multi_turn sees the call (and the cancellation)
            reason = "stop"
        elif reason == "abort" and len(response_ids) >= sampling["max_new_tokens"]:
            # the abort came after its last token: complete (and a resume would have no budget)
            reason = "length"
        logprobs = array.array("f", logprobs)
        if len(logprobs) != len(response_ids):
            raise RolloutError(
                f"rid {rid}: {len(logprobs)} log-probs for {len(response_ids)} tokens"
            )
        return Sample(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            logprobs=logprobs,
            loss_mask=array.array("B", [1]) * len(response_ids),
            group_id=request.group_id,
            trajectory_id=request.index,
            turn=turn,
            finish_reason=reason,
            masked=reason in ("abort", "error"),
            weight_version=version,
            latency_s=time.perf_counter() - self.start,
            routed_experts=routes,
        )

    def failed(self, request, reason="error", prompt_ids=None, turn=0):
        """The sample of a request that failed or timed out ("error": counted), or was cancelled
        before it was sent ("abort"): no tokens, masked out. `prompt_ids`: the failed turn's
        (default: the trajectory's prompt)."""
        return Sample(
            prompt_ids=request.prompt_ids if prompt_ids is None else prompt_ids,
            response_ids=[],
            logprobs=[],
            loss_mask=[],
            group_id=request.group_id,
            trajectory_id=request.index,
            turn=turn,
            finish_reason=reason,
            masked=True,
            weight_version=self.engine.weight_version,
            latency_s=time.perf_counter() - self.start,
        )

    # ------------------------------------------------------------------ what features add
    # (dynamic sampling's refills, a cancel policy's aborts, tools' turns, partial rollout: the
    # default config uses none of them)

    def filter_and_refill(self, turns):
        """Dynamic sampling, on every return before the decision: tally the trajectory's group,
        then launch the prompts the filter asks for (the in-flight ones go on). Returns the new
        tasks, in launch order."""
        self.group_filter.returned(turns[-1])
        new = []
        while self.settings.more_prompts is not None:
            count = self.group_filter.wanted(self.settings.plan, self.stats.prompts_launched)
            if count <= 0:
                break
            prompts = self.settings.more_prompts(count, first_group_id=self.next_group)
            if not prompts:
                break
            requests = []
            for offset, ids in enumerate(prompts):
                for _ in range(self.settings.group_size):
                    index = len(self.tasks) + len(requests)
                    requests.append(Request(index, self.next_group + offset, ids))
            new += self.launch(requests)
            self.next_group += len(prompts)
            self.stats.prompts_launched += len(prompts)
        return new

    async def cancel_groups(self, group_ids, pending):
        """A Decision's `cancel_groups`: abort those groups' running members inside the engine
        while the rest of the rollout goes on (each returns, cut, as an aborted trajectory)."""
        new = set(group_ids) - self.cancelled_groups
        if not new:
            return
        self.cancelled_groups |= new
        await self.abort([t for t in pending if self.group_of[self.tasks[t]] in new])

    async def cancel_the_rest(self, pending):
        """At the decision: abort what is still running (timed out, if the rollout timeout
        decided: `run` counts what it cut)."""
        if self.timed_out():
            log.warning(
                "rollout.rollout_timeout_s=%s reached: %d trajectories unfinished, what they "
                "still generate aborted (treated as cancelled)",
                self.settings.timeout_s,
                len(pending),
            )
        await self.abort(pending)
        self.stats.cancel_latency_s = time.perf_counter() - self.start - self.stats.decision_s

    def timed_out(self):
        """Whether rollout.rollout_timeout_s made the decision."""
        timeout_s = self.settings.timeout_s
        return bool(timeout_s) and self.stats.decision_s >= timeout_s

    async def stop_every_task(self):
        """After an error: abort what still runs in the engine and wait for every task (a
        reward still running). Should the abort itself fail (the engine's socket), the tasks
        are cancelled: the run ends on the error, and the engine with it."""
        running = [t for t in self.tasks if not t.done()]
        try:
            await self.abort(running, raise_if_stuck=False)
        except Exception:
            for task in running:
                task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def abort(self, pending, raise_if_stuck=True):
        """Abort inside the engine (not only the asyncio task): a cancelled task alone leaves the
        request decoding in the scheduler, burning the compute we wanted back. Returns once every
        task's generation has returned (a trajectory whose reward is still being computed, or
        whose tool is running, has nothing left to abort: its task ends after them)."""
        # and no cancelled trajectory starts a turn, nor waits for its tool
        self.cancelled.update(self.tasks[t] for t in pending)
        for t in pending:
            if self.tasks[t] in self.in_tool:
                self.in_tool[self.tasks[t]].set()

        def generating(task):
            index = self.tasks[task]
            return not self.generated[index].is_set() and index not in self.in_tool

        pending = [t for t in pending if generating(t)]
        # SGLang drops an abort for a rid it does not track yet (managers/tokenizer_manager.py,
        # abort_request): a request sent just before the decision (a refill, a multi-turn
        # trajectory's next turn) must reach the engine first, or it would run to its end unaborted
        timeout_s = self.cfg.abort_timeout_s
        deadline = time.perf_counter() + timeout_s
        tracked = self.engine.tokenizer_manager.rid_to_state

        def unsent(task):
            return generating(task) and self.current_rid.get(self.tasks[task]) not in tracked

        while time.perf_counter() < deadline and any(unsent(t) for t in pending):
            await asyncio.sleep(0.002)
        rids = [self.current_rid[self.tasks[t]] for t in pending if generating(t)]
        self.cancelling.update(rids)
        self.engine.abort(rids)
        returned = {
            asyncio.ensure_future(self.generated[self.tasks[t]].wait()): t
            for t in pending
            if generating(t)  # (one may have reached its tool meanwhile)
        }
        _, late = await asyncio.wait(returned, timeout=timeout_s) if returned else (set(), set())
        stuck = [returned[waiting] for waiting in late]
        for waiting in late:
            waiting.cancel()
        for task in stuck:
            task.cancel()
        await asyncio.gather(*stuck, return_exceptions=True)  # no stuck task outlives the rollout
        if stuck and raise_if_stuck:
            raise RolloutError(
                f"{len(stuck)} aborted requests did not return within {timeout_s}s "
                f"(rids {rids[:3]}...)"
            )

    async def run_tool(self, request, sample):
        """The tool on `sample`, a turn ending in a call: its Observation, counted; None when the
        trajectory is cancelled first (`abort`): its result would be thrown away, so the call is
        cancelled (one queued for a thread never starts, task/tools.py) and the rollout does not
        wait for it. Awaited, so the loop serves the other requests and the cancel decision
        meanwhile; while it runs, an abort has nothing of this trajectory's in the engine."""
        stop = self.in_tool[request.index] = asyncio.Event()
        calling = asyncio.ensure_future(self.settings.tool(sample.response_ids, request.prompt_ids))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({calling, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            calling.cancel()  # (nothing, once it returned)
            stopped.cancel()
            try:  # a tool may take a while to stop: until it has, it is still in its tool
                await asyncio.gather(calling, stopped, return_exceptions=True)
            finally:
                del self.in_tool[request.index]
        if calling.cancelled() and stop.is_set():
            return None
        if calling.cancelled():  # the tool's own CancelledError: ours would have ended us above
            raise RolloutError(f"the task's tool {type(self.settings.tool).__name__} was cancelled")
        observation = calling.result()  # a task's own tool raising: the rollout raises
        self.stats.num_tool_calls += 1
        self.stats.num_tool_errors += observation.is_error
        self.stats.tool_calls[observation.tool] += 1
        self.stats.tool_errors[observation.tool] += observation.is_error
        return observation

    async def continue_partial(self, request):
        """Continue an unfinished single-turn sample: its prompt + partial response go in as
        token ids, `max_new_tokens` is what is left of the budget, and the result holds every
        token of both."""
        settings = self.settings
        partial = request.resumed
        if request.index in self.cancelled:
            # cancelled before its request was sent: stays suspended, as this step's trajectory
            return [dataclasses.replace(partial, trajectory_id=request.index)]
        budget = min(settings.sampling["max_new_tokens"], settings.budget)
        remaining = budget - len(partial.response_ids)  # > 0: checked at launch
        sampling = {**settings.sampling, "max_new_tokens": remaining}
        more = await self.generate_one(request, partial.prompt_ids + partial.response_ids, sampling)
        return [partial.continued_by(more)]


async def wait_for_enough(
    tasks,
    plan,
    start,
    timeout_s=0.0,
    group_filter=None,
    on_return=None,
    cancel_groups=None,
    held=None,
):
    """Wake on each completion (or when cancel.decide asks to look again) and apply each Decision:
    `cancel_groups(group ids, pending)` aborts some groups' running members, and the loop ends
    when `decide` says stop or nothing is pending. `on_return(turns)` sees each returned
    trajectory first and hands back the tasks it launched; `group_filter` is dynamic sampling's
    tally (kept groups); `held` {group id: members finished in earlier steps} partial rollout's
    held groups. `tasks`, and those `on_return` hands back, come in launch order: the tasks done
    by one wake-up are taken in that order. Returns (the tasks still pending, the last Decision,
    taken on everything that returned)."""
    group_size = plan.group_size if plan is not None else 0
    progress = Progress(group_size=group_size, finished_per_group=dict(held or {}))
    # Each task reports itself once, when it finishes: asyncio.wait(pending) would hook and unhook
    # every pending task at every wake-up, O(n^2) over a rollout of n requests (5.7 s of the
    # event loop's CPU at 4,096; RESULTS "The rollout's wait")
    pending = set()
    finished = collections.deque()  # the tasks done and not yet looked at, in finishing order
    arrived = asyncio.Event()
    launched = {}  # task -> its launch index (kept: an index freed would be given again)

    def on_done(task):
        finished.append(task)
        arrived.set()

    def watch(task):
        if task in launched:  # its callback would report it again: one trajectory counted twice
            raise ValueError(f"wait_for_enough was given {task!r} twice")
        task.add_done_callback(on_done)
        pending.add(task)
        launched[task] = len(launched)

    for task in tasks:
        watch(task)
    while True:
        progress.elapsed_s = time.perf_counter() - start
        if group_filter is not None:
            progress.kept_groups = group_filter.kept
        decision = cancel.decide(plan, progress, timeout_s)
        if decision.stop or not pending:
            return pending, decision
        if decision.cancel_groups and cancel_groups is not None:
            await cancel_groups(decision.cancel_groups, pending)
        wait_s = None
        if decision.wake_at_s is not None:
            wait_s = max(decision.wake_at_s - progress.elapsed_s, 0)
        if not finished:
            # one future waited on (asyncio.wait: Python 3.11's wait_for can swallow a
            # cancellation, task/tools.py)
            waiting = asyncio.ensure_future(arrived.wait())
            try:
                await asyncio.wait({waiting}, timeout=wait_s)  # a timeout: decide looks again
            finally:
                waiting.cancel()
        # one more pass of the loop: a task done by now has its callback run (asyncio schedules
        # it a pass after the task ends), so the decision sees every task done by the time it
        # woke, as asyncio.wait's done set did (one missed at a timeout: its group was dropped)
        await asyncio.sleep(0)
        arrived.clear()
        # those done by the same wake-up in launch order, not finishing order (the engine's
        # order within one decode step): a group policy keeps the first groups complete
        done = sorted(finished, key=launched.get)
        finished.clear()
        for task in done:
            pending.discard(task)
            turns = task.result()
            progress.returned(turns, elapsed_s=time.perf_counter() - start)
            if on_return is not None:
                for new in on_return(turns):
                    watch(new)


async def with_reward(work, reward, stats, generated=None):
    """A trajectory's turns, each given the trajectory's reward once it finished (aborted,
    failed: none); `generated` is set when the turns are back, before the reward. A reward function
    that fails on it fails the trajectory: logged, counted, kept out like an abort."""
    try:
        turns = await work
    finally:
        if generated is not None:
            generated.set()
    if reward is not None and not turns[-1].masked:
        try:
            value = reward(turns)
            if inspect.isawaitable(
                value
            ):  # Rewards.for_rollout's: computed off the loop (rewards.py)
                value = await value
        except RewardError as e:
            log.error("trajectory %d: %s", turns[-1].trajectory_id, e)
            stats.num_reward_errors += 1
            for turn in turns:
                turn.masked = True
                # not "error": that counts a request the engine failed (check_failures)
                turn.finish_reason = "reward_error"
            return turns
        for turn in turns:
            turn.reward = value
    return turns


def check_launch(requests, settings, max_total_tokens):
    """Before anything is sent: a resume needs budget left and a single-turn task (a
    RolloutError: a caller's bug, since a sample cut exactly at the budget ends "length", never
    "abort"); and a launch larger than the KV pool gets a warning, since SGLang admits a request
    only if the pool can reserve most of its max_new_tokens: the rest queue, and a "tail"
    cancellation would then cancel requests that never started."""
    max_new_tokens = settings.sampling["max_new_tokens"]
    budget = min(max_new_tokens, settings.budget)
    multi_turn = settings.tool is not None
    for request in requests:
        resumed = request.resumed
        if resumed is not None and (len(resumed.response_ids) >= budget or multi_turn):
            raise RolloutError(
                f"cannot resume a sample of group {request.group_id} with "
                f"{len(resumed.response_ids)} tokens (budget {budget}, multi-turn: {multi_turn})"
            )
    if max_total_tokens and len(requests) * max_new_tokens > max_total_tokens:
        log.warning(
            "%d requests x %d new tokens exceed rollout.max_total_tokens=%d: requests will queue",
            len(requests),
            max_new_tokens,
            max_total_tokens,
        )


def check_failures(samples, stats, max_failed_ratio):
    """Count the failed requests; raise when reward failures or engine failures exceed
    `max_failed_ratio` of the rollout (a few are logged and skipped; many mean a broken reward
    function or engine, not bad luck)."""
    num_trajectories = len({s.trajectory_id for s in samples})
    if stats.num_reward_errors > max_failed_ratio * num_trajectories:
        raise RewardError(
            f"the reward function failed on {stats.num_reward_errors}/{num_trajectories} "
            f"trajectories (rollout.max_failed_ratio={max_failed_ratio}); see the log for each"
        )
    stats.num_failed = sum(s.finish_reason == "error" for s in samples)
    if stats.num_failed > max_failed_ratio * len(samples):
        raise RolloutError(
            f"{stats.num_failed}/{len(samples)} requests failed inside the engine "
            f"(rollout.max_failed_ratio={max_failed_ratio}); see the log for rids"
        )
