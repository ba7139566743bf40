"""GRPO trainer: one training step, the step loop around it, and the command line.

Owns the order of the algorithm, on one rank or several (each rank: an FSDP2 shard of the policy and
its own engine). Each stage of the step is one call into the module that owns it and hands back
its own metrics; every feature is switched inside its stage, so none is named here:

    rollout (rollout.py, inflight.py, rewards.py, cancel.py) -> advantages (advantages.py)
    -> training sequences (merge.py) -> update (update.py, loss.py) -> weight sync (memory.py)
    -> metrics (metrics.py)

Setup is assemble.py's. Importing this file never trains (SGLang's and the launcher's processes
re-import the main module). README.md has the map.
"""

import argparse
import contextlib
import glob
import logging
import os
import signal
import sys
import time

import torch
import tqdm

import advantages
import memory
import merge
import rollout
import update
from config import ConfigError, config_yaml, yaml_quoted
from extras import replay
from metrics import Logger, joined, rate, reduce_metrics, slowest
from rewards import RewardError
import runtime.checkpoint as checkpoint
import runtime.parallel as parallel
from runtime.engine import RolloutError, StopSignal, strip_expandable_segments
from runtime.model import ModelError
from assemble import check_run, load_config, setup
from task.data import DataError

log = logging.getLogger("train")


# ---------------------------------------------------------------- one GRPO step
def train_step(run, step):
    """One GRPO step on this rank. Returns (its metrics, reduced over ranks; the sequences it
    trained on)."""
    start = time.perf_counter()
    # 1. rollout: group_size trajectories per prompt, each scored as it finishes, the tail cut
    groups, metrics = rollout.collect(run, step)
    # the engine's memory is released and the trainer's brought back (memory.py)
    to_train_start = time.perf_counter()
    run.phases.to_train()
    # the ranks meet here, each rollout done: the update's time is then its own, not a wait for
    # another rank's rollout (its first collective would wait as long)
    wait_start = time.perf_counter()
    parallel.barrier()
    train_start = time.perf_counter()
    # 2. each trajectory's advantage, from its group's rewards
    trajectories, advantage_metrics = advantages.compute(run.trainer, groups)
    # 3. the sequences to train on: prefix-sharing turns merged, each with its advantage
    max_seq_len = run.trainer.policy.config.max_position_embeddings
    sequences, sequence_metrics = merge.training_sequences(trajectories, run.cfg, max_seq_len)
    # 4. the policy update: train.num_minibatches optimizer steps on the clipped-ratio loss (one
    # by default, whose pi_old is the policy itself: ratio 1, no clipping)
    # (the engine sampled this step with weight version `step`; the update makes version step + 1)
    update_metrics = update.update_policy(run.trainer, sequences, step)
    run.updates_done = step + 1  # from here on, a checkpoint of this run is at step + 1
    train_s = time.perf_counter() - train_start
    # 5. weight sync: the engine samples the next step from the updated policy
    # the engine-vs-trainer gap the update measured on this rank (none where pi_old came from the
    # engine)
    gap = update_metrics.get("train/logprob_gap")
    metrics = joined(metrics, advantage_metrics, sequence_metrics, update_metrics)
    try:
        sync = memory.sync_weights(run, step, logprob_gap=gap)
    except RolloutError as e:  # the engine died, or refused the push
        # the update is done and the checkpoint that follows holds it: the step's record goes
        # with the error, for `train` to log it as any step's
        e.trained_step = metrics, sequences
        raise
    metrics = joined(metrics, sync)
    # 6. metrics, each reduced over ranks as its stage declared
    metrics["timing/to_train_s"] = slowest(wait_start - to_train_start)
    metrics["timing/rank_wait_s"] = slowest(train_start - wait_start)
    metrics["timing/train_s"] = slowest(train_s)
    metrics["timing/step_s"] = slowest(time.perf_counter() - start)
    metrics["perf/train_tokens_per_s"] = rate(update_metrics["train/tokens"].value, train_s)
    return reduce_metrics(metrics), sequences


