"""GRPO trainer: setup helpers, one training step, checkpoints, and the step loop (`main`).

Owns the order of the algorithm (rollout -> reward -> advantage -> update -> weight sync -> log ->
checkpoint). The math lives in grpo.py, the engine in rollout.py, tasks in tasks.py, settings in
config.py, memory phases in memory.py. Importing this file never trains: SGLang's scheduler
processes re-import the main module.
"""
import argparse
import dataclasses
import glob
import logging
import os
import random
import shutil
import sys
import time

import torch
import tqdm

import grpo
import merge
import tasks
from config import Config, ConfigError, load_config
from memory import MemoryPhases
from metrics import Logger, masked_mean, rollout_metrics
from rollout import RolloutEngine, RolloutError, plan_launch

log = logging.getLogger("train")


class ModelError(RuntimeError):
    """The policy model cannot be built or loaded."""


# ---------------------------------------------------------------- setup
def build_policy(cfg, init_dir):
    """(policy, tokenizer). `model.path: tiny` builds the demo model from the config (random init,
    seeded); anything else loads a HF checkpoint. `init_dir` (a resumed checkpoint) wins over both."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    dtype = getattr(torch, cfg.model.dtype)
    path = init_dir or cfg.model.path
    try:
        if cfg.model.path == "tiny":
            # Rebuilt, not reloaded: AutoTokenizer would swap in Qwen2Tokenizer (shared/notes/tiny-demo.md)
            tokenizer = tasks.build_char_tokenizer()
            if init_dir:
                return AutoModelForCausalLM.from_pretrained(init_dir, dtype=dtype), tokenizer
            m = cfg.model
            torch.manual_seed(cfg.train.seed)
            config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=m.hidden_size,
                                 intermediate_size=m.intermediate_size, num_hidden_layers=m.num_layers,
                                 num_attention_heads=m.num_heads, num_key_value_heads=m.num_heads,
                                 max_position_embeddings=m.max_position_embeddings, tie_word_embeddings=True,
                                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id, torch_dtype=cfg.model.dtype)
            return Qwen2ForCausalLM(config).to(dtype), tokenizer
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise ModelError(f"model.path={path!r} could not be loaded: {str(e).splitlines()[0]}") from None


def build_task(cfg, tokenizer):
    """(train prompts, validation prompts, reward function, tool or None) for `data.task`."""
    d, seed = cfg.data, cfg.train.seed
    if d.task == "tiny":
        train = tasks.tiny_prompts(tokenizer, d.num_tiny_prompts, d.tiny_max_count, seed=seed)
        val = tasks.tiny_prompts(tokenizer, d.num_val_prompts, d.tiny_max_count, seed=seed + 1)
        return train, val, tasks.tiny_reward, None
    if d.task == "tiny_tool":
        train = tasks.tiny_tool_prompts(tokenizer, d.num_tiny_prompts, d.tiny_max_operand, seed=seed)
        val = tasks.tiny_tool_prompts(tokenizer, d.num_val_prompts, d.tiny_max_operand, seed=seed + 1)
        return train, val, tasks.tiny_tool_reward, tasks.tiny_calculator(tokenizer)
    use_tool = cfg.rollout.max_turns > 1
    tools = [tasks.CALCULATOR_SCHEMA] if use_tool else None
    train = tasks.gsm8k_prompts(tokenizer, d.train_path, "train", d.max_prompt_len, tools)
    val = tasks.gsm8k_prompts(tokenizer, d.val_path or d.train_path, "test", d.max_prompt_len, tools)
    return train, val[:d.num_val_prompts], tasks.gsm8k_reward, tasks.qwen_calculator(tokenizer) if use_tool else None


def draw_prompts(prompts, step, count, seed):
    """The prompts of `step`: a fixed function of (seed, step), so a resumed run draws the same ones."""
    epoch, offset = divmod(step * count, len(prompts))
    order = list(range(len(prompts)))
    random.Random(seed * 100_003 + epoch).shuffle(order)
    order += list(range(len(prompts)))  # a batch that runs past the epoch's end wraps around
    return [prompts[i] for i in order[offset:offset + count]]


def score(samples, prompts, tokenizer, reward_fn):
    """Reward each trajectory on its last turn's response and give every turn that reward; returns the
    trajectories (lists of turns, index = trajectory_id). Aborted and failed ones keep 0 but are
    never averaged in as zeros (their is_aborted flag keeps them out)."""
    trajectories = {}
    for s in samples:
        trajectories.setdefault(s.trajectory_id, []).append(s)
    for turns in trajectories.values():
        last = turns[-1]
        if not last.is_aborted:
            text = tokenizer.decode(last.response_ids.tolist(), skip_special_tokens=True)
            reward = reward_fn(text, prompts[last.group_id].answer, finished=last.finish_reason == "stop")
            for turn in turns:
                turn.reward = reward
    return [trajectories[i] for i in sorted(trajectories)]


def trajectory_advantages(trajectories, scale_by_std):
    """GRPO advantage per trajectory, from its group's surviving trajectories: ([N], #degenerate groups)."""
    last = [turns[-1] for turns in trajectories]
    return grpo.group_advantages(torch.tensor([s.reward for s in last]), torch.tensor([s.group_id for s in last]),
                                 torch.tensor([not s.is_aborted for s in last]), scale_by_std)


