"""The SGLang engine's lifecycle, and every call into SGLang's API (written against sglang 0.5.23).

Owns starting the in-process engine (its environment, ports, device), watching its processes, the
process's signal handling (SGLang's handlers replaced; the trainer's StopSignal), single requests
and aborts, weight pushes, and memory release/wake. Does not own what is generated or when it is
cancelled (rollout.py, inflight.py), nor when memory moves (memory.py).
"""

import array
import asyncio
import base64
import hashlib
import json
import logging
import multiprocessing.resource_tracker
import os
import re
import signal
import sys
import threading
import time
import warnings

import numpy
import psutil
import torch
import tqdm

log = logging.getLogger("engine")
# the CPU stand-in for SGLang's CUDA kernels, at the repository's root
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_COMPAT_DIR = os.path.join(REPO, "cpu_compat")


class RolloutError(RuntimeError):
    """The engine failed in a way the step cannot survive (too many failed requests, a stuck
    abort)."""


class EngineDiedError(RolloutError):
    """A process of the SGLang engine (its scheduler) exited or raised while the trainer needed
    it."""


def as_trained(name, tensor):
    """The layout of a model whose checkpoint holds its tensors as it trains them."""
    return [(name, tensor)]


class Engine:
    """An SGLang `Engine` in this process (its scheduler runs in child processes), used by the
    trainer."""

    def __init__(
        self,
        model_path,
        cfg,
        dtype="float32",
        seed=0,
        gpu_id=0,
        local_rank=0,
        trust_remote_code=False,
        lora=None,
        routing_replay=False,
        fp32_head=None,
    ):
        self.cfg = cfg
        self.routing_replay = routing_replay  # each request returns the experts it routed to
        self.dtype = getattr(torch, dtype)  # weight sync casts the trainer's fp32 masters to this
        self.weight_version = 0
        self.adapter = None  # the LoRA adapter every request is served with (`load_adapter`)
        on_gpu = torch.cuda.is_available()
        self.engine = start_sglang(
            model_path,
            cfg,
            dtype,
            seed,
            gpu_id,
            local_rank,
            trust_remote_code,
            on_gpu,
            lora,
            routing_replay,
            fp32_head,
        )
        self.tokenizer_manager = self.engine.tokenizer_manager
        # An engine process that dies must end the step with EngineDiedError (and a checkpoint),
        # never kill the trainer. SGLang has three ways to kill this process instead, all replaced
        # here (sglang 0.5.23):
        # - its watchdog polls the scheduler processes and sends SIGQUIT on a death: stopped; we
        #   watch the same   processes ourselves, from inside every wait on the engine
        #   (`_while_alive`);
        # - a scheduler that raises (CUDA OOM, an illegal access, a rejected weight push) sends
        #   SIGQUIT to its parent (managers/scheduler.py, `run_scheduler_process`), whose handler
        #   runs kill_process_tree on itself: at launch `engine.py`'s
        #   launch_phase_sigquit_handler, once the request loop is made tokenizer_manager.py's
        #   SignalHandler.running_phase_sigquit_handler. Ours only records it (`_on_sigquit`);
        # - when its request loop is made the tokenizer manager hooks SIGTERM to drain the engine
        #   and exit 0 (the run would end without a checkpoint).
        # The loop's two handlers are taken off it as it is made (`_create_request_loop`), so
        # SIGQUIT is `_on_sigquit`'s and SIGTERM the trainer's StopSignal's.
        watchdog = self.tokenizer_manager._subprocess_watchdog  # the scheduler processes it polls
        self._engine_processes = list(zip(watchdog._processes, watchdog._names)) if watchdog else []
        if watchdog:
            watchdog.stop()
        # set by SIGQUIT: an engine process raised (its traceback is in the log)
        self.child_failed = None
        signal.signal(signal.SIGQUIT, self._on_sigquit)
        # Freeze the engine processes' start-up objects out of the cyclic GC: SGLang's flush_cache
        # (run by every KV-cache release) does a gc.collect() on CPU, measured 0.6 s per call
        # before, 1 ms after.
        self._run(self.tokenizer_manager.freeze_gc())
        # SGLang creates its request loop at the first request; create it now, at start, with
        # the signals back where they were: SIGTERM to train.py's StopSignal (installed before
        # the engine starts), SIGQUIT to `_on_sigquit`
        self._run(self._create_request_loop())
        self.weight_shapes = tensor_shapes(model_path)
        self.stop_ids = stop_token_ids(self.tokenizer_manager)
        # what release/wake free by tag; CUDA graphs are captured (and hold memory) only on GPU
        self.memory_tags = (
            ("weights", "kv_cache", "cuda_graph") if on_gpu else ("weights", "kv_cache")
        )

    async def _create_request_loop(self):
        """SGLang's request loop made, with the handlers of SIGTERM and SIGQUIT as they were
        before. Left to the loop (uvloop's, which records a signal that comes while it is idle
        and answers it only when some later signal comes during a run), SGLang's SIGTERM handler
        drained the engine and exited 0 at a rollout (no checkpoint), and a SIGTERM or SIGQUIT
        that came while training went unanswered (a preempted run trained on until the SIGKILL
        after its grace period)."""
        held = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGQUIT)}
        self.tokenizer_manager.auto_create_handle_loop()
        for sig, handler in held.items():
            # while the loop runs: on one that does not, uvloop's remove_signal_handler leaves
            # the handler in place and returns False (uvloop/loop.pyx); it then sets SIG_DFL
            if not self.tokenizer_manager.event_loop.remove_signal_handler(sig):
                raise RuntimeError(f"the engine's request loop held no {sig.name} handler")
            if handler is not None:  # (None: one not set from Python, left as SIG_DFL)
                signal.signal(sig, handler)

    def _on_sigquit(self, signum=None, frame=None):
        self.child_failed = "it raised an exception and sent SIGQUIT (its traceback is above)"

    def _run(self, coroutine):
        """Run an engine coroutine to completion on the engine's own event loop (we are not
        inside one), checking twice a second that the engine's processes are alive: a dead
        scheduler never answers. Every call into the engine goes through here: SGLang's own
        synchronous methods (`Engine.flush_cache`, `release_memory_occupation`, ...) wait on a
        reply with no timeout (managers/communicator.py)."""
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
        """Raise EngineDiedError if a process of the engine has exited (cancelling `cancel`
        first)."""
        # after SIGQUIT the process that raised is exiting: wait to name it
        deadline = time.monotonic() + 2.0
        while (
            self.child_failed
            and all(p.is_alive() for p, _ in self._engine_processes)
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        dead = [
            f"{name} (pid {p.pid}, exit code {p.exitcode})"
            for p, name in self._engine_processes
            if not p.is_alive()
        ]
        if self.child_failed:
            dead.append(self.child_failed)
        if dead:
            if cancel is not None:
                cancel.cancel()
            raise EngineDiedError(f"the SGLang engine died: {', '.join(dead)}")

    # ------------------------------------------------------------------ requests
    async def request(self, rid, input_ids, sampling):
        """One generation from token ids: (output ids, their log-probs, finish reason type, the
        engine's finish reason, weight version, routed experts). With `skip_tokenizer_init` the
        output ids include a matched stop token. The routed experts (with `routing_replay`, else
        empty): int16, [input + output tokens - 1, layers, top-k] flattened, every token the
        engine computed (managers/scheduler_components/batch_result_processor.py,
        _maybe_collect_routed_experts); empty where SGLang collected none."""
        out = await self.engine.async_generate(
            input_ids=list(input_ids),
            sampling_params=sampling,
            return_logprob=True,
            rid=rid,
            lora_path=self.adapter,
            return_routed_experts=self.routing_replay,
        )
        meta = out["meta_info"]
        logprobs = [lp for lp, _token, _ in meta["output_token_logprobs"]]
        version = meta.get("weight_version", "0")
        routes = array.array("h")
        if meta.get("routed_experts"):  # base64 of int32 (srt/state_capturer/routed_experts.py,
            # its decoder); kept as int16: an expert id is < 32,768
            wide = numpy.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=numpy.int32)
            routes.frombytes(wide.astype(numpy.int16).tobytes())
        return (
            out["output_ids"],
            logprobs,
            (meta.get("finish_reason") or {}).get("type", "error"),
            meta.get("finish_reason"),
            int(version) if str(version).isdigit() else 0,
            routes,
        )

    def abort(self, rids):
        """Abort requests inside the engine (fire and forget: each returns its partial output).
        SGLang matches rids by *prefix*, so rids must be uuids; when they hold every request the
        engine tracks, one abort_all (a set, not a count: a rid the engine does not track yet
        would make an equal count hold another request)."""
        tracked = self.tokenizer_manager.rid_to_state
        try:
            if tracked and set(tracked) <= set(rids):
                self.tokenizer_manager.abort_request(abort_all=True)
            else:
                for rid in rids:
                    self.tokenizer_manager.abort_request(rid=rid)
        except Exception as e:  # its send to the scheduler (tokenizer_manager.abort_request)
            raise RolloutError(f"aborting {len(rids)} requests failed in the engine: {e!r}") from e

    async def abort_and_wait(self, rid, timeout_s):
        """Abort one request and wait (at most `timeout_s`) until the engine has let it go; a
        RolloutError if it has not (still in the engine, it would hold its memory into the
        train phase: memory.MemoryPhases refuses to release with a request in flight)."""
        self.abort([rid])
        deadline = time.perf_counter() + timeout_s
        while rid in self.tokenizer_manager.rid_to_state:
            if time.perf_counter() >= deadline:
                raise RolloutError(f"request {rid}'s abort did not return within {timeout_s}s")
            await asyncio.sleep(0.01)

    def num_in_flight(self):
        """Requests the engine still tracks (0 after every rollout, cancelled or not)."""
        return len(self.tokenizer_manager.rid_to_state)

    # ------------------------------------------------------------------ weights and memory
    def update_weights(
        self,
        named_params,
        version,
        bucket_bytes=256 << 20,
        gather=lambda tensor: tensor,
        layout=as_trained,
    ):
        """Push the trainer's parameters bucket by bucket (`weight_buckets`), then stamp `version`.
        `layout`, (name, tensor) -> [(name, tensor)], turns each into the tensors the engine
        loaded from the checkpoint: `checkpoint_layout(model)` for a model from from_pretrained
        (it reads the conversions loading recorded), `as_trained` where they are the same.

        sglang 0.5.23 requires begin_weight_update()/end_weight_update() around the pushes. The
        prefix cache is flushed once, with the last bucket: KV computed with the old weights must
        not be reused.
        """
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightsFromTensorReqInput,
        )
        from sglang.srt.utils import MultiprocessingSerializer

        named_params = list(named_params)
        for trained_name, param in named_params:
            # a mismatched tensor makes SGLang's scheduler raise (and die): refuse it here, with its
            # name; a DTensor's shape is the whole tensor's, laid out on the meta device (no data)
            for name, tensor in layout(trained_name, torch.empty(param.shape, device="meta")):
                if self.weight_shapes.get(name) != tuple(tensor.shape):
                    raise RolloutError(
                        f"weight sync: {name} {tuple(tensor.shape)} does not match the engine's "
                        f"model ({self.weight_shapes.get(name, 'no such tensor')})"
                    )
        self._run(self.tokenizer_manager.begin_weight_update(BeginWeightUpdateReqInput(), None))
        num_buckets = 0
        buckets = weight_buckets(named_params, self.dtype, bucket_bytes, gather, layout)
        for bucket, is_last in buckets:
            request = UpdateWeightsFromTensorReqInput(
                # one per TP rank
                serialized_named_tensors=[MultiprocessingSerializer.serialize(bucket)],
                flush_cache=is_last,
                weight_version=str(version) if is_last else None,
            )
            ok, message = self._run(
                self.tokenizer_manager.update_weights_from_tensor(request, None)
            )
            if not ok:
                raise RolloutError(f"weight sync failed in bucket {num_buckets}: {message}")
            num_buckets += 1  # the pushed tensors are freed when the generator empties `bucket`
        self._run(self.tokenizer_manager.end_weight_update(EndWeightUpdateReqInput(), None))
        self.weight_version = version
        return num_buckets

    def load_adapter(self, tensors, config, version, checksums=None):
        """Serve LoRA adapter `tensors` ({peft name: tensor}, `config` as peft's adapter_config)
        as weight `version`: loaded into SGLang's adapter pool under a new name, every later
        request served with it, the previous one unloaded. Megabytes, where a full push moves the
        whole model; the engine must have been started with `lora` (start_sglang). `checksums`
        ({name: sha256}, `adapter_checksums` of what was meant to arrive): the engine hashes each
        tensor as it arrived, before loading it, and raises on any difference, which ends its
        scheduler (sglang/srt/managers/tp_worker.py, load_lora_adapter_from_tensors:
        "[LORA-CHECK] ... MISMATCH" in the log) and so this call, with EngineDiedError."""
        from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        name, previous = f"policy_v{version}", self.adapter
        if previous == name:  # the same version again (a resume on this engine): replaced
            self._unload_adapter(previous)
            self.adapter = previous = None
        request = LoadLoRAAdapterFromTensorsReqInput(
            lora_name=name,
            config_dict=config,
            serialized_named_tensors=[MultiprocessingSerializer.serialize(tensors)],  # one TP rank
            expected_checksums=checksums,
        )
        out = self._run(self.tokenizer_manager.load_lora_adapter_from_tensors(request, None))
        if not out.success:
            raise RolloutError(f"adapter sync (version {version}) failed: {out.error_message}")
        self.adapter = name
        if previous is not None:
            self._unload_adapter(previous)
        self.set_version(version)  # (a full push stamps it with its last bucket)

    def set_version(self, version):
        """The weight version every request reports from now on (SGLang's starts at "default",
        which requests report as 0): a resumed run's engine starts at its first step's."""
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        self._run(
            self.tokenizer_manager.update_weight_version(
                UpdateWeightVersionReqInput(new_version=str(version), abort_all_requests=False)
            )
        )
        self.weight_version = version

    def _unload_adapter(self, name):
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        out = self._run(
            self.tokenizer_manager.unload_lora_adapter(
                UnloadLoRAAdapterReqInput(lora_name=name), None
            )
        )
        if not out.success:
            raise RolloutError(f"adapter {name} could not be unloaded: {out.error_message}")

    def weight_checksums(self):
        """{tensor name: hash} of every weight the engine holds, by SGLang's weight checker
        (sglang/srt/utils/weight_checker.py: `tensor_hash` of each tensor, in the engine's layout:
        fused projections, padded vocabulary; rotary caches skipped). memory.check_weights
        compares them with the trainer's."""
        from sglang.srt.managers.io_struct import CheckWeightsReqInput

        ok, message, ranks, _ = self._run(
            self.tokenizer_manager.check_weights(CheckWeightsReqInput(action="checksum"), None)
        )
        if not ok or not ranks:
            raise RolloutError(f"the engine's weight checksums failed: {message}")
        return ranks[0]["checksums"]  # one TP rank

    def flush_cache(self):
        """Drop the prefix cache (weight sync does this too: KV from old weights must not be
        reused)."""
        return self._run(self.tokenizer_manager.flush_cache())

    def release(self, tags):
        """Free engine memory by tag ("weights", "kv_cache", "cuda_graph"), once the engine is
        idle."""
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        self.wait_until_idle()
        self._run(
            self.tokenizer_manager.release_memory_occupation(
                ReleaseMemoryOccupationReqInput(tags=tags), None
            )
        )

    def wait_until_idle(self, poll_s=0.01):
        """The last request returning does not mean the scheduler is idle: its overlap loop (on
        by default on GPU) runs one more iteration, and release asserts idleness. flush_cache
        succeeds only on an idle scheduler (and drops the prefix cache, which a release frees
        anyway): retry it until it does."""
        deadline = time.perf_counter() + self.cfg.abort_timeout_s
        while not self.flush_cache().success:
            if time.perf_counter() > deadline:
                raise RolloutError(
                    f"the engine was not idle {self.cfg.abort_timeout_s}s after the rollout: "
                    "cannot release its memory"
                )
            time.sleep(poll_s)

    def wake(self, tags):
        """Take back the engine memory `release` freed, by tag (SGLang's
        resume_memory_occupation)."""
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        self._run(
            self.tokenizer_manager.resume_memory_occupation(
                ResumeMemoryOccupationReqInput(tags=tags), None
            )
        )

    def kv_cache_tokens(self):
        """Token capacity of the engine's KV pool (what `kv_cache` release frees), as the
        scheduler reported it at start (`Engine.get_server_info` reads the same dict, after a
        round trip with no timeout)."""
        return self.engine._scheduler_init_result.scheduler_infos[0]["max_total_num_tokens"]

    def shutdown(self):
        """SGLang's shutdown; an engine process it SIGKILLed and could not see reaped within 60 s
        (its kill_process_tree raises RuntimeError: srt/utils/common.py) is a warning: called in
        a `finally`, the error replaced the one the run was ending with (an engine death's, with
        where its checkpoint is)."""
        try:
            self.engine.shutdown()
        except RuntimeError as e:
            log.warning("the engine's shutdown: %s", e)


