"""Training batches: samples -> micro-batch tensors, and the trainer forward's per-token log-probs.

Owns the tensor layout the loss reads ([B, T-1]: targets, loss mask, engine log-probs, token
versions), the packed layout the model computes on (rows of whole sequences, padding only at row
ends), micro-batching (by rows, or by a token budget; every rank runs the same count), the staleness
mask of partial rollout's older tokens and their off-policy statistics. Does not own the loss
(grpo.py) or the optimizer step (train.py).
"""

import itertools
import math

import torch

import grpo
import parallel
from metrics import summed
from sample import Sample

# array typecode -> tensor dtype
TORCH_DTYPES = {"i": torch.int32, "f": torch.float32, "B": torch.uint8}


def tensor_view(values):
    """A Sample's per-token array as a tensor sharing its memory (torch.tensor would walk it item
    by item)."""
    dtype = TORCH_DTYPES[values.typecode]
    return torch.frombuffer(values, dtype=dtype) if values else torch.empty(0, dtype=dtype)


def collate(samples, pad_id, rows=None):
    """Right-padded [B, T] tensors. Position t of `targets` is the token predicted from input t.

    With `rows` (how many of the samples, in order, share each packed row; `pack_rows` chooses
    them), the model instead computes on `packed_ids` and `position_ids` [R, W] (W: the fullest
    row), and its output head only at `head_index`, the positions that predict a response token
    (no loss reads a prompt token's log-prob). `gather` [B, T-1] says where each padded
    position's prediction sits in the head's output and `gathered` marks those positions, so the
    loss reads the same [B, T-1] layout."""
    full = [s.prompt_ids + s.response_ids for s in samples]
    # a rank with nothing to train still runs padding micro-batches
    width = max(map(len, full), default=2)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    loss_mask = torch.zeros(len(samples), width - 1)
    engine_logprobs = torch.zeros(len(samples), width - 1)
    # weight version that sampled each target
    versions = torch.zeros(len(samples), width - 1, dtype=torch.long)
    for row, (s, ids) in enumerate(zip(samples, full)):
        input_ids[row, : len(ids)] = tensor_view(ids)  # copies, casting int32 -> int64
        attention_mask[row, : len(ids)] = 1
        first = len(s.prompt_ids) - 1  # logits at the last prompt position predict response token 0
        # aborted rows keep an all-zero mask: they count in no loss or denominator
        if not s.is_aborted:
            loss_mask[row, first : first + len(s.response_ids)] = tensor_view(s.loss_mask)
        engine_logprobs[row, first : first + len(s.response_ids)] = tensor_view(s.logprobs)
        versions[row, first : first + len(s.response_ids)] = tensor_view(s.versions)
    batch = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        targets=input_ids[:, 1:],
        loss_mask=loss_mask,
        engine_logprobs=engine_logprobs,
        versions=versions,
    )
    if rows:
        lengths = [len(ids) for ids in full]
        # row r holds samples bounds[r]:bounds[r + 1]
        bounds = list(itertools.accumulate(rows, initial=0))
        row_width = max(sum(lengths[a:b]) for a, b in zip(bounds, bounds[1:]))
        # Positions restart at 0 for each sequence, and every pad slot is at 0 too (a one-token
        # segment of its own): transformers (>= 4.53) then builds a block-diagonal causal mask per
        # row, but only with no attention_mask and no cache
        # (masking_utils.find_packed_sequence_indices).
        packed_ids = torch.full((len(rows), row_width), pad_id, dtype=torch.long)
        position_ids = torch.zeros((len(rows), row_width), dtype=torch.long)
        gather = torch.zeros((len(samples), width - 1), dtype=torch.long)
        gathered = torch.zeros((len(samples), width - 1), dtype=torch.bool)
        # flat positions in [R * W] whose hidden state predicts a response token
        head_index, done = [], 0
        for r, (a, b) in enumerate(zip(bounds, bounds[1:])):
            start = r * row_width
            for i in range(a, b):
                packed_ids.view(-1)[start : start + lengths[i]] = input_ids[i, : lengths[i]]
                position_ids.view(-1)[start : start + lengths[i]] = torch.arange(lengths[i])
                first, n = len(samples[i].prompt_ids) - 1, len(samples[i].response_ids)
                gather[i, first : first + n] = torch.arange(done, done + n)
                gathered[i, first : first + n] = True
                head_index.append(torch.arange(start + first, start + first + n))
                start, done = start + lengths[i], done + n
        batch |= dict(
            packed_ids=packed_ids,
            position_ids=position_ids,
            head_index=torch.cat(head_index),
            gather=gather,
            gathered=gathered,
        )
    return batch


