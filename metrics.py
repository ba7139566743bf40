"""Stage 6 of the step: metrics reduced over ranks, and where they go (TensorBoard events, one
console line per step, config.yaml in the run directory).

Owns how a metric is reduced over ranks (`summed`, `slowest`, `rate`, `ratio`, `quantile`,
`spread`, else averaged: declared where the metric is made), masked means, pass@k, and the
logger. Each stage computes its own metrics (the rollout's in rollout.py, the update's in
update.py, ...); none of the training math is here.
A metric's prefix says what it measures, not which stage made it: train/ the batch trained on (its
rewards, from stage 1; its loss, from stage 4), val/ validation, rollout/ the engine's work
(launched, aborted, lengths), timing/, perf/, memory/, and one per feature (partial/, staleness/,
filter/, merge/, tools/).
"""

import dataclasses
import math
import os

import torch
from torch.utils.tensorboard import SummaryWriter

from config import config_yaml
import runtime.parallel as parallel


@dataclasses.dataclass(frozen=True)
class Summed:
    """A metric summed over ranks (a count, or a throughput), made by `summed(value)` where the
    metric is produced. Deliberately not a number: `summed(3) + summed(4)` raises, so arithmetic
    can never drop the rule; `reduce_metrics` turns it into a plain number. A plain number is
    averaged over the ranks that logged it (losses and rates that every rank measures alike); a
    mean over items is a `Ratio`."""

    value: float


@dataclasses.dataclass(frozen=True)
class Slowest:
    """A metric that is the largest rank's (the max over ranks): a time or a memory peak, since
    the step waits for the slowest rank, or a worst case (the largest log-prob gap). Made by
    `slowest(value)`; not a number, as Summed."""

    value: float


@dataclasses.dataclass(frozen=True)
class Rate:
    """A throughput of the whole job (tokens per second), made by `rate(amount, seconds)`:
    reduced as the amounts summed over the slowest rank's seconds, since the ranks work side by
    side and the phase lasts as long as its slowest. Each rank's own rate summed would count a
    rank that finished early as busy all along. Not a number, as Summed."""

    amount: float
    seconds: float

    @property
    def value(self):
        """This rank's own rate (0 over no time)."""
        return self.amount / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Ratio:
    """A mean over items the ranks hold in different numbers (samples, trajectories, tokens),
    made by `ratio(total, count)`: reduced as the totals summed over the counts summed, so every
    item weighs alike wherever it ran (each rank's mean averaged would weigh a rank with one
    finished sample like one with eight). Not a number, as Summed."""

    total: float
    count: float

    @property
    def value(self):
        """This rank's own mean (0 with no items)."""
        return self.total / self.count if self.count else 0.0


@dataclasses.dataclass(frozen=True)
class Quantile:
    """The q-quantile of items the ranks hold in different numbers (response lengths), made by
    `quantile(values, q)`: reduced over every rank's items pooled (the ranks' own quantiles
    averaged are no quantile of the batch). Not a number, as Summed."""

    values: tuple
    q: float

    @property
    def value(self):
        """The quantile of these items (0 with none)."""
        return torch.tensor(self.values or [0], dtype=torch.float64).quantile(self.q).item()


@dataclasses.dataclass(frozen=True)
class Spread:
    """The standard deviation (unbiased) of items the ranks hold in different numbers (rewards),
    made by `spread(values)`: reduced over every rank's items pooled (the ranks' own deviations
    averaged miss the differences between ranks). Not a number, as Summed."""

    values: tuple

    @property
    def value(self):
        """The standard deviation of these items (0 with fewer than two)."""
        if len(self.values) < 2:
            return 0.0
        return torch.tensor(self.values, dtype=torch.float64).std().item()


def summed(value):
    """`value` (a number, or a one-element tensor), marked to be summed over ranks."""
    return Summed(value.item() if torch.is_tensor(value) else value)


def slowest(value):
    """`value`, marked to be reduced as the slowest rank's (the max)."""
    return Slowest(value.item() if torch.is_tensor(value) else value)


def rate(amount, seconds):
    """`amount` done in `seconds` on this rank, marked to be reduced over ranks as a Rate."""
    amount, seconds = (v.item() if torch.is_tensor(v) else v for v in (amount, seconds))
    return Rate(float(amount), float(seconds))


