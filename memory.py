"""Memory phases of a colocated step, and stage 5 of the step, the weight sync between them.

Which of engine weights, KV cache, trainer parameters, gradients and optimizer state are resident
on the accelerator, when, and the peak of each phase: rollout (engine weights + KV cache; trainer
offloaded) -> train (engine released; trainer onloaded) -> weight sync, staged as in SGLang RFC
7009: offload the optimizer (its freed blocks handed back to the driver at once), wake engine
weights, push weights in buckets, offload trainer parameters (blocks returned again), and only
then wake the KV cache. `all_at_once` wakes weights and KV cache together, for comparison.

The weight sync also owns the run's health checks (the other trainers' most reported silent
failure is an engine that samples from other weights or computes another model than the
trainer's; neither raises):
- after a push, every tensor the engine holds is hashed inside the engine (SGLang's weight
  checker) and compared with the same hash of what the trainer sent, bit for bit
  (`check_weights`, on `run.check_weights_first` / `run.check_weights_every` steps);
- `GapWatch`: at the first step, when both hold the same weights, the engine-vs-trainer log-prob
  gap the update measured must be below what the dtypes explain (`STEP0_MAX_GAP`); later, a gap
  above `run.max_logprob_gap` for `run.max_logprob_gap_steps` steps in a row stops the run.
Each failure is a HealthError (train.py ends the run with exit 2). The engine calls themselves live
in runtime/engine.py; this file decides their order and refuses illegal transitions.
"""

import collections
import dataclasses
import math
import time

import torch

from config import ConfigError, refuse_unread
from metrics import slowest
import runtime.lora as lora
import runtime.parallel as parallel
from runtime.estimate import kv_values_per_token

MEMORY_MODES = ("staged", "all_at_once", "off")  # memory.mode
# the ledger's name of each engine memory tag (CUDA graph pools are not modelled)
LEDGER_NAME = {"weights": "engine_weights", "kv_cache": "kv_cache"}


# config.refuse_unread's table: the log-prob gap's bound and patience each need the other, and
# the trainer's own pi_old after the first step (`GapWatch`; with old_logprobs=engine there is no
# gap to read past it)
READ_WHEN = {
    "run.max_logprob_gap": (
        lambda cfg: cfg.run.max_logprob_gap_steps > 0 and cfg.train.old_logprobs == "trainer",
        "with run.max_logprob_gap_steps > 0 and train.old_logprobs=trainer",
    ),
    "run.max_logprob_gap_steps": (
        lambda cfg: cfg.run.max_logprob_gap > 0 and cfg.train.old_logprobs == "trainer",
        "with run.max_logprob_gap > 0 and train.old_logprobs=trainer",
    ),
}


def check(cfg):
    """memory.mode's choice, and the gap check's fields where nothing reads them
    (assemble.load_config calls this at load)."""
    if cfg.memory.mode not in MEMORY_MODES:
        raise ConfigError(f"memory.mode={cfg.memory.mode!r}: expected one of {MEMORY_MODES}")
    refuse_unread(cfg, READ_WHEN)


class PhaseError(RuntimeError):
    """An illegal memory transition (e.g. waking a tag that was never released)."""


