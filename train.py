"""GRPO trainer: one training step, the step loop, setup, and the command line.

Owns the order of the algorithm (rollout -> reward -> advantage -> update -> weight sync -> log ->
checkpoint), on one rank or several (each rank: an FSDP2 shard of the policy and its own engine).
The math lives in grpo.py, the stop rules in cancel.py, generation in rollout.py, rewards in
rewards.py, micro-batches in batching.py, memory phases in memory.py; README.md has the map.
Importing this file never trains (SGLang's and the launcher's processes re-import the main module).
"""

import argparse
import glob
import hashlib
import logging
import math
import signal
import sys
import time

import torch
import tqdm

import batching
import checkpoint
import eval as evaluation  # eval.py; the builtin eval is never used here
import grpo
import health
import merge
import parallel
import replay
import rewards
from cancel import filter_groups, plan_launch
from config import ConfigError, load_config
from memory import MemoryPhases
from metrics import (
    Logger,
    slowest,
    summed,
    TokenMeans,
    filter_metrics,
    masked_mean,
    reduce_metrics,
    rollout_metrics,
    trajectory_texts,
)
from model import ModelError
from sample import groups_of, trajectories_of
from sglang_engine import EngineDiedError, RolloutError, StopSignal
from setup_run import setup
from tasks import DataError

log = logging.getLogger("train")


class NonFiniteError(RuntimeError):
    """`train.max_bad_updates` steps in a row had a non-finite loss or gradient: the policy is
    broken."""


# ---------------------------------------------------------------- one GRPO step
def train_step(run, step, plan, phases):
    """One GRPO step on this rank: rollout -> reward -> advantage -> update -> weight sync.
    Returns its metrics, reduced over ranks (counts summed, times the slowest rank's), and the
    validation texts."""
    cfg = run.cfg
    step_start = time.perf_counter()
    scalars, texts = validate(run) if step % cfg.run.val_every == 0 else ({}, {})

    # 1. rollout and 2. reward: group_size trajectories per prompt, each scored by rewards.score
    #    as it finishes (so the cancel decision can read rewards); the tail cancelled as
    #    cancel.decide says (partial rollout: suspended, resumed next step)
    groups, rollout_stats = rollout(run, plan, seed=rollout_seed(cfg.train.seed, step))
    scalars |= rollout_metrics(flatten(groups), rollout_stats)
    # dynamic sampling keeps the groups whose rewards differ (off: all kept, the counts logged)
    groups, filter_counts = filter_groups(groups, drop=cfg.rollout.filter_groups)
    trajectories = flatten(groups)

    # 3. group-relative advantage over each group's surviving trajectories (train.kl_in=reward:
    #    of their rewards less the KL to the reference, which needs the trainer's memory back)
    train_start = time.perf_counter()
    phases.to_train()
    kl_cost = None
    if cfg.train.kl_in == "reward":
        kl_cost = cfg.train.kl_coef * reference_kl(run, trajectories)
        finished = torch.tensor([not turns[-1].is_aborted for turns in trajectories])
        scalars["train/reward_kl_cost"] = masked_mean(kl_cost, finished).item()
    advantages, num_degenerate = trajectory_advantages(groups, cfg.train.scale_by_std, kl_cost)

    # 4. policy update on (merged) sequences
    max_seq_len = run.policy.config.max_position_embeddings
    sequences, sequence_advantages, merge_metrics = merge.training_sequences(
        trajectories,
        advantages,
        max_seq_len,
        merge_turns=cfg.rollout.merge_turns,
        mask_truncated=cfg.train.mask_truncated,
    )
    # train.old_logprobs=engine skips the trainer's forward, except at the first step: the health
    # check reads the engine-vs-trainer gap there
    from_engine = cfg.train.old_logprobs == "engine" and step != run.start_step
    scalars |= train_on_rollout(run, sequences, sequence_advantages, step, from_engine)
    run.updates_done = step + 1  # from here on, a checkpoint of this run is at step + 1
    if cfg.run.dump_rollouts:  # what `train.py --replay` re-runs
        replay.dump(cfg.run.out, step, run.start_step, sequences, sequence_advantages, scalars)

    # 5. weight sync (staged wake-up): the engine samples the next step from the updated policy
    sync_start = time.perf_counter()
    check_s = []

    def check_push():
        """... and the engine holds what was sent, bit for bit (health.py)."""
        check_start = time.perf_counter()
        health.check_weights(
            run.engine, run.policy.named_parameters(), cfg.run.out, gather=parallel.full_tensor
        )
        check_s.append(time.perf_counter() - check_start)

    checking = health.should_check_weights(step, cfg.run)
    phases.sync(version=step + 1, after_push=check_push if checking else None)
    now = time.perf_counter()
    if check_s:
        scalars["timing/check_weights_s"] = slowest(check_s[0])

    if run.buffer is not None:
        scalars |= run.buffer.metrics()  # its rollout/* counts replace rollout_metrics'
    scalars |= merge_metrics
    scalars |= filter_metrics(
        trajectories,
        filter_counts,
        rollout_stats,
        target_groups=plan.target_groups,
        filtering=cfg.rollout.filter_groups,
    )
    scalars |= phases.metrics()
    scalars |= {
        "train/degenerate_groups": summed(num_degenerate),
        "timing/train_s": slowest(sync_start - train_start),
        "timing/weight_sync_s": slowest(now - sync_start - sum(check_s)),
        "timing/step_s": slowest(now - step_start),
        "perf/train_tokens_per_s": summed(scalars["train/tokens"] / (sync_start - train_start)),
    }
    return reduce_metrics(scalars), texts


