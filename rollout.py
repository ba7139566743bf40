"""Rollout: owns the in-process SGLang engine and every call made to it (written against sglang 0.5.23).

Generation from token ids with per-request ids, tail cancellation (abort inside the engine, await
every task), weight sync from the trainer, and memory release/resume. Does not own rewards, losses,
or phase ordering (memory.py decides when release/resume happen; this file only performs them).
"""
import array
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import time
import uuid

import torch

import checkpoint
from cancel import count_complete_groups, keep_first_complete_groups
from sample import Sample

log = logging.getLogger("rollout")
CPU_COMPAT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_compat")


class RolloutError(RuntimeError):
    """The engine failed in a way the step cannot survive (too many failed requests, a stuck abort)."""


class EngineDiedError(RolloutError):
    """A process of the SGLang engine (its scheduler) exited while the trainer needed it."""


@dataclasses.dataclass
class RolloutStats:
    rollout_s: float = 0.0          # launch -> every request returned
    decision_s: float = 0.0         # launch -> cancellation decided (= rollout_s when nothing cancelled)
    cancel_latency_s: float = 0.0   # decision -> every cancelled request returned from the engine
    num_cancelled: int = 0
    num_failed: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    num_timed_out: int = 0          # requests aborted by rollout.rollout_timeout_s