def tensor_bytes(tensors):
    """Bytes this rank holds: a sharded (FSDP2 DTensor) tensor counts its local shard only."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


@dataclasses.dataclass
class Ledger:
    """Bytes per tag, from real tensor sizes. On CPU release frees nothing (torch_memory_saver needs
    CUDA), so peaks are *modelled* from these; on GPU they are measured as well."""

    engine_weights: int  # the engine's copy of the model, in the engine's dtype
    # KV pool: token capacity x layers x (K and V) x kv heads x head dim x dtype (or an MLA
    # model's latent: estimate.kv_values_per_token)
    kv_cache: int
    trainer_params: int
    trainer_grads: int
    optimizer_state: int  # AdamW: exp_avg + exp_avg_sq (+ step); 2x params before the first step
    reference_params: int = 0  # the frozen KL reference (0 without one), offloaded with the trainer

    @classmethod
    def measure(cls, policy, optimizer, kv_cache_tokens, engine_dtype, reference=None):
        params = list(policy.parameters())
        trained = [p for p in params if p.requires_grad]  # LoRA: the adapters (+ lora_also_train)
        element = torch.empty((), dtype=engine_dtype).element_size()
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        kv_per_token = kv_values_per_token(policy.config) * element
        # whole model: each rank's engine
        return cls(
            engine_weights=sum(p.numel() for p in params) * element,
            kv_cache=kv_cache_tokens * kv_per_token,
            trainer_params=tensor_bytes(params),
            # allocated by backward, freed by zero_grad(None)
            trainer_grads=tensor_bytes(trained),
            optimizer_state=tensor_bytes(state) if state else 2 * tensor_bytes(trained),
            reference_params=tensor_bytes(reference.parameters()) if reference is not None else 0,
        )


class MemoryPhases:
    """The per-step phase machine: `start()` once before the first rollout, then each step
    `to_train()` after the rollout, and around the weight push (`sync_weights`) `to_sync()` after
    the update and `to_rollout()` after the push."""

    def __init__(
        self,
        engine,
        policy,
        optimizer,
        mode="staged",
        bucket_bytes=256 << 20,
        engine_dtype=torch.float32,
        reference=None,
        *,
        device,
    ):
        if mode not in MEMORY_MODES:
            raise ValueError(f"memory mode {mode!r}: expected one of {MEMORY_MODES}")
        self.engine = engine
        self.policy = policy
        self.optimizer = optimizer
        self.reference = reference
        self.mode, self.bucket_bytes = mode, bucket_bytes
        # the trainer's device, given: the parameters' own may already be the host's (a machine
        # built after setup's start() offloaded them)
        self.device = torch.device(device)
        self.ledger = Ledger.measure(
            policy, optimizer, engine.kv_cache_tokens(), engine_dtype, reference
        )
        self.phase = "setup"
        # what is resident now; trainer_grads only exist between backward and zero_grad
        self.resident = {"engine_weights", "kv_cache", "trainer_params", "optimizer_state"}
        if reference is not None:
            self.resident.add("reference_params")
        self.engine_released = set()
        # the last 64 actions in order ("release weights", "offload optimizer", "empty cache",
        # ...): about 9 a step, so a long run's would pile up
        self.events = collections.deque(maxlen=64)
        # phase -> {"modelled": ledger bytes, "measured": device-wide bytes in use, "trainer": this
        # process's allocator peak}; the last two on GPU only. Reset each step.
        self.peaks = {}
        # each phase's peaks as they were when it last ended: what `metrics` reports (the rollout
        # phase has just begun again when the step's metrics are read)
        self.ended = {}

    def start(self):
        """setup -> rollout, once: the trainer's memory goes to the CPU, since the first step's
        rollout comes first."""
        self._expect("setup", "start")
        self._offload("params", "optimizer")
        self._enter("rollout")
        self._note()

    # ------------------------------------------------------------------ transitions
    def to_train(self):
        """rollout -> train: free the engine (it must be idle), bring the trainer back."""
        self._expect("rollout", "to_train")
        if self.engine.num_in_flight():
            raise PhaseError(
                f"cannot release engine memory with {self.engine.num_in_flight()} requests in "
                "flight"
            )
        # the rollout phase's peak, noted after the rollout (its KV cache filled, on GPU)
        self._note()
        self._enter("train")
        if self.mode != "off":
            self._release(list(self.engine.memory_tags))
        self._onload("params", "optimizer")
        # the update allocates them (activations are not modelled)
        self.resident.add("trainer_grads")
        self._note()

    def to_sync(self):
        """train -> sync, after the update: the optimizer's state offloaded and the engine's weights
        awake, the trainer's weights still on its device (the weight check hashes them there, as
        the engine hashes its own), for the push."""
        self._expect("train", "to_sync")
        # the train phase's peak, noted after the update (activations included, on GPU)
        self._note()
        self._enter("sync")
        self.optimizer.zero_grad(set_to_none=True)
        self.resident.discard("trainer_grads")
        self._offload("optimizer")
        # staged: wake only the weights, so the KV cache is not resident while two model copies are
        if self.mode != "off":
            self._wake(["weights"] if self.mode == "staged" else list(self.engine.memory_tags))
        self._note(extra=min(self.bucket_bytes, self.ledger.trainer_params))  # one bucket in flight

    def to_rollout(self):
        """sync -> rollout, after the push: the trainer's weights offloaded, then (staged) the
        engine's KV cache awake."""
        self._expect("sync", "to_rollout")
        self._offload("params")
        if self.mode == "staged":
            # KV cache (+ CUDA graphs)
            self._wake([tag for tag in self.engine.memory_tags if tag != "weights"])
        self._enter("rollout")
        self._note()

    # ------------------------------------------------------------------ bookkeeping
    def _expect(self, phase, action):
        if self.phase != phase:
            raise PhaseError(
                f"{action}() needs phase {phase!r}, but the step is in phase {self.phase!r}"
            )

    def _enter(self, phase):
        """End the current phase (its peaks kept in `ended`, but setup's, which no step repeats)
        and start `phase`'s peaks afresh (the allocator's too); usage is noted after each action
        inside it (not before the first, which still belongs to the previous phase)."""
        if self.phase != "setup" and self.phase in self.peaks:
            self.ended[self.phase] = self.peaks[self.phase]
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

    def _wake(self, tags):
        # SGLang answers a wake (resume_memory_occupation) of a tag it never released with a bare
        # KeyError from a set removal
        missing = set(tags) - self.engine_released
        if missing:
            raise PhaseError(f"cannot wake engine memory {sorted(missing)}: it was not released")
        self.engine.wake(tags)
        self.events.append(f"wake {' '.join(tags)}")
        self.engine_released -= set(tags)
        self.resident |= {LEDGER_NAME[t] for t in tags if t in LEDGER_NAME}
        self._note()

    def _onload(self, *parts):
        """The trainer's `parts` ("params": its parameters and the KL reference's; "optimizer":
        AdamW's state) onto the accelerator."""
        self._move_trainer(True, "params" in parts, "optimizer" in parts)

    def _offload(self, *parts):
        """The trainer's `parts` (as `_onload`) off the accelerator to the CPU."""
        self._move_trainer(False, "params" in parts, "optimizer" in parts)

    def _move_trainer(self, onload, params, optimizer):
        """Move trainer parameters (and the KL reference) and/or optimizer state onto the
        accelerator or off it to the CPU. After an offload the freed blocks are handed back to the
        CUDA driver at once (empty_cache): PyTorch's caching allocator would otherwise keep them,
        and the engine (another process) could not wake into them."""
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
        """Each phase's peaks as it last ended (read after the weight sync: this step's train
        and sync, and the rollout that began it), and what is resident now."""
        out = {
            f"memory/{phase}_peak_bytes_{self.source}": slowest(peak[self.source])
            for phase, peak in self.ended.items()
        }
        if self.device.type == "cuda":
            out |= {
                f"memory/{phase}_trainer_peak_bytes": slowest(peak["trainer"])
                for phase, peak in self.ended.items()
            }
        for name in ("engine_weights", "kv_cache", "trainer_params", "optimizer_state"):
            out[f"memory/resident_{name}"] = slowest(name in self.resident)
        return out


