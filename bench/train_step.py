"""One full update (old log-probs, then the minibatch's forward, backward and optimizer step),
padded micro-batches against packed ones (`train.max_tokens_per_micro_batch`), on the same samples
and weights.

Two length mixes: `demo`, one real rollout of the CPU demo (configs/tiny.yaml: its engine, its
initial policy, 32 prompts x 8); and `gsm8k`, synthetic GSM8K-like samples, one rank's share of
configs/gsm8k.yaml (8 prompts x 8 samples; prompts ~150 tokens, shared by a group; responses
log-normal around 250 with a tail to the 1,024-token budget) on a Qwen2-shaped model (4 layers of
256, grouped KV heads, tied embeddings) with a 32,000-token vocabulary (Llama's and Mistral's;
Qwen's 151,936 made one update take minutes on 2 cores). The padded arm runs the config with
`train.max_tokens_per_micro_batch=0` (micro-batches of `micro_batch_size` rows, each as wide as its
longest); the packed arm's budget is the padded arm's largest micro-batch on these samples (rows x
width), so neither computes on more positions at once (memory grows with positions, and with rows x
width^2 in attention's dense mask: both are then bounded alike). The packed arm gains twice: fewer
padding positions, and an output head that runs only where a response token is predicted
(`head_positions`). This small model spends most of its compute in the head (32,000 x 256 against 4
layers of 256), a real one much less (Qwen2.5-1.5B: about 15%), so on a GPU the second gain is
smaller. Times: medians of `--repeats` alternated pairs (the arms take turns going first). Peak
memory: the most bytes held in live tensors at once during one update (less what was held before
it), from the profiler's count of every CPU tensor allocation and free
(`torch.profiler.profile(profile_memory=True)`): exact and the same on every run, unlike the
resident set, which the C allocator's retained pages move by megabytes. Measured after the timed
updates, so lazy imports and first-call workspaces are not counted. The packed arm holds one thing
more at equal positions: the rotary tables (cos, sin) per packed position, 2 x positions x head_dim
floats, where the padded rows share one row's (their position ids are all 0..width-1). Run from the
repo root: `python bench/train_step.py`. The last line is the machine-readable summary: train_step:
mix=demo speedup=<f> padded_fraction=<f> mix=gsm8k speedup=<f> padded_fraction=<f> peak_ratio=<f>
(padded_fraction: the packed path's; peak_ratio: packed peak / padded peak, the larger of the two
mixes).
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import checkpoint  # noqa: E402
import grpo  # noqa: E402
import setup_run  # noqa: E402
import train  # noqa: E402
import tasks  # noqa: E402
import rollout  # noqa: E402
import model  # noqa: E402
from config import load_config  # noqa: E402
from sample import Sample  # noqa: E402

VOCAB = 32_000  # the gsm8k mix's vocabulary
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (config, overrides); the gsm8k mix builds its own Qwen2-shaped model (see `policy_for`)
MIXES = {
    "demo": ("configs/tiny.yaml", []),
    "gsm8k": ("configs/gsm8k.yaml", ["data.train_path=unused", "model.compute_dtype=float32"]),
}


def demo_samples(out_dir, num_prompts=0, seed=0):
    """One rollout of the CPU demo's first step (`num_prompts`: 0 = the demo's), from the real
    engine, with GRPO advantages of random rewards (the update's cost depends on the lengths, not
    the rewards)."""
    cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"), [f"run.out={out_dir}"])
    policy, tokenizer = model.build_policy(cfg, None)
    engine = rollout.RolloutEngine(
        checkpoint.export_for_engine(policy, tokenizer, out_dir), cfg.rollout, seed=seed
    )
    try:
        prompts = tasks.PromptStream(tasks.build_task(cfg, tokenizer).train_prompts, seed).take(
            num_prompts or cfg.rollout.prompts_per_step
        )
        samples, _ = engine.generate(
            [p.prompt_ids for p in prompts], cfg.rollout.group_size, 1.0, cfg.rollout.max_new_tokens
        )
    finally:
        engine.shutdown()
    return samples


def gsm8k_samples(num_samples=64, seed=0):
    """Groups of 8 sharing a prompt of ~N(150, 30) tokens, responses log-normal (median 250) cut
    at the 1,024-token budget."""
    rng = random.Random(seed)
    samples = []
    for i in range(num_samples):
        if i % 8 == 0:
            prompt = [
                rng.randrange(VOCAB) for _ in range(min(max(int(rng.gauss(150, 30)), 40), 512))
            ]
        num_response = min(max(int(rng.lognormvariate(5.5, 0.7)), 1), 1024)
        samples.append(
            Sample(
                prompt,
                [rng.randrange(VOCAB) for _ in range(num_response)],
                [-1.0] * num_response,
                [1] * num_response,
                group_id=i // 8,
                trajectory_id=i,
            )
        )
    return samples


def policy_for(mix, cfg):
    """The mix's model, seeded: the demo's tiny model, or a small Qwen2 with Qwen's vocabulary."""
    if mix == "demo":
        return model.build_policy(cfg, None)[0]
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=704,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=2048,
        )
    ).float()