class RolloutEngine:
    """An SGLang `Engine` in this process (its scheduler runs in child processes), used by the trainer."""

    def __init__(self, model_path, cfg, dtype="float32", seed=0, gpu_id=0, local_rank=0, trust_remote_code=False):
        self.cfg = cfg
        self.dtype = getattr(torch, dtype)  # weight sync casts the trainer's fp32 masters to this
        self.weight_version = 0
        self._cancelling = set()  # rids this side aborted on purpose (any other abort is a failure)
        on_gpu = torch.cuda.is_available()
        # Children inherit the environment: one OMP thread per engine process keeps 2 CPU cores from
        # being oversubscribed (measured 70x faster generation than the default thread count).
        os.environ["OMP_NUM_THREADS"] = str(cfg.engine_threads)
        if not on_gpu:
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # else SGLang reaches for vllm's rotary kernels
            # the CUDA-only sgl_kernel wheel cannot load without a GPU: use the CPU stand-in, both
            # here (SGLang imports it in this process too) and in the scheduler processes
            if CPU_COMPAT_DIR not in sys.path:
                sys.path.insert(0, CPU_COMPAT_DIR)
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [CPU_COMPAT_DIR, os.environ.get("PYTHONPATH")]))
        prepare_engine_environment(on_gpu)
        import sglang

        # One engine per rank, each on its rank's GPU (`gpu_id`, parallel.gpu_index), each with an NCCL port
        # from its local rank's own window: SGLang would pick it with the `random` module, which ranks started
        # with one seed draw identically (verl issue 3977).
        device_args = dict(base_gpu_id=gpu_id) if on_gpu else dict(
            device="cpu", attention_backend="torch_native", disable_cuda_graph=True)
        # SGLang reconfigures the root logger of this process to its own log_level and handler: without the
        # restore below, every trainer warning after engine start (e.g. rollout queueing) was dropped.
        root_logger = logging.getLogger()
        root_level, root_handlers = root_logger.level, root_logger.handlers[:]
        # The engine's processes ignore Ctrl-C (it reaches the whole process group): the trainer decides how
        # to stop, and shuts them down itself. (A spawned Python keeps an inherited SIG_IGN for SIGINT.)
        previous_sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.engine = sglang.Engine(
                model_path=model_path, dtype=dtype, random_seed=seed, skip_tokenizer_init=True,
                # the memory saver frees weights/KV on release; it needs CUDA (its LD_PRELOAD hook loads libcuda)
                enable_memory_saver=on_gpu, mem_fraction_static=cfg.mem_fraction_static,
                max_total_tokens=cfg.max_total_tokens or None, skip_server_warmup=True, log_level="error",
                # an idle scheduler waits on its sockets instead of spinning a core: the trainer (and, on a shared
                # CPU, the other ranks) gets that core while the engine is idle (measured: 2 ranks on 2 cores
                # trained 2-3x slower with spinning schedulers)
                sleep_on_idle=True, nccl_port=free_port(local_rank), trust_remote_code=trust_remote_code,
                **device_args)
        finally:
            signal.signal(signal.SIGINT, previous_sigint)
        root_logger.setLevel(root_level)
        root_logger.handlers[:] = root_handlers
        self.tokenizer_manager = self.engine.tokenizer_manager
        # An engine process that dies must end the step with EngineDiedError (and a checkpoint), never kill the
        # trainer. SGLang has three ways to kill this process instead, all replaced here (sglang 0.5.23):
        # - its watchdog polls the scheduler processes and sends SIGQUIT on a death: stopped; we watch the same
        #   processes ourselves, from inside every wait on the engine (`_while_alive`);
        # - a scheduler that raises (CUDA OOM, an illegal access, a rejected weight push) sends SIGQUIT to its
        #   parent (managers/scheduler.py, `run_scheduler_process`), whose handler runs kill_process_tree on
        #   itself: at launch `engine.py`'s launch_phase_sigquit_handler, once the event loop runs
        #   tokenizer_manager.py's SignalHandler.running_phase_sigquit_handler. Both only record it now;
        # - on its first request the tokenizer manager hooks SIGTERM to drain the engine and exit 0 (the run
        #   would end without a checkpoint): SIGTERM goes to `on_sigterm` (the trainer's StopSignal).
        watchdog = self.tokenizer_manager._subprocess_watchdog  # the scheduler processes it polls
        self._engine_processes = list(zip(watchdog._processes, watchdog._names)) if watchdog else []
        if watchdog:
            watchdog.stop()
        self.child_failed = None  # set by SIGQUIT: an engine process raised (its traceback is in the log)
        signal.signal(signal.SIGQUIT, self._on_sigquit)
        self.on_sigterm = None
        self.tokenizer_manager.signal_handler_class = trainer_signals(self.tokenizer_manager.signal_handler_class, self)
        # Freeze the engine processes' start-up objects out of the cyclic GC: SGLang's flush_cache (run
        # by every KV-cache release) does a gc.collect() on CPU, measured 0.6 s per call before, 1 ms after.
        self._run(self.tokenizer_manager.freeze_gc())
        # SGLang creates its request loop at the first request, and installs its signal handlers (TrainerSignals
        # above) on it there. Create it now, at start: the trainer's own SIGINT/SIGTERM handlers (StopSignal,
        # installed later) then take precedence in every phase. Created at the first rollout instead, the
        # loop's handlers replaced them, and a SIGTERM that came while training was never seen.
        self._run(self._create_request_loop())
        self.weight_shapes = checkpoint.tensor_shapes(model_path)
        # what release/resume free by tag; CUDA graphs are captured (and hold memory) only on GPU
        self.memory_tags = ("weights", "kv_cache", "cuda_graph") if on_gpu else ("weights", "kv_cache")

    async def _create_request_loop(self):
        self.tokenizer_manager.auto_create_handle_loop()

    def _on_sigquit(self, signum=None, frame=None):
        self.child_failed = "it raised an exception and sent SIGQUIT (its traceback is above)"

    def _run(self, coroutine):
        """Run an engine coroutine to completion on the engine's own event loop (we are not inside one),
        checking twice a second that the engine's processes are alive: a dead scheduler never answers.
        Every call into the engine goes through here: SGLang's own synchronous methods (`Engine.flush_cache`,
        `release_memory_occupation`, ...) wait on a reply with no timeout (managers/communicator.py)."""
        return self.engine.loop.run_until_complete(self._while_alive(coroutine))

    async def _while_alive(self, coroutine):
        self.check_alive()
        task = asyncio.ensure_future(coroutine)
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done():
                self.check_alive(cancel=task)
        return task.result()

    def check_alive(self, cancel=None):
        """Raise EngineDiedError if a process of the engine has exited (cancelling `cancel` first)."""
        deadline = time.monotonic() + 2.0  # after SIGQUIT the process that raised is exiting: wait to name it
        while self.child_failed and all(p.is_alive() for p, _ in self._engine_processes) and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = [f"{name} (pid {p.pid}, exit code {p.exitcode})" for p, name in self._engine_processes
                if not p.is_alive()]
        if self.child_failed:
            dead.append(self.child_failed)
        if dead:
            if cancel is not None:
                cancel.cancel()
            raise EngineDiedError(f"the SGLang engine died: {', '.join(dead)}")

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, group_size, temperature, max_new_tokens, plan=None, tool=None, max_turns=1,
                 max_response_tokens=0, resumes=()):
        """Sample `group_size` trajectories per prompt; with a `plan`, cancel the tail per `plan.cancel`.

        prompts: list of token-id lists. A trajectory is one turn, or with a `tool` ((response ids, the
        trajectory's prompt ids) -> (observation ids, is_error), run on a turn ending in
        `tool.call_end_id`) up to `max_turns` turns within `max_response_tokens` generated + observation
        tokens. `resumes` (partial rollout, single-turn only): unfinished samples launched first, each
        continued from its prompt + partial response with what is left of the budget; the caller gives
        them group ids apart from the new prompts' (0..). Returns (every turn of every trajectory in launch order, resumes first, with
        `trajectory_id` numbering the trajectories 0.., RolloutStats).
        """
        sampling = {"temperature": temperature, "top_p": self.cfg.top_p if temperature > 0 else 1.0,
                    "max_new_tokens": max_new_tokens}
        if tool is not None:
            sampling["stop_token_ids"] = [tool.call_end_id]  # pause generation at the end of a tool call
        budget = max_response_tokens or max_new_tokens * max_turns
        for s in resumes:  # a sample cut exactly at the budget ends "length", never "abort": a caller's bug
            if len(s.response_ids) >= min(max_new_tokens, budget) or tool is not None:
                raise RolloutError(f"cannot resume a sample of group {s.group_id} with {len(s.response_ids)} "
                                   f"tokens (budget {min(max_new_tokens, budget)}, multi-turn: {tool is not None})")
        units = [(s.group_id, s.prompt_ids, s) for s in resumes]
        units += [(group_id, ids, None) for group_id, ids in enumerate(prompts) for _ in range(group_size)]
        if self.cfg.max_total_tokens and len(units) * max_new_tokens > self.cfg.max_total_tokens:
            # SGLang admits a request only if the KV pool can reserve most of its max_new_tokens: the
            # rest queue, and a "tail" cancellation would then cancel requests that never started
            log.warning("%d requests x %d new tokens exceed rollout.max_total_tokens=%d: requests will queue",
                        len(units), max_new_tokens, self.cfg.max_total_tokens)
        return self._run(self._generate_all(units, sampling, plan, tool, max_turns, budget))

    async def _generate_all(self, units, sampling, plan, tool, max_turns, budget):
        stats, start = RolloutStats(), time.perf_counter()
        self._current_rid, self._cancelled = {}, set()
        tasks = {}
        for i, (group_id, ids, partial) in enumerate(units):
            work = (self._resume(i, partial, sampling, budget, start) if partial is not None else
                    self._trajectory(i, ids, group_id, sampling, tool, max_turns, budget, stats, start))
            tasks[asyncio.create_task(work)] = i
        pending, finished = set(tasks), []
        timeout = self.cfg.rollout_timeout_s or None  # a hung request must not hang the run: it is aborted
        if plan is not None and plan.cancel != "none":
            pending = await self._wait_for_enough(pending, finished, plan, start, timeout)
        else:
            _, pending = await asyncio.wait(pending, timeout=timeout)
        stats.decision_s = time.perf_counter() - start
        if pending and timeout and stats.decision_s >= timeout:
            stats.num_timed_out = len(pending)
            log.warning("rollout.rollout_timeout_s=%s reached: aborting %d requests (treated as cancelled)",
                        timeout, len(pending))
        if pending:
            # Abort inside the engine (not only the asyncio task): a cancelled task alone leaves the
            # request decoding in the scheduler, burning the compute we wanted back.
            self._cancelled.update(tasks[t] for t in pending)  # and no cancelled trajectory starts a turn
            rids = [self._current_rid[tasks[t]] for t in pending]
            self._cancelling.update(rids)
            if len(pending) == len(self.tokenizer_manager.rid_to_state):
                self.tokenizer_manager.abort_request(abort_all=True)
            else:
                for rid in rids:
                    self.tokenizer_manager.abort_request(rid=rid)
            returned, stuck = await asyncio.wait(pending, timeout=self.cfg.abort_timeout_s)
            stats.cancel_latency_s = time.perf_counter() - start - stats.decision_s
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)  # no task outlives the rollout
            self._cancelling.difference_update(rids)
            if stuck:
                raise RolloutError(f"{len(stuck)} aborted requests did not return within "
                                   f"{self.cfg.abort_timeout_s}s (rids {rids[:3]}...)")
            # a request can finish on its own between the decision and the abort: it is kept
            stats.num_cancelled = sum(t.result()[-1].is_aborted for t in pending)
        await asyncio.gather(*tasks)  # every task is done here; re-raises nothing (errors became samples)
        stats.rollout_s = time.perf_counter() - start
        samples = [turn for t in tasks for turn in t.result()]
        if plan is not None and plan.cancel == "group" and not plan.partial:  # partial: finished ones wait
            keep_first_complete_groups(samples, finished, plan.group_size, plan.target_groups)
        stats.num_failed = sum(s.finish_reason == "error" for s in samples)
        if stats.num_failed > self.cfg.max_failed_ratio * len(samples):
            raise RolloutError(f"{stats.num_failed}/{len(samples)} requests failed inside the engine "
                               f"(rollout.max_failed_ratio={self.cfg.max_failed_ratio}); see the log for rids")
        return samples, stats

    async def _wait_for_enough(self, pending, finished, plan, start, limit_s=None):
        """Event-driven: wake on each completion (or a deadline), decide, return what is left.
        `finished` collects the last turn of each finished trajectory, in completion order."""
        deadline = None  # the time policy's, once set
        hard_deadline = start + limit_s if limit_s else None  # rollout.rollout_timeout_s
        while pending:
            now = time.perf_counter()
            if hard_deadline is not None and now >= hard_deadline:
                break
            deadlines = [d for d in (deadline, hard_deadline) if d is not None]
            timeout = max(min(deadlines) - now, 0) if deadlines else None
            done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finished.extend(t.result()[-1] for t in done)
            num_ok = sum(not s.is_aborted for s in finished)
            if plan.cancel == "group":
                if count_complete_groups(finished, plan.group_size) >= plan.target_groups:
                    break
            elif num_ok >= plan.target_samples:
                break
            now = time.perf_counter()
            if plan.cancel == "time" and deadline is None and num_ok >= plan.time_quantile * plan.target_samples:
                deadline = now + plan.time_factor * (now - start)  # q of the target back at t: wait factor*t more
            if deadline is not None and now >= deadline:
                break
        return pending

    async def _trajectory(self, trajectory_id, prompt_ids, group_id, sampling, tool, max_turns, budget, stats, start):
        """Turns of one trajectory: generate, run the tool on a tool call, append its observation, go on.
        Each turn's prompt is the previous prompt + response + observation, so turns merge (merge.py)."""
        turns, context = [], array.array("i", prompt_ids)
        for turn in range(max_turns):
            if turn > 0 and trajectory_id in self._cancelled:
                turns[-1].finish_reason = "abort"  # cancelled while its tool ran: unfinished
                break
            remaining = budget - (len(context) - len(prompt_ids))
            if remaining <= 0:  # token budget spent on earlier turns and observations
                turns[-1].finish_reason = "length"  # its last call is never answered: truncated
                break
            rid = self._current_rid[trajectory_id] = uuid.uuid4().hex  # uuid: SGLang aborts by rid *prefix*
            turn_sampling = {**sampling, "max_new_tokens": min(sampling["max_new_tokens"], remaining)}
            sample = await self._generate_one(rid, context, group_id, turn_sampling, start)
            sample.trajectory_id, sample.turn = trajectory_id, turn
            turns.append(sample)
            if tool is None or sample.finish_reason != "stop" or sample.response_ids[-1:].tolist() != [tool.call_end_id]:
                break  # an answer, a length cut, an abort or an error ends the trajectory
            if turn == max_turns - 1:
                sample.finish_reason = "length"  # a call with no turn left to read the result: truncated, not an answer
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
        """Continue an unfinished single-turn sample: its prompt + partial response go in as token ids,
        `max_new_tokens` is what is left of the budget, and the result holds every token of both."""
        remaining = min(sampling["max_new_tokens"], budget) - len(partial.response_ids)  # > 0: checked at launch
        rid = self._current_rid[trajectory_id] = uuid.uuid4().hex
        more = await self._generate_one(rid, partial.prompt_ids + partial.response_ids, partial.group_id,
                                        {**sampling, "max_new_tokens": remaining}, start)
        more.trajectory_id = trajectory_id
        return [partial.continued_by(more)]

    async def _generate_one(self, rid, prompt_ids, group_id, sampling, start):
        """One request; an engine exception becomes a sample marked "error" (counted, logged, dropped)."""
        try:
            out = await asyncio.wait_for(self.engine.async_generate(
                input_ids=list(prompt_ids), sampling_params=sampling, return_logprob=True, rid=rid),
                timeout=self.cfg.request_timeout_s or None)
        except asyncio.TimeoutError:  # abort it inside the engine too, and wait until the engine let it go
            self.tokenizer_manager.abort_request(rid=rid)
            deadline = time.perf_counter() + self.cfg.abort_timeout_s
            while rid in self.tokenizer_manager.rid_to_state and time.perf_counter() < deadline:
                await asyncio.sleep(0.01)
            log.error("request %s timed out after rollout.request_timeout_s=%s", rid, self.cfg.request_timeout_s)
            return self._failed(prompt_ids, group_id, start)
        except Exception as e:  # noqa: BLE001 - counted and logged: never silently turned into padding
            log.error("request %s failed inside the engine: %r", rid, e)
            return self._failed(prompt_ids, group_id, start)
        meta = out["meta_info"]
        reason = (meta.get("finish_reason") or {}).get("type", "error")
        if reason == "abort" and rid not in self._cancelling:
            # the engine aborted it by itself (e.g. context overflow): a failure, not our cancellation
            log.error("request %s aborted by the engine: %s", rid, meta.get("finish_reason"))
            reason = "error"
        response_ids = array.array("i", out["output_ids"])
        if reason == "abort" and len(response_ids) >= sampling["max_new_tokens"]:
            reason = "length"  # the abort came after its last token: complete (and a resume would have no budget)
        logprobs = array.array("f", [lp for lp, _token, _ in meta["output_token_logprobs"]])
        assert len(logprobs) == len(response_ids), f"rid {rid}: {len(logprobs)} log-probs for {len(response_ids)} tokens"
        version = meta.get("weight_version", "0")
        return Sample(prompt_ids=prompt_ids, response_ids=response_ids, logprobs=logprobs,
                      loss_mask=array.array("B", [1]) * len(response_ids), group_id=group_id, finish_reason=reason,
                      is_aborted=reason in ("abort", "error"),
                      weight_version=int(version) if str(version).isdigit() else 0,
                      latency_s=time.perf_counter() - start)

    def _failed(self, prompt_ids, group_id, start):
        """The sample of a request that failed or timed out: no tokens, masked out, counted as "error"."""
        return Sample(prompt_ids, [], [], [], group_id, finish_reason="error", is_aborted=True,
                      weight_version=self.weight_version, latency_s=time.perf_counter() - start)

    def num_in_flight(self):
        """Requests the engine still tracks (0 after every rollout, cancelled or not)."""
        return len(self.tokenizer_manager.rid_to_state)

    # ------------------------------------------------------------------ weights and memory
    def update_weights(self, named_params, version, bucket_bytes=256 << 20, gather=lambda tensor: tensor):
        """Push the trainer's parameters bucket by bucket (`weight_buckets`), then stamp `version`.

        sglang 0.5.23 requires begin_weight_update()/end_weight_update() around the pushes. The prefix cache
        is flushed once, with the last bucket: KV computed with the old weights must not be reused.
        """
        from sglang.srt.managers.io_struct import (BeginWeightUpdateReqInput, EndWeightUpdateReqInput,
                                                   UpdateWeightsFromTensorReqInput)
        from sglang.srt.utils import MultiprocessingSerializer

        named_params = list(named_params)
        for name, param in named_params:
            # a mismatched tensor makes SGLang's scheduler raise (and die): refuse it here, with its name
            if self.weight_shapes.get(name) != tuple(param.shape):  # a DTensor's shape is the whole tensor's
                raise RolloutError(f"weight sync: {name} {tuple(param.shape)} does not match the engine's "
                                   f"model ({self.weight_shapes.get(name, 'no such tensor')})")
        self._run(self.tokenizer_manager.begin_weight_update(BeginWeightUpdateReqInput(), None))
        num_buckets = 0
        for bucket, is_last in weight_buckets(named_params, self.dtype, bucket_bytes, gather):
            request = UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=[MultiprocessingSerializer.serialize(bucket)],  # one per TP rank
                flush_cache=is_last, weight_version=str(version) if is_last else None)
            ok, message = self._run(self.tokenizer_manager.update_weights_from_tensor(request, None))
            if not ok:
                raise RolloutError(f"weight sync failed in bucket {num_buckets}: {message}")
            num_buckets += 1  # the pushed tensors are freed when `bucket` is rebound
        self._run(self.tokenizer_manager.end_weight_update(EndWeightUpdateReqInput(), None))
        self.weight_version = version
        return num_buckets

    def flush_cache(self):
        """Drop the prefix cache (weight sync does this too: KV from old weights must not be reused)."""
        return self._run(self.tokenizer_manager.flush_cache())

    def release(self, tags):
        """Free engine memory by tag ("weights", "kv_cache", "cuda_graph"), once the engine is idle."""
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        self.wait_until_idle()
        self._run(self.tokenizer_manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=tags), None))

    def wait_until_idle(self, poll_s=0.01):
        """The last request returning does not mean the scheduler is idle: its overlap loop (on by default on
        GPU) runs one more iteration, and release asserts idleness. flush_cache succeeds only on an idle
        scheduler (and drops the prefix cache, which a release frees anyway): retry it until it does."""
        deadline = time.perf_counter() + self.cfg.abort_timeout_s
        while not self.flush_cache().success:
            if time.perf_counter() > deadline:
                raise RolloutError(f"the engine was not idle {self.cfg.abort_timeout_s}s after the rollout: "
                                   "cannot release its memory")
            time.sleep(poll_s)

    def resume(self, tags):
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        self._run(self.tokenizer_manager.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=tags), None))

    def kv_cache_tokens(self):
        """Token capacity of the engine's KV pool (what `kv_cache` release frees), as the scheduler reported it
        at start (`Engine.get_server_info` reads the same dict, after a round trip with no timeout)."""
        return self.engine._scheduler_init_result.scheduler_infos[0]["max_total_num_tokens"]

    def shutdown(self):
        self.engine.shutdown()

    def kill(self):
        """Kill the engine's processes now (a second Ctrl-C: no time for a clean shutdown)."""
        from sglang.srt.utils import kill_process_tree

        kill_process_tree(os.getpid(), include_parent=False)


