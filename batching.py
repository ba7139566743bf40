"""Training batches: samples -> padded micro-batch tensors, and the trainer forward's per-token log-probs.

Owns the tensor layout the loss reads ([B, T-1]: targets, loss mask, engine log-probs, token versions),
micro-batching (every rank runs the same count), the staleness mask of partial rollout's older tokens and
their off-policy statistics. Does not own the loss (grpo.py) or the optimizer step (train.py).
"""
import math

import torch

import grpo
import parallel
from sample import Sample

TORCH_DTYPES = {"i": torch.int32, "f": torch.float32, "B": torch.uint8}  # array typecode -> tensor dtype


def tensor_view(values):
    """A Sample's per-token array as a tensor sharing its memory (torch.tensor would walk it item by item)."""
    dtype = TORCH_DTYPES[values.typecode]
    return torch.frombuffer(values, dtype=dtype) if values else torch.empty(0, dtype=dtype)


def collate(samples, pad_id):
    """Right-padded [B, T] tensors. Position t of `targets` is the token predicted from input t."""
    full = [s.prompt_ids + s.response_ids for s in samples]
    width = max(map(len, full), default=2)  # a rank with nothing to train still runs padding micro-batches
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    loss_mask = torch.zeros(len(samples), width - 1)
    engine_logprobs = torch.zeros(len(samples), width - 1)
    versions = torch.zeros(len(samples), width - 1, dtype=torch.long)  # weight version that sampled each target
    for row, (s, ids) in enumerate(zip(samples, full)):
        input_ids[row, :len(ids)] = tensor_view(ids)  # copies, casting int32 -> int64
        attention_mask[row, :len(ids)] = 1
        first = len(s.prompt_ids) - 1  # logits at the last prompt position predict response token 0
        if not s.is_aborted:  # aborted rows keep an all-zero mask: they count in no loss or denominator
            loss_mask[row, first:first + len(s.response_ids)] = tensor_view(s.loss_mask)
        engine_logprobs[row, first:first + len(s.response_ids)] = tensor_view(s.logprobs)
        versions[row, first:first + len(s.response_ids)] = tensor_view(s.versions)
    return dict(input_ids=input_ids, attention_mask=attention_mask, targets=input_ids[:, 1:],
                loss_mask=loss_mask, engine_logprobs=engine_logprobs, versions=versions)


def sequence_logprobs(model, batch, temperature, autocast_dtype=None):
    """Per-token log-probs and entropies [B, T-1] of `batch['targets']` under `model`, in fp32.

    For this call the model's output head returns log-probs (grpo.head_logprobs, chunked over positions)
    instead of [B, T, V] logits: it still runs inside the model's forward, where FSDP2 has gathered the
    head's weight as for the usual logits, but the full logits never exist. With one rank,
    `autocast_dtype` runs the matmuls in bf16 over the fp32 parameters (with FSDP2 its mixed precision
    policy does that, and autocast stays off).
    """
    head = model.get_output_embeddings()

    def logprobs_head(hidden):  # hidden: [B, T, H]; position t predicts target t (= input t + 1)
        logprobs, entropy = grpo.head_logprobs(hidden[:, :-1], head.weight, head.bias, batch["targets"], temperature)
        return torch.stack([logprobs, entropy], -1)  # [B, T-1, 2], returned where the logits would be

    head.forward = logprobs_head  # an instance attribute: shadows nn.Linear.forward until deleted
    try:
        device_type = batch["input_ids"].device.type
        with torch.autocast(device_type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            # use_cache=False: the config's default (True for Qwen2.5) would build a DynamicCache that keeps every
            # layer's K/V alive through the no-grad pass, for nothing (transformers utils/generic.py)
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    finally:
        del head.forward
    return out[..., 0], out[..., 1].detach()


def micro_batches(samples, advantages, size, count, pad_id):
    """Exactly `count` collated micro-batches of at most `size` samples, each padded only to its own longest
    row (not the step's: one long response would widen every row), then padding micro-batches (one row,
    nothing trained). With FSDP every forward and backward is a collective, so every rank must run the
    same number of them, whatever its share of the step's samples (verl equalises the same way)."""
    out = []
    for start in range(0, len(samples), size):
        mb = collate(samples[start:start + size], pad_id)
        mb["advantages"] = advantages[start:start + size].float()
        out.append(mb)
    while len(out) < count:
        mb = collate([Sample([pad_id], [pad_id], [0.0], [0], group_id=0, is_aborted=True)], pad_id)
        mb["advantages"] = torch.zeros(1)
        out.append(mb)
    return out


def num_micro_batches(num_rows, size):
    """The micro-batch count every rank runs: the largest any rank needs (at least one)."""
    return max(int(parallel.all_reduce([math.ceil(num_rows / size)], op="max")[0]), 1)


def mask_stale_tokens(micro_batches, version, max_staleness):
    """Each micro-batch's per-token staleness (weight versions between the policy being trained, `version`,
    and the one that sampled the token; 0 where nothing is trained). With `max_staleness` >= 0, older
    tokens leave the loss mask (the alternative to weighting them by TIS). Returns the count masked."""
    masked = 0
    for mb in micro_batches:
        mb["staleness"] = (version - mb["versions"]) * (mb["loss_mask"] > 0)
        if max_staleness >= 0:
            too_old = (mb["staleness"] > max_staleness) & (mb["loss_mask"] > 0)
            masked += int(too_old.sum())
            mb["loss_mask"] = mb["loss_mask"] * ~too_old
    return {"staleness/masked_tokens": masked}


def offpolicy_stats(micro_batches, tis_cap):
    """How much of the batch an older policy sampled (partial rollout resumes): the trained tokens per
    staleness (a histogram as staleness/tokens_<k> counts), and on the stale tokens the importance
    weight pi_old / pi_engine (capped by `tis_cap` when on) and the fraction the cap cut."""
    trained = [mb["loss_mask"] > 0 for mb in micro_batches]
    staleness = torch.cat([mb["staleness"][m] for mb, m in zip(micro_batches, trained)])
    log_weight = torch.cat([(mb["old_logprobs"] - mb["engine_logprobs"])[m & (mb["staleness"] > 0)]
                            for mb, m in zip(micro_batches, trained)])
    stats = {f"staleness/tokens_{k}": int((staleness == k).sum()) for k in range(4)}
    stats["staleness/tokens_4+"] = int((staleness >= 4).sum())
    stats["train/stale_token_frac"] = (staleness > 0).float().mean().item() if len(staleness) else 0.0
    if len(log_weight):
        cap = math.log(tis_cap) if tis_cap else math.inf
        stats["train/stale_is_weight"] = log_weight.clamp(max=cap).exp().mean().item()
        stats["train/stale_is_capped_frac"] = (log_weight > cap).float().mean().item()
    return stats
