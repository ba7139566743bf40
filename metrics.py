"""Metrics: masked reductions, per-rollout statistics, and the TensorBoard + console logger.

Owns what is computed for logging and where it goes (TensorBoard events, one console line per step,
config.yaml in the run directory). Does not own any training math (grpo.py) or timing decisions.
"""

import dataclasses
import math
import os

import torch
import yaml
from torch.utils.tensorboard import SummaryWriter

import parallel


class Summed:
    """Marks a metric summed over ranks (a count, or a throughput): made by `summed(value)` where
    the metric is produced. A plain number is averaged over the ranks that logged it (rates,
    losses, means)."""


class Slowest:
    """Marks a metric that is the slowest rank's (the max over ranks): a time or a memory peak,
    since the step waits for the slowest rank. Made by `slowest(value)`."""


class _SummedInt(Summed, int):
    pass


class _SummedFloat(Summed, float):
    pass


class _SlowestInt(Slowest, int):
    pass


class _SlowestFloat(Slowest, float):
    pass


def summed(value):
    """`value` (a number, or a one-element tensor), marked to be summed over ranks; an int stays
    an int (it prints as a count)."""
    value = value.item() if torch.is_tensor(value) else value
    return _SummedInt(value) if isinstance(value, int) else _SummedFloat(value)


def slowest(value):
    """`value`, marked to be reduced as the slowest rank's (the max)."""
    value = value.item() if torch.is_tensor(value) else value
    return _SlowestInt(value) if isinstance(value, int) else _SlowestFloat(value)


def reduce_metrics(scalars):
    """One dict of step metrics from every rank's, each reduced as its producer declared it:
    Summed, Slowest, else averaged. A collective: every rank calls it. `timing/rollout_s_min`
    beside the max shows how unevenly the ranks' rollouts ended."""
    per_rank = parallel.gather_objects(scalars)
    if len(per_rank) == 1:
        return scalars
    out = {}
    for key in dict.fromkeys(k for d in per_rank for k in d):
        values = [d[key] for d in per_rank if key in d]
        if isinstance(values[0], Summed):
            out[key] = summed(sum(values))
        elif isinstance(values[0], Slowest):
            out[key] = slowest(max(values))
        else:
            out[key] = sum(values) / len(values)
    out["timing/rollout_s_min"] = min(d.get("timing/rollout_s", math.inf) for d in per_rank)
    return out