def weight_buckets(named_params, dtype, bucket_bytes, gather):
    """([(name, whole tensor in `dtype`)], is_last) buckets of about `bucket_bytes`, for the engine.

    Each parameter is cast *before* `gather` (FSDP2's `full_tensor()`, a collective: every rank walks the
    same names in the same order): the cast is elementwise, so the result is bit-identical, and the
    all-gather moves half the bytes of an fp32 one with no fp32 copy of the whole tensor ever made. A
    bucket is yielded once it reaches `bucket_bytes`, so it holds at most that plus one tensor; the caller
    pushes it and drops it before the next is built: never a second copy of the model."""
    bucket, size = [], 0
    for i, (name, param) in enumerate(named_params):
        tensor = gather(param.detach().to(dtype))
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        is_last = i == len(named_params) - 1
        if size >= bucket_bytes or is_last:
            yield bucket, is_last
            bucket, size = [], 0


def trainer_signals(sglang_signal_handler, rollout_engine):
    """SGLang's signal handler class (sglang 0.5.23, installed on the engine's event loop at its first
    request), with SIGTERM handed to `rollout_engine.on_sigterm` and SIGQUIT (an engine process raised)
    recorded for `check_alive` instead of killing this process tree."""
    class TrainerSignals(sglang_signal_handler):
        def sigterm_handler(self, signum=None, frame=None):
            if rollout_engine.on_sigterm is not None:
                rollout_engine.on_sigterm(signal.SIGTERM, frame)

        def running_phase_sigquit_handler(self, signum=None, frame=None):
            rollout_engine._on_sigquit(signum, frame)
    return TrainerSignals


