"""Benchmark for merge.py: merge time on synthetic multi-turn batches, and trained tokens merged vs
step-wise.

Owns the synthetic trajectory generator and the timing. The timings use synthetic batches only; the
token counts per step come from real rollouts of the CPU multi-turn demo (starts the engine;
--demo-steps 0 skips it). Run from the repo root: `python bench/merge.py`. The last line is the
machine-readable summary.
"""

import argparse
import array
import dataclasses
import gc
import os
import random
import statistics
import sys
import time

# Run as a script from anywhere: make the repo root (this file's parent's parent) importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from merge import merge_batch, unmerged  # noqa: E402  (needs the sys.path line above)
from sample import Sample, trajectories_of  # noqa: E402

VOCAB_SIZE = 151_936  # a Qwen-sized vocabulary


def synthetic_batch(
    num_trajectories: int,
    num_turns: int,
    rng: random.Random,
    break_prob: float,
    group_size: int = 8,
) -> list[list[Sample]]:
    """Trajectories whose turn i+1 prompt = turn i prompt + response + tool observation
    (~200/100/20 tokens), as the rollout builds them: per-token arrays, each turn's prompt a new
    array (`context` in task/tools.py's multi_turn)."""

    def tokens(mean: int) -> array.array:
        return array.array(
            "i", [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(mean // 2, mean * 3 // 2))]
        )

    batch = []
    for traj in range(num_trajectories):
        turns, history = [], tokens(200)  # history: the full context the next turn is prompted with
        for turn in range(num_turns):
            if turn > 0 and rng.random() < break_prob:
                history = tokens(200)  # e.g. the history was re-templated: a prefix break
            response = tokens(100)
            turns.append(
                Sample(
                    prompt_ids=history,
                    response_ids=response,
                    logprobs=array.array("f", [-1.0]) * len(response),
                    loss_mask=array.array("B", [1]) * len(response),
                    group_id=traj // group_size,
                    trajectory_id=traj,
                    turn=turn,
                )
            )
            history = history + response + tokens(20)
        batch.append(turns)
    return batch


@dataclasses.dataclass
class Timing:
    # median wall time of merge_batch over the repeats: the number the issue tracks
    ms: float
    min_ms: float  # fastest and slowest repeat: a wide spread means another process had the CPU
    max_ms: float
    # median CPU time of the same calls: near `ms` unless the process was descheduled
    cpu_ms: float
    gc_ms: float  # median part of `ms` spent in Python's garbage collector
    # median time to free the merged batch afterwards: the trainer pays it after the step
    free_ms: float


def time_merge(batch: list[list[Sample]], max_seq_len: int, repeats: int) -> Timing:
    """Time merge_batch as the trainer calls it: GC on, and the result kept while the clock runs.

    GC stays on (the trainer runs with it on); gc.collect() first, so each repeat starts from the
    same GC state. The trainer keeps the merged batch for the whole step, so freeing it is timed
    apart (free_ms).
    """
    gc_seconds, gc_start = [0.0], [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_seconds[0] += time.perf_counter() - gc_start[0]

    wall = []
    cpu = []
    gc_ms = []
    free_ms = []
    gc.callbacks.append(on_gc)
    try:
        for _ in range(repeats):
            gc.collect()
            gc_seconds[0] = 0.0
            start = time.perf_counter()
            start_cpu = time.process_time()
            merged = merge_batch(batch, max_seq_len)
            wall.append((time.perf_counter() - start) * 1e3)
            cpu.append((time.process_time() - start_cpu) * 1e3)
            gc_ms.append(gc_seconds[0] * 1e3)
            start = time.perf_counter()
            del merged
            free_ms.append((time.perf_counter() - start) * 1e3)
    finally:
        gc.callbacks.remove(on_gc)
    median = statistics.median
    return Timing(median(wall), min(wall), max(wall), median(cpu), median(gc_ms), median(free_ms))


def num_tokens(samples: list[Sample]) -> int:
    # Tokens the trainer runs forward/backward over: prompt + response of every sequence.
    return sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)


def token_counts(trajectories: list[list[Sample]]) -> tuple[int, int]:
    """(merged, step-wise) totals of prompt + response tokens over all sequences, for any
    trajectories: synthetic here, real multi-turn rollouts in the demo. No max_seq_len: it only
    counts and warns."""
    merged, _ = merge_batch(trajectories, max_seq_len=sys.maxsize)
    return num_tokens(merged), num_tokens(unmerged(trajectories))


def demo_token_counts(steps: int) -> tuple[int, int]:
    """Trained tokens per step, merged vs step-wise, on the CPU multi-turn demo
    (configs/tiny_tool.yaml): real rollouts from the real engine with the calculator tool,
    medians over `steps` rollouts."""
    import atexit
    import shutil
    import tempfile

    # imported only when the demo runs: they import torch and SGLang's engine
    import rollout
    import train
    from assemble import load_config

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tempfile.mkdtemp(prefix="bench_merge_")
    atexit.register(shutil.rmtree, out, ignore_errors=True)  # at exit: its model and run files
    cfg = load_config(os.path.join(repo, "configs", "tiny_tool.yaml"), [f"run.out={out}"])
    run = train.setup(cfg)
    merged, stepwise = [], []
    try:
        for step in range(steps):
            prompts = run.stream.take(cfg.rollout.prompts_per_step)
            samples, stats = rollout.generate_scored(
                run, prompts, cfg.rollout.group_size, cfg.rollout.temperature
            )
            counts = token_counts(trajectories_of(samples))
            merged.append(counts[0])
            stepwise.append(counts[1])
            print(
                f"demo step {step}: {len(samples)} turns, {stats.num_tool_calls} tool calls, "
                f"tokens {counts[1]} step-wise -> {counts[0]} merged"
            )
    finally:
        run.engine.shutdown()
    return round(statistics.median(merged)), round(statistics.median(stepwise))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=2560, help="trajectories per step (1x)")
    parser.add_argument("--turns", type=int, default=5, help="turns per trajectory")
    parser.add_argument(
        "--repeats", type=int, default=9, help="timed repeats; the median is reported"
    )
    parser.add_argument(
        "--break-prob", type=float, default=0.0, help="chance a turn's prompt breaks the prefix"
    )
    parser.add_argument("--max-seq-len", type=int, default=32_768)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--demo-steps",
        type=int,
        default=3,
        help="rollouts of the CPU multi-turn demo for the token counts (0: synthetic counts)",
    )
    args = parser.parse_args()

    rng = random.Random(args.seed)
    ms = {}
    for scale in (1, 2, 4):  # 2x and 4x show the merge is linear in batch size
        batch = synthetic_batch(args.trajectories * scale, args.turns, rng, args.break_prob)
        t = time_merge(batch, args.max_seq_len, args.repeats)
        ms[scale] = t.ms
        print(
            f"{args.trajectories * scale} trajectories x {args.turns} turns: {t.ms:.1f} ms "
            f"(range {t.min_ms:.1f}-{t.max_ms:.1f}, cpu {t.cpu_ms:.1f}; {t.ms / scale:.1f} ms per "
            f"{args.trajectories}; garbage collection {t.gc_ms:.1f} ms; "
            f"freeing the result {t.free_ms:.1f} ms, not timed)"
        )
        if scale == 1:
            stats = merge_batch(batch, args.max_seq_len)[1]
            tokens_merged, tokens_unmerged = token_counts(batch)
            print(
                f"sequences {stats.sequences_before} -> {stats.sequences_after} "
                f"(ratio {stats.merge_ratio:.2f}, prefix breaks {stats.prefix_breaks}, "
                f"over length {stats.over_length}); tokens {tokens_unmerged} -> {tokens_merged} "
                f"({tokens_unmerged / tokens_merged:.2f}x fewer)"
            )
    if args.demo_steps:
        tokens_merged, tokens_unmerged = demo_token_counts(args.demo_steps)
        print(
            f"multi-turn demo, per step: tokens {tokens_unmerged} step-wise -> "
            f"{tokens_merged} merged "
            f"({tokens_unmerged / tokens_merged:.2f}x fewer)"
        )
    print(
        f"merge: trajectories={args.trajectories} turns={args.turns} ms={ms[1]:.2f} "
        f"ms_2x={ms[2]:.2f} ms_4x={ms[4]:.2f} "
        f"tokens_merged={tokens_merged} tokens_unmerged={tokens_unmerged}"
    )


if __name__ == "__main__":  # SGLang's scheduler processes re-import this file: guard main()
    main()
