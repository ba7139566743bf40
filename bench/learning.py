"""Learning benchmark: the CPU demo trained with no cancellation (baseline), the tail dropped (drop), and the
tail suspended and continued next step (partial), for the given seeds; one table of validation reward at
the same step and median step / rollout time.

Each run is `python train.py --config configs/tiny.yaml` in a subprocess (its own engine, exactly what a
user runs), the arms of a seed back to back so machine drift hits them alike. A script, not a test: 200
steps take ~7-8 minutes a run on 2 CPU cores. Run from the repo root:
    python bench/learning.py --seeds 0,1,2 --arms baseline,partial,drop
The last line is the machine-readable summary (means over the seeds).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# drop and partial cut the same tail: launch the batch, stop once 80% of its samples finished; drop throws
# the rest away, partial suspends and continues it, weighting tokens an older policy sampled by truncated
# importance sampling (train.tis_cap). `--over-sample` makes both over-provision instead (APRIL, arXiv
# 2509.18521): launch 1.25x the prompts, stop once a batch of samples finished.
ARMS = {"baseline": ["rollout.cancel=none"],
        "drop": ["rollout.cancel=count", "rollout.drop_rate=0.2"],
        "partial": ["rollout.cancel=count", "rollout.drop_rate=0.2", "rollout.partial=true", "train.tis_cap=2"]}


def train_once(arm, seed, steps, out_dir, over_sample):
    """Train one arm; returns {tag: [(step, value)]} from its TensorBoard events."""
    sets = [f"train.seed={seed}", f"train.steps={steps}", "run.checkpoint_every=0", *ARMS[arm]]
    if over_sample and arm != "baseline":
        sets = [s.replace("rollout.drop_rate=0.2", "rollout.over_sample_rate=0.25") for s in sets]
    cmd = [sys.executable, "train.py", "--config", "configs/tiny.yaml", "--out", out_dir]
    for item in sets:
        cmd += ["--set", item]
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"{arm} seed {seed} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    events = EventAccumulator(os.path.join(out_dir, "tb"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def summarize(logged):
    """The row of one run: last validation (greedy, sampled) and median step and rollout seconds."""
    median = lambda tag: statistics.median(v for _, v in logged[tag])  # noqa: E731
    return {"val_greedy": logged["val/reward_mean"][-1][1], "val_sampled": logged["val/reward_mean_sampled"][-1][1],
            "step_s": median("timing/step_s"), "rollout_s": median("timing/rollout_s"),
            "last_step": logged["val/reward_mean"][-1][0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values")
    parser.add_argument("--arms", default="baseline,partial,drop", help=f"comma-separated, of {sorted(ARMS)}")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (the demo's 200)")
    parser.add_argument("--over-sample", action="store_true", help="drop and partial launch 1.25x the prompts")
    args = parser.parse_args()
    seeds, arms = [int(s) for s in args.seeds.split(",")], args.arms.split(",")
    unknown = set(arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; known: {sorted(ARMS)}")

    rows = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        for seed in seeds:
            for arm in arms:
                row = summarize(train_once(arm, seed, args.steps, os.path.join(tmp, f"{arm}-{seed}"), args.over_sample))
                rows[arm].append(row)
                print(f"seed {seed} {arm:8s}: val greedy {row['val_greedy']:.3f} sampled {row['val_sampled']:.3f} "
                      f"at step {row['last_step']}, median step {row['step_s']:.2f} s, rollout {row['rollout_s']:.2f} s",
                      flush=True)
    print(f"\n| arm | val greedy (step {args.steps}) | val sampled | median step s | median rollout s |")
    print("|---|---|---|---|---|")
    mean = {arm: {key: statistics.mean(r[key] for r in rows[arm]) for key in rows[arm][0]} for arm in arms}
    for arm in arms:
        sampled = ", ".join(f"{r['val_sampled']:.3f}" for r in rows[arm])
        greedy = ", ".join(f"{r['val_greedy']:.3f}" for r in rows[arm])
        print(f"| {arm} | {mean[arm]['val_greedy']:.3f} ({greedy}) | {mean[arm]['val_sampled']:.3f} ({sampled}) | "
              f"{mean[arm]['step_s']:.2f} | {mean[arm]['rollout_s']:.2f} |")
    if "baseline" in arms and "partial" in arms:
        base = [r["val_sampled"] for r in rows["baseline"]]
        print(f"baseline sampled spread over seeds: {min(base):.3f}..{max(base):.3f}; partial step time "
              f"{mean['partial']['step_s'] / mean['baseline']['step_s']:.3f}x baseline")
        print(f"learning: baseline_val_sampled={mean['baseline']['val_sampled']:.3f} "
              f"partial_val_sampled={mean['partial']['val_sampled']:.3f} "
              f"baseline_step_s={mean['baseline']['step_s']:.3f} partial_step_s={mean['partial']['step_s']:.3f}")


if __name__ == "__main__":
    main()