def prepare_engine_environment(on_gpu):
    """The engine's processes inherit this process's environment; what they need there.
    torch_memory_saver refuses `expandable_segments:True` in PYTORCH_CUDA_ALLOC_CONF (the engine would die
    at start with a message about a library the user never chose): removed here, and said so.
    TORCHELASTIC_USE_AGENT_STORE, set by torchrun, can make SGLang's private TCPStore hang (pytorch
    issue 192113): SGLang's scheduler is not part of the trainer's rendezvous.
    On GPU, two more (sglang 0.5.23):
    - SGLANG_MEMORY_SAVER_CUDA_GRAPH=1: without it SGLang captures CUDA graphs outside the memory saver's
      regions (model_executor/runner_backend/full_cuda_graph_backend.py, `_memory_saver_adapter`), so a
      release of the "cuda_graph" tag frees nothing; with it the graph pool is paused too (a pinned CPU
      backup is kept, since replays read capture-time state).
    - CUDA tensors pushed to the engine name their device by UUID, not index
      (sglang.srt.utils.patch_torch.monkey_patch_torch_reductions; the scheduler applies it on its side,
      managers/tp_worker.py): an index is wrong when the two processes see the GPUs in another order (a
      launcher that sets CUDA_VISIBLE_DEVICES per rank). CUDA-only: the patch breaks CPU tensor pickling."""
    alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    options = [o for o in alloc_conf.split(",") if o.strip()]
    kept = [o for o in options if o.replace(" ", "").lower() != "expandable_segments:true"]
    if len(kept) != len(options):
        log.warning("removed expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF: SGLang's memory saver "
                    "(torch_memory_saver) refuses it and the engine would not start")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(kept)
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if on_gpu:
        os.environ.setdefault("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "1")
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()


PORT_WINDOW = 1000  # each local rank draws its engine's NCCL port from its own 1,000 ports


def free_port(local_rank=0, low=20000, window=PORT_WINDOW):
    """A free TCP port for the engine's NCCL rendezvous, below the ephemeral range, from `local_rank`'s own
    window (ranks of one node never draw the same port; 10 windows, then they repeat). Test-bound on the
    IPv4 wildcard, as the scheduler's TCPStore binds it later (sglang srt/utils/network.py,
    `get_free_port_below_ephemeral`): a port taken on any interface is refused, not only on 127.0.0.1.
    Drawn with an RNG of this process's own, not the seeded global one."""
    import random
    import socket

    start = low + (local_rank % 10) * window
    rng = random.Random(f"{os.getpid()}-{time.time_ns()}")
    for port in rng.sample(range(start, start + window), min(64, window)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
                return port
            except OSError:
                continue
    raise RolloutError(f"no free port in {start}-{start + window - 1} for the engine's NCCL rendezvous")