def kill_engine_processes():
    """SIGKILL to every process below this one, neither logged nor waited for, unlike SGLang's
    kill_process_tree (srt/utils/common.py: an INFO line first, then up to 60 s of reaping, then a
    RuntimeError), since stderr may be a full pipe and nothing here may block. Multiprocessing's
    resource tracker is spared (SGLang's kill takes it too): once this process has exited it
    unlinks the shared memory and semaphores the engine's processes registered, which would
    otherwise stay in /dev/shm (after its warning about them, which goes to stderr: while that is
    a stalled pipe, it waits there)."""
    tracker = getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)
    for child in psutil.Process().children(recursive=True):
        if child.pid == tracker:
            continue
        try:
            child.kill()
        except psutil.Error:  # gone meanwhile
            pass


def write_without_blocking(line, wait_s=0.2):
    """Write `line` to stderr if that takes at most `wait_s`, else leave it: the caller exits
    next. The write runs on a daemon thread, which the exit ends wherever it waits: a full pipe
    (a pager not reading, another rank's writer filling it), a terminal paused with Ctrl-S, a
    full socket. Nothing of fd 2's is changed (its O_NONBLOCK flag is the open file's, shared
    with the shell and the other ranks), and it works as whichever user owns fd 2."""

    def write():
        try:
            os.write(2, line.encode())
        except OSError:  # closed, no reader
            pass

    writer = threading.Thread(target=write, name="exit_line", daemon=True)
    writer.start()
    writer.join(wait_s)


