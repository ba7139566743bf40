"""Run health: the checks that stop a run whose engine and trainer disagree, before it trains on
it for hours.

Two ways a colocated run goes wrong without an error (the other trainers' most reported silent
failure): the engine samples from weights other than the trainer's (a push that dropped or mangled a
tensor, a stale cache), or it computes differently from the trainer (a dtype, rope, template or
tokenizer mismatch). Neither raises; both only move `train/logprob_gap`, and a small fault moves it
little. So:
- `check_weights`: after a push, every tensor the engine holds is hashed inside the engine (SGLang's
  weight checker) and compared with the same hash of what the trainer sent, bit for bit;
- `GapWatch`: at the first step, when both hold the same weights, the engine-vs-trainer log-prob
  gap must be below what the dtypes explain (measured: `STEP0_MAX_GAP`); later, a gap above
  `run.max_logprob_gap` for `run.max_logprob_gap_steps` steps in a row stops the run.
Each failure is a HealthError: train.py ends the run with exit 2, naming the last checkpoint.
"""

import torch

import checkpoint

# SGLang fuses these projections into one tensor (tp=1: the parts concatenated along dim 0, in
# this order; sglang/srt/models/qwen2.py, stacked_params_mapping)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# the vocabulary tensors, whose rows SGLang pads with zeros to a multiple of 64
# (sglang/srt/layers/vocab_parallel_embedding.py, weight_loader)
VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight")
# The step-0 gap allowed, by the coarser of model.compute_dtype and model.engine_dtype: well above
# what those dtypes give (measured on the CPU demo, docs/RESULTS.md) and well below what a
# mismatch gives (a rope base off by 2x: 0.1 and more).
STEP0_MAX_GAP = {"float32": 1e-4, "bfloat16": 2e-2}


class HealthError(RuntimeError):
    """The engine and the trainer disagree: training on would learn from the wrong samples."""


class WeightMismatchError(HealthError):
    """After a weight push, the engine holds tensors other than the ones the trainer sent."""


class LogprobGapError(HealthError):
    """The engine's log-probs of its own samples are not the trainer's."""


def should_check_weights(step, run_cfg):
    """Every push of the first `run.check_weights_first` steps, then every
    `run.check_weights_every` steps (0: never again)."""
    every = run_cfg.check_weights_every
    return step < run_cfg.check_weights_first or (every > 0 and (step + 1) % every == 0)


def check_weights(engine, named_params, out_dir, gather=lambda tensor: tensor):
    """Raise WeightMismatchError unless every tensor the engine holds hashes as the trainer's
    `named_params` do once cast to the engine's dtype (and fused and padded as SGLang lays them
    out). The hash is SGLang's own (`tensor_hash`: sha256 on CPU, a Triton kernel on a GPU), run on
    the trainer's tensors where they live. Returns the number of tensors checked."""
    from sglang.srt.layers.vocab_parallel_embedding import pad_vocab_size
    from sglang.srt.managers.mm_utils import tensor_hash

    params = dict(named_params)
    engine_sums = engine.weight_checksums()
    wrong = []
    for name, engine_sum in engine_sums.items():
        tensor = trainer_tensor(name, params, engine.dtype, gather)
        if name.endswith(VOCAB_TENSORS):
            padding = pad_vocab_size(tensor.shape[0]) - tensor.shape[0]
            tensor = torch.nn.functional.pad(tensor, (0, 0, 0, padding))
        if f"{tensor_hash(tensor.contiguous()):016x}" != engine_sum:
            wrong.append(name)
    if wrong:
        raise WeightMismatchError(
            f"after the weight push, {len(wrong)} of {len(engine_sums)} engine tensors differ from "
            f"what the trainer sent: {', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}. "
            f"The engine would sample from other weights than the ones trained. "
            f"Last checkpoint: {last_checkpoint(out_dir)}"
        )
    return len(engine_sums)


def trainer_tensor(engine_name, params, dtype, gather):
    """The trainer's tensor for one of the engine's, whole and cast to the engine's dtype."""
    for fused, parts in FUSED.items():
        if f".{fused}." in engine_name:
            names = [engine_name.replace(fused, part) for part in parts]
            return torch.cat([trainer_tensor(name, params, dtype, gather) for name in names])
    if engine_name not in params:
        raise WeightMismatchError(
            f"the engine holds {engine_name}, which no trainer tensor makes: the engine's model "
            "is not the trainer's"
        )
    return gather(params[engine_name].detach().to(dtype))


def last_checkpoint(out_dir):
    """Where to resume from, for the error messages."""
    return checkpoint.latest(out_dir) or "none yet"


class GapWatch:
    """Reads each step's `train/logprob_gap` (engine vs trainer, on the tokens the current weights
    sampled) and raises LogprobGapError when it says they disagree."""

    def __init__(self, cfg, first_step):
        coarser = (
            "bfloat16"
            if "bfloat16" in (cfg.model.compute_dtype, cfg.model.engine_dtype)
            else "float32"
        )
        self.step0_max = STEP0_MAX_GAP[coarser]
        self.dtypes = (
            f"model.compute_dtype={cfg.model.compute_dtype}, "
            f"model.engine_dtype={cfg.model.engine_dtype}"
        )
        self.first_step = first_step
        self.max_gap = cfg.run.max_logprob_gap
        self.patience = cfg.run.max_logprob_gap_steps
        self.out_dir = cfg.run.out
        self.over = 0  # steps in a row above max_gap

    def observe(self, step, gap):
        if step == self.first_step and gap > self.step0_max:
            raise LogprobGapError(
                f"step {step}: the engine's log-probs of its own samples differ from the trainer's "
                f"by {gap:.3g} per token while both hold the same weights ({self.dtypes} allow "
                f"{self.step0_max:g}). The engine computes another model: check the dtypes, the "
                "model's config (rope, vocabulary) and the tokenizer the engine loaded. "
                f"Last checkpoint: {last_checkpoint(self.out_dir)}"
            )
        self.over = self.over + 1 if self.max_gap and gap > self.max_gap else 0
        if self.patience and self.over >= self.patience:
            raise LogprobGapError(
                f"step {step}: the engine-vs-trainer log-prob gap was above "
                f"run.max_logprob_gap={self.max_gap} for {self.over} steps in a row (now "
                f"{gap:.3g}): the engine samples from weights or code other than the trainer's. "
                f"Last checkpoint: {last_checkpoint(self.out_dir)}"
            )
