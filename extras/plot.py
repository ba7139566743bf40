"""Plot a run: the curves a reader looks at first, from a run directory's TensorBoard events, as one
PNG.

    python -m extras.plot runs/tiny                 # writes runs/tiny/curves.png
    python -m extras.plot runs/tiny --out demo.png

Owns nothing of training: it only reads what metrics.py logged. Panels whose metrics a run did not
log (e.g. validation in a run without it) are left out, and it prints which metrics it drew.
"""

import argparse
import os
import sys

# (panel title, [(metric, label)]): the first look at a GRPO run
PANELS = [
    (
        "reward",
        [
            ("train/reward_mean", "trained"),
            ("rollout/reward_mean_completed", "completed"),
            ("rollout/reward_mean_launched", "launched"),
        ],
    ),
    ("validation reward", [("val/reward_mean", "greedy"), ("val/reward_mean_sampled", "sampled")]),
    (
        "response length (tokens)",
        [("rollout/response_len_mean", "mean"), ("rollout/response_len_p90", "p90")],
    ),
    ("aborted ratio", [("rollout/aborted_ratio", "aborted")]),
    (
        "step time (s)",
        [("timing/step_s", "step"), ("timing/rollout_s", "rollout"), ("timing/train_s", "train")],
    ),
]
# drawn only for runs that called a tool (a single-turn run logs these as flat 0 and 1)
TOOL_PANEL = (
    "tool use (multi-turn)",
    [
        ("rollout/tool_calls_per_trajectory", "calls per trajectory"),
        ("val/tool_call_ratio", "val: share that called"),
        ("merge/ratio", "merge ratio"),
    ],
)


def read_scalars(run_dir):
    """{metric: ([steps], [values])} from the events under run_dir/tb."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events_dir = os.path.join(run_dir, "tb")
    if not os.path.isdir(events_dir):
        raise FileNotFoundError(f"no TensorBoard events under {events_dir}")
    events = EventAccumulator(events_dir, size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {
        tag: ([e.step for e in events.Scalars(tag)], [e.value for e in events.Scalars(tag)])
        for tag in events.Tags()["scalars"]
    }


def plot(run_dir, out_path, title=None):
    """Write the PNG (titled `title`, else the run directory's name); returns the metrics drawn."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    scalars = read_scalars(run_dir)
    called_tool = max(scalars.get("rollout/tool_calls", ([], [0]))[1], default=0) > 0
    panels = [
        (title, [(m, label) for m, label in curves if m in scalars])
        for title, curves in PANELS + [TOOL_PANEL] * called_tool
    ]
    panels = [(title, curves) for title, curves in panels if curves]
    if not panels:
        raise ValueError(f"{run_dir}: none of the plotted metrics were logged")
    columns = min(len(panels), 3)
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.5 * columns, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    drawn = []
    for ax, (panel_title, curves) in zip(axes.flat, panels):
        for metric, label in curves:
            steps, values = scalars[metric]
            ax.plot(
                steps, values, label=label, marker="o" if len(steps) < 30 else None, markersize=3
            )
            drawn.append(metric)
        ax.set_title(panel_title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or os.path.basename(os.path.normpath(run_dir)))
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return drawn


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run directory (holds tb/)")
    parser.add_argument("--out", help="PNG path (default: RUN_DIR/curves.png)")
    parser.add_argument("--title", help="figure title (default: the run directory's name)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(args.run_dir, "curves.png")
    try:
        drawn = plot(args.run_dir, out, args.title)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}: {', '.join(drawn)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