class StopSignal:
    """From set-up on, SIGINT (Ctrl-C) or SIGTERM asks the run to finish the set-up, step,
    validation or checkpoint it is in, save a checkpoint (none before an update) and stop; a
    second one exits at once (the engine's processes killed, no checkpoint, exit 130). The engine's
    processes ignore SIGINT, and its request loop leaves SIGTERM here (`_create_request_loop`),
    so only the trainer decides; in the engine's start-up it is heard once SGLang has forked them
    (`hearing_sigint_once_forked`).
    A repeat within REPEAT_S is the same signal arriving twice: a Ctrl-C reaches each rank from the
    terminal and again from its launcher (parallel.forward_to_ranks; torchrun forwards it too)."""

    REPEAT_S = 2.0

    def __init__(self):
        self.received = None
        self.received_at = 0.0
        self._previous = {
            sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)
        }

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.received and time.monotonic() - self.received_at < self.REPEAT_S:
            return  # the first one, again
        # may run inside the engine's event loop, which swallows exceptions: exit from here. Each
        # line cannot block: stderr may be a full pipe (piped to a pager, a terminal paused with
        # Ctrl-S), where print would wait, and this process with it; nor be dropped (a logging
        # call is, while SGLang's start-up has the root logger)
        if self.received:
            kill_engine_processes()
            line = f"interrupted (second signal ({name})): exited at once; the last checkpoint "
            write_without_blocking(line + "stands\n")
            os._exit(130)
        self.received, self.received_at = name, time.monotonic()
        write_without_blocking(
            f"{name}: finishing this set-up, step or validation, then a checkpoint and exit (send "
            "it again to exit at once)\n"
        )

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def hearing_sigint_once_forked(sglang_engine, handler):
    """`sglang_engine` (the class) with SIGINT's `handler` back in this process once the engine's
    processes are forked (they ignore SIGINT: `start_sglang`). sglang 0.5.23's
    `Engine._launch_subprocesses` (srt/entrypoints/engine.py) forks the scheduler and
    detokenizer processes, then calls `init_tokenizer_manager_func` in this process, then waits
    for the model to load (minutes for a large model on a GPU); that function is one of the fields
    SGLang keeps for forks to override: here it puts `handler` back, then runs SGLang's."""
    init_tokenizer_manager = sglang_engine.init_tokenizer_manager_func

    def hear_sigint_then_init(*args, **kwargs):
        signal.signal(signal.SIGINT, handler)
        return init_tokenizer_manager(*args, **kwargs)

    class Engine(sglang_engine):
        init_tokenizer_manager_func = staticmethod(hear_sigint_then_init)

    return Engine


