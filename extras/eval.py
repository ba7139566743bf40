"""Evaluate a checkpoint (or any HF model folder) on the task's validation prompts: pass@k, maj@k,
greedy accuracy and mean reward, each with a 95% bootstrap interval over prompts.

    python -m extras.eval --run runs/tiny                      # its latest checkpoint
    python -m extras.eval --run runs/tiny --step 100 --samples 16 --k 1,4,16
    python -m extras.eval --model PATH --config configs/gsm8k.yaml

Owns the evaluation metrics and the command. Only the engine runs (no trainer, no optimizer): it
samples `--samples` responses per prompt at the training temperature, plus one greedy, and each is
scored by the run's reward, `data.reward`'s or else the task's own (rewards.Rewards.task_reward,
as in training; DAPO's overlong penalty shapes only training's advantage). A sample is correct
when its reward is >= 1. Every sample and its reward go to eval.jsonl beside the
checkpoint. Training's validation uses the same estimator (metrics.pass_at_k), logging val/pass@k
when `run.val_samples` > 1.
"""

import argparse
import dataclasses
import json
import math
import os
import random
import sys

import tqdm

import rewards
from config import ConfigError, read_config
from memory import push_weights
from metrics import pass_at_k
import runtime.checkpoint as checkpoint
from rollout import rollout_seed
from runtime.checkpoint import CheckpointError
from runtime.engine import RolloutError, strip_expandable_segments
from runtime.model import TINY_CHARS, ModelError, check_folder_code, load_tokenizer
from assemble import engine_only, load_config, start_engine
from sample import trajectories_of
from task.data import DataError, build_task, task_module, vocabulary


# ---------------------------------------------------------------- the metrics
def majority_correct(answers, correct):
    """maj@k of one prompt: is the most frequent answer among `answers` (the first k samples'
    extracted answers; None: no answer, never a winner) a correct one? An answer is correct when
    any sample that gave it scored >= 1: the reward judges a whole sample (its format, whether it
    finished), the vote judges the answer, so the samples' order cannot change the result. Ties go
    to the answer seen first."""
    counts = {}
    for answer, ok in zip(answers, correct):
        if answer is not None:
            count, right = counts.get(answer, (0, False))
            counts[answer] = (count + 1, right or ok)
    if not counts:
        return 0.0
    return float(max(counts.values(), key=lambda count_right: count_right[0])[1])


def answer_of(task, text):
    """What maj@k votes on: data.task `task`'s `answer_of(text)` (GSM8K's extracted number, the tiny
    tasks' whole final text); None for a task without one (chat: maj@k is not reported)."""
    vote = getattr(task_module(task), "answer_of", None)
    return vote(text) if vote is not None else None


def bootstrap_interval(values, resamples=1000, seed=0):
    """95% interval of the mean of per-prompt `values`, resampling prompts with replacement."""
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=len(values))) / len(values) for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def summarise(per_prompt, ks, with_majority):
    """{metric: (mean over prompts, (low, high))} from each prompt's records: its sampled ones
    (reward, answer) and its greedy one."""
    columns = {}
    for records in per_prompt:
        sampled = [r for r in records if r["sample"] != "greedy"]
        correct = [r["reward"] >= 1.0 for r in sampled]
        for k in ks:
            columns.setdefault(f"pass@{k}", []).append(pass_at_k(len(sampled), sum(correct), k))
        if with_majority:
            for k in ks:
                answers = [r["answer_extracted"] for r in sampled[:k]]
                columns.setdefault(f"maj@{k}", []).append(majority_correct(answers, correct[:k]))
        greedy = [r["reward"] >= 1.0 for r in records if r["sample"] == "greedy"]
        columns.setdefault("greedy", []).extend(map(float, greedy))
        columns.setdefault("mean_reward", []).append(
            sum(r["reward"] for r in sampled) / len(sampled)
        )
    return {
        name: (sum(values) / len(values), bootstrap_interval(values))
        for name, values in columns.items()
    }