def sequence_logprobs(model, batch, temperature, autocast_dtype=None, entropy_grad=False):
    """Per-token log-probs and entropies [B, T-1] of `batch['targets']` under `model`, in fp32.

    For this call the model's output head returns log-probs (grpo.head_logprobs, chunked over
    positions) instead of [B, T, V] logits: it still runs inside the model's forward, where FSDP2
    has gathered the head's weight as for the usual logits, but the full logits never exist. With
    one rank, `autocast_dtype` runs the matmuls in bf16 over the fp32 parameters (with FSDP2 its
    mixed precision policy does that, and autocast stays off). The entropies carry their graph
    only with `entropy_grad` (an entropy bonus in the loss).
    """
    head = model.get_output_embeddings()
    packed = "packed_ids" in batch
    input_ids = batch["packed_ids"] if packed else batch["input_ids"]
    # packed: only the positions that predict a response token (the next one in the row is its
    # target); padded: position t predicts target t (= input t + 1)
    index = batch["head_index"] if packed else None
    targets = input_ids.flatten()[index + 1] if packed else input_ids[:, 1:]

    def logprobs_head(hidden):  # hidden: [B, T, H]
        logprobs, entropy = grpo.head_logprobs(
            hidden if packed else hidden[:, :-1],
            head.weight,
            head.bias,
            targets,
            temperature,
            index=index,
            entropy_grad=entropy_grad,
        )
        # [B, T-1, 2] (packed: [N, 2]), where the logits would be
        return torch.stack([logprobs, entropy], -1)

    head.forward = logprobs_head  # an instance attribute: shadows nn.Linear.forward until deleted
    try:
        # use_cache=False: the config's default (True for Qwen2.5) would build a DynamicCache that
        # keeps every layer's K/V alive through the no-grad pass (transformers utils/generic.py),
        # and packing needs it off
        inputs = (
            dict(position_ids=batch["position_ids"], attention_mask=None)
            if packed
            else dict(attention_mask=batch["attention_mask"])
        )
        with torch.autocast(
            input_ids.device.type,
            dtype=autocast_dtype or torch.float32,
            enabled=autocast_dtype is not None,
        ):
            out = model(input_ids=input_ids, use_cache=False, **inputs).logits
    finally:
        del head.forward
    if packed:  # back to the [B, T-1] layout the loss reads (gradients flow through the gather)
        out = out[batch["gather"]] * batch["gathered"].unsqueeze(-1)
    return out[..., 0], out[..., 1] if entropy_grad else out[..., 1].detach()


