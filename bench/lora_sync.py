"""The LoRA weight sync against the full push, on one engine in one run: bytes and seconds of
pushing the whole model (what a full fine-tuning step sends: Engine.update_weights, in buckets)
and of loading the adapter alone into SGLang's LoRA pool (Engine.load_adapter, what a LoRA step
sends: memory.push_weights), alternated, medians of `--repeats`.

The model is the demo's Qwen2 built locally at a larger shape (`--hidden`, `--layers`; default
~25 M parameters, 100 MB in fp32: the push must dominate its fixed costs to be measured), with the
demo's adapters (rank `--rank` on every projection of its decoder layers). After the timed pushes
the engine's greedy log-probs through the adapter are compared with the trainer's (the gap check
of every step). Run from the repo root: `python bench/lora_sync.py`; the last line: lora_sync:
full_bytes=<n> adapter_bytes=<n> full_s=<f> adapter_s=<f> bytes_ratio=<f> time_ratio=<f>
"""

import argparse
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import assemble  # noqa: E402
import memory  # noqa: E402
import runtime.lora as lora  # noqa: E402
import train  # noqa: E402


def tensor_bytes(tensors, dtype=None):
    return sum(t.numel() * (dtype or t.dtype).itemsize for t in tensors)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="bench-lora-sync-")
    atexit.register(shutil.rmtree, out, ignore_errors=True)  # at exit: its model and run files
    cfg = assemble.load_config(
        "configs/tiny_lora.yaml",
        [
            f"run.out={out}",
            f"model.hidden_size={args.hidden}",
            f"model.intermediate_size={args.hidden * 11 // 4}",
            f"model.num_layers={args.layers}",
            "model.num_heads=8",
            f"model.lora_rank={args.rank}",
            "model.lora_also_train=[]",
            "data.num_val_prompts=8",
        ],
    )
    run = train.setup(cfg)
    try:
        policy, engine = run.trainer.policy, run.engine
        with torch.no_grad():  # an adapter that changes the model (B starts at zero)
            for module in lora.adapted(policy).values():
                module.lora_B.normal_(0, 0.02)
        full = list(lora.base_weights(policy))
        adapter = lora.adapter_tensors(policy)
        full_bytes = tensor_bytes((t for _, t in full), engine.dtype)
        adapter_bytes = tensor_bytes(adapter.values())
        bucket = cfg.memory.bucket_mb << 20
        times = {"full": [], "adapter": []}
        version = 1
        for _ in range(args.repeats):
            for arm in ("full", "adapter"):
                start = time.perf_counter()
                if arm == "full":
                    engine.update_weights(full, version, bucket)
                else:
                    memory.push_weights(engine, policy, version, bucket)
                times[arm].append(time.perf_counter() - start)
                version += 1
        # the adapter is served: the engine's greedy log-probs against the trainer's
        prompt = run.val_prompts[0].prompt_ids
        sampling = {"temperature": 0.0, "max_new_tokens": 8}
        ids, engine_logprobs, *_ = engine._run(engine.request("gap", prompt, sampling))
        with torch.no_grad():
            logits = policy(torch.tensor([list(prompt) + list(ids)])).logits.log_softmax(-1)[0]
        trainer = [logits[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)]
        gap = max(abs(a - b) for a, b in zip(trainer, engine_logprobs))
    finally:
        run.engine.shutdown()
    full_s, adapter_s = (statistics.median(times[arm]) for arm in ("full", "adapter"))
    params = sum(t.numel() for _, t in full)
    print(f"model: {params:,} parameters; adapter: rank {args.rank}, {len(adapter)} tensors")
    print(f"full push: {full_bytes / 2**20:.1f} MiB, median {full_s:.3f} s ({times['full']})")
    print(
        f"adapter: {adapter_bytes / 2**20:.2f} MiB, median {adapter_s:.3f} s ({times['adapter']})"
    )
    print(f"engine vs trainer through the adapter: max log-prob gap {gap:.2e}")
    print(
        f"lora_sync: full_bytes={full_bytes} adapter_bytes={adapter_bytes} full_s={full_s:.4f} "
        f"adapter_s={adapter_s:.4f} bytes_ratio={full_bytes / adapter_bytes:.1f} "
        f"time_ratio={full_s / adapter_s:.1f} gap={gap:.2e}"
    )


if __name__ == "__main__":
    main()