def largest_padded_micro_batch(samples, size):
    """Positions (rows x width) of the padded arm's largest micro-batch: the packed arm's budget."""
    chunks = [samples[i : i + size] for i in range(0, len(samples), size)]
    return max(len(c) * max(len(s.prompt_ids) + len(s.response_ids) for s in c) for c in chunks)


def update(mix, samples, packed, on_start=None):
    """One train_on_rollout from the seeded initial weights; returns (seconds, its stats)."""
    config, sets = MIXES[mix]
    cfg = load_config(os.path.join(ROOT, config), sets)
    cfg.train.max_tokens_per_micro_batch = (
        largest_padded_micro_batch(samples, cfg.train.micro_batch_size) if packed else 0
    )
    policy = policy_for(mix, cfg)
    run = setup_run.trainer_only(cfg, policy)
    advantages, _ = grpo.group_advantages(
        torch.randn(len(samples), generator=torch.Generator().manual_seed(0)),
        torch.tensor([s.group_id for s in samples]),
        torch.ones(len(samples), dtype=torch.bool),
    )
    if on_start:
        on_start()
    start = time.perf_counter()
    stats = train.train_on_rollout(run, samples, advantages)
    return time.perf_counter() - start, stats


def peak_bytes(mix, samples, packed, out_dir):
    """The most bytes held in live CPU tensors during one update, above the count when it began
    (run after the timed updates of both arms: first-call allocations are not the update's)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        update(mix, samples, packed)
    trace = os.path.join(out_dir, f"{mix}-{int(packed)}-trace.json")
    prof.export_chrome_trace(trace)  # its "[memory]" events carry the allocator's running total
    with open(trace) as f:
        totals = [
            e["args"]["Total Allocated"]
            for e in json.load(f)["traceEvents"]
            if e.get("name") == "[memory]"
        ]
    return max(totals) - totals[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats", type=int, default=3, help="alternated padded/packed pairs per mix"
    )
    parser.add_argument(
        "--gsm8k-samples", type=int, default=64, help="one rank's batch in configs/gsm8k.yaml"
    )
    parser.add_argument(
        "--demo-prompts", type=int, default=0, help="the demo mix's prompts (0: the demo's 32)"
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads (the engine is shut down first)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out_dir = tempfile.mkdtemp(prefix="bench-train-step-")
    summary, peak_ratios = [], []
    for mix, samples in (
        ("demo", demo_samples(out_dir, args.demo_prompts)),
        ("gsm8k", gsm8k_samples(args.gsm8k_samples)),
    ):
        seconds, stats = {False: [], True: []}, {}
        update(mix, samples[:8], packed=True)  # warm-up: first-call costs, not measured
        for repeat in range(args.repeats):
            for packed in ((False, True) if repeat % 2 == 0 else (True, False)):
                elapsed, stats[packed] = update(mix, samples, packed)
                seconds[packed].append(elapsed)
        peaks = {packed: peak_bytes(mix, samples, packed, out_dir) for packed in (False, True)}
        padded_s, packed_s = statistics.median(seconds[False]), statistics.median(seconds[True])
        for packed, name in ((False, "padded"), (True, "packed")):
            s = stats[packed]
            print(
                f"{mix} {name}: update_s={statistics.median(seconds[packed]):.3f} (repeats "
                f"{' '.join(f'{x:.3f}' for x in seconds[packed])}) tokens={s['train/tokens']} "
                f"micro_batches={s['train/micro_batches']} "
                f"head_positions={s['train/head_positions']} "
                f"padded_fraction={s['train/padded_fraction']:.3f} "
                f"tokens_per_s={s['train/tokens'] / statistics.median(seconds[packed]):.0f} "
                f"peak_mib={peaks[packed] / 2**20:.2f}"
            )
        summary.append(
            f"mix={mix} speedup={padded_s / packed_s:.3f} "
            f"padded_fraction={stats[True]['train/padded_fraction']:.3f}"
        )
        peak_ratios.append(peaks[True] / peaks[False])
    print(f"train_step: {' '.join(summary)} peak_ratio={max(peak_ratios):.3f}")


if __name__ == "__main__":
    main()
