"""Memory phases of a colocated step: which of engine weights, KV cache, trainer parameters,
gradients and optimizer state are resident on the accelerator, when, and the peak of each phase.

rollout (engine weights + KV cache; trainer offloaded) -> train (engine released; trainer onloaded)
-> sync, staged as in SGLang RFC 7009: offload the optimizer (its blocks go back to the device at
once), resume engine weights, push weights in buckets, offload trainer parameters (blocks returned
again), and only then resume the KV cache. `all_at_once` resumes weights and KV cache together, for
comparison. The engine calls themselves live in sglang_engine.py; this file decides their order
and refuses illegal transitions.
"""

import dataclasses

import torch

import parallel
from metrics import slowest

MEMORY_MODES = ("staged", "all_at_once", "off")  # memory.mode
# the ledger's name of each engine memory tag (CUDA graph pools are not modelled)
LEDGER_NAME = {"weights": "engine_weights", "kv_cache": "kv_cache"}


class PhaseError(RuntimeError):
    """An illegal memory transition (e.g. resuming a tag that was never released)."""


def tensor_bytes(tensors):
    """Bytes this rank holds: a sharded (FSDP2 DTensor) tensor counts its local shard only."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


@dataclasses.dataclass
class Ledger:
    """Bytes per tag, from real tensor sizes. On CPU release frees nothing (torch_memory_saver needs
    CUDA), so peaks are *modelled* from these; on GPU they are measured as well."""

    engine_weights: int  # the engine's copy of the model, in the engine's dtype
    # KV pool: token capacity x layers x (K and V) x kv heads x head dim x dtype
    kv_cache: int
    trainer_params: int
    trainer_grads: int
    optimizer_state: int  # AdamW: exp_avg + exp_avg_sq (+ step); 2x params before the first step
    reference_params: int = 0  # the frozen KL reference (0 without one), offloaded with the trainer

    @classmethod
    def measure(cls, policy, optimizer, kv_cache_tokens, engine_dtype, reference=None):
        params = list(policy.parameters())
        element = torch.empty((), dtype=engine_dtype).element_size()
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        config = policy.config
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        kv_per_token = (
            config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element
        )
        # whole model: each rank's engine
        return cls(
            engine_weights=sum(p.numel() for p in params) * element,
            kv_cache=kv_cache_tokens * kv_per_token,
            trainer_params=tensor_bytes(params),
            # allocated by backward, freed by zero_grad(None)
            trainer_grads=tensor_bytes(params),
            optimizer_state=tensor_bytes(state) if state else 2 * tensor_bytes(params),
            reference_params=tensor_bytes(reference.parameters()) if reference is not None else 0,
        )


class MemoryPhases:
    """The per-step phase machine: `to_train()` after a rollout, `sync(version)` after the
    update."""

    def __init__(
        self,
        engine,
        policy,
        optimizer,
        mode="staged",
        bucket_bytes=256 << 20,
        engine_dtype=torch.float32,
        reference=None,
    ):
        if mode not in MEMORY_MODES:
            raise ValueError(f"memory mode {mode!r}: expected one of {MEMORY_MODES}")
        self.engine = engine
        self.policy = policy
        self.optimizer = optimizer
        self.reference = reference
        self.mode, self.bucket_bytes = mode, bucket_bytes
        self.device = next(policy.parameters()).device
        self.ledger = Ledger.measure(
            policy, optimizer, engine.kv_cache_tokens(), engine_dtype, reference
        )
        self.phase = "rollout"
        # what is resident now; trainer_grads only exist between backward and zero_grad
        self.resident = {"engine_weights", "kv_cache", "trainer_params", "optimizer_state"}
        if reference is not None:
            self.resident.add("reference_params")
        self.engine_released = set()
        # every action in order ("release weights", "offload optimizer", "empty cache", ...)
        self.events = []
        # phase -> {"modelled": ledger bytes, "measured": device-wide bytes in use, "trainer": this
        # process's allocator peak}; the last two on GPU only. Reset each step.
        self.peaks = {}
        self._move_trainer(onload=False, params=True, optimizer=True)  # rollout comes first

    @classmethod
    def of(cls, run, cfg):
        """The phases of a train.py run (`cfg`: MemoryConfig)."""
        return cls(
            run.engine,
            run.policy,
            run.optimizer,
            mode=cfg.mode,
            bucket_bytes=cfg.bucket_mb << 20,
            engine_dtype=run.engine.dtype,
            reference=run.reference,
        )

    # ------------------------------------------------------------------ transitions
    def to_train(self):
        """rollout -> train: free the engine (it must be idle), bring the trainer back."""
        self._expect("rollout", "to_train")
        if self.engine.num_in_flight():
            raise PhaseError(
                f"cannot release engine memory with {self.engine.num_in_flight()} requests in "
                "flight"
            )
        self._enter("train")
        if self.mode != "off":
            self._release(list(self.engine.memory_tags))
        self._move_trainer(onload=True, params=True, optimizer=True)
        # the update allocates them (activations are not modelled)
        self.resident.add("trainer_grads")
        self._note()

    def sync(self, version, after_push=None):
        """train -> rollout, pushing the new weights to the engine in between; `after_push()`
        runs right after the push, while the trainer's weights are still on its device (the
        weight check hashes them there, as the engine hashes its own)."""
        self._expect("train", "sync")
        # the train phase's peak, noted after the update (activations included, on GPU)
        self._note()
        self._enter("sync")
        self.optimizer.zero_grad(set_to_none=True)
        self.resident.discard("trainer_grads")
        self._move_trainer(onload=False, params=False, optimizer=True)
        # staged: wake only the weights, so the KV cache is not resident while two model copies are
        if self.mode != "off":
            self._resume(["weights"] if self.mode == "staged" else list(self.engine.memory_tags))
        self._note(extra=min(self.bucket_bytes, self.ledger.trainer_params))  # one bucket in flight
        num_buckets = self.engine.update_weights(
            self.policy.named_parameters(), version, self.bucket_bytes, gather=parallel.full_tensor
        )
        if after_push is not None:
            after_push()
        self._move_trainer(onload=False, params=True, optimizer=False)
        if self.mode == "staged":
            # KV cache (+ CUDA graphs)
            self._resume([tag for tag in self.engine.memory_tags if tag != "weights"])
        self._enter("rollout")
        self._note()
        return num_buckets

    # ------------------------------------------------------------------ bookkeeping
    def _expect(self, phase, action):
        if self.phase != phase:
            raise PhaseError(
                f"{action}() needs phase {phase!r}, but the step is in phase {self.phase!r}"
            )

    def _enter(self, phase):
        """Start a phase's peaks afresh (the allocator's too); usage is noted after each action
        inside it (not before the first, which still belongs to the previous phase)."""
        self.phase = phase
        self.peaks[phase] = {"modelled": 0, "measured": 0, "trainer": 0}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _release(self, tags):
        already = set(tags) & self.engine_released
        if already:
            raise PhaseError(f"engine memory {sorted(already)} is already released")
        self.engine.release(tags)
        self.events.append(f"release {' '.join(tags)}")
        self.engine_released |= set(tags)
        self.resident -= {LEDGER_NAME[t] for t in tags if t in LEDGER_NAME}
        self._note()

    def _resume(self, tags):
        # SGLang answers a resume of a tag it never released with a bare KeyError from a set removal
        missing = set(tags) - self.engine_released
        if missing:
            raise PhaseError(f"cannot resume engine memory {sorted(missing)}: it was not released")
        self.engine.resume(tags)
        self.events.append(f"resume {' '.join(tags)}")
        self.engine_released -= set(tags)
        self.resident |= {LEDGER_NAME[t] for t in tags if t in LEDGER_NAME}
        self._note()

    def _move_trainer(self, onload, params, optimizer):
        """Move trainer parameters (and the KL reference) and/or optimizer state onto the
        accelerator or off it to the CPU. After an offload the freed blocks go back to the device
        at once: PyTorch's caching allocator would otherwise keep them, and the engine (another
        process) could not resume into them."""
        if self.mode == "off":
            return  # both stay resident
        # on a CPU machine the move is a no-op
        device = self.device if onload else torch.device("cpu")
        if params:
            for model, name in (
                (self.policy, "trainer_params"),
                (self.reference, "reference_params"),
            ):
                if model is not None:
                    model.to(device)
                    (self.resident.add if onload else self.resident.discard)(name)
            self.events.append(f"{'onload' if onload else 'offload'} params")
        if optimizer:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and key != "step":  # AdamW keeps `step` on the CPU
                        state[key] = value.to(device, non_blocking=True)
            (self.resident.add if onload else self.resident.discard)("optimizer_state")
            self.events.append(f"{'onload' if onload else 'offload'} optimizer")
        if not onload:
            self._empty_cache()
        self._note()

    def _empty_cache(self):
        if self.device.type == "cuda":
            # the non-blocking copies above must finish before their sources go
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self.events.append("empty cache")

    def _note(self, extra=0):
        """Record the current usage into the phase's peaks: modelled from the ledger; on GPU also
        measured, device-wide (engine processes included) and this process's allocator peak since
        the phase began."""
        modelled = sum(getattr(self.ledger, name) for name in self.resident) + extra
        peak = self.peaks.setdefault(self.phase, {"modelled": 0, "measured": 0, "trainer": 0})
        peak["modelled"] = max(peak["modelled"], modelled)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            peak["measured"] = max(peak["measured"], total - free)
            peak["trainer"] = max(peak["trainer"], torch.cuda.max_memory_allocated(self.device))

    @property
    def source(self):
        """GPU peaks are measured; CPU peaks are modelled (releasing frees nothing there)."""
        return "measured" if self.device.type == "cuda" else "modelled"

    def metrics(self):
        out = {
            f"memory/{phase}_peak_bytes_{self.source}": slowest(peak[self.source])
            for phase, peak in self.peaks.items()
        }
        if self.device.type == "cuda":
            out |= {
                f"memory/{phase}_trainer_peak_bytes": slowest(peak["trainer"])
                for phase, peak in self.peaks.items()
            }
        for name in ("engine_weights", "kv_cache", "trainer_params", "optimizer_state"):
            out[f"memory/resident_{name}"] = slowest(name in self.resident)
        return out