def training_sequences(trajectories, advantages, cfg, max_seq_len):
    """Sequences to train on: merged turns (or one per turn), each with its *trajectory's* advantage,
    over-long ones dropped and counted. Single-turn trajectories pass through unchanged."""
    if cfg.rollout.merge_turns:
        sequences, stats = merge.merge_batch(trajectories, max_seq_len)
    else:
        sequences = merge.unmerged(trajectories)
        stats = merge.MergeStats(turns=len(sequences), sequences_before=len(sequences), sequences_after=len(sequences))
    kept = [s for s in sequences if len(s.prompt_ids) + len(s.response_ids) <= max_seq_len]
    metrics = {"merge/sequences_before": stats.sequences_before, "merge/sequences_after": stats.sequences_after,
               "merge/ratio": stats.merge_ratio, "merge/prefix_breaks": stats.prefix_breaks,
               "merge/over_length_dropped": len(sequences) - len(kept),
               "rollout/turns_per_trajectory": stats.turns / max(len(trajectories), 1)}
    return kept, advantages[[s.trajectory_id for s in kept]], metrics


# ---------------------------------------------------------------- training step
TORCH_DTYPES = {"i": torch.int32, "f": torch.float32, "B": torch.uint8}  # array typecode -> tensor dtype


def tensor_view(values):
    """A Sample's per-token array as a tensor sharing its memory (torch.tensor would walk it item by item)."""
    dtype = TORCH_DTYPES[values.typecode]
    return torch.frombuffer(values, dtype=dtype) if values else torch.empty(0, dtype=dtype)


def collate(samples, pad_id):
    """Right-padded [B, T] tensors. Position t of `targets` is the token predicted from input t."""
    full = [s.prompt_ids + s.response_ids for s in samples]
    width = max(map(len, full))
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    loss_mask = torch.zeros(len(samples), width - 1)
    engine_logprobs = torch.zeros(len(samples), width - 1)
    for row, (s, ids) in enumerate(zip(samples, full)):
        input_ids[row, :len(ids)] = tensor_view(ids)  # copies, casting int32 -> int64
        attention_mask[row, :len(ids)] = 1
        first = len(s.prompt_ids) - 1  # logits at the last prompt position predict response token 0
        if not s.is_aborted:  # aborted rows keep an all-zero mask: they count in no loss or denominator
            loss_mask[row, first:first + len(s.response_ids)] = tensor_view(s.loss_mask)
        engine_logprobs[row, first:first + len(s.response_ids)] = tensor_view(s.logprobs)
    return dict(input_ids=input_ids, attention_mask=attention_mask, targets=input_ids[:, 1:],
                loss_mask=loss_mask, engine_logprobs=engine_logprobs)