def request_limits(model_config, max_total_tokens):
    """(the most tokens one request holds, prompt and response; its longest prompt) in an engine
    serving a model of HF config `model_config` with a KV pool of `max_total_tokens` (0: sized
    from memory at start, not counted here). SGLang cuts a request's max_new_tokens to
    max_req_len - 1 - its prompt (managers/scheduler.py, init_req_max_new_tokens), logged only in
    its own log, and refuses a prompt of max_req_len - 5 tokens or more, max_req_len being
    min(context length, KV pool) - 1 (managers/tp_worker.py), the context length read from the
    config as SGLang reads it (utils/hf_transformers/common.py, get_context_length)."""
    from sglang.srt.utils.hf_transformers.common import get_context_length

    room = get_context_length(model_config)
    if max_total_tokens:
        room = min(room, max_total_tokens)
    max_req_len = room - 1
    return max_req_len - 1, max_req_len - 6


def stop_token_ids(tokenizer_manager):
    """The token ids that end every request inside the engine (a request's own stop_token_ids
    come on top): the model's EOS ids, from its config and generation config
    (configs/model_config.py, `_get_hf_eos_token_id`), and its tokenizer's EOS and additional stop
    ids (managers/schedule_batch.py, `Req._check_token_based_finish`)."""
    ids = set(tokenizer_manager.model_config.hf_eos_token_id or ())
    tokenizer = tokenizer_manager.tokenizer
    if tokenizer is not None:
        ids |= {tokenizer.eos_token_id} - {None}
        ids |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
    return frozenset(ids)