# ---------------------------------------------------------------- the step loop
def train(run, stop=None):
    """The step loop: validate, step, log, dump for replay, checkpoint; stop cleanly on
    SIGINT/SIGTERM, after the set-up, step or validation it came in (returns its name; `stop`
    is the StopSignal to read, else one held while the loop runs), and with a checkpoint when the
    engine dies or the rollout fails (RolloutError, RewardError; on one rank: with several, the
    last periodic one stands). Returns None when all steps ran."""
    cfg = run.cfg
    # one writer of TensorBoard and the console
    logger = Logger(cfg.run.out, cfg, first_step=run.start_step) if parallel.rank() == 0 else None
    own_stop = stop is None
    if own_stop:
        stop = StopSignal()
    steps = range(run.start_step, cfg.train.steps)
    before = data_before_step(run)
    try:
        if signalled(stop):  # in set-up (the engine's start-up: minutes on a GPU): no step
            return stopped(run, stop)
        # a checkpoint whose streak of skipped updates is at the limit (the step that reached it
        # failed in its weight sync, before the loop asks below) stops as the run would have
        update.stop_after_bad_updates(run.trainer, run.start_step - 1)
        # the bar on rank 0's terminal only: redirected to a file (None: tqdm/std.py's isatty
        # check) its carriage returns would run into the step lines
        bar = None if logger else True
        for step in tqdm.tqdm(steps, initial=run.start_step, total=cfg.train.steps, disable=bar):
            before = data_before_step(run)  # what an engine death before the update puts back
            # the weights the engine holds before this step, every run.val_every steps and at a
            # run's first step: a resumed run's TensorBoard drops what the earlier run logged from
            # there on (metrics.Logger), a finished run's final validation included
            first = step == run.start_step
            scalars, texts = validation(run) if first or step % cfg.run.val_every == 0 else ({}, {})
            if signalled(stop):  # in the last checkpoint's save or this validation: no more steps
                return stopped(run, stop)
            metrics, sequences = train_step(run, step)
            record(run, logger, step, scalars | metrics, texts, sequences)
            update.stop_after_bad_updates(run.trainer, step)  # the policy is broken, not unlucky
            if signalled(stop):  # every rank stops after the same step
                return stopped(run, stop)
            every = cfg.run.checkpoint_every
            if (every and (step + 1) % every == 0) or step + 1 == cfg.train.steps:
                checkpoint.save(cfg.run.out, step + 1, run)
        scalars, texts = validation(run)  # the final policy's
        if logger:
            logger.log(cfg.train.steps, scalars, echo=tqdm.tqdm.write, texts=texts)
        return None
    except (update.NonFiniteError, memory.HealthError) as e:
        # said with where to resume from: the error came after the last checkpoint
        where = checkpoint.latest(cfg.run.out) or "none yet"
        raise type(e)(f"{e} Last checkpoint: {where}") from None
    except (RolloutError, RewardError) as e:  # the engine died, or too many requests or rewards
        # failed, an abort stuck, a weight push refused: the trainer's own state is intact
        if parallel.world_size() > 1:
            raise  # the other ranks wait in collectives: the last periodic checkpoint stands
        if getattr(e, "trained_step", None):  # failed in the step's weight sync, after its update
            metrics, sequences = e.trained_step  # (step, scalars, texts: the step in progress)
            record(run, logger, step, scalars | reduce_metrics(metrics), texts, sequences)
        raise save_after_failure(run, e, before) from None
    finally:
        if own_stop:
            stop.restore()
        if logger:
            logger.close()


def record(run, logger, step, metrics, texts, sequences):
    """A step's metrics to TensorBoard and the console (rank 0's `logger`), and its sequences to
    run.out/rollouts, what `train.py --replay` re-runs (run.dump_rollouts)."""
    if logger:
        logger.log(step, metrics, echo=tqdm.tqdm.write, texts=texts)
    if run.cfg.run.dump_rollouts:
        replay.dump(run.cfg, step, run.start_step, sequences, metrics)


def validation(run):
    """(scalars, texts) of the weights the engine holds now (rollout.validate): the loop's, not
    the step's, so its time is `timing/val_s`, outside `timing/step_s`."""
    start = time.perf_counter()
    scalars, texts = rollout.validate(run, version=run.updates_done)
    scalars["timing/val_s"] = time.perf_counter() - start
    return scalars, texts


def data_before_step(run):
    """What a step consumes before its update, as it stands when the step begins: the prompt
    stream's position and partial rollout's buffer (its suspended samples)."""
    return {
        "updates_done": run.updates_done,
        "position": run.stream.position,
        "buffer": run.buffer.state_dict() if run.buffer else None,
    }


