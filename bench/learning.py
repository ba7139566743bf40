"""Learning benchmark: the CPU demo trained with no cancellation (baseline), the tail dropped
(drop), the tail suspended and continued next step (partial), DAPO (dapo), and pi_old taken from
the engine (engine_logprobs), for the given seeds; one table of validation reward at the same step
and at equal wall-clock time, median step / rollout time, and the share of zero-variance groups
over training.

Each run is `python train.py --config configs/tiny.yaml` in a subprocess (its own engine, exactly
what a user runs), the arms of a seed back to back, their order rotated from seed to seed, so
machine drift hits them alike. A script, not a
test: 200 steps take ~7-8 minutes a run on 2 CPU cores. Run from the repo root:

    python bench/learning.py --seeds 0,1,2 --arms baseline,partial,drop
    python bench/learning.py --seeds 0,1,2 --arms baseline,dapo [--config configs/tiny_tool.yaml]
    python bench/learning.py --seeds 0,1,2 --arms baseline,engine_logprobs

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
sys.path.insert(0, ROOT)
from assemble import load_config  # noqa: E402

# drop and partial cut the same tail: launch the batch, stop once 80% of its samples finished; drop
# throws the rest away, partial suspends and continues it, weighting tokens an older policy sampled
# by truncated importance sampling (train.tis_cap). `--over-sample` makes both over-provision
# instead (APRIL, arXiv 2509.18521): launch 1.25x the prompts, stop once a batch of samples
# finished.
ARMS = {
    "baseline": ["rollout.cancel=none"],
    "drop": ["rollout.cancel=count", "rollout.drop_rate=0.2"],
    "partial": [
        "rollout.cancel=count",
        "rollout.drop_rate=0.2",
        "rollout.partial=true",
        "train.tis_cap=2",
    ],
    # configs/gsm8k_dapo.yaml's settings: dynamic sampling fused with over-sampling and partial
    # rollout (the demos' loss is token-mean already), but not clip-higher (with one minibatch the
    # ratio is 1: nothing is clipped, and train.clip_eps_high is refused) nor overlong filtering:
    # the tool demo's responses nearly all end at the budget (rollout/truncated_ratio 0.96-1.0),
    # so it masked every token (train/tokens ~2 a step) and the arm learned nothing (greedy
    # 0.125 at step 250, measured)
    "dapo": [
        "rollout.cancel=count",
        "rollout.over_sample_rate=0.25",
        "rollout.partial=true",
        "train.tis_cap=2",
        "rollout.filter_groups=true",
    ],
    # pi_old from the engine's log-probs: the trainer's extra forward skipped (same updates up to
    # the engine/trainer log-prob gap, faster steps)
    "engine_logprobs": ["train.old_logprobs=engine"],
}


def train_once(arm, seed, steps, out_dir, over_sample, config, extra_sets=()):
    """Train one arm; returns {tag: [(step, value, seconds since the run's first event)]} from
    its TensorBoard events."""
    sets = [f"train.seed={seed}", f"train.steps={steps}", "run.checkpoint_every=0", *ARMS[arm]]
    sets += extra_sets
    if over_sample and arm != "baseline":
        sets = [s.replace("rollout.drop_rate=0.2", "rollout.over_sample_rate=0.25") for s in sets]
    if load_config(config, []).rollout.max_turns > 1:
        # partial rollout resumes single-turn samples only (refused with tools' turns): there an
        # arm's cancelled trajectories are dropped
        sets = [s for s in sets if s != "rollout.partial=true"]
    cmd = [sys.executable, "train.py", "--config", config, "--out", out_dir]
    for item in sets:
        cmd += ["--set", item]
    done = subprocess.run(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if done.returncode != 0:
        sys.exit(f"{arm} seed {seed} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    events = EventAccumulator(os.path.join(out_dir, "tb"))
    events.Reload()
    scalars = {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}
    start = min(e.wall_time for tag in scalars.values() for e in tag)
    return {
        tag: [(e.step, e.value, e.wall_time - start) for e in values]
        for tag, values in scalars.items()
    }


def summarize(logged):
    """The row of one run: last validation (greedy, sampled), median step and rollout seconds,
    the share of zero-variance groups, and when the run ended."""
    median = lambda tag: statistics.median(v for _, v, _ in logged[tag])  # noqa: E731
    total = lambda tag: sum(v for _, v, _ in logged[tag])  # noqa: E731
    return {
        "val_greedy": logged["val/reward_mean"][-1][1],
        "val_sampled": logged["val/reward_mean_sampled"][-1][1],
        "step_s": median("timing/step_s"),
        "rollout_s": median("timing/rollout_s"),
        "last_step": logged["val/reward_mean"][-1][0],
        "end_s": logged["val/reward_mean_sampled"][-1][2],
        "zero_variance": total("filter/zero_variance_groups")
        / max(total("filter/zero_variance_groups") + total("filter/kept_groups"), 1),
    }


def sampled_at(logged, seconds):
    """The last sampled validation reward logged within `seconds` of the run's start (equal
    wall-clock time)."""
    return [v for _, v, t in logged["val/reward_mean_sampled"] if t <= seconds][-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values")
    parser.add_argument(
        "--arms", default="baseline,partial,drop", help=f"comma-separated, of {sorted(ARMS)}"
    )
    parser.add_argument(
        "--steps", type=int, default=200, help="training steps per run (the demo's 200)"
    )
    parser.add_argument(
        "--over-sample", action="store_true", help="drop and partial launch 1.25x the prompts"
    )
    parser.add_argument(
        "--config",
        default="configs/tiny.yaml",
        help="the demo: configs/tiny.yaml or tiny_tool.yaml",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a config override for every arm (repeatable)",
    )
    args = parser.parse_args()
    seeds, arms = [int(s) for s in args.seeds.split(",")], args.arms.split(",")
    unknown = set(arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; known: {sorted(ARMS)}")

    rows = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        for i, seed in enumerate(seeds):
            logged = {}
            for arm in arms[i % len(arms) :] + arms[: i % len(arms)]:  # rotated: none always first
                logged[arm] = train_once(
                    arm,
                    seed,
                    args.steps,
                    os.path.join(tmp, f"{arm}-{seed}"),
                    args.over_sample,
                    args.config,
                    extra_sets=args.set,
                )
                row = summarize(logged[arm])
                rows[arm].append(row)
                print(
                    f"seed {seed} {arm:8s}: val greedy {row['val_greedy']:.3f} "
                    f"sampled {row['val_sampled']:.3f} at step {row['last_step']} "
                    f"({row['end_s']:.0f} s), median step {row['step_s']:.2f} s, "
                    f"rollout {row['rollout_s']:.2f} s, "
                    f"zero-variance groups {row['zero_variance']:.1%}",
                    flush=True,
                )
            # the seed's arms compared at the shortest run's end
            equal = min(rows[arm][-1]["end_s"] for arm in arms)
            for arm in arms:
                rows[arm][-1]["val_sampled_equal_time"] = sampled_at(logged[arm], equal)
            print(
                f"seed {seed} at equal wall time ({equal:.0f} s): "
                + ", ".join(
                    f"{arm} sampled {rows[arm][-1]['val_sampled_equal_time']:.3f}" for arm in arms
                ),
                flush=True,
            )
    print(
        f"\n| arm | val greedy (step {args.steps}) | val sampled "
        "| val sampled at equal wall time | median step s | median rollout s "
        "| zero-variance groups |"
    )
    print("|---|---|---|---|---|---|---|")
    mean = {
        arm: {key: statistics.mean(r[key] for r in rows[arm]) for key in rows[arm][0]}
        for arm in arms
    }
    for arm in arms:
        sampled = ", ".join(f"{r['val_sampled']:.3f}" for r in rows[arm])
        greedy = ", ".join(f"{r['val_greedy']:.3f}" for r in rows[arm])
        equal = ", ".join(f"{r['val_sampled_equal_time']:.3f}" for r in rows[arm])
        print(
            f"| {arm} | {mean[arm]['val_greedy']:.3f} ({greedy}) "
            f"| {mean[arm]['val_sampled']:.3f} ({sampled}) | "
            f"{mean[arm]['val_sampled_equal_time']:.3f} ({equal}) | {mean[arm]['step_s']:.2f} | "
            f"{mean[arm]['rollout_s']:.2f} | {mean[arm]['zero_variance']:.1%} |"
        )
    # the summary lines: partial against the baseline at the same step, dapo at equal wall-clock
    # time (its steps take longer), the baseline's spread over the seeds beside each
    for arm, key, when in (
        ("partial", "val_sampled", "at the same step"),
        ("dapo", "val_sampled_equal_time", "at equal wall time"),
        ("engine_logprobs", "val_sampled_equal_time", "at equal wall time"),
    ):
        if "baseline" in arms and arm in arms:
            base = [r[key] for r in rows["baseline"]]
            print(
                f"baseline sampled spread {when} over seeds: {min(base):.3f}..{max(base):.3f}; "
                f"{arm} step time "
                f"{mean[arm]['step_s'] / mean['baseline']['step_s']:.3f}x baseline"
            )
            print(
                f"learning: baseline_val_sampled={mean['baseline'][key]:.3f} "
                f"{arm}_val_sampled={mean[arm][key]:.3f} "
                f"baseline_step_s={mean['baseline']['step_s']:.3f} "
                f"{arm}_step_s={mean[arm]['step_s']:.3f}"
            )


if __name__ == "__main__":
    main()