def weight_buckets(named_params, dtype, bucket_bytes, gather, layout=as_trained):
    """([(name, whole tensor in `dtype`)], is_last) buckets of about `bucket_bytes`, for the engine,
    each tensor in the engine's checkpoint `layout` (views of the gathered tensor, but where
    transformers' inverse op copies: a mixture of experts' gate and up halves, one tensor more).

    Each parameter is cast *before* `gather` (FSDP2's `full_tensor()`, a collective: every rank
    walks the same names in the same order): the cast is elementwise, so the result is
    bit-identical, and the all-gather moves half the bytes of an fp32 one with no fp32 copy of
    the whole tensor ever made. A bucket is yielded once it reaches `bucket_bytes`, so it holds
    at most that plus one tensor; once the caller has pushed it, it is emptied in place before
    the next is built (rebinding the name would leave the caller's reference holding it while the
    next is gathered: two buckets at once): never a second copy of the model."""
    bucket, size = [], 0
    for i, (name, param) in enumerate(named_params):
        # a copy even where the dtype is the parameter's: serializing a CPU tensor for the push
        # moves its storage into shared memory (torch's reduce_storage), for good
        tensor = gather(param.detach().to(dtype, copy=True))
        bucket += layout(name, tensor)
        size += tensor.numel() * tensor.element_size()
        is_last = i == len(named_params) - 1
        del tensor  # the bucket holds it
        if size >= bucket_bytes or is_last:
            yield bucket, is_last
            bucket.clear()  # the list the caller holds too: its tensors are freed here
            size = 0


