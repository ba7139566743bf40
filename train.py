"""GRPO trainer: one training step, the step loop, setup, and the command line (`main`).

Owns the order of the algorithm (rollout -> reward -> advantage -> update -> weight sync -> log ->
checkpoint), on one rank or several (each rank: an FSDP2 shard of the policy and its own engine).
The math lives in grpo.py, generation in rollout.py, the engine itself in sglang_engine.py, the
model in model.py, ranks in parallel.py, data in tasks.py, settings in config.py, memory phases in
memory.py, micro-batches in batching.py. Importing this file never trains (SGLang's and the
launcher's processes re-import the main module).
"""

import argparse
import dataclasses
import logging
import math
import signal
import sys
import time

import torch
import tqdm

import batching
import checkpoint
import grpo
import merge
import parallel
from buffer import PartialBuffer, share_state
from config import Config, ConfigError, load_config
from memory import MemoryPhases
from metrics import Logger, filter_metrics, masked_mean, rollout_metrics, trajectory_texts
from cancel import filter_groups, plan_launch
from sglang_engine import EngineDiedError, RolloutError, StopSignal
from model import ModelError, build_optimizer, build_policy
from rollout import RolloutEngine
from sample import trajectories_of
from tasks import DataError, PromptStream, RewardError, build_task, call_reward

log = logging.getLogger("train")


class NonFiniteError(RuntimeError):
    """`train.max_bad_updates` steps in a row had a non-finite loss or gradient: the policy is
    broken."""


# ---------------------------------------------------------------- setup
def score(turns, prompt, tokenizer, reward_fn):
    """The one place text becomes a reward: a finished trajectory's, from its last turn's
    response."""
    text = tokenizer.decode(turns[-1].response_ids.tolist(), skip_special_tokens=True)
    return call_reward(reward_fn, text, prompt.answer, finished=turns[-1].finish_reason == "stop")


def trajectory_advantages(trajectories, scale_by_std):
    """GRPO advantage per trajectory, from its group's surviving trajectories: ([N], #degenerate
    groups)."""
    last = [turns[-1] for turns in trajectories]
    # explicit dtypes: a partial-rollout step where no group completed has no trajectories at all
    return grpo.group_advantages(
        torch.tensor([s.reward for s in last], dtype=torch.float),
        torch.tensor([s.group_id for s in last], dtype=torch.long),
        torch.tensor([not s.is_aborted for s in last], dtype=torch.bool),
        scale_by_std,
    )


def training_sequences(trajectories, advantages, cfg, max_seq_len):
    """Sequences to train on: merged turns (or one per turn) of finished trajectories, each with
    its *trajectory's* advantage, over-long ones dropped and counted (and with
    `train.mask_truncated`, DAPO's overlong filtering, the ones cut at the budget). Single-turn
    trajectories pass through."""
    if cfg.rollout.merge_turns:
        sequences, stats = merge.merge_batch(trajectories, max_seq_len)
    else:
        sequences = merge.unmerged(trajectories)
        stats = merge.MergeStats(
            turns=len(sequences), sequences_before=len(sequences), sequences_after=len(sequences)
        )
    # Cancelled and failed rows train nothing (all-zero loss mask, no advantage) but would still
    # cost the old-log-prob pass, the forward and the backward, and they are the longest rows: they
    # stop here.
    finished = [s for s in sequences if not s.is_aborted]
    kept = [s for s in finished if len(s.prompt_ids) + len(s.response_ids) <= max_seq_len]
    trained = [s for s in kept if not (cfg.train.mask_truncated and s.finish_reason == "length")]
    metrics = {
        "merge/sequences_before": stats.sequences_before,
        "merge/sequences_after": stats.sequences_after,
        "merge/ratio": stats.merge_ratio,
        "merge/prefix_breaks": stats.prefix_breaks,
        "train/truncated_masked": len(kept) - len(trained),
        "merge/over_length_dropped": len(finished) - len(kept),
        "rollout/turns_per_trajectory": stats.turns / max(len(trajectories), 1),
    }
    return trained, advantages[[s.trajectory_id for s in trained]], metrics