def flatten(groups):
    """The trajectories of a list of groups, group by group."""
    return [turns for group in groups for turns in group]


def rollout_seed(run_seed, step, purpose="train"):
    """The seed of one rollout, from which each request's sampling_seed derives
    (rollout.request_seed): the same run seed samples the same tokens wherever the engine's
    arithmetic allows (rollout.deterministic)."""
    return int.from_bytes(
        hashlib.blake2b(f"{run_seed}:{step}:{purpose}".encode(), digest_size=4).digest(), "big"
    )


def rollout(run, plan, seed=None):
    """The step's training rollout: (groups, RolloutStats), each group a list of trajectories
    (lists of turns), new prompts from this rank's stream. Partial rollout: earlier steps'
    unfinished samples go first, and only complete groups come back (buffer.py). Dynamic
    sampling: the engine asks for more prompts as it goes (`more_prompts`)."""
    r = run.cfg.rollout
    buffer = run.buffer
    resumes = []
    prior_rewards = None
    if buffer is None:
        prompts = run.stream.take(plan.num_prompts)
        prompts_by_group = list(prompts)
    else:
        new = run.stream.take(buffer.new_prompts_needed(plan.num_prompts))
        resumes, prompts = buffer.launch(new, plan.num_prompts, run.engine.weight_version)
        # group ids: the new prompts' (0..), then one per resumed held group
        prompts_by_group = prompts + [group.prompt for group in buffer.resumed.values()]
        prior_rewards = buffer.prior_rewards()

    def more_prompts(count, first_group_id):
        """Dynamic sampling's refills from this rank's stream. Their group ids continue after
        every group id so far, so they index `prompts_by_group` as the earlier ones do."""
        assert first_group_id == len(prompts_by_group)
        prompts_by_group.extend(run.stream.take(count))
        return [p.prompt_ids for p in prompts_by_group[first_group_id:]]

    samples, stats = run.engine.generate(
        [p.prompt_ids for p in prompts],
        r.group_size,
        r.temperature,
        r.max_new_tokens,
        plan,
        tool=run.tool,
        max_turns=r.max_turns,
        max_response_tokens=r.max_response_tokens,
        resumes=resumes,
        reward=scorer(run, prompts_by_group),
        more_prompts=more_prompts,
        prior_rewards=prior_rewards,
        seed=seed,
    )
    if buffer is None:
        return groups_of(trajectories_of(samples)), stats
    return buffer.collect(samples, prompts_by_group), stats


def generate(run, prompts, group_size, temperature, seed=None):
    """Validation's rollout (and the tests'): `group_size` trajectories per prompt, every
    request waited for, each trajectory scored. Returns (samples, RolloutStats)."""
    r = run.cfg.rollout
    return run.engine.generate(
        [p.prompt_ids for p in prompts],
        group_size,
        temperature,
        r.max_new_tokens,
        tool=run.tool,
        max_turns=r.max_turns,
        max_response_tokens=r.max_response_tokens,
        reward=scorer(run, prompts, overlong=False),  # the task's reward alone, as eval.py's
        seed=seed,
    )