def micro_batches(samples, advantages, size, pad_id, max_tokens=0):
    """Collated micro-batches: with `max_tokens`, packed rows of at most that many positions
    (`pack_rows`), else padded ones of at most `size` samples, each padded only to its own
    longest row. Then padding micro-batches (one row, nothing trained) up to the count of the
    rank that needs the most: with FSDP every forward and backward is a collective, so every rank
    must run the same number (verl equalises the same way). Returns (micro-batches, how many
    samples were longer than the budget: each got one of its own)."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    if max_tokens:
        layout = pack_rows(lengths, max_tokens)  # [micro-batch][row][sample index]
        indices = [[i for row in mb for i in row] for mb in layout]
        row_sizes = [[len(row) for row in mb] for mb in layout]
    else:
        indices = [
            list(range(start, min(start + size, len(samples))))
            for start in range(0, len(samples), size)
        ]
        row_sizes = [None] * len(indices)  # padded: one sample per row
    out = []
    for mb_indices, mb_row_sizes in zip(indices, row_sizes):
        mb = collate([samples[i] for i in mb_indices], pad_id, mb_row_sizes)
        mb["advantages"] = advantages[mb_indices].float()
        out.append(mb)
    count = max(int(parallel.all_reduce([len(out)], op="max")[0]), 1)
    while len(out) < count:
        mb = collate(
            [Sample([pad_id], [pad_id], [0.0], [0], group_id=0, is_aborted=True)],
            pad_id,
            [1] if max_tokens else None,
        )
        mb["advantages"] = torch.zeros(1)
        out.append(mb)
    return out, sum(n > max_tokens for n in lengths) if max_tokens else 0


def pack_rows(lengths, max_tokens):
    """Sample indices laid out as [micro-batch][row][sample]. First-fit decreasing over the whole
    minibatch (longest first, each into the first row with room) into rows as wide as its longest
    sequence, then as many rows per micro-batch as the budget holds (rows x width <= max_tokens,
    so the budget bounds the positions computed, hence memory). Rows come out nearly full (a few
    % padding at GRPO's 64 samples per rank; fewer samples leave more gaps), and none is wider
    than its longest sequence needs alone: with a dense block-diagonal mask (SDPA) attention
    costs width^2 per row whatever the row holds. A sequence longer than the budget gets a
    micro-batch of its own."""
    over = [[[i]] for i, n in enumerate(lengths) if n > max_tokens]
    fitting = sorted(
        (i for i, n in enumerate(lengths) if n <= max_tokens), key=lambda i: -lengths[i]
    )
    width = lengths[fitting[0]] if fitting else 1
    rows, room = [], []
    for i in fitting:
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    per_micro_batch = max_tokens // width
    return over + [rows[k : k + per_micro_batch] for k in range(0, len(rows), per_micro_batch)]


def layout_stats(micro_batches):
    """What the model computed on: real tokens, the share of padding among the positions it ran
    (`padded_fraction`), the positions its output head ran on (packed: response tokens only),
    micro-batch count and real tokens per micro-batch."""
    tokens = sum(int(mb["attention_mask"].sum()) for mb in micro_batches)
    positions = sum(
        (mb["packed_ids"] if "packed_ids" in mb else mb["attention_mask"]).numel()
        for mb in micro_batches
    )
    head = sum(
        len(mb["head_index"]) if "head_index" in mb else mb["targets"].numel()
        for mb in micro_batches
    )
    return {
        "train/tokens": summed(tokens),
        "train/padded_fraction": 1 - tokens / max(positions, 1),
        "train/head_positions": head,
        "train/micro_batches": summed(len(micro_batches)),
        "train/tokens_per_micro_batch": tokens / max(len(micro_batches), 1),
    }


def mask_stale_tokens(micro_batches, version, max_staleness):
    """Each micro-batch's per-token staleness (weight versions between the policy being trained,
    `version`, and the one that sampled the token; 0 where nothing is trained). With
    `max_staleness` >= 0, older tokens leave the loss mask (the alternative to weighting them by
    TIS). Returns {"staleness/masked_tokens": the count masked}. Writes mb["staleness"], which
    old log-probs' gap and `offpolicy_stats` read: it runs first."""
    masked = 0
    for mb in micro_batches:
        mb["staleness"] = (version - mb["versions"]) * (mb["loss_mask"] > 0)
        if max_staleness >= 0:
            too_old = (mb["staleness"] > max_staleness) & (mb["loss_mask"] > 0)
            masked += int(too_old.sum())
            mb["loss_mask"] = mb["loss_mask"] * ~too_old
    return {"staleness/masked_tokens": summed(masked)}


def offpolicy_stats(micro_batches, tis_cap):
    """How much of the batch an older policy sampled (partial rollout resumes): the trained
    tokens per staleness (a histogram as staleness/tokens_<k> counts), and on the stale tokens
    the importance weight pi_old / pi_engine (capped by `tis_cap` when on) and the fraction the
    cap cut."""
    trained = [mb["loss_mask"] > 0 for mb in micro_batches]
    staleness = torch.cat([mb["staleness"][m] for mb, m in zip(micro_batches, trained)])
    log_weight = torch.cat(
        [
            (mb["old_logprobs"] - mb["engine_logprobs"])[m & (mb["staleness"] > 0)]
            for mb, m in zip(micro_batches, trained)
        ]
    )
    stats = {f"staleness/tokens_{k}": summed((staleness == k).sum()) for k in range(4)}
    stats["staleness/tokens_4+"] = summed((staleness >= 4).sum())
    stats["train/stale_token_frac"] = (
        (staleness > 0).float().mean().item() if len(staleness) else 0.0
    )
    if len(log_weight):
        cap = math.log(tis_cap) if tis_cap else math.inf
        stats["train/stale_is_weight"] = log_weight.clamp(max=cap).exp().mean().item()
        stats["train/stale_is_capped_frac"] = (log_weight > cap).float().mean().item()
    return stats


def minibatches(samples, advantages, cfg, pad_id, device):
    """The step's `cfg.num_minibatches` minibatches (`cfg`: TrainConfig), each a list of collated
    micro-batches on `device`: minibatch i is the i-th slice of this rank's samples. Collated
    once, read by both passes (old log-probs, then the update). Every rank makes the same count
    (clip_grad_norm_ is a collective too). Returns (minibatches, sequences over the budget)."""
    size = max(math.ceil(len(samples) / cfg.num_minibatches), 1)
    out = []
    over_budget = 0
    for i in range(cfg.num_minibatches):
        rows = slice(i * size, (i + 1) * size)
        batches, over = micro_batches(
            samples[rows],
            advantages[rows],
            cfg.micro_batch_size,
            pad_id,
            max_tokens=cfg.max_tokens_per_micro_batch,
        )
        out.append([{key: value.to(device) for key, value in mb.items()} for mb in batches])
        over_budget += over
    return out, over_budget