def ratio(total, count):
    """The mean `total / count`, marked to be reduced over ranks as a Ratio (its value 0 with no
    items; `reduce_metrics` leaves it out when no rank has one)."""
    total, count = (v.item() if torch.is_tensor(v) else v for v in (total, count))
    return Ratio(float(total), float(count))


def quantile(values, q):
    """The q-quantile of `values` (numbers), marked to be reduced over ranks as a Quantile."""
    return Quantile(tuple(float(v) for v in values), q)


def spread(values):
    """The standard deviation of `values` (numbers), marked to be reduced over ranks as a
    Spread."""
    return Spread(tuple(float(v) for v in values))


def joined(*stages):
    """The stages' metrics as one dict. A key two stages both report is a ValueError: with `|`
    one would silently replace the other (a metric of yours under a name a stage already logs)."""
    out = {}
    for metrics in stages:
        repeated = sorted(out.keys() & metrics.keys())
        if repeated:
            raise ValueError(f"metrics {repeated} come from two stages: give one another name")
        out |= metrics
    return out


def reduce_metrics(scalars):
    """One dict of plain numbers from every rank's step metrics, each reduced as its producer
    declared it: Summed, Slowest, Rate, Ratio, Quantile, Spread, else averaged. A mean or
    quantile over no item on any rank is left out, not 0 (a step with nothing finished:
    TensorBoard shows a gap, not "every answer wrong, length 0"), and so is a spread over fewer
    than two (one reward's deviation is no "all rewards equal"). A collective: every rank calls
    it. With several ranks, `timing/rollout_s_min` beside the max shows how unevenly their
    rollouts ended."""
    per_rank = parallel.gather_objects(scalars)
    out = {}
    for key in dict.fromkeys(k for d in per_rank for k in d):
        values = [d[key] for d in per_rank if key in d]
        if isinstance(values[0], (Ratio, Quantile)) and not any(
            v.count if isinstance(v, Ratio) else v.values for v in values
        ):
            continue  # no item anywhere
        if isinstance(values[0], Spread) and sum(len(v.values) for v in values) < 2:
            continue  # no deviation
        if isinstance(values[0], Summed):
            out[key] = sum(v.value for v in values)
        elif isinstance(values[0], Slowest):
            out[key] = max(v.value for v in values)
        elif isinstance(values[0], Rate):
            out[key] = Rate(sum(v.amount for v in values), max(v.seconds for v in values)).value
        elif isinstance(values[0], Ratio):
            out[key] = sum(v.total for v in values) / sum(v.count for v in values)
        elif isinstance(values[0], Quantile):
            out[key] = quantile([x for v in values for x in v.values], values[0].q).value
        elif isinstance(values[0], Spread):
            out[key] = spread([x for v in values for x in v.values]).value
        else:
            out[key] = sum(values) / len(values)
    if len(per_rank) > 1 and "timing/rollout_s" in out:
        out["timing/rollout_s_min"] = min(
            d["timing/rollout_s"].value if "timing/rollout_s" in d else math.inf for d in per_rank
        )
    return out


def local_values(scalars):
    """This rank's metrics as plain numbers, not reduced over ranks: for a benchmark or a test
    that reads one rank's figures (the step reduces with `reduce_metrics`)."""
    return {key: getattr(value, "value", value) for key, value in scalars.items()}