def sequence_logprobs(model, batch, temperature):
    """Per-token log-probs and entropies [B, T-1] of `batch['targets']` under `model`."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    return grpo.token_logprobs(logits, batch["targets"], temperature)


def micro_batches(batch, size):
    for start in range(0, len(batch["input_ids"]), size):
        yield {key: value[start:start + size] for key, value in batch.items()}


def train_on_rollout(run, samples, advantages):
    """Old log-probs from the trainer, then `num_minibatches` clipped-ratio optimizer steps."""
    cfg, t, policy, optimizer, scheduler = run.cfg, run.cfg.train, run.policy, run.optimizer, run.scheduler
    r = cfg.rollout
    norm_length = r.max_response_tokens or r.max_new_tokens * r.max_turns  # Dr. GRPO's constant: the budget
    batch = collate(samples, pad_id=policy.config.pad_token_id or 0)
    batch["advantages"] = advantages
    batch = {key: value.to(run.device) for key, value in batch.items()}
    with torch.no_grad():  # the policy that sampled: recomputed here, the engine's copy is only compared
        batch["old_logprobs"] = torch.cat([sequence_logprobs(policy, mb, cfg.rollout.temperature)[0]
                                           for mb in micro_batches(batch, t.micro_batch_size)])
        if run.reference is not None:
            batch["ref_logprobs"] = torch.cat([sequence_logprobs(run.reference, mb, cfg.rollout.temperature)[0]
                                               for mb in micro_batches(batch, t.micro_batch_size)])
    gap = masked_mean((batch["old_logprobs"] - batch["engine_logprobs"]).abs(), batch["loss_mask"])
    stats = {"train/logprob_gap": gap.item()}
    minibatch_size = -(-len(samples) // t.num_minibatches)
    for minibatch in micro_batches(batch, minibatch_size):
        optimizer.zero_grad(set_to_none=True)
        total, minibatch_loss = grpo.aggregation_count(minibatch["loss_mask"], t.loss_agg), 0.0
        for mb in micro_batches(minibatch, t.micro_batch_size):
            logprobs, entropy = sequence_logprobs(policy, mb, cfg.rollout.temperature)
            loss, loss_stats = grpo.policy_loss(
                logprobs, mb["old_logprobs"], mb["advantages"], mb["loss_mask"], t.clip_eps, t.loss_agg,
                norm_length, ref_logprobs=mb.get("ref_logprobs"), kl_coef=t.kl_coef,
                engine_logprobs=mb["engine_logprobs"] if t.tis_cap else None, tis_cap=t.tis_cap)
            # weight each micro-batch by its share of the denominator: accumulation == one big batch
            weighted = loss * grpo.aggregation_count(mb["loss_mask"], t.loss_agg) / total
            weighted.backward()
            minibatch_loss += weighted.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), t.grad_clip)
        optimizer.step()
        scheduler.step()
        stats.update({"train/loss": minibatch_loss, "train/grad_norm": grad_norm.item(),
                      "train/entropy": masked_mean(entropy.detach(), mb["loss_mask"]).item(),
                      **{f"train/{k}": v.item() for k, v in loss_stats.items()}})
    stats["train/lr"] = scheduler.get_last_lr()[0]
    return stats


def generate(run, prompts, group_size, temperature, plan=None):
    """The engine call of both training and validation: single- or multi-turn per the config."""
    r = run.cfg.rollout
    return run.engine.generate([p.prompt_ids for p in prompts], group_size, temperature, r.max_new_tokens, plan,
                               run.tool, r.max_turns, r.max_response_tokens)


def validate(run):
    """Greedy and sampled (training temperature) reward: greedy decoding hides policy changes that
    sampling shows, and sampling is what the next rollout sees. Never cancelled (no plan)."""
    out = {}
    for suffix, temperature in (("", 0.0), ("_sampled", run.cfg.rollout.temperature)):
        samples, _ = generate(run, run.val_prompts, 1, temperature)
        rewards = [turns[-1].reward for turns in score(samples, run.val_prompts, run.tokenizer, run.reward_fn)]
        out[f"val/reward_mean{suffix}"] = sum(rewards) / len(rewards)
        out[f"val/accuracy{suffix}"] = sum(r >= 1.0 for r in rewards) / len(rewards)
    return out


# ---------------------------------------------------------------- checkpoints
def save_checkpoint(out_dir, step, run):
    """Written to a temp dir then renamed: a crash mid-write never leaves a half checkpoint behind."""
    final = os.path.join(out_dir, "checkpoints", f"step_{step:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    run.policy.save_pretrained(tmp, safe_serialization=True)
    run.tokenizer.save_pretrained(tmp)
    torch.save({"step": step, "optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()},
               os.path.join(tmp, "trainer_state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    return final


def latest_checkpoint(out_dir):
    found = sorted(glob.glob(os.path.join(out_dir, "checkpoints", "step_[0-9]*[0-9]")))
    return found[-1] if found else None


def export_for_engine(policy, tokenizer, out_dir):
    """The engine loads weights from a folder, like any checkpoint: write the initial policy there."""
    model_dir = os.path.join(out_dir, "model")
    policy.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    return model_dir


# ---------------------------------------------------------------- main loop
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.yaml", help="YAML file overriding config.py defaults")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one field")
    parser.add_argument("--out", help="run directory (overrides run.out)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the run directory")
    return parser.parse_args(argv)


@dataclasses.dataclass
class Run:
    """Everything the loop needs, built once by `setup`."""
    cfg: Config
    policy: torch.nn.Module
    reference: torch.nn.Module | None  # frozen initial policy for the KL term (only when kl_coef > 0)
    tokenizer: object
    train_prompts: list
    val_prompts: list
    reward_fn: object
    tool: object  # tasks.CalculatorTool for multi-turn tasks, else None
    engine: RolloutEngine
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    device: str
    start_step: int = 0


def setup(cfg, resume=False, engine=None):
    """Build policy, task, optimizer and engine; with `resume`, restore the latest checkpoint.
    An `engine` passed in (tests share one) is synced to the policy instead of starting another."""
    torch.set_num_threads(cfg.train.threads)  # the engine's processes need the other core(s)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    resume_dir = latest_checkpoint(cfg.run.out) if resume else None
    if resume and resume_dir is None:
        raise ConfigError(f"--resume: no checkpoint under {cfg.run.out}/checkpoints")
    policy, tokenizer = build_policy(cfg, resume_dir)
    train_prompts, val_prompts, reward_fn, tool = build_task(cfg, tokenizer)
    engine_dir = resume_dir or export_for_engine(policy, tokenizer, cfg.run.out)
    policy.to(device)
    reference = None
    if cfg.train.kl_coef > 0:  # the *initial* policy, also after a resume: built again, not copied
        reference = build_policy(cfg, None)[0].to(device).eval().requires_grad_(False)
    t = cfg.train
    optimizer = torch.optim.AdamW(policy.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
                                  weight_decay=t.weight_decay)
    warmup = lambda step: min(1.0, (step + 1) / t.warmup_steps) if t.warmup_steps else 1.0  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    start_step = 0
    if resume_dir:
        state = torch.load(os.path.join(resume_dir, "trainer_state.pt"), weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        start_step = state["step"]
        log.info("resumed from %s at step %d", resume_dir, start_step)
    if engine is None:
        engine = RolloutEngine(engine_dir, cfg.rollout, dtype=cfg.model.dtype, seed=t.seed + start_step)
        engine.weight_version = start_step
    else:
        engine.update_weights(policy.named_parameters(), version=start_step)
    return Run(cfg, policy, reference, tokenizer, train_prompts, val_prompts, reward_fn, tool, engine, optimizer,
               scheduler, device, start_step)


def train(run):
    """The GRPO loop: rollout -> reward -> advantage -> update -> weight sync -> log -> checkpoint."""
    cfg, engine, r = run.cfg, run.engine, run.cfg.rollout
    logger = Logger(cfg.run.out, cfg)
    plan = plan_launch(r, r.prompts_per_step)
    phases = MemoryPhases(engine, run.policy, run.optimizer, cfg.memory.mode, cfg.memory.bucket_mb << 20,
                          engine_dtype=getattr(torch, cfg.model.dtype))
    max_seq_len = run.policy.config.max_position_embeddings
    for step in tqdm.trange(run.start_step, cfg.train.steps, initial=run.start_step, total=cfg.train.steps):
        step_start = time.perf_counter()
        scalars = validate(run) if step % cfg.run.val_every == 0 else {}
        # 1. rollout: group_size trajectories per prompt; the slow tail is cancelled per rollout.cancel
        prompts = draw_prompts(run.train_prompts, step, plan.num_prompts, cfg.train.seed)
        samples, stats = generate(run, prompts, r.group_size, r.temperature, plan)
        # 2. reward, 3. group-relative advantage over each group's surviving trajectories
        trajectories = score(samples, prompts, run.tokenizer, run.reward_fn)
        advantages, num_degenerate = trajectory_advantages(trajectories, cfg.train.scale_by_std)
        # 4. policy update on (merged) sequences, with the engine's memory released
        sequences, sequence_advantages, merge_metrics = training_sequences(trajectories, advantages, cfg, max_seq_len)
        train_start = time.perf_counter()
        phases.to_train()
        scalars |= train_on_rollout(run, sequences, sequence_advantages)
        # 5. weight sync (staged wake-up): the engine samples the next step from the updated policy
        sync_start = time.perf_counter()
        phases.sync(version=step + 1)
        # 6. log, 7. checkpoint
        now = time.perf_counter()
        scalars |= rollout_metrics(samples, stats) | merge_metrics | phases.metrics() | {
            "train/degenerate_groups": num_degenerate, "timing/train_s": sync_start - train_start,
            "timing/weight_sync_s": now - sync_start, "timing/step_s": now - step_start}
        logger.log(step, scalars, echo=tqdm.tqdm.write)
        if step + 1 == cfg.train.steps or (cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0):
            save_checkpoint(cfg.run.out, step + 1, run)
    logger.log(cfg.train.steps, validate(run), echo=tqdm.tqdm.write)
    logger.close()


def main(argv=None):
    args = parse_args(argv)
    cfg = load_config(args.config, args.set + ([f"run.out={args.out}"] if args.out else []))
    run = setup(cfg, resume=args.resume)
    try:
        train(run)
    finally:
        run.engine.shutdown()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("sglang").setLevel(logging.WARNING)  # its INFO lines would bury the step lines
    try:
        main()
    except (ConfigError, tasks.DataError, ModelError, RolloutError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