# ---------------------------------------------------------------- training step
def train_on_rollout(run, samples, advantages, version=0):
    """Old log-probs from the trainer, then `num_minibatches` clipped-ratio optimizer steps.
    `version` is the weight version being trained: tokens an older one sampled (partial rollout) are
    stale.

    With several ranks each holds its own samples (whole GRPO groups, so advantages were computed
    locally). Each rank's loss is divided by the *global* count of trained tokens (or sequences) and
    FSDP sums the gradients, so N ranks make the same update as one rank on the combined batch, in
    every loss mode. Minibatch i is every rank's i-th slice of its own samples.
    """
    t, r, policy, optimizer, scheduler = (
        run.cfg.train,
        run.cfg.rollout,
        run.policy,
        run.optimizer,
        run.scheduler,
    )
    # Dr. GRPO's constant: the budget
    norm_length = r.max_response_tokens or r.max_new_tokens * r.max_turns
    pad_id = policy.config.pad_token_id or 0
    logprobs_of = lambda model, mb: batching.sequence_logprobs(
        model, mb, r.temperature, run.autocast_dtype
    )  # noqa: E731
    minibatch_size = max(math.ceil(len(samples) / t.num_minibatches), 1)
    clip_low, clip_high = t.clip_range()
    # [num_minibatches][micro-batches]: collated once, used by both passes
    minibatches, over_budget = [], 0
    # the same count on every rank: clip_grad_norm_ is a collective too
    for i in range(t.num_minibatches):
        rows = slice(i * minibatch_size, (i + 1) * minibatch_size)
        mbs, over = batching.micro_batches(
            samples[rows],
            advantages[rows],
            t.micro_batch_size,
            pad_id,
            t.max_tokens_per_micro_batch,
        )
        minibatches.append([{key: value.to(run.device) for key, value in mb.items()} for mb in mbs])
        over_budget += over
    every_mb = [mb for minibatch in minibatches for mb in minibatch]
    stats = batching.mask_stale_tokens(every_mb, version, t.max_token_staleness)
    # the policy that sampled: recomputed here, the engine's copy is only compared
    with torch.no_grad():
        for mb in every_mb:
            mb["old_logprobs"] = logprobs_of(policy, mb)[0]
            if run.reference is not None:
                mb["ref_logprobs"] = logprobs_of(run.reference, mb)[0]
    # engine vs trainer on the tokens the current weights sampled (older tokens differ by design)
    fresh = [mb["loss_mask"] * (mb["staleness"] == 0) for mb in every_mb]
    gap = sum(
        ((mb["old_logprobs"] - mb["engine_logprobs"]).abs() * m).sum()
        for mb, m in zip(every_mb, fresh)
    )
    num_tokens = sum(m.sum() for m in fresh)
    stats |= {
        "train/skipped_updates": 0,
        "train/logprob_gap": (gap / max(num_tokens, 1)).item(),
        "train/over_budget_sequences": over_budget,
        **batching.layout_stats(every_mb),
        **batching.offpolicy_stats(every_mb, t.tis_cap),
    }
    for minibatch in minibatches:
        optimizer.zero_grad(set_to_none=True)
        local_count = sum(
            grpo.aggregation_count(mb["loss_mask"], t.loss_agg).item() for mb in minibatch
        )
        # the loss denominator of the whole step
        total = max(parallel.all_reduce([local_count])[0], 1)
        minibatch_loss = 0.0
        for mb in minibatch:
            logprobs, entropy = logprobs_of(policy, mb)
            loss, loss_stats = grpo.policy_loss(
                logprobs,
                mb["old_logprobs"],
                mb["advantages"],
                mb["loss_mask"],
                clip_low,
                t.loss_agg,
                norm_length,
                ref_logprobs=mb.get("ref_logprobs"),
                kl_coef=t.kl_coef,
                engine_logprobs=mb["engine_logprobs"] if t.tis_cap else None,
                tis_cap=t.tis_cap,
                clip_eps_high=clip_high,
                ratio_level=t.ratio_level,
            )
            # weight each micro-batch by its share of the denominator: accumulation == one big batch
            weighted = loss * grpo.aggregation_count(mb["loss_mask"], t.loss_agg) / total
            weighted.backward()
            minibatch_loss += weighted.item()
        grad_norm = parallel.full_tensor(
            torch.nn.utils.clip_grad_norm_(policy.parameters(), t.grad_clip)
        )
        minibatch_loss = parallel.all_reduce([minibatch_loss])[0]
        if math.isfinite(minibatch_loss) and math.isfinite(grad_norm.item()):
            optimizer.step()
            scheduler.step()
        # the loss and norm are global, so every rank skips alike; NaN moments would poison AdamW
        # for good
        else:
            log.warning(
                "non-finite loss %s or grad norm %s: update skipped",
                minibatch_loss,
                grad_norm.item(),
            )
            optimizer.zero_grad(set_to_none=True)
            stats["train/skipped_updates"] += 1
        stats.update(
            {
                "train/loss": minibatch_loss,
                "train/grad_norm": grad_norm.item(),
                "train/entropy": masked_mean(entropy, mb["loss_mask"]).item(),
                **{f"train/{k}": v.item() for k, v in loss_stats.items()},
            }
        )
    stats["train/lr"] = scheduler.get_last_lr()[0]
    return stats