def head_override(model_path, fp32_head):
    """SGLang's model-config override for `fp32_head` (None: none): enable_lm_head_fp32, set on
    the config as loaded (sglang/srt/utils/hf_transformers/config.py, get_config) where the
    model's LogitsProcessor reads it (srt/layers/logits_processor.py); for a folder whose
    config.json nests its text model (text_config: Qwen3.5's, Llama 4's), on that one too, whose
    config their head is given (srt/models/qwen3_vl.py)."""
    if fp32_head is None:
        return {}
    override = {"enable_lm_head_fp32": fp32_head}
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            nested = isinstance(json.load(f).get("text_config"), dict)
    except (OSError, ValueError, AttributeError):  # a hub id, or no readable config: none nested
        nested = False
    return override | ({"text_config": dict(override)} if nested else {})


def start_sglang(
    model_path,
    cfg,
    dtype,
    seed,
    gpu_id,
    local_rank,
    trust_remote_code,
    on_gpu,
    lora=None,
    routing_replay=False,
    fp32_head=None,
):
    """Start an in-process `sglang.Engine` (its scheduler and detokenizer are child processes)
    for this rank: the environment its processes inherit, its device, its port; returns it.
    `Engine` then takes it over. `lora` ({"rank", "targets"}): with SGLang's LoRA pool, which
    `Engine.load_adapter` fills. `routing_replay`: it records the experts of every token it
    computes (a host buffer of KV tokens x layers x top-k int32: srt/state_capturer/).
    `fp32_head` (model.fp32_head): its head's logits summed and kept in fp32 (True) or not
    (False), whatever the folder's config.json says (a checkpoint of another setting, a LoRA
    run's base); None: as the folder says."""
    # Children inherit the environment: one OMP thread per engine process keeps 2 CPU cores from
    # being oversubscribed (measured 70x faster generation than the default thread count).
    os.environ["OMP_NUM_THREADS"] = str(cfg.engine_threads)
    if not on_gpu:
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # else SGLang reaches for vllm's rotary kernels
        # the CUDA-only sgl_kernel wheel cannot load without a GPU: use the CPU stand-in, both
        # here (SGLang imports it in this process too) and in the scheduler processes
        if CPU_COMPAT_DIR not in sys.path:
            sys.path.insert(0, CPU_COMPAT_DIR)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [CPU_COMPAT_DIR, os.environ.get("PYTHONPATH")])
        )
    if cfg.deterministic and not on_gpu:
        raise RolloutError(
            "rollout.deterministic needs a GPU: SGLang's deterministic inference runs only on the "
            "fa3, flashinfer or triton attention backends, and the CPU engine's is torch_native "
            "(sglang/srt/arg_groups/overrides.py, _deterministic_attention_backend)"
        )
    prepare_engine_environment(on_gpu)
    # (`sglang.Engine` is a lazy stand-in for this class: sglang/__init__.py)
    from sglang.srt.entrypoints.engine import Engine as SGLangEngine

    device_args = engine_device_args(on_gpu, gpu_id, lora)

    # SGLang reconfigures the root logger of this process to its own log_level and handler: without
    # the restore below, every trainer warning after engine start (e.g. rollout queueing) was
    # dropped.
    root_logger = logging.getLogger()
    root_level, root_handlers = root_logger.level, root_logger.handlers[:]
    # The engine's processes ignore Ctrl-C (it reaches the whole process group): the trainer decides
    # how to stop, and shuts them down itself. A process inherits an ignored signal at its fork (and
    # a spawned Python keeps it), so SIGINT is ignored here while SGLang forks them, and heard again
    # from then on. (Ignored for the whole start-up, a Ctrl-C there was lost: the run trained on.)
    previous_sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = hearing_sigint_once_forked(SGLangEngine, previous_sigint)(
            model_path=model_path,
            dtype=dtype,
            random_seed=seed,
            skip_tokenizer_init=True,
            # the memory saver frees weights/KV on release; it needs CUDA (its LD_PRELOAD hook loads
            # libcuda)
            enable_memory_saver=on_gpu,
            mem_fraction_static=cfg.mem_fraction_static,
            max_total_tokens=cfg.max_total_tokens or None,
            skip_server_warmup=True,
            log_level="error",
            # an idle scheduler waits on its sockets instead of spinning a core: the trainer (and,
            # on a shared CPU, the other ranks) gets that core while the engine is idle (measured: 2
            # ranks on 2 cores trained 2-3x slower with spinning schedulers)
            sleep_on_idle=True,
            nccl_port=free_port(local_rank),
            trust_remote_code=trust_remote_code,
            # each request then samples with its own seed (a request without one would get 42:
            # every member of a group the same tokens; the trainer sends one per request)
            enable_deterministic_inference=cfg.deterministic,
            enable_return_routed_experts=routing_replay,
            json_model_override_args=json.dumps(head_override(model_path, fp32_head)),
            **device_args,
        )
    finally:
        signal.signal(signal.SIGINT, previous_sigint)
    root_logger.setLevel(root_level)
    root_logger.handlers[:] = root_handlers
    return engine