# ---------------------------------------------------------------- sampling
def sample_prompts(run, prompts, num_samples, temperature):
    """Each prompt's records: `num_samples` responses at `temperature` and one greedy, scored by
    the task's reward as they finish (a progress bar counts them)."""
    per_prompt = [[] for _ in prompts]
    total = len(prompts) * (num_samples + 1)
    with tqdm.tqdm(total=total, desc="eval samples", file=sys.stderr) as bar:
        for label, count, temp in (("sampled", num_samples, temperature), ("greedy", 1, 0.0)):

            async def counted(turns):  # the task's reward alone, as validation's
                bar.update(1)
                return await run.rewards.task_reward(turns, prompts[turns[-1].group_id].answer)

            r = run.cfg.rollout
            # each request its own sampling_seed, as in training: with rollout.deterministic one
            # seed for all would make a prompt's samples identical (pass@k = pass@1)
            seed = rollout_seed(run.cfg.train.seed, 0, f"eval_{label}")
            samples, _ = run.engine.generate(
                [p.prompt_ids for p in prompts],
                count,
                temp,
                r.max_new_tokens,
                tool=run.tool,
                max_turns=r.max_turns,
                max_response_tokens=r.max_response_tokens,
                reward=counted,
                seed=seed,
            )
            for turns in trajectories_of(samples):
                last = turns[-1]
                text = run.tokenizer.decode(last.response_ids.tolist(), skip_special_tokens=True)
                per_prompt[last.group_id].append(
                    {
                        "prompt_index": last.group_id,
                        "sample": "greedy" if label == "greedy" else len(per_prompt[last.group_id]),
                        "response": text,
                        "finish_reason": last.finish_reason,
                        "reward": last.reward,
                        "answer": prompts[last.group_id].answer,
                        # a failed sample (in the engine, or its reward) casts no vote
                        "answer_extracted": (
                            None if last.masked else answer_of(run.cfg.data.task, text)
                        ),
                    }
                )
    return per_prompt


def evaluate(run, num_samples, ks, temperature):
    """(every record, the summary) over the run's validation prompts."""
    per_prompt = sample_prompts(run, run.val_prompts, num_samples, temperature)
    with_majority = answer_of(run.cfg.data.task, "0") is not None
    return per_prompt, summarise(per_prompt, ks, with_majority)


def eval_line(summary, num_prompts):
    """The last line: eval: n=<prompts> pass@k=<f> [lo,hi] ... mean_reward=<f>."""
    parts = [f"n={num_prompts}"]
    for name, (mean, (low, high)) in summary.items():
        if name != "mean_reward":
            parts.append(f"{name}={mean:.3f} [{low:.3f},{high:.3f}]")
    return f"eval: {' '.join(parts)} mean_reward={summary['mean_reward'][0]:.3f}"


# ---------------------------------------------------------------- command line
def model_folder(args):
    """(config, the checkpoint or model folder, its step or 0, and for a LoRA checkpoint (the
    base's folder, the policy whose adapters the engine serves), else None). A LoRA checkpoint
    holds its adapters alone: the engine loads the base and serves them as in training
    (checkpoint.lora_served)."""
    if args.model:
        cfg = load_config(args.config, args.set)
        # model.fp32_head: the folder's config.json decides, unless set on (start_engine)
        return cfg, args.model, 0, None
    # the run's config: types and bounds read again (config.read_config), its choices checked by
    # load_config when the run started (a later check, of settings eval never reads, would
    # refuse an older run's; train.py's --resume does check them)
    cfg = read_config(os.path.join(args.run, "config.yaml"), args.set)
    check_folder_code(cfg, f"--run {args.run}'s config.yaml", args.set)
    if args.step is None:
        folder = checkpoint.latest(args.run)
        if folder is None:
            raise ConfigError(f"--run {args.run}: no checkpoint under {args.run}/checkpoints")
    else:
        folder = os.path.join(args.run, "checkpoints", f"step_{args.step:06d}")
        if not os.path.isdir(folder):
            raise ConfigError(f"--step {args.step}: no checkpoint {folder}")
    state = checkpoint.check_resume(folder, cfg)
    step = state["step"]
    # the head this checkpoint's run trained with: a later resume may have changed the run's
    saved = (state["config"] or {}).get("model", {})
    if "fp32_head" in saved:
        cfg = dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, fp32_head=bool(saved["fp32_head"]))
        )
    if not cfg.model.lora_rank:
        return cfg, folder, step, None
    return cfg, folder, step, checkpoint.lora_served(folder, cfg, vocabulary(cfg, TINY_CHARS))