def generate(
    run, prompts, group_size, temperature, plan=None, resumes=(), by_group=None, **filtering
):
    """The engine call of training and validation: single- or multi-turn per the config, each
    finished trajectory scored as it returns against `by_group[group id]` (default `prompts`);
    aborted, failed ones: none."""
    r, by_group = run.cfg.rollout, prompts if by_group is None else by_group
    return run.engine.generate(
        [p.prompt_ids for p in prompts],
        group_size,
        temperature,
        r.max_new_tokens,
        plan,
        run.tool,
        r.max_turns,
        r.max_response_tokens,
        resumes,
        **filtering,
        reward=lambda turns: score(
            turns, by_group[turns[-1].group_id], run.tokenizer, run.reward_fn
        ),
    )


def rollout(run, plan):
    """The step's training rollout: (prompts, samples, stats), new prompts from this rank's
    stream. Partial rollout: earlier steps' unfinished samples go first, only whole groups come
    back (buffer.py), with their prompts. Dynamic sampling: the engine asks for more prompts as
    it goes (`refill`), indexed as `by_group`."""
    r, buffer = run.cfg.rollout, run.buffer
    prompts = run.stream.take(
        buffer.new_prompts_needed(plan.num_prompts) if buffer else plan.num_prompts
    )
    resumes, prompts = (
        buffer.launch(prompts, plan.num_prompts, run.engine.weight_version)
        if buffer
        else ((), prompts)
    )
    # index = group id
    by_group = prompts + [group.prompt for group in (buffer.resumed.values() if buffer else ())]

    # the engine numbers them after every group id so far: by_group's next indices
    def refill(group_ids):
        by_group.extend(run.stream.take(len(group_ids)))
        return [p.prompt_ids for p in by_group[group_ids[0] :]]

    samples, stats = generate(
        run,
        prompts,
        r.group_size,
        r.temperature,
        plan,
        resumes,
        by_group,
        refill=refill,
        prior_rewards=buffer.prior_rewards() if buffer else None,
    )
    return (*buffer.collect(samples, by_group), stats) if buffer else (by_group, samples, stats)


def validate(run):
    """Greedy and sampled (training temperature) reward: greedy decoding hides policy changes that
    sampling shows, and sampling is what the next rollout sees. Never cancelled (no plan). Each rank
    scores its share of the prompts; sums and counts are reduced, so the means are exact. Returns
    (scalars, texts): rank 0's first greedy trajectories as text."""
    out, texts, prompts = {}, {}, parallel.rank_share(run.val_prompts)
    for suffix, temperature in (("", 0.0), ("_sampled", run.cfg.rollout.temperature)):
        samples = generate(run, prompts, 1, temperature)[0] if prompts else []
        trajectories = trajectories_of(samples)  # scored as they finished
        if not suffix and parallel.rank() == 0 and run.cfg.run.log_samples:
            texts["val/samples"] = trajectory_texts(
                trajectories, run.tokenizer, run.cfg.run.log_samples
            )
        rewards = [turns[-1].reward for turns in trajectories]
        # >= 1 well-formed call
        called = sum(any(t.tool_call == 1 for t in turns) for turns in trajectories)
        total, correct, calls, count = parallel.all_reduce(
            [sum(rewards), sum(r >= 1.0 for r in rewards), called, len(rewards)]
        )
        out[f"val/reward_mean{suffix}"], out[f"val/accuracy{suffix}"] = (
            total / count,
            correct / count,
        )
        if run.tool is not None:
            out[f"val/tool_call_ratio{suffix}"] = calls / count
    return out, texts