# ---------------------------------------------------------------- stage 5: the weight sync
def push_weights(engine, policy, version, bucket_bytes, everything=False, check=False):
    """The engine's weights become `policy`'s as `version`: every parameter pushed in buckets, or
    with LoRA adapters (runtime/lora.py) the adapter alone, into SGLang's adapter pool, and what
    trains in full beside it; `everything`: the frozen base too (an engine that loaded other
    weights: a shared one). `check`: the engine verifies the adapter's bytes as they arrive
    (sha256 per tensor; the rest of the model is `check_weights`')."""
    from runtime.engine import adapter_checksums, checkpoint_layout

    layout = checkpoint_layout(policy)
    adapter = lora.adapter_tensors(policy, gather=parallel.full_tensor)
    if not adapter:
        engine.update_weights(
            policy.named_parameters(), version, bucket_bytes, parallel.full_tensor, layout
        )
        return
    base = list(lora.base_weights(policy, trained_only=not everything))
    if base:
        engine.update_weights(base, version, bucket_bytes, parallel.full_tensor, layout)

    checksums = adapter_checksums(adapter) if check else None
    engine.load_adapter(adapter, lora.adapter_config(policy), version, checksums)


def sync_weights(run, step, logprob_gap=None):
    """The engine samples the next step from the updated policy: the trainer's weights, which
    step `step` made, pushed in buckets as weight version step + 1 between the train and rollout
    phases, checked bit for bit on the steps `should_check_weights` picks, and the update's
    `logprob_gap` (its metric, a Ratio; None where pi_old came from the engine) read by the run's
    GapWatch. Returns the stage's metrics."""
    start = time.perf_counter()
    if logprob_gap is not None:  # before the push: an engine dying in it leaves a checkpoint at
        # step + 1, whose streak must have seen this step
        run.gap_watch.observe_ranks(step, logprob_gap)
    run.phases.to_sync()  # the engine's weights awake; the trainer's still on its device
    check = should_check_weights(step, run.cfg.run)
    push_weights(run.engine, run.trainer.policy, step + 1, run.phases.bucket_bytes, check=check)
    check_s = 0.0
    if check:  # before the trainer's weights leave the device: hashed where the engine's are
        check_start = time.perf_counter()
        # with LoRA the engine's own weights are the base (the adapter: its checksums on arrival,
        # and the log-prob gap)
        check_weights(run.engine, lora.base_weights(run.trainer.policy), parallel.full_tensor)
        check_s = time.perf_counter() - check_start
    run.phases.to_rollout()  # the trainer's weights offloaded, the engine's KV cache awake
    metrics = run.phases.metrics()
    metrics["timing/weight_sync_s"] = slowest(time.perf_counter() - start - check_s)
    if check_s:
        metrics["timing/check_weights_s"] = slowest(check_s)
    return metrics