def signalled(stop):
    """Whether a SIGINT/SIGTERM came to any rank (a collective: every rank stops at the same
    point)."""
    return parallel.all_reduce([stop.received is not None], op="max")[0] > 0


def stopped(run, stop):
    """After a signal: the trainer's state saved (`save_state`), and the signal's name to
    return."""
    save_state(run)
    return stop.received or "a signal on another rank"


def save_after_failure(run, error, before):
    """The trainer's own state is intact when its engine dies or its rollout fails: save it
    (`save_state`), and return the error to raise, saying where it is. Failed before the step's
    update, the step's prompts and resumed samples were taken and never trained: they are put
    back (`before`, from data_before_step), so --resume runs that step from them, as the run
    would have."""
    if run.updates_done == before["updates_done"]:
        run.stream.position = before["position"]
        if run.buffer:
            run.buffer.load_state_dict(before["buffer"])
    try:
        path = save_state(run)
    except checkpoint.CheckpointError as failed:  # (a full disk): both said, the cause first
        where = checkpoint.latest(run.cfg.run.out) or "none"
        return type(error)(
            f"{error}. Saving the trainer's state after {run.updates_done} updates failed too "
            f"({failed}); the last checkpoint: {where}"
        )
    if path is None:
        return type(error)(f"{error}. Nothing was trained yet: the same command starts again")
    return type(error)(
        f"{error}. The trainer's state after {run.updates_done} updates is saved in {path}; "
        "--resume continues from it"
    )


def save_state(run):
    """The trainer's state checkpointed after a signal or a failure: the folder holding it. Not
    written again where the newest checkpoint holds it (a signal during that checkpoint's save, a
    failure in the validation after it); nor at all (None) where a fresh run trained nothing yet:
    the same command starts it again, where a checkpoint of the weights it began with (~25 GB at
    GSM8K) would make the folder refuse it."""
    saved = checkpoint.latest(run.cfg.run.out)
    if saved is None and run.updates_done == 0:
        return None
    if saved is not None and checkpoint.step_of(saved) == run.updates_done:
        return saved
    return checkpoint.save(run.cfg.run.out, run.updates_done, run)


# ---------------------------------------------------------------- command line
def parse_args(argv=None):
    configs = ", ".join(sorted(glob.glob("configs/*.yaml"))) or "none found in ./configs"
    parser = argparse.ArgumentParser(
        allow_abbrev=False,  # --replay refuses the flags it would drop, by their names
        description=(
            "Train a language model with GRPO: an in-process SGLang engine samples groups of "
            "responses, a reward scores them, and the policy learns from their group-relative "
            "advantages. With no arguments it runs the CPU demo (configs/tiny.yaml): a tiny "
            "model built locally, no downloads. Metrics go to TensorBoard under the run "
            "directory (tensorboard --logdir runs)."
        ),
        epilog=f"configs: {configs}. Every setting and its meaning: config.py.",
    )
    parser.add_argument(
        "--config", default="configs/tiny.yaml", help="YAML file overriding config.py defaults"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one field, e.g. --set train.lr=1e-4 (repeatable)",
    )
    parser.add_argument("--out", help="run directory (overrides run.out)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in the run directory",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print every setting as this run would use it (YAML, a valid --config) and exit",
    )
    parser.add_argument(
        "--replay",
        metavar="RUN/rollouts/step_NNNNNN",
        help="re-run that dumped step's update without the engine (run.dump_rollouts; "
        "extras/replay.py)",
    )
    return parser.parse_args(argv)


def config_of(args):
    """The run's Config: config.py's defaults <- the YAML file <- --set <- --out (a folder name
    taken as written: as a YAML value, `runs/exp #2` was cut to `runs/exp` and `2026` an int)."""
    out = [f"run.out={yaml_quoted(args.out)}"] if args.out is not None else []
    return load_config(args.config, args.set + out)