def masked_mean(values, mask):
    """Mean of `values` where `mask` is 1; 0.0 (not NaN) when nothing is unmasked."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def length_stats(lengths, prefix):
    """mean / p50 / p90 / max of a list of token counts, each exact over ranks (with no count on
    any rank, `reduce_metrics` leaves them out)."""
    return {
        f"{prefix}_mean": ratio(sum(lengths), len(lengths)),
        f"{prefix}_p50": quantile(lengths, 0.5),
        f"{prefix}_p90": quantile(lengths, 0.9),
        f"{prefix}_max": quantile(lengths, 1.0),
    }


def pass_at_k(n, c, k):
    """The unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021):
    1 - C(n-c, k) / C(n, k), the chance that k of the n drawn without replacement hold a correct
    one, computed as a product (the binomials overflow floats at large n)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


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
    what its tokens weigh. Means and counts may be device tensors: they are read in one go by
    `means`, so adding one never waits for the GPU."""

    def __init__(self):
        self.added = {}  # name -> [(mean, tokens)]

    def add(self, name, mean, num_tokens):
        self.added.setdefault(name, []).append((mean, num_tokens))

    def means(self):
        """{name: token-weighted mean}, reduced over ranks (a collective: every rank calls it);
        a name with no token on any rank is left out (an entropy of 0 would read as a collapsed
        policy)."""
        names = sorted(self.added)
        pairs = [pair for n in names for pair in self.added[n]]
        tensors = [torch.as_tensor(v) for pair in pairs for v in pair]
        device = tensors[0].device if tensors else None
        values = iter(
            torch.stack([t.to(device, torch.float64) for t in tensors]).tolist() if tensors else []
        )
        local_sums, local_tokens = [], []
        for n in names:
            total, tokens = 0.0, 0
            for _ in self.added[n]:
                mean, num_tokens = next(values), next(values)
                total, tokens = total + mean * num_tokens, tokens + num_tokens
            local_sums.append(total)
            local_tokens.append(tokens)
        totals = parallel.all_reduce(local_sums + local_tokens)
        sums = totals[: len(names)]
        tokens = totals[len(names) :]
        return {name: s / n for name, s, n in zip(names, sums, tokens) if n}


class Logger:
    """TensorBoard writer + one console line per step; writes the resolved config at start.
    `first_step` is the run's first step (a resumed run's checkpoint step): the points an earlier
    process logged from there on (steps it ran past its last checkpoint, which this process runs
    again) are then hidden, so every step shows once. The event files keep them."""

    def __init__(self, out_dir, config, first_step=0):
        os.makedirs(out_dir, exist_ok=True)
        # replaced whole (eval --run reads it): written in place, a full disk left it empty
        path = os.path.join(out_dir, "config.yaml")
        with open(path + ".tmp", "w") as f:
            f.write(config_yaml(config))
        os.replace(path + ".tmp", path)
        # a SessionLog.START event at first_step, which TensorBoard's Python loader
        # (EventAccumulator: extras/plot.py, the benches) reads as a restart, dropping every point
        # at that step or later read before it (_Purge). RustBoard, the `tensorboard` command's
        # reader, ignores it but drops a tag's points from a step on when that step comes again
        # (its reservoir's preemption): the tags the resumed run logs again show once either way
        self.writer = SummaryWriter(os.path.join(out_dir, "tb"), purge_step=first_step)

    def log(self, step, scalars, echo=print, texts=None):
        for name, value in scalars.items():
            self.writer.add_scalar(name, float(value), step)
        for name, text in (texts or {}).items():
            self.writer.add_text(name, text, step)
        self.writer.flush()  # a crash or Ctrl-C keeps every logged step visible in TensorBoard
        keys = [
            ("reward", "train/reward_mean"),
            ("completed", "rollout/reward_mean_completed"),
            ("launched", "rollout/reward_mean_launched"),
            ("val", "val/reward_mean"),
            ("val_sampled", "val/reward_mean_sampled"),
            ("len", "rollout/response_len_mean"),
            ("aborted", "rollout/aborted_ratio"),
            ("loss", "train/loss"),
            ("gap", "train/logprob_gap"),
            ("s", "timing/step_s"),
        ]
        printed = {k: v for k, v in scalars.items() if not self.same_as_reward(k, scalars)}
        parts = [
            f"{short} {printed[key]:.2e}" if short == "gap" else f"{short} {printed[key]:.3f}"
            for short, key in keys
            if key in printed
        ]
        echo(f"step {step:4d} | " + " | ".join(parts))

    @staticmethod
    def same_as_reward(key, scalars):
        """Whether `key` is a rollout-wide reward mean that reads as the trained one: with nothing
        cancelled or filtered the three are one number, printed once (TensorBoard has all)."""
        reward = scalars.get("train/reward_mean")
        return (
            key in ("rollout/reward_mean_completed", "rollout/reward_mean_launched")
            and reward is not None
            and f"{scalars[key]:.3f}" == f"{reward:.3f}"
        )

    def close(self):
        self.writer.close()