class HealthError(RuntimeError):
    """The engine and the trainer disagree: training on would learn from the wrong samples."""


class WeightMismatchError(HealthError):
    """After a weight push, the engine holds tensors other than the ones the trainer sent."""


class LogprobGapError(HealthError):
    """The engine's log-probs of its own samples are not the trainer's."""


# SGLang fuses these projections into one tensor (tp=1: the parts concatenated along dim 0, in
# this order; sglang/srt/models/qwen2.py, stacked_params_mapping); a model that holds them fused
# already (Phi-3's qkv_proj and gate_up_proj) is compared under the engine's name
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# a mixture of experts: SGLang's FusedMoE holds all experts' gate and up projections as w13_weight
# [experts, 2 x intermediate, hidden] (gate first) and their down projections as w2_weight
# (sglang/srt/layers/moe/fused_moe_triton/layer.py), the layout transformers 5 trains Qwen3 MoE,
# Qwen2 MoE, Mixtral and DeepSeek-V3 in (modeling_qwen3_moe.py, Qwen3MoeExperts). Llama 4 and
# GPT-OSS hold theirs [experts, hidden, 2 x intermediate], and some SGLang backends put the up
# half first: their first check stops the run as different weights (not rehearsed here)
EXPERTS = {"experts.w13_weight": "experts.gate_up_proj", "experts.w2_weight": "experts.down_proj"}
# the vocabulary tensors, whose rows SGLang pads with zeros to a multiple of 64 where it holds them
# as a VocabParallelEmbedding (sglang/srt/layers/vocab_parallel_embedding.py, weight_loader), but
# not all do (Gemma 3's is a plain nn.Embedding: sglang/srt/models/gemma3_causal.py)
VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight")
# The step-0 gap allowed, by the coarser of model.compute_dtype and model.engine_dtype: well above
# what those dtypes give (measured on the CPU demo, docs/RESULTS.md) and well below what a
# mismatch gives (a rope base off by 2x: 0.1 and more).
STEP0_MAX_GAP = {"float32": 1e-4, "bfloat16": 2e-2}


def should_check_weights(step, run_cfg):
    """Every push of the first `run.check_weights_first` steps, then every
    `run.check_weights_every` steps (0: never again)."""
    every = run_cfg.check_weights_every
    return step < run_cfg.check_weights_first or (every > 0 and (step + 1) % every == 0)


def check_weights(engine, named_params, gather=lambda tensor: tensor):
    """Raise WeightMismatchError unless every tensor the engine holds hashes as the trainer's
    `named_params` do once cast to the engine's dtype (and fused and padded as SGLang lays them
    out). The hash is SGLang's own (`tensor_hash`: sha256 on CPU, a Triton kernel on a GPU), run on
    the trainer's tensors where they live. Returns the number of tensors checked."""
    from runtime.engine import pad_vocab_size, tensor_hash

    params = dict(named_params)
    engine_sums = engine.weight_checksums()
    wrong = []
    for name in engine_sums:
        tensor = trainer_tensor(name, params, engine.dtype, gather)
        same = f"{tensor_hash(tensor.contiguous()):016x}" == engine_sums[name]
        if not same and name.endswith(VOCAB_TENSORS):  # padded by this engine's model
            padding = pad_vocab_size(tensor.shape[0]) - tensor.shape[0]
            tensor = torch.nn.functional.pad(tensor, (0, 0, 0, padding))
            same = f"{tensor_hash(tensor.contiguous()):016x}" == engine_sums[name]
        if not same:
            wrong.append(name)
    if wrong:
        raise WeightMismatchError(
            f"after the weight push, {len(wrong)} of {len(engine_sums)} engine tensors differ from "
            f"what the trainer sent: {', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}. "
            "The engine would sample from other weights than the ones trained."
        )
    return len(engine_sums)