def run_rank(argv):
    """One rank's whole job (the only one with `run.nproc: 1`): join the process group when a
    launcher started us, set up, train, shut the engine down. Returns what `train` returns."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("sglang").setLevel(logging.WARNING)  # its INFO lines would bury the steps
    args = parse_args(argv)
    cfg = config_of(args)
    if parallel.under_launcher():
        parallel.init()
    # from set-up on (a Ctrl-C there stops the run before its first step), until the engine is
    # down: a second signal exits at once until then
    stop = StopSignal()
    # one run writes a folder at a time: held by rank 0 itself, which writes it (a launcher's
    # lock died with the launcher while its ranks went on saving)
    only = checkpoint.only_run(cfg.run.out) if parallel.rank() == 0 else contextlib.nullcontext()
    try:
        with only:
            run = setup(cfg, resume=args.resume)
            try:
                return train(run, stop)
            finally:
                run.engine.shutdown()
    finally:
        stop.restore()
        parallel.close()


def main(argv=None):
    """`run.nproc > 1` outside torchrun: start the ranks here (each runs `run_rank` on the same
    arguments). Returns the name of the signal that stopped training early, or None."""
    strip_expandable_segments()  # before anything allocates CUDA memory (ranks inherit it)
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.replay:
        # the dump's config is the step's: a flag that would set another is refused, not dropped
        flags = ("--config", "--out", "--resume", "--print-config")
        others = [f for f in flags if any(a == f or a.startswith(f + "=") for a in argv)]
        if others:
            raise ConfigError(f"--replay re-runs a dumped step as it ran: {others} read nothing")
        done = replay.replay(args.replay, args.set)
        weights = {None: f"not compared (no {done.after})", 0: f"equal to {done.after}'s"}.get(
            done.weights_differ, f"{done.weights_differ} tensors unlike {done.after}'s"
        )
        exact = "loss-and-grad-norm-only" if done.exact is None else done.exact
        print(
            f"replay: loss={done.loss!r} (logged {done.logged_loss!r}) grad_norm="
            f"{done.grad_norm!r} (logged {done.logged_grad_norm!r}) weights {weights} "
            f"exact={exact}"
        )
        return None
    cfg = config_of(args)
    if args.print_config:  # defaults, the file and --set resolved: what the run would read
        print(config_yaml(cfg), end="")
        return None
    nproc = cfg.run.nproc or parallel.default_nproc()
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise ConfigError(
            f"run.nproc={nproc} but only {torch.cuda.device_count()} GPUs are visible"
        )
    if not torch.cuda.is_available() and nproc > (os.cpu_count() or 1):  # a process per rank
        raise ConfigError(f"run.nproc={nproc} but this machine has {os.cpu_count()} CPUs")
    if os.path.exists(cfg.run.out) and not os.path.isdir(cfg.run.out):
        raise ConfigError(f"run.out={cfg.run.out!r} is a file, not a run directory")
    if nproc > 1 and not parallel.under_launcher():
        with checkpoint.only_run(cfg.run.out):  # another run's: refused before any rank starts
            pass  # (rank 0 then holds it: run_rank)
        check_run(cfg, nproc, args.resume)  # once here, not once per rank
        each = parallel.launch(nproc, run_rank, argv).values()  # each rank's result
        stopped_by = next((name for name in each if name), None)
    else:
        stopped_by = run_rank(argv)
    if stopped_by and os.environ.get("RANK", "0") == "0":  # (the process group is closed)
        if checkpoint.latest(cfg.run.out):
            print(
                f"stopped by {stopped_by} after a checkpoint; --resume continues", file=sys.stderr
            )
        else:  # before any update (`stopped`)
            print(f"stopped by {stopped_by} before any update: nothing saved", file=sys.stderr)
    elif os.environ.get("RANK", "0") == "0":  # where to look next
        out = cfg.run.out
        print(f"done: {out} (tensorboard --logdir {out}/tb; python -m extras.eval --run {out})")
    return stopped_by


if __name__ == "__main__":
    errors = (
        ConfigError,
        DataError,
        ModelError,
        update.NonFiniteError,
        memory.HealthError,
        RewardError,
        RolloutError,
        parallel.RankError,
        checkpoint.CheckpointError,
    )
    try:
        stopped_by = main()
    except errors as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        print(
            f"interrupted ({str(e) or 'SIGINT'}): exited at once; the last checkpoint stands",
            file=sys.stderr,
        )
        sys.exit(130)
    if stopped_by:
        sys.exit(128 + getattr(signal, stopped_by, signal.SIGTERM))
