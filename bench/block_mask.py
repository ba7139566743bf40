"""The packed update's FlexAttention mask, built two ways side by side in one run: torch's
create_block_mask (uncompiled: every token pair evaluated, [T, T] booleans first; what
update.document_mask did before) and update.document_mask (from each 128-token block's first and
last sequence). Each width is one packed row of GSM8K-like sequences (bench/train_step.py's
`gsm8k_samples` lengths), the two masks checked equal block for block, then timed (median of
`--repeats`, device synchronised). On a GPU add 47104: the `auto` budget Qwen2.5-1.5B gets on an
H200.

    python bench/block_mask.py [--widths 4096,16384] [--repeats 5]

Last line: block_mask: device=<d> width=<w> dense_s=<f> blocks_s=<f> speedup=<f> (the widest).
"""

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import update  # noqa: E402


def packed_row(width, seed=0):
    """position_ids [1, width]: sequences of 150 to 420 tokens back to back (a GSM8K-like prompt
    and response each), the last cut at the row's end."""
    generator = torch.Generator().manual_seed(seed)
    position_ids = torch.empty(1, width, dtype=torch.long)
    start = 0
    while start < width:
        n = min(int(torch.randint(150, 421, (1,), generator=generator)), width - start)
        position_ids[0, start : start + n] = torch.arange(n)
        start += n
    return position_ids


def dense_mask(position_ids):
    """The mask as create_block_mask builds it, uncompiled (the reference)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch_size, width = position_ids.shape
    mask_mod = update.causal_in_document(update.document_ids(position_ids))
    return create_block_mask(mask_mod, batch_size, None, width, width, device=position_ids.device)


def timed(fn, position_ids, repeats):
    seconds = []
    for _ in range(repeats + 1):  # the first warms up
        if position_ids.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        mask = fn(position_ids)
        if position_ids.is_cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:]), mask


def same(a, b):
    """Equal counts and equal allowed indices, partial and full, key and query side."""
    for side in ("kv", "full_kv", "q", "full_q"):
        counts, other = getattr(a, f"{side}_num_blocks"), getattr(b, f"{side}_num_blocks")
        if not torch.equal(counts.int(), other.int()):
            return False
        order = torch.arange(getattr(a, f"{side}_indices").shape[-1], device=counts.device)
        valid = order < counts[..., None]
        ours = getattr(a, f"{side}_indices").int()[valid]
        theirs = getattr(b, f"{side}_indices").int()[valid]
        if not torch.equal(ours, theirs):
            return False
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=lambda t: [int(w) for w in t.split(",")], default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    widths = args.widths or ([4096, 16384, 47104] if device.type == "cuda" else [4096, 16384])
    line = None
    for width in widths:
        position_ids = packed_row(width).to(device)
        dense_s, expected = timed(dense_mask, position_ids, args.repeats)
        blocks_s, got = timed(update.document_mask, position_ids, args.repeats)
        if not same(got, expected):
            raise SystemExit(f"block_mask: width {width}: the two masks differ")
        line = (
            f"block_mask: device={device.type} width={width} dense_s={dense_s:.4f} "
            f"blocks_s={blocks_s:.4f} speedup={dense_s / blocks_s:.1f}"
        )
        print(line, flush=True)
    return line


if __name__ == "__main__":
    main()
