"""Peak memory of a colocated step with staged vs all-at-once engine wake-up during weight sync.

Runs real steps (rollout -> train -> sync) for the configured model in both modes, alternating.
On CPU release frees nothing, so peaks are *modelled* from a ledger of real tensor sizes; on a GPU
the same script samples device-wide memory at every transition and reports *measured* peaks.
"""

import argparse
import atexit
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import torch

from advantages import group_advantages  # noqa: E402
import train  # noqa: E402
from train_step import train_on  # noqa: E402
import rollout  # noqa: E402
from assemble import load_config  # noqa: E402
from memory import MemoryPhases  # noqa: E402


def one_step(run, phases, step):
    """rollout -> train -> weight sync under `phases`; returns the peak over the step's phases."""
    r = run.cfg.rollout
    prompts = run.stream.take(r.prompts_per_step)
    samples, _ = rollout.generate_scored(
        run, prompts, r.group_size, r.temperature
    )  # scored as they finish
    advantages, _ = group_advantages(
        torch.tensor([s.reward for s in samples]),
        torch.tensor([s.group_id for s in samples]),
        torch.ones(len(samples), dtype=torch.bool),
    )
    phases.to_train()
    train_on(run.trainer, samples, advantages)
    phases.to_sync()
    policy = run.trainer.policy
    run.engine.update_weights(policy.named_parameters(), step + 1, phases.bucket_bytes)
    phases.to_rollout()
    return {phase: peak[phases.source] for phase, peak in phases.ended.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument(
        "--set", action="append", default=[], help="config override, as in train.py"
    )
    parser.add_argument("--repeats", type=int, default=2, help="steps per mode, alternating")
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="bench_memory_")
    atexit.register(shutil.rmtree, out, ignore_errors=True)  # at exit: its model and run files
    cfg = load_config(args.config, args.set + [f"run.out={out}"])
    run = train.setup(cfg)
    dtype = getattr(torch, cfg.model.engine_dtype)
    bucket = cfg.memory.bucket_mb << 20
    trainer = run.trainer
    phases = {
        mode: MemoryPhases(
            run.engine,
            trainer.policy,
            trainer.optimizer,
            mode,
            bucket,
            dtype,
            device=trainer.device,
        )
        for mode in ("staged", "all_at_once")
    }
    for machine in phases.values():
        machine.start()
    peaks = {mode: [] for mode in phases}
    try:
        for step in range(args.repeats):
            for mode, machine in phases.items():
                per_phase = one_step(run, machine, step)
                peaks[mode].append(max(per_phase.values()))
                print(
                    f"step {step} {mode:11s} "
                    + " ".join(f"{p}={b / 2**20:.2f}MiB" for p, b in per_phase.items())
                )
    finally:
        run.engine.shutdown()
    ledger, source = phases["staged"].ledger, phases["staged"].source
    print(
        f"ledger ({source} peaks): "
        + " ".join(f"{k}={v / 2**20:.2f}MiB" for k, v in vars(ledger).items())
    )
    staged, all_at_once = max(peaks["staged"]), max(peaks["all_at_once"])
    print(
        f"memory: staged_peak_bytes={staged} all_at_once_peak_bytes={all_at_once} "
        f"engine_weight_bytes={ledger.engine_weights} saving_bytes={all_at_once - staged} "
        f"source={source}"
    )


if __name__ == "__main__":
    main()