def scorer(run, prompts_by_group, overlong=True):
    """The reward step, as the rollout calls it on each finished trajectory (its turns): its
    score against the answer of its prompt, `prompts_by_group[group id]`, plus DAPO's overlong
    penalty when on (training's rollouts only: `overlong` False for validation)."""

    r = run.cfg.rollout
    t = run.cfg.train

    async def reward(turns):  # off the rollout's event loop (rewards.py)
        prompt = prompts_by_group[turns[-1].group_id]
        value = await rewards.score(
            turns, prompt.answer, run.tokenizer, run.reward_fn, r.reward_timeout_s
        )
        if overlong and t.overlong_penalty:  # DAPO: long responses earn less, before the cut
            length = len(turns[-1].response_ids)  # single-turn (config.py refuses more turns)
            budget = min(r.max_new_tokens, r.max_response_tokens or r.max_new_tokens)
            value += rewards.overlong_penalty(length, budget, t.overlong_buffer, t.overlong_penalty)
        return value

    return reward


def trajectory_advantages(groups, scale_by_std, cost=None):
    """GRPO advantage per trajectory, from its group's surviving trajectories. `groups`: lists
    of trajectories; `cost`: [N] subtracted from their rewards first (the KL in the reward).
    Returns ([N] aligned with flatten(groups), #degenerate groups)."""
    last_turns = [turns[-1] for turns in flatten(groups)]
    group_index = [g for g, group in enumerate(groups) for _ in group]
    # explicit dtypes: a partial-rollout step where no group completed has no trajectories at all
    rewards = torch.tensor([s.reward for s in last_turns], dtype=torch.float)
    return grpo.group_advantages(
        rewards if cost is None else rewards - cost,
        torch.tensor(group_index, dtype=torch.long),
        torch.tensor([not s.is_aborted for s in last_turns], dtype=torch.bool),
        scale_by_std,
    )


def reference_kl(run, trajectories):
    """Each trajectory's KL to the frozen reference, summed over the tokens the model wrote (every
    turn's): train.kl_estimator of the log-probs that sampled them (the engine's) against the
    reference's, one forward pass without grad, in padded micro-batches of train.micro_batch_size
    (packing would reorder the samples). Unfinished trajectories get 0 (batching.collate gives an
    aborted sample no trained token; no advantage anyway). For the KL as a cost in the reward, as
    verl's use_kl_in_reward does (ray_trainer.py apply_kl_penalty; its GRPO advantage sums the
    token rewards)."""
    t = run.cfg.train
    samples = [turn for turns in trajectories for turn in turns]
    owner = torch.tensor(
        [i for i, turns in enumerate(trajectories) for _ in turns], dtype=torch.long
    )
    pad_id = run.policy.config.pad_token_id or 0
    # padded micro-batches keep the samples' order (packing would not); padding ones come last
    batches, _ = batching.micro_batches(
        samples, torch.zeros(len(samples)), t.micro_batch_size, pad_id
    )
    per_sample = []
    with torch.no_grad():
        for mb in batches:
            mb = {key: value.to(run.device) for key, value in mb.items()}
            reference, _ = batching.sequence_logprobs(
                run.reference, mb, run.cfg.rollout.temperature, run.autocast_dtype
            )
            kl = grpo.kl_estimate(mb["engine_logprobs"], reference, t.kl_estimator)
            per_sample += (kl * mb["loss_mask"]).sum(-1).tolist()
    total = torch.zeros(len(trajectories))
    return total.index_add_(0, owner, torch.tensor(per_sample[: len(samples)], dtype=torch.float))