def engine_device_args(on_gpu, gpu_id, lora):
    """SGLang's arguments for the device and for LoRA (`lora`: {rank, targets} or None)."""
    # One engine per rank, each on its rank's GPU (`gpu_id`, parallel.gpu_index), each with an NCCL
    # port from its local rank's own window: SGLang would pick it with the `random` module, which
    # ranks started with one seed draw identically (verl issue 3977).
    device_args = (
        dict(base_gpu_id=gpu_id)
        if on_gpu
        else dict(device="cpu", attention_backend="torch_native", disable_cuda_graph=True)
    )
    if lora:
        # two adapters at once: the new one loads before the old one goes
        device_args |= dict(
            enable_lora=True,
            max_lora_rank=lora["rank"],
            lora_target_modules=list(lora["targets"]),
            max_loras_per_batch=2,
            # an adapter weight that matches no module of the pool is an error, not a warning
            # (sglang/srt/lora/mem_pool.py): the engine would serve the base for it
            lora_strict_loading=True,
        )
        if not on_gpu:  # the GPU backends' kernels need CUDA (pinning: cpu_compat/sitecustomize.py)
            device_args["lora_backend"] = "torch_native"
        else:
            # the weight sync pushes the adapter alone, so the base must survive the train phase's
            # release: the memory saver copies it to host memory and back instead of dropping it
            # (without this a resumed region's contents are undefined; sglang/srt/model_executor/
            # model_runner_components/load_model_utils.py, region(..., enable_cpu_backup)). Not
            # run here: the CPU engine releases nothing.
            device_args["enable_weights_cpu_backup"] = True
    return device_args


# the allocator settings' names: the newer one first (torch/include/c10/core/AllocatorConfig.h)
ALLOC_CONF_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def strip_expandable_segments():
    """Remove `expandable_segments:True` from the allocator settings, under either name. Called
    first in every entry point (train.py, extras/eval.py), before any CUDA allocation: torch's
    allocator reads the setting once, at its first allocation, and memory it allocated as
    expandable segments cannot be shared with the engine's process (torch_memory_saver refuses
    it), so the first weight push of a multi-rank GPU run would fail after the NCCL barrier's
    first allocation. Idempotent; says what it removed."""
    for name in ALLOC_CONF_NAMES:
        options = [o for o in os.environ.get(name, "").split(",") if o.strip()]
        kept = [o for o in options if o.replace(" ", "").lower() != "expandable_segments:true"]
        if len(kept) != len(options):
            log.warning(
                "removed expandable_segments:True from %s: SGLang's memory saver "
                "(torch_memory_saver) refuses it and the engine would not start",
                name,
            )
            os.environ[name] = ",".join(kept)


# Warnings SGLang raises on import in a CPU process, each harmless here, as (the message's
# start, up to its first comma, the module raising it): the CPU engine loads no AWQ or GGUF
# weights, and the linear-attention kernels (FLA) it falls back from are not used by Qwen2.
HARMLESS_WARNINGS = (
    ("Only CUDA", "sglang.srt.layers.quantization.awq.awq"),  # "..., HIP and XPU support AWQ"
    ("Only CUDA", "sglang.srt.layers.quantization.gguf"),  # "..., MUSA and NPU support GGUF"
    ("Triton is not supported on current platform", "sglang.kernels.ops.attention.fla.utils"),
)


def quiet_harmless_warnings():
    """Ignore HARMLESS_WARNINGS, matched by message, category and raising module, in this process
    and (through PYTHONWARNINGS, which they read at start) in the engine's: 9 lines at every
    start that meant nothing to a user. PYTHONWARNINGS cannot hold a comma, hence the prefixes."""
    entries = []
    for message, module in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", re.escape(message), UserWarning, re.escape(module))
        entries.append(f"ignore:{message}:UserWarning:{module}")
    known = os.environ.get("PYTHONWARNINGS", "")
    added = [entry for entry in entries if entry not in known.split(",")]
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [known, *added]))


def keep_semaphores_out():
    """tqdm's progress bars share a thread lock instead of their default multiprocessing one.
    SGLang's Engine.shutdown kills every child of this process (entrypoints/engine.py:
    kill_process_tree(os.getpid(), include_parent=False)), multiprocessing's resource tracker
    among them; once SGLang has made "spawn" the start method, tqdm's lock is a named semaphore
    the tracker holds, and releasing it at exit relaunched the tracker and printed a KeyError
    traceback (extras/eval.py's last lines). Bars are drawn from this process's threads only."""
    tqdm.tqdm.set_lock(threading.RLock())