def run_eval(cfg, engine, tokenizer, num_samples, ks, temperature):
    """(every record, the summary) of `engine`'s weights on the task of `cfg`."""
    run = engine_only(cfg, engine, tokenizer, build_task(cfg, tokenizer))
    return evaluate(run, num_samples, ks, temperature)


def write_records(path, per_prompt):
    """eval.jsonl: one line per sample, written whole (renamed into place)."""
    with open(path + ".tmp", "w") as f:
        for records in per_prompt:
            for record in records:
                f.write(json.dumps(record) + "\n")
    os.replace(path + ".tmp", path)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="a run directory: evaluate its latest checkpoint")
    source.add_argument("--model", help="any HF model folder (with --config)")
    parser.add_argument("--step", type=int, help="--run: this checkpoint's step instead")
    parser.add_argument("--config", help="--model: the task's config (configs/tiny.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--samples", type=int, default=8, help="sampled responses per prompt")
    parser.add_argument("--k", default="1", help="comma-separated k for pass@k and maj@k")
    parser.add_argument("--temperature", type=float, help="default: rollout.temperature")
    parser.add_argument("--out", help="default: eval.jsonl beside the checkpoint")
    args = parser.parse_args(argv)
    # usage errors before anything starts (argparse exits 2 with the usage line); a flag the
    # chosen source never reads among them (--step with --model was dropped, silently)
    if args.step is not None and args.model:
        parser.error("--step picks one of a run's checkpoints: use it with --run")
    if args.config is not None and args.run:
        parser.error("--config is --model's: a run is evaluated with its own config.yaml")
    args.config = args.config or "configs/tiny.yaml"
    if args.samples < 1:
        parser.error(f"--samples {args.samples}: expected a count >= 1")
    try:
        args.k = sorted({int(k) for k in args.k.split(",")})
    except ValueError:
        parser.error(f"--k {args.k!r}: expected comma-separated integers, such as 1,4,16")
    if min(args.k) < 1:
        parser.error(f"--k {min(args.k)}: each k must be >= 1")
    # rollout.temperature's bound: below it SGLang samples greedily (pass@k would be pass@1)
    if args.temperature is not None and not (
        math.isfinite(args.temperature) and args.temperature >= 0.01
    ):
        parser.error(f"--temperature {args.temperature}: expected a finite value >= 0.01")
    if max(args.k) > args.samples:
        raise ConfigError(f"--k {max(args.k)} needs --samples >= {max(args.k)}")
    return args


def main(argv=None):
    strip_expandable_segments()  # before anything allocates CUDA memory
    args = parse_args(argv)
    cfg, folder, step, lora_served = model_folder(args)
    out = args.out or os.path.join(folder, "eval.jsonl")
    # refused before the engine starts, not after every sample was drawn
    if not os.access(os.path.dirname(os.path.abspath(out)), os.W_OK):
        raise ConfigError(f"--out {out}: its folder does not exist or is not writable")
    tokenizer = load_tokenizer(cfg, folder, vocabulary(cfg, TINY_CHARS))
    temperature = cfg.rollout.temperature if args.temperature is None else args.temperature
    engine_dir, adapted = lora_served or (folder, None)
    engine = start_engine(cfg, engine_dir, step, training=False, folder_head=bool(args.model))
    try:
        if adapted is not None:  # LoRA: the checkpoint's adapter into the engine's pool
            push_weights(engine, adapted, step, cfg.memory.bucket_mb << 20)
        per_prompt, summary = run_eval(cfg, engine, tokenizer, args.samples, args.k, temperature)
    finally:
        engine.shutdown()
    write_records(out, per_prompt)
    failed = sum(r["finish_reason"] in ("error", "reward_error") for p in per_prompt for r in p)
    print(
        f"{folder}: {len(per_prompt)} prompts x {args.samples} samples at T={temperature}, "
        f"+1 greedy; every sample in {out}; {failed} failed (engine or reward error: "
        "scored 0, no vote)"
    )
    print(eval_line(summary, len(per_prompt)))


if __name__ == "__main__":
    try:
        main()
    # RolloutError: more requests failed in the engine than rollout.max_failed_ratio allows
    except (
        ConfigError,
        DataError,
        ModelError,
        rewards.RewardError,
        CheckpointError,
        RolloutError,
    ) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