def train_on_rollout(run, samples, advantages, version=0, from_engine=False):
    """Old log-probs from the trainer (`from_engine`: the engine's), then `num_minibatches`
    clipped-ratio optimizer steps. `version` is the weight version being trained: tokens an older
    one sampled (partial rollout) are stale.

    With several ranks each holds its own samples (whole GRPO groups, so advantages were computed
    locally). Each rank's loss is divided by the *global* count of trained tokens (or sequences)
    and FSDP sums the gradients, so N ranks make the same update as one rank on the combined
    batch, in every loss mode. Minibatch i is every rank's i-th slice of its own samples.
    """
    t = run.cfg.train
    pad_id = run.policy.config.pad_token_id or 0
    minibatches, over_budget = batching.minibatches(samples, advantages, t, pad_id, run.device)
    every_mb = [mb for minibatch in minibatches for mb in minibatch]
    stats = batching.mask_stale_tokens(every_mb, version, t.max_token_staleness)
    stats |= old_logprobs(run, every_mb, from_engine)
    stats |= batching.layout_stats(every_mb)
    stats |= batching.offpolicy_stats(every_mb, t.tis_cap)
    stats["train/over_budget_sequences"] = summed(over_budget)
    token_stats = TokenMeans()
    losses = []
    grad_norms = []
    skipped = 0
    for minibatch in minibatches:
        loss, grad_norm = update(run, minibatch, token_stats)
        losses.append(loss)
        grad_norms.append(grad_norm)
        skipped += not (math.isfinite(loss) and math.isfinite(grad_norm))
    stats["train/skipped_updates"] = skipped
    stats["train/loss"] = sum(losses) / len(losses)  # mean over the step's minibatches
    stats["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
    stats |= token_stats.means()
    stats["train/lr"] = run.scheduler.get_last_lr()[0]
    return stats


def old_logprobs(run, micro_batches, from_engine=False):
    """The sampling policy's log-probs, recomputed by the trainer on every micro-batch (and the
    frozen reference's, for the KL term in the loss); the engine's own copy is only compared (the
    gap). `from_engine` (train.old_logprobs=engine): the engine's are pi_old, the forward is
    skipped, and there is no gap to report."""
    r = run.cfg.rollout
    with torch.no_grad():
        for mb in micro_batches:
            if from_engine:
                mb["old_logprobs"] = mb["engine_logprobs"]
            else:
                mb["old_logprobs"] = batching.sequence_logprobs(
                    run.policy, mb, r.temperature, run.autocast_dtype
                )[0]
            if run.reference is not None and run.cfg.train.kl_in == "loss":
                mb["ref_logprobs"] = batching.sequence_logprobs(
                    run.reference, mb, r.temperature, run.autocast_dtype
                )[0]
    if from_engine:
        return {}
    # engine vs trainer on the tokens the current weights sampled (older tokens differ by design)
    gap = 0.0
    num_tokens = 0
    for mb in micro_batches:
        fresh = mb["loss_mask"] * (mb["staleness"] == 0)
        gap += ((mb["old_logprobs"] - mb["engine_logprobs"]).abs() * fresh).sum().item()
        num_tokens += fresh.sum().item()
    return {"train/logprob_gap": gap / max(num_tokens, 1)}


def update(run, minibatch, token_stats):
    """One clipped-ratio optimizer step over a minibatch's micro-batches (gradient accumulation),
    skipped when the loss or the gradient norm is not finite. Adds each micro-batch's statistics
    to `token_stats`. Returns (the minibatch's loss, its gradient norm), both global over ranks."""
    t = run.cfg.train
    r = run.cfg.rollout
    clip_low, clip_high = t.clip_range()
    norm_length = r.max_response_tokens or r.max_new_tokens * r.max_turns  # Dr. GRPO's constant
    run.optimizer.zero_grad(set_to_none=True)
    counts = [grpo.aggregation_count(mb["loss_mask"], t.loss_agg).item() for mb in minibatch]
    total = max(parallel.all_reduce([sum(counts)])[0], 1)  # the loss denominator of all ranks
    minibatch_loss = 0.0
    for mb, count in zip(minibatch, counts):
        logprobs, entropy = batching.sequence_logprobs(
            run.policy, mb, r.temperature, run.autocast_dtype, entropy_grad=t.entropy_coef > 0
        )
        loss, loss_stats = grpo.policy_loss(
            logprobs,
            mb["old_logprobs"],
            mb["advantages"],
            mb["loss_mask"],
            clip_eps=clip_low,
            agg_mode=t.loss_agg,
            norm_length=norm_length,
            ref_logprobs=mb.get("ref_logprobs"),
            kl_coef=t.kl_coef,
            engine_logprobs=mb["engine_logprobs"] if t.tis_cap else None,
            tis_cap=t.tis_cap,
            clip_eps_high=clip_high,
            ratio_level=t.ratio_level,
            kl_estimator=t.kl_estimator,
            entropy=entropy,
            entropy_coef=t.entropy_coef,
        )
        # weight each micro-batch by its share of the denominator: accumulation == one big batch
        weighted = loss * count / total
        weighted.backward()
        minibatch_loss += weighted.item()
        num_tokens = mb["loss_mask"].sum().item()
        token_stats.add(
            "train/entropy", masked_mean(entropy.detach(), mb["loss_mask"]).item(), num_tokens
        )
        for name, value in loss_stats.items():
            token_stats.add(f"train/{name}", value.item(), num_tokens)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.policy.parameters(), t.grad_clip)
    grad_norm = parallel.full_tensor(grad_norm).item()
    minibatch_loss = parallel.all_reduce([minibatch_loss])[0]
    if math.isfinite(minibatch_loss) and math.isfinite(grad_norm):
        run.optimizer.step()
        run.scheduler.step()
    else:
        # the loss and norm are global, so every rank skips alike; NaN moments would poison
        # AdamW for good
        log.warning("non-finite loss %s or grad norm %s: update skipped", minibatch_loss, grad_norm)
        run.optimizer.zero_grad(set_to_none=True)
    return minibatch_loss, grad_norm


