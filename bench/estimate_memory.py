"""Per-GPU memory of a config, estimated without a GPU: what each phase of a step holds on one rank,
for 1 rank and for N ranks (FSDP2 shards the trainer's fp32 state; every rank holds a whole engine).

python bench/estimate_memory.py --config configs/gsm8k.yaml [--ranks 8] [--gpu-gib 79.2]

Arithmetic from the model's shape and the config, not a measurement: the rules of thumb are in the
comments, and the activation term is an estimate (bf16 activations; its factor, fitted on H200
runs under FlexAttention, depends on train.compile: runtime/estimate.py). The model's
shape comes from its HF config (`model.path`), or, offline, from the public configs of the models
the shipped configs name. Ends with one line per rank count: estimate: config=<path> ranks=<n>
rollout_gib=<f> train_gib=<f> sync_gib=<f> peak_gib=<f> headroom=<f>
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from config import read_config  # noqa: E402
from assemble import load_config  # noqa: E402

from runtime.estimate import (  # noqa: E402,F401  (the arithmetic; names bench/ reads)
    CONTEXT_GIB,
    H100_80GB_GIB,
    KNOWN_SHAPES,
    estimate,
    qwen2_config,
    shape_of,
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/gsm8k.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--ranks", type=int, default=8, help="N, shown beside 1 rank")
    parser.add_argument(
        "--gpu-gib", type=float, default=H100_80GB_GIB, help="the card's total as CUDA reports it"
    )
    args = parser.parse_args()
    # the estimate reads no rows; gsm8k and chat need a train_path set (a tiny task refuses one)
    task = read_config(args.config, args.set).data.task
    rows = ["data.train_path=unused-by-the-estimate"] if task in ("gsm8k", "chat") else []
    cfg = load_config(args.config, args.set + rows)
    gpu_bytes = args.gpu_gib * 2**30
    results = {n: estimate(cfg, n, gpu_bytes) for n in sorted({1, args.ranks})}
    gib = lambda b: f"{b / 2**30:8.2f}"  # noqa: E731
    print(
        f"{args.config}: {cfg.model.path}, per-GPU GiB (estimates, not measured), "
        f"{args.gpu_gib:g} GiB card"
    )
    print(
        f"{'component':<48}"
        + "".join(f"{f'{n} rank' + ('s' if n > 1 else ''):>10}" for n in results)
    )
    # row by row: with max_tokens_per_micro_batch auto, each rank count names its own budget in
    # the activations row
    for row in zip(*(parts.items() for parts, _ in results.values())):
        names = list(dict.fromkeys(name for name, _ in row))
        label = names[0] if len(names) == 1 else " / ".join(names).replace(" tokens, packed", "")
        print(f"{label:<48}" + "".join(f"{gib(value):>10}" for _, value in row))
    for phase in ("rollout", "train", "sync"):
        print(
            f"{'peak: ' + phase + ' phase':<48}"
            + "".join(f"{gib(ph[phase]):>10}" for _, ph in results.values())
        )
    for n, (_, phases) in results.items():
        peak = max(phases.values())
        print(
            f"estimate: config={args.config} ranks={n} rollout_gib={phases['rollout'] / 2**30:.2f} "
            f"train_gib={phases['train'] / 2**30:.2f} sync_gib={phases['sync'] / 2**30:.2f} "
            f"peak_gib={peak / 2**30:.2f} headroom={1 - peak / gpu_bytes:.3f}"
        )


if __name__ == "__main__":
    main()