def prepare_engine_environment(on_gpu):
    """The engine's processes inherit this process's environment; what they need there.
    torch_memory_saver refuses `expandable_segments:True` in PYTORCH_CUDA_ALLOC_CONF (the engine
    would die at start with a message about a library the user never chose): removed here, and
    said so. TORCHELASTIC_USE_AGENT_STORE, set by torchrun, can make SGLang's private TCPStore
    hang (pytorch issue 192113): SGLang's scheduler is not part of the trainer's rendezvous. On
    GPU, two more (sglang 0.5.23):
    - SGLANG_MEMORY_SAVER_CUDA_GRAPH=1: without it SGLang captures CUDA graphs outside the memory
      saver's regions (model_executor/runner_backend/full_cuda_graph_backend.py,
      `_memory_saver_adapter`), so a release of the "cuda_graph" tag frees nothing; with it the
      graph pool is paused too (a pinned CPU backup is kept, since replays read capture-time
      state).
    - CUDA tensors pushed to the engine name their device by UUID, not index
      (sglang.srt.utils.patch_torch.monkey_patch_torch_reductions; the scheduler applies it on
      its side, managers/tp_worker.py): an index is wrong when the two processes see the GPUs in
      another order (a launcher that sets CUDA_VISIBLE_DEVICES per rank): `name_gpus_by_uuid`."""
    strip_expandable_segments()
    quiet_harmless_warnings()
    keep_semaphores_out()
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if on_gpu:
        os.environ.setdefault("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "1")
        name_gpus_by_uuid()


def name_gpus_by_uuid():
    """SGLang's patch of torch's tensor pickling (sglang/srt/utils/patch_torch.py,
    `monkey_patch_torch_reductions`: a CUDA tensor's device by UUID), kept to CUDA tensors. The
    patch rewrites argument 6 of every tensor's reduction, and a CPU tensor's has 3
    (torch/multiprocessing/reductions.py, `reduce_tensor`): every CPU tensor pushed after it
    raised IndexError (a reviewer found eval of a LoRA checkpoint, whose policy stays on the CPU,
    and the benches that push from the CPU failing so on a GPU). A CPU tensor goes through
    torch's own reduction (shared memory), as on a machine without a GPU."""
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from torch.multiprocessing import reductions

    monkey_patch_torch_reductions()  # once per process (it checks)
    by_uuid = reductions.reduce_tensor
    if getattr(by_uuid, "cuda_only", False):
        return

    def reduce_tensor(tensor):
        if tensor.is_cuda:
            return by_uuid(tensor)
        return reductions._reduce_tensor_original(tensor)

    reduce_tensor.cuda_only = True
    reductions.reduce_tensor = reduce_tensor
    reductions.init_reductions()  # the picklers' table holds the function: registered again


def tensor_hash(tensor):
    """SGLang's hash of a tensor, as its weight checker computes it in the engine (sha256 on CPU,
    a Triton kernel on a GPU): memory.check_weights hashes the trainer's side with it."""
    from sglang.srt.managers.mm_utils import tensor_hash as sglang_tensor_hash

    return sglang_tensor_hash(tensor)


def adapter_checksums(tensors):
    """{name: sha256 hex} of each tensor's bytes, as SGLang hashes an adapter's tensors on arrival
    (sglang/srt/managers/tp_worker.py, load_lora_adapter_from_tensors): `Engine.load_adapter`'s
    `checksums`."""
    return {
        name: hashlib.sha256(
            t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
        ).hexdigest()
        for name, t in tensors.items()
    }


def pad_vocab_size(vocab_size):
    """The vocabulary size SGLang pads its embedding and head rows to (a multiple of 64)."""
    from sglang.srt.layers.vocab_parallel_embedding import pad_vocab_size as sglang_pad

    return sglang_pad(vocab_size)


def checkpoint_layout(model):
    """(name, tensor) -> [(name, tensor)]: one of `model`'s parameters as the tensors its checkpoint
    on disk holds, which is what the engine loads and takes in a weight push. The same for most
    models; transformers 5 trains a mixture of experts with each layer's experts fused into one 3D
    tensor (experts.gate_up_proj) where the checkpoint holds one tensor per expert and projection
    (experts.0.gate_proj.weight, ...): transformers' own inverse of its loading conversion splits
    it (core_model_loading.py, revert_weight_conversion; save_pretrained calls it too). One tensor
    at a time: a conversion whose inverse needs several trained tensors together would give a
    part under the whole's name, which update_weights' shape check refuses by name."""
    from transformers.core_model_loading import revert_weight_conversion

    return lambda name, tensor: list(revert_weight_conversion(model, {name: tensor}).items())


def tensor_shapes(model_path):
    """{tensor name: shape} of the HF checkpoint the engine loaded (all safetensors shards)."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(os.listdir(model_path)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(model_path, file), "pt") as f:
                shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


PORT_WINDOW = 1000  # each local rank draws its engine's NCCL port from its own 1,000 ports


def free_port(local_rank=0, low=20000, window=PORT_WINDOW):
    """A free TCP port for the engine's NCCL rendezvous, below the ephemeral range, from
    `local_rank`'s own window (ranks of one node never draw the same port; 10 windows, then they
    repeat). Test-bound on the IPv4 wildcard, as the scheduler's TCPStore binds it later (sglang
    srt/utils/network.py, `get_free_port_below_ephemeral`): a port taken on any interface is
    refused, not only on 127.0.0.1. Drawn with an RNG of this process's own, not the seeded
    global one."""
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
    raise RolloutError(
        f"no free port in {start}-{start + window - 1} for the engine's NCCL rendezvous"
    )