def validate(run):
    """Greedy and sampled (training temperature) reward: greedy decoding hides policy changes
    that sampling shows, and sampling is what the next rollout sees. Never cancelled. Each rank
    scores its share of the prompts; sums and counts are reduced, so the means are exact.
    Returns (scalars, texts): rank 0's first greedy trajectories as text."""
    out = {}
    texts = {}
    prompts = parallel.rank_share(run.val_prompts)
    n = run.cfg.run.val_samples
    for suffix, temperature, group_size in (
        ("", 0.0, 1),
        ("_sampled", run.cfg.rollout.temperature, n),
    ):
        seed = rollout_seed(run.cfg.train.seed, run.updates_done, f"val{suffix}")
        samples = generate(run, prompts, group_size, temperature, seed)[0] if prompts else []
        trajectories = trajectories_of(samples)  # scored as they finished
        if not suffix and parallel.rank() == 0 and run.cfg.run.log_samples:
            texts["val/samples"] = trajectory_texts(
                trajectories, run.tokenizer, run.cfg.run.log_samples
            )
        scores = [turns[-1].reward for turns in trajectories]
        # trajectories with at least one well-formed tool call
        called = sum(any(t.tool_call == 1 for t in turns) for turns in trajectories)
        total, correct, calls, count = parallel.all_reduce(
            [sum(scores), sum(r >= 1.0 for r in scores), called, len(scores)]
        )
        out[f"val/reward_mean{suffix}"] = total / count
        out[f"val/accuracy{suffix}"] = correct / count
        if group_size > 1:
            out |= pass_at_ks(trajectories, group_size)
        if run.tool is not None:
            out[f"val/tool_call_ratio{suffix}"] = calls / count
    return out, texts


def pass_at_ks(trajectories, n):
    """val/pass@k for k = 1, 2, 4, ... up to n (eval.py's estimator), from n scored trajectories
    per prompt (group ids: the prompts), exact over ranks."""
    correct = {}
    for turns in trajectories:
        group = turns[-1].group_id
        correct[group] = correct.get(group, 0) + (turns[-1].reward >= 1.0)
    ks = [2**i for i in range(n.bit_length()) if 2**i < n] + [n]
    sums = [sum(evaluation.pass_at_k(n, c, k) for c in correct.values()) for k in ks]
    *sums, count = parallel.all_reduce(sums + [len(correct)])
    return {f"val/pass@{k}": total / count for k, total in zip(ks, sums)}