def trainer_name(engine_name, params):
    """Where the trainer's `params` would hold one of the engine's tensors, tried in this order:
    the engine's own name (a model that holds it so: Phi-3's fused qkv_proj); a mixture of
    experts' w13 / w2 under the trainer's 3D experts name (`EXPERTS`); for a tensor SGLang fuses
    from parts (`FUSED`), a list of the parts' names, concatenated in that order. A name, or that
    list (`trainer_tensor` refuses a name they do not hold)."""
    if engine_name in params:
        return engine_name
    for engine_part, part in EXPERTS.items():
        if engine_name.endswith(engine_part):
            return engine_name.replace(engine_part, part)
    for fused, parts in FUSED.items():
        if f".{fused}." in engine_name:
            return [engine_name.replace(fused, part) for part in parts]
    return engine_name


def trainer_tensor(engine_name, params, dtype, gather):
    """The trainer's tensor for one of the engine's, whole and cast to the engine's dtype."""
    name = trainer_name(engine_name, params)
    if isinstance(name, list):
        return torch.cat([trainer_tensor(part, params, dtype, gather) for part in name])
    if name not in params:
        # a model whose head is its embedding (tie_word_embeddings), served by an engine model
        # that never ties them (SGLang's qwen3_moe.py): it samples from a head it never loaded
        tied = name == "lm_head.weight" and "model.embed_tokens.weight" in params
        raise WeightMismatchError(
            f"the engine holds {engine_name}, which no trainer tensor makes: the engine's model "
            "is not the trainer's"
            + (" (the trainer's head is its embedding; the engine's is its own)" if tied else "")
        )
    return gather(params[name].detach().to(dtype))


class GapWatch:
    """Reads each step's `train/logprob_gap_max` (engine vs trainer, on the tokens the current
    weights sampled: the largest rank's mean; none on a step with no such token) and raises
    LogprobGapError when it says they disagree."""

    def __init__(self, cfg, first_step, over=0):
        coarser = (
            "bfloat16"
            if "bfloat16" in (cfg.model.compute_dtype, cfg.model.engine_dtype)
            else "float32"
        )
        self.step0_max = STEP0_MAX_GAP[coarser]
        # a resumed process's first step in bf16: still a fresh engine to check, but the gap of a
        # trained policy's rounding drifts: held to the run's own per-step bound where that is
        # larger (a bf16 gap of 0.03 trained on uninterrupted, and stopped the resume). fp32's
        # bound holds whatever the weights (the same fp32 numbers on both sides)
        if first_step > 0 and coarser == "bfloat16":
            self.step0_max = max(self.step0_max, cfg.run.max_logprob_gap)
        self.dtypes = (
            f"model.compute_dtype={cfg.model.compute_dtype}, "
            f"model.engine_dtype={cfg.model.engine_dtype}"
        )
        self.first_step = first_step
        self.max_gap = cfg.run.max_logprob_gap
        self.patience = cfg.run.max_logprob_gap_steps
        self.over = over  # steps in a row above max_gap (a resumed run's, from its checkpoint)

    def observe_ranks(self, step, local_gap):
        """`observe` the largest rank's gap, given this rank's `train/logprob_gap` (a Ratio): every
        rank's engine must agree, and every rank then stops after the same step (and checkpoints
        the same streak). A collective: every rank calls it. A rank with no fresh token to
        compare sends -inf; a step where none had one is not observed (its 0 would pass the
        first step's check and end a streak, measuring nothing): the first step's check moves
        to the next. A NaN gap (the trainer's own log-probs NaN: its update is skipped and
        counted) measures nothing either; an engine's non-finite log-prob is an inf gap
        (update.logprob_gap)."""
        local = local_gap.value if local_gap.count else -math.inf
        local = -math.inf if math.isnan(local) else local  # NaN would compare false everywhere
        largest = parallel.all_reduce([local], op="max")[0]
        if largest > -math.inf:
            self.observe(step, largest)
        elif step == self.first_step:
            self.first_step = step + 1

    def observe(self, step, gap):
        if step == self.first_step and gap > self.step0_max:
            why = " (a NaN or -inf log-prob of a token it sampled)" if math.isinf(gap) else ""
            raise LogprobGapError(
                f"step {step}: the engine's log-probs of its own samples differ from the trainer's "
                f"by {gap:.3g} per token{why} while both hold the same weights (allowed: "
                f"{self.step0_max:g}, {self.dtypes}). The engine computes another model: check the "
                "dtypes, the model's config (rope, vocabulary) and the tokenizer the engine loaded."
            )
        self.over = self.over + 1 if self.max_gap and gap > self.max_gap else 0
        if self.patience and self.over >= self.patience:
            raise LogprobGapError(
                f"step {step}: the engine-vs-trainer log-prob gap (train/logprob_gap_max) was "
                f"above run.max_logprob_gap={self.max_gap} for {self.over} steps in a row (now "
                f"{gap:.3g}): the engine samples from weights or code other than the trainer's."
            )