# ---------------------------------------------------------------- main loop
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default="configs/tiny.yaml", help="YAML file overriding config.py defaults"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one field"
    )
    parser.add_argument("--out", help="run directory (overrides run.out)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in the run directory",
    )
    return parser.parse_args(argv)


@dataclasses.dataclass
class Run:
    """Everything the loop needs, built once by `setup`."""

    cfg: Config
    policy: torch.nn.Module  # fp32 master weights; an FSDP2 shard of them with several ranks
    # frozen initial policy for the KL term (only when kl_coef > 0)
    reference: torch.nn.Module | None
    tokenizer: object
    stream: PromptStream  # this rank's training prompts; its position is checkpointed
    val_prompts: list
    reward_fn: object
    tool: object  # tasks.CalculatorTool for multi-turn tasks, else None
    engine: RolloutEngine
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    device: torch.device
    autocast_dtype: torch.dtype | None  # one rank computing in bf16; None for fp32 or under FSDP2
    # partial rollout's unfinished samples and held groups; None when off
    buffer: PartialBuffer | None
    start_step: int = 0
    # optimizer steps the policy holds (the step a checkpoint after a fault records)
    updates_done: int = 0


def setup(cfg, resume=False, engine=None):
    """Build policy, task, engine and optimizer on this rank; with `resume`, restore the latest
    checkpoint. An `engine` passed in (tests share one) is synced to the policy instead of
    starting another."""
    torch.set_num_threads(cfg.train.threads)  # the engine's processes need the other core(s)
    t, world = cfg.train, parallel.world_size()
    if cfg.rollout.prompts_per_step % world:
        raise ConfigError(
            f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must divide evenly over "
            f"{world} ranks (each rank takes whole GRPO groups)"
        )
    device = (
        torch.device("cuda", parallel.gpu_index())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    resume_dir = checkpoint.latest(cfg.run.out) if resume else None
    if resume and resume_dir is None:
        raise ConfigError(f"--resume: no checkpoint under {cfg.run.out}/checkpoints")
    state = checkpoint.read_trainer_state(resume_dir) if resume_dir else None
    start_step = state["step"] if state else 0
    policy, tokenizer = build_policy(cfg, resume_dir)
    train_prompts, val_prompts, reward_fn, tool = build_task(cfg, tokenizer)
    engine_dir = resume_dir or checkpoint.export_for_engine(policy, tokenizer, cfg.run.out)
    shared_engine = engine is not None
    # before the trainer takes device memory: the engine sizes its KV cache from what is free
    if engine is None:
        engine = RolloutEngine(
            engine_dir,
            cfg.rollout,
            dtype=cfg.model.engine_dtype,
            seed=t.seed + start_step + 100_003 * parallel.rank(),
            gpu_id=parallel.gpu_index(),
            local_rank=parallel.local_rank(),
            trust_remote_code=cfg.model.trust_remote_code,
        )
        engine.weight_version = start_step
    compute_dtype = getattr(torch, cfg.model.compute_dtype)
    # the KL reference is the *initial* policy, also after a resume: built again, not copied
    reference = build_policy(cfg, None)[0].requires_grad_(False).eval() if t.kl_coef > 0 else None
    if world > 1:
        policy, reference = (
            parallel.shard(m, compute_dtype) if m is not None else None for m in (policy, reference)
        )
    for model in (m for m in (policy, reference) if m is not None):
        model.to(device)
    optimizer, scheduler = build_optimizer(policy, t)
    if resume_dir:
        checkpoint.restore(resume_dir, state, policy, optimizer, scheduler)
    if shared_engine:  # an engine we started loaded exactly these weights from engine_dir
        engine.update_weights(
            policy.named_parameters(), version=start_step, gather=parallel.full_tensor
        )
    autocast_dtype = compute_dtype if world == 1 and compute_dtype != torch.float32 else None
    buffer = (
        PartialBuffer(
            cfg.rollout.group_size, cfg.rollout.max_staleness, multi_turn=tool is not None
        )
        if plan_launch(cfg.rollout, 1).partial
        else None
    )
    if state and state.get("buffer"):  # unfinished samples and held groups of the checkpointed step
        if buffer is None:
            log.warning(
                "the checkpoint holds %d partial-rollout groups; rollout.partial is off: not resumed",
                len(state["buffer"]["groups"]),
            )
        else:
            buffer.load_state_dict(share_state(state["buffer"], parallel.rank(), world))
    stream = PromptStream.for_rank(
        train_prompts, t.seed, parallel.rank(), world, (state or {}).get("prompt_positions")
    )
    return Run(
        cfg,
        policy,
        reference,
        tokenizer,
        stream,
        val_prompts,
        reward_fn,
        tool,
        engine,
        optimizer,
        scheduler,
        device,
        autocast_dtype,
        buffer,
        start_step,
        updates_done=start_step,
    )


def train_step(run, step, plan, phases):
    """One GRPO step on this rank: rollout -> reward -> advantage -> update -> weight sync.
    Returns its metrics, reduced over ranks (counts summed, times the slowest rank's), and
    validation texts."""
    cfg, max_seq_len = run.cfg, run.policy.config.max_position_embeddings
    step_start = time.perf_counter()
    scalars, texts = validate(run) if step % cfg.run.val_every == 0 else ({}, {})
    # 1. rollout: group_size trajectories per prompt of this rank's stream, 2. each rewarded as it
    #    finishes; the    tail cancelled per rollout.cancel (partial: suspended), dynamic sampling
    #    keeps groups whose rewards differ
    _, samples, stats = rollout(run, plan)
    # read before the filter renumbers the trajectories it keeps
    scalars |= rollout_metrics(samples, stats)
    trajectories, filter_counts = filter_groups(
        trajectories_of(samples), drop=cfg.rollout.filter_groups
    )
    # 3. group-relative advantage over each group's surviving trajectories
    advantages, num_degenerate = trajectory_advantages(trajectories, cfg.train.scale_by_std)
    # 4. policy update on (merged) sequences, with the engine's memory released
    sequences, sequence_advantages, merge_metrics = training_sequences(
        trajectories, advantages, cfg, max_seq_len
    )
    train_start = time.perf_counter()
    phases.to_train()
    scalars |= train_on_rollout(run, sequences, sequence_advantages, version=step)
    run.updates_done = step + 1  # from here on, a checkpoint of this run is at step + 1
    # 5. weight sync (staged wake-up): the engine samples the next step from the updated policy
    sync_start = time.perf_counter()
    phases.sync(version=step + 1)
    now = time.perf_counter()
    # buffer's rollout/* replace those
    scalars |= (run.buffer.metrics() if run.buffer else {}) | merge_metrics
    scalars |= filter_metrics(
        trajectories, filter_counts, stats, plan.target_groups, cfg.rollout.filter_groups
    ) | {
        **phases.metrics(),
        "train/degenerate_groups": num_degenerate,
        "timing/train_s": sync_start - train_start,
        "timing/weight_sync_s": now - sync_start,
        "timing/step_s": now - step_start,
        "perf/train_tokens_per_s": scalars["train/tokens"] / (sync_start - train_start),
    }
    return parallel.reduce_metrics(scalars), texts


def train(run, stop=None):
    """The step loop: log, checkpoint, and stop cleanly: after the step on SIGINT/SIGTERM
    (returns the signal's name; `stop` is the StopSignal to read, else one held while the loop
    runs), on `train.max_bad_updates` non-finite updates in a row (NonFiniteError), and with a
    checkpoint when the engine dies (EngineDiedError). Returns None when all steps ran."""
    cfg, is_writer = run.cfg, parallel.rank() == 0
    # one writer of TensorBoard and the console
    logger = Logger(cfg.run.out, cfg) if is_writer else None
    # per rank
    plan = plan_launch(cfg.rollout, cfg.rollout.prompts_per_step // parallel.world_size())
    phases = MemoryPhases(
        run.engine,
        run.policy,
        run.optimizer,
        cfg.memory.mode,
        cfg.memory.bucket_mb << 20,
        engine_dtype=run.engine.dtype,
        reference=run.reference,
    )
    own_stop, bad_steps, stop = stop is None, 0, stop or StopSignal(run.engine)
    try:
        for step in tqdm.trange(
            run.start_step,
            cfg.train.steps,
            initial=run.start_step,
            total=cfg.train.steps,
            disable=not is_writer,
        ):
            scalars, texts = train_step(run, step, plan, phases)
            if logger:
                logger.log(step, scalars, echo=tqdm.tqdm.write, texts=texts)
            bad_steps = bad_steps + 1 if scalars["train/skipped_updates"] else 0
            if bad_steps >= cfg.train.max_bad_updates:
                raise NonFiniteError(
                    f"{bad_steps} steps in a row had a non-finite loss or gradient (step {step}); "
                    f"last checkpoint: {checkpoint.latest(cfg.run.out)}"
                )
            # all ranks, same step
            stopping = parallel.all_reduce([stop.received is not None], op="max")[0] > 0
            if (
                stopping
                or step + 1 == cfg.train.steps
                or (cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0)
            ):
                checkpoint.save(cfg.run.out, step + 1, run)
            if stopping:
                return stop.received or "a signal on another rank"
        scalars, texts = validate(run)
        if logger:
            logger.log(cfg.train.steps, scalars, echo=tqdm.tqdm.write, texts=texts)
        return None
    except EngineDiedError as e:
        # the other ranks wait in collectives: the last periodic checkpoint stands
        if parallel.world_size() > 1:
            raise
        # the trainer's own state is intact: keep it
        path = checkpoint.save(cfg.run.out, run.updates_done, run)
        raise EngineDiedError(
            f"{e}. The trainer's state after {run.updates_done} updates is saved in {path}; "
            "--resume continues from it"
        ) from None
    finally:
        if own_stop:
            stop.restore()
        if logger:
            logger.close()


def run_rank(argv):
    """One rank's whole job (the only one with `run.nproc: 1`): join the process group when a
    launcher started us, set up, train, shut the engine down. Returns what `train` returns."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # its INFO lines would bury the step lines
    logging.getLogger("sglang").setLevel(logging.WARNING)
    args = parse_args(argv)
    cfg = load_config(args.config, args.set + ([f"run.out={args.out}"] if args.out else []))
    if parallel.under_launcher():
        parallel.init()
    try:
        run = setup(cfg, resume=args.resume)
        # held until the engine is down: a second signal exits at once until then
        stop = StopSignal(run.engine)
        try:
            return train(run, stop)
        finally:
            run.engine.shutdown()
            stop.restore()
    finally:
        parallel.close()


def main(argv=None):
    """`run.nproc > 1` outside torchrun: start the ranks here (each runs `run_rank` on the same
    arguments). Returns the name of the signal that stopped training early, or None."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    cfg = load_config(args.config, args.set + ([f"run.out={args.out}"] if args.out else []))
    nproc = cfg.run.nproc or parallel.default_nproc()
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise ConfigError(
            f"run.nproc={nproc} but only {torch.cuda.device_count()} GPUs are visible"
        )
    if nproc > 1 and not parallel.under_launcher():
        stopped_by = parallel.launch(nproc, run_rank, argv).values()  # each rank's run_rank result
        return next((name for name in stopped_by if name), None)
    return run_rank(argv)


if __name__ == "__main__":
    try:
        stopped_by = main()
    except (
        ConfigError,
        DataError,
        ModelError,
        NonFiniteError,
        RewardError,
        RolloutError,
        parallel.RankError,
    ) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        print(
            f"interrupted ({e or 'SIGINT'}): exited at once; the last checkpoint stands",
            file=sys.stderr,
        )
        sys.exit(130)
    if stopped_by:
        print(f"stopped by {stopped_by} after a checkpoint; --resume continues", file=sys.stderr)
        sys.exit(128 + getattr(signal, stopped_by, signal.SIGTERM))
