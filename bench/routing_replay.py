"""Routing replay (train.routing_replay) against none, on one rollout of the real engine: how far
the trainer's log-probs of the sampled tokens are from the engine's, with the trainer's routers
choosing for themselves and with the engine's choice replayed, on the same weights and tokens.

The model is a random Qwen3 mixture of experts (bench/families.py's, `--experts` experts, 2 a
token); engine and trainer compute in `--dtype` (bfloat16: as on a GPU, where their routers' near
ties fall apart most). The rollout is configs/gsm8k.yaml's at CPU sizes (tests/test_gpu_readiness's)
on `--prompts` GSM8K prompts, 8 samples each; the trainer scores every sampled token in packed
micro-batches, both arms in one process. Run from the repo root: `python bench/routing_replay.py`
(~2 min on 2 cores); the last line: routing_replay: agreement=<f> tokens=<n>
mean_gap_own=<f> mean_gap_replayed=<f> p99_own=<f> p99_replayed=<f> max_own=<f> max_replayed=<f>
"""

import argparse
import atexit
import os
import shutil
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the repo root
sys.path.append(os.path.join(ROOT, "bench"))  # after the root: bench/memory.py is not memory

import assemble  # noqa: E402
import families  # noqa: E402
import train  # noqa: E402
import update  # noqa: E402


def gaps(trainer, micro_batches, replay):
    """(|trainer - engine| log-prob of every sampled token, with or without `replay`; with it,
    the share of replayed token x layer choices the trainer's routers would have made too)."""
    out, counts = [], []
    with torch.no_grad(), update.compute_precision(trainer):
        for mb in micro_batches:
            with trainer.route_replay.replaying(mb if replay else {}):
                logprobs = update.sequence_logprobs(
                    trainer.policy, mb, trainer.cfg.rollout.temperature, trainer.autocast_dtype
                )[0]
            if replay:
                share, count = trainer.route_replay.agreement()
                counts.append((float(count), float(share)))
            out.append((logprobs - mb["engine_logprobs"]).abs()[mb["loss_mask"].bool()])
    agreement = sum(c * s for c, s in counts) / sum(c for c, _ in counts) if replay else None
    return torch.cat(out), agreement


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="bench-routing-")
    atexit.register(shutil.rmtree, out, ignore_errors=True)  # at exit: its model and run files
    folder = os.path.join(out, "qwen3_moe")
    families.build_folder("qwen3_moe", folder, num_experts=args.experts, norm_topk_prob=True)
    sets = [s for s in families.CPU_SIZES if not s.startswith(("data.reward", "run.check"))]
    cfg = assemble.load_config(
        "configs/gsm8k.yaml",
        sets
        + [
            f"run.out={out}/run",
            f"model.path={folder}",
            f"model.compute_dtype={args.dtype}",
            f"model.engine_dtype={args.dtype}",
            f"rollout.prompts_per_step={args.prompts}",
            "train.routing_replay=true",
            "train.compile=false",
        ],
    )
    run = train.setup(cfg)
    try:
        prompts = [p.prompt_ids for p in run.stream.take(args.prompts)]
        samples, _ = run.engine.generate(
            prompts, cfg.rollout.group_size, cfg.rollout.temperature, cfg.rollout.max_new_tokens
        )
    finally:
        run.engine.shutdown()
    trainer = run.trainer
    # setup ends with the trainer offloaded for the first rollout (MemoryPhases.start): back on
    # its device for the forwards below (on a GPU they met CUDA inputs with CPU weights)
    trainer.policy.to(trainer.device)
    micro_batches, _ = update.make_minibatches(
        samples, cfg.train, trainer.pad_id, trainer.device, trainer.route_replay.width
    )
    micro_batches = micro_batches[0]
    own, _ = gaps(trainer, micro_batches, replay=False)
    replayed, agreement = gaps(trainer, micro_batches, replay=True)
    unrouted = sum(int(mb["unrouted"]) for mb in micro_batches)
    print(
        f"{len(samples)} samples, {own.numel()} sampled tokens, {args.experts} experts; "
        f"trainer autocast {trainer.autocast_dtype}, engine {cfg.model.engine_dtype}; unrouted "
        f"samples: {unrouted}"
    )
    print(f"the trainer's routers agree with the engine's on {agreement:.4f} of its choices")
    for name, values in (("own routing", own), ("replayed", replayed)):
        print(
            f"{name}: |log-prob gap| mean {values.mean():.2e}, p99 {values.quantile(0.99):.2e}, "
            f"max {values.max():.2e}, tokens over 0.1: {(values > 0.1).sum()}"
        )
    print(
        f"routing_replay: agreement={agreement:.4f} tokens={own.numel()} "
        f"mean_gap_own={own.mean():.3e} mean_gap_replayed={replayed.mean():.3e} "
        f"p99_own={own.quantile(0.99):.3e} p99_replayed={replayed.quantile(0.99):.3e} "
        f"max_own={own.max():.3e} max_replayed={replayed.max():.3e}"
    )


if __name__ == "__main__":
    main()