def masked_mean(values, mask):
    """Mean of `values` where `mask` is 1; 0.0 (not NaN) when nothing is unmasked."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def length_stats(lengths, prefix):
    """mean / p50 / p90 / max of a list of token counts (empty list -> zeros)."""
    t = torch.tensor(lengths or [0], dtype=torch.float)
    return {
        f"{prefix}_mean": t.mean().item(),
        f"{prefix}_p50": t.quantile(0.5).item(),
        f"{prefix}_p90": t.quantile(0.9).item(),
        f"{prefix}_max": slowest(t.max().item()),
    }


def rollout_metrics(trajectories, stats):
    """Reward, length, cancellation and tool statistics of one training rollout (`stats`:
    RolloutStats).

    Counted per trajectory (its last turn; a single-turn sample is its own trajectory). Aborted and
    failed trajectories are not scored: `reward_mean_completed` averages finished ones only,
    `reward_mean_launched` counts unfinished ones as 0, so the survivor bias of tail cancellation
    (verl PR 2929) is visible as the gap between the two. Token counts cover every turn.
    """
    samples = [turn for turns in trajectories for turn in turns]
    launched = [turns[-1] for turns in trajectories]  # the last turn of each trajectory
    finished = [s for s in launched if not s.is_aborted]
    # turns cut by cancellation
    failed = ("error", "reward_error")  # kept out like an abort, but counted on their own
    aborted = [s for s in samples if s.is_aborted and s.finish_reason not in failed]
    num_aborted = sum(s.is_aborted and s.finish_reason not in failed for s in launched)
    rewards = torch.tensor([s.reward for s in finished] or [0.0])
    num_tokens = sum(len(s.response_ids) for s in samples)
    out = {
        "train/reward_mean_completed": rewards.mean().item(),
        "train/reward_mean_launched": rewards.sum().item() / max(len(launched), 1),
        "train/reward_std": rewards.std().item() if len(finished) > 1 else 0.0,
        "train/accuracy": sum(s.reward >= 1.0 for s in finished) / max(len(finished), 1),
        "rollout/launched": summed(len(launched)),
        "rollout/aborted": summed(num_aborted),
        "rollout/aborted_ratio": num_aborted / max(len(launched), 1),
        "rollout/failed": summed(sum(s.finish_reason == "error" for s in samples)),
        "rollout/truncated_ratio": sum(s.finish_reason == "length" for s in finished)
        / max(len(finished), 1),
        "rollout/wasted_tokens": summed(sum(len(s.response_ids) for s in aborted)),
        "perf/rollout_tokens_per_s": summed(num_tokens / max(stats.rollout_s, 1e-9)),
        "timing/rollout_s": slowest(stats.rollout_s),
        "rollout/cancel_decision_s": slowest(stats.decision_s),  # launch -> enough finished
        # decision -> every aborted request returned
        "rollout/cancel_latency_s": slowest(stats.cancel_latency_s),
        "rollout/tool_calls": summed(stats.num_tool_calls),
        "rollout/tool_errors": summed(stats.num_tool_errors),
        **{f"tools/{name}/calls": summed(n) for name, n in stats.tool_calls.items()},
        **{f"tools/{name}/errors": summed(n) for name, n in stats.tool_errors.items()},
        "rollout/tool_calls_per_trajectory": stats.num_tool_calls / max(len(launched), 1),
        "rollout/timed_out": summed(stats.num_timed_out),
        "rollout/reward_errors": summed(stats.num_reward_errors),
    }
    out["train/reward_mean_unfiltered"] = out["train/reward_mean_completed"]
    out.update(length_stats([len(s.response_ids) for s in finished], "rollout/response_len"))
    if aborted:
        out.update(length_stats([len(s.response_ids) for s in aborted], "rollout/aborted_len"))
    return out


def filter_metrics(trajectories, counts, stats, target_groups, filtering):
    """Dynamic sampling's figures (logged with it off too: the zero-variance share says what it
    would save). `trajectories`: the trained ones; `counts`: cancel.filter_groups'.
    `train/reward_mean` is what was trained on and `train/reward_mean_unfiltered` every finished
    trajectory (NeMo-RL issue 3794: a filter whose logged reward was silently the unfiltered
    one)."""
    rewards = [turns[-1].reward for turns in trajectories if not turns[-1].is_aborted]
    return {
        **{f"filter/{name}": summed(value) for name, value in counts.items()},
        "filter/prompts_launched": summed(stats.prompts_launched),
        # 1 when filtering kept fewer groups than the target (the prompt bound ended the step),
        # on any rank
        "filter/truncated_steps": slowest(filtering and counts["kept_groups"] < target_groups),
        "train/reward_mean": sum(rewards) / max(len(rewards), 1),
        "perf/generated_tokens_per_kept_group": stats.generated_tokens
        / max(counts["kept_groups"], 1),
    }


def trajectory_texts(trajectories, tokenizer, count):
    """Markdown of the first `count` trajectories: the prompt, then everything generated after it
    (every turn, tool observations included) with special tokens kept, so a wrong stop or a
    malformed call shows."""
    blocks = []
    for turns in trajectories[:count]:
        first, last = turns[0], turns[-1]
        # a later turn's prompt holds the earlier turns
        full = list(last.prompt_ids) + list(last.response_ids)
        prompt = tokenizer.decode(list(first.prompt_ids), skip_special_tokens=False)
        generated = tokenizer.decode(full[len(first.prompt_ids) :], skip_special_tokens=False)
        blocks.append(
            f"reward {last.reward:.3f}, finish {last.finish_reason}, {len(turns)} turn(s)\n\n"
            # indented: a code block, nothing rendered
            f"    {prompt[-300:]!r}\n\n    {generated!r}"
        )
    return "\n\n---\n\n".join(blocks)


class TokenMeans:
    """Per-micro-batch token means (entropy, clip fraction, KL, TIS weight) as one token-weighted
    mean over the step's micro-batches and every rank's: a short or padding micro-batch weighs
    what its tokens weigh."""

    def __init__(self):
        self.sums = {}  # name -> sum of mean x tokens
        self.tokens = {}  # name -> tokens

    def add(self, name, mean, num_tokens):
        self.sums[name] = self.sums.get(name, 0.0) + mean * num_tokens
        self.tokens[name] = self.tokens.get(name, 0) + num_tokens

    def means(self):
        """{name: token-weighted mean}, reduced over ranks (a collective: every rank calls it)."""
        names = sorted(self.sums)
        totals = parallel.all_reduce(
            [self.sums[n] for n in names] + [self.tokens[n] for n in names]
        )
        sums = totals[: len(names)]
        tokens = totals[len(names) :]
        return {name: s / max(n, 1) for name, s, n in zip(names, sums, tokens)}


class Logger:
    """TensorBoard writer + one console line per step; writes the resolved config at start."""

    def __init__(self, out_dir, config):
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(dataclasses.asdict(config), f, sort_keys=False)
        self.writer = SummaryWriter(os.path.join(out_dir, "tb"))

    def log(self, step, scalars, echo=print, texts=None):
        for name, value in scalars.items():
            self.writer.add_scalar(name, float(value), step)
        for name, text in (texts or {}).items():
            self.writer.add_text(name, text, step)
        self.writer.flush()  # a crash or Ctrl-C keeps every logged step visible in TensorBoard
        keys = [
            ("reward", "train/reward_mean"),
            ("launched", "train/reward_mean_launched"),
            ("val", "val/reward_mean"),
            ("val_sampled", "val/reward_mean_sampled"),
            ("len", "rollout/response_len_mean"),
            ("aborted", "rollout/aborted_ratio"),
            ("loss", "train/loss"),
            ("gap", "train/logprob_gap"),
            ("s", "timing/step_s"),
        ]
        parts = [
            f"{short} {scalars[key]:.2e}" if short == "gap" else f"{short} {scalars[key]:.3f}"
            for short, key in keys
            if key in scalars
        ]
        echo(f"step {step:4d} | " + " | ".join(parts))

    def close(self):
        self.writer.close()