# ---------------------------------------------------------------- the step loop
def train(run, stop=None):
    """The step loop: log, checkpoint, and stop cleanly: after the step on SIGINT/SIGTERM
    (returns the signal's name; `stop` is the StopSignal to read, else one held while the loop
    runs), on `train.max_bad_updates` non-finite updates in a row (NonFiniteError), and with a
    checkpoint when the engine dies (EngineDiedError). Returns None when all steps ran."""
    cfg = run.cfg
    is_writer = parallel.rank() == 0
    logger = (
        Logger(cfg.run.out, cfg) if is_writer else None
    )  # one writer of TensorBoard and console
    plan = plan_launch(cfg.rollout, cfg.rollout.prompts_per_step // parallel.world_size())
    phases = MemoryPhases.of(run, cfg.memory)
    own_stop = stop is None
    if own_stop:
        stop = StopSignal(run.engine)
    bad_steps = 0  # non-finite updates in a row
    gap_watch = health.GapWatch(cfg, first_step=run.start_step)
    steps = tqdm.trange(
        run.start_step,
        cfg.train.steps,
        initial=run.start_step,
        total=cfg.train.steps,
        disable=not is_writer,
    )
    try:
        for step in steps:
            scalars, texts = train_step(run, step, plan, phases)
            if logger:
                logger.log(step, scalars, echo=tqdm.tqdm.write, texts=texts)
            if "train/logprob_gap" in scalars:  # not measured with train.old_logprobs=engine
                gap_watch.observe(step, scalars["train/logprob_gap"])
            bad_steps = bad_steps + 1 if scalars["train/skipped_updates"] else 0
            if bad_steps >= cfg.train.max_bad_updates:
                raise NonFiniteError(
                    f"{bad_steps} steps in a row had a non-finite loss or gradient (step {step}); "
                    f"last checkpoint: {checkpoint.latest(cfg.run.out)}"
                )
            # every rank stops after the same step
            stopping = parallel.all_reduce([stop.received is not None], op="max")[0] > 0
            every = cfg.run.checkpoint_every
            periodic = every and (step + 1) % every == 0
            if stopping or periodic or step + 1 == cfg.train.steps:
                checkpoint.save(cfg.run.out, step + 1, run)
            if stopping:
                return stop.received or "a signal on another rank"
        scalars, texts = validate(run)  # the final policy's
        if logger:
            logger.log(cfg.train.steps, scalars, echo=tqdm.tqdm.write, texts=texts)
        return None
    except EngineDiedError as e:
        if parallel.world_size() > 1:
            raise  # the other ranks wait in collectives: the last periodic checkpoint stands
        raise save_after_engine_death(run, e) from None
    finally:
        if own_stop:
            stop.restore()
        if logger:
            logger.close()


def save_after_engine_death(run, error):
    """The trainer's own state is intact when its engine dies: checkpoint it, and return the
    error to raise, saying where it is."""
    path = checkpoint.save(run.cfg.run.out, run.updates_done, run)
    return EngineDiedError(
        f"{error}. The trainer's state after {run.updates_done} updates is saved in {path}; "
        "--resume continues from it"
    )


# ---------------------------------------------------------------- command line
def parse_args(argv=None):
    configs = ", ".join(sorted(glob.glob("configs/*.yaml"))) or "none found in ./configs"
    parser = argparse.ArgumentParser(
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
        "--replay",
        metavar="RUN/rollouts/step_N",
        help="re-run that dumped step's update without the engine (run.dump_rollouts; replay.py)",
    )
    return parser.parse_args(argv)


def config_of(args):
    """The run's Config: config.py's defaults <- the YAML file <- --set <- --out."""
    sets = args.set + ([f"run.out={args.out}"] if args.out else [])
    return load_config(args.config, sets)


def run_rank(argv):
    """One rank's whole job (the only one with `run.nproc: 1`): join the process group when a
    launcher started us, set up, train, shut the engine down. Returns what `train` returns."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("sglang").setLevel(logging.WARNING)  # its INFO lines would bury the steps
    args = parse_args(argv)
    cfg = config_of(args)
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
    if args.replay:
        loss, grad_norm, logged_loss, logged_grad_norm = replay.replay(args.replay)
        exact = loss == logged_loss and grad_norm == logged_grad_norm
        print(
            f"replay: loss={loss!r} (logged {logged_loss!r}) grad_norm={grad_norm!r} "
            f"(logged {logged_grad_norm!r}) exact={exact}"
        )
        return None
    cfg = config_of(args)
    nproc = cfg.run.nproc or parallel.default_nproc()
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise ConfigError(
            f"run.nproc={nproc} but only {torch.cuda.device_count()} GPUs are visible"
        )
    if nproc > 1 and not parallel.under_launcher():
        stopped_by = parallel.launch(nproc, run_rank, argv).values()  # each rank's result
        return next((name for name in stopped_by if name), None)
    return run_rank(argv)


if __name__ == "__main__":
    errors = (
        ConfigError,
        DataError,
        ModelError,
        NonFiniteError,
        health.HealthError,
        rewards.RewardError,
        RolloutError,
        parallel.RankError,
    )
    try:
        stopped_by = main()
    except errors as e:
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
