"""The output head at top_p < 1 against top_p 1, side by side in one run: loss.head_logprobs (the
chunked projection, then log-probs and entropies; forward and backward) on the same hidden states
and weight, the two top_p in turns, median of `--repeats` after a warm-up, device synchronised.
The logits' spread is `--scale` (their std): 6 makes them peaked as a trained model's, so no
position's nucleus passes its top 256 and each is scored from those tokens (loss.nucleus_slots);
0.05 makes them near-uniform, every position `wide` (the whole vocabulary, the worst case). The
count of wide positions in the first chunk is printed. Defaults: Qwen2.5's vocabulary, 512
positions in chunks of 256, fp32, CPU; the head alone, not the update (bench/train_step.py).

    python bench/nucleus_head.py [--vocab 151936] [--tokens 512] [--scale 0.05]
    python bench/nucleus_head.py --device cuda --dtype bfloat16 --hidden 1536 --tokens 16384 \\
        --chunk 1024

Last line: nucleus_head: device=<d> vocab=<v> wide=<n> top_p1_s=<f> top_p_s=<f> ratio=<f>
"""

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import loss  # noqa: E402


def timed_head(hidden, weight, targets, top_p, chunk):
    """Seconds for one forward and backward of loss.head_logprobs at `top_p`."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    sync = torch.cuda.synchronize if hidden.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    logprobs, _ = loss.head_logprobs(h, w, None, targets, 1.0, chunk_tokens=chunk, top_p=top_p)
    logprobs.sum().backward()
    sync()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--scale", type=float, default=6.0, help="the logits' std")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    weight = (torch.randn(args.vocab, args.hidden) / args.hidden**0.5).to(args.device, dtype)
    hidden = (torch.randn(1, args.tokens, args.hidden) * args.scale).to(args.device, dtype)
    targets = torch.randint(0, args.vocab, (1, args.tokens), device=args.device)
    with torch.no_grad():
        logits = hidden[0, : args.chunk] @ weight.T
        wide = len(loss.nucleus_edge(logits, 1.0, args.top_p)[3])
    times = {1.0: [], args.top_p: []}
    for repeat in range(args.repeats + 1):  # the first round warms up, untimed
        for top_p in times:
            seconds = timed_head(hidden, weight, targets, top_p, args.chunk)
            if repeat:
                times[top_p].append(seconds)
    full, nucleus = (statistics.median(times[p]) for p in (1.0, args.top_p))
    print(
        f"nucleus_head: device={args.device} vocab={args.vocab} wide={wide} "
        f"top_p1_s={full:.3f} top_p_s={nucleus:.3f} ratio={nucleus / full:.3f}"
    )


if __name__ == "__main__":
    main()
