"""Stage 4 of the step: the policy update. Sequences in, `train.num_minibatches` clipped-ratio
optimizer steps out, with the stage's metrics.

Owns the trainer's half of a run (`Trainer`: policy, reference, optimizer, schedule), the tensor
layout the loss reads ([B, T-1]: targets, loss mask, engine log-probs, token versions; [B]:
advantages), the packed layout the model computes on (rows of whole sequences, padding only at row
ends) and the engine's routes laid out on it (routing replay: `route_table`), micro-batching (by
rows, or by a token budget; every rank runs the same count), pi_old (the trainer's, detached from
the update's forward or recomputed, or the engine's: `pi_old_source`), the staleness mask of
partial rollout's older tokens and their off-policy statistics, gradient accumulation exact over
micro-batches and ranks, and skipping non-finite updates. Does not own the loss math (loss.py), the
advantages (advantages.py), the routers' hooks (runtime/routing.py) or the weight push that follows
(memory.py).
"""

import dataclasses
import itertools
import logging
import math

import torch

import loss
from config import ConfigError, refuse_unread
from metrics import TokenMeans, masked_mean, ratio, slowest, summed
import runtime.parallel as parallel
from runtime.model import build_optimizer
from runtime.routing import NO_ROUTE, RouteReplay
from sample import Sample

log = logging.getLogger("update")


class NonFiniteError(RuntimeError):
    """`train.max_bad_updates` steps in a row had a non-finite loss or gradient: the policy is
    broken."""


@dataclasses.dataclass
class Trainer:
    """The trainer's half of a run, which this stage updates (built by assemble.py)."""

    cfg: object  # the run's Config
    policy: torch.nn.Module  # fp32 master weights; an FSDP2 shard with several ranks
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    device: torch.device
    # the policy's routers, replaying the engine's routes in its forwards (train.routing_replay;
    # off: no hooks, width 0)
    route_replay: RouteReplay
    # the frozen initial policy, for the KL (kept only when train.kl_coef > 0)
    reference: torch.nn.Module | None = None
    autocast_dtype: torch.dtype | None = None  # one rank computing in bf16; None for fp32 or FSDP2
    first_step: int = 0  # this process's first step (pi_old from the engine is checked there)
    bad_steps: int = 0  # steps in a row with an update skipped as non-finite

    @classmethod
    def build(cls, cfg, policy, device, reference=None, autocast_dtype=None, first_step=0):
        """The trainer of `policy` (already on `device`), with the AdamW optimizer and schedule
        `model.build_optimizer` makes."""
        if reference is None and "kl" in loss.term_coefficients(cfg.train):
            # the loss's KL term reads the reference's log-probs: without it, a TypeError mid-update
            raise ConfigError("train.kl_coef > 0 with train.kl_in=loss needs a KL reference")
        optimizer, scheduler = build_optimizer(policy, cfg.train)
        return cls(
            cfg=cfg,
            policy=policy,
            optimizer=optimizer,
            scheduler=scheduler,
            device=device,
            reference=reference,
            autocast_dtype=autocast_dtype,
            first_step=first_step,
            route_replay=RouteReplay(policy, cfg.train.routing_replay),
        )

    @property
    def pad_id(self):
        return self.policy.config.pad_token_id or 0


# config.refuse_unread's table: one rank trains no FSDP2 shard (runtime/parallel.py); run.nproc 0
# (every visible GPU) may be several, and a config loads alike on every machine; a padded row
# holds one sample, with a prompt of its own
READ_WHEN = {
    "train.fsdp_keep_gathered": (
        lambda cfg: cfg.run.nproc != 1,
        "with several ranks (run.nproc), whose policy FSDP2 shards",
    ),
    # packed micro-batches are sized by their token budget; the KL-in-reward reference pass stays
    # padded, to keep the samples' order (advantages.reference_kl)
    "train.micro_batch_size": (
        lambda cfg: cfg.train.max_tokens_per_micro_batch == 0
        or (cfg.train.kl_coef > 0 and cfg.train.kl_in == "reward"),
        "with padded micro-batches (train.max_tokens_per_micro_batch: 0) or train.kl_in=reward",
    ),
    "train.shared_prefix": (
        lambda cfg: cfg.train.max_tokens_per_micro_batch != 0,
        "with packed micro-batches (train.max_tokens_per_micro_batch), whose rows share prompts",
    ),
    # every token but a resumed one is of the weights being trained
    "train.max_token_staleness": (
        lambda cfg: cfg.rollout.resumes(),
        "with partial rollout (rollout.partial, rollout.max_staleness > 0)",
    ),
}


def check(cfg):
    """train.old_logprobs's choice and where it is valid, and the fields read only with several
    ranks (assemble.load_config calls this)."""
    refuse_unread(cfg, READ_WHEN)
    t = cfg.train
    if cfg.rollout.resumes() and not t.tis_cap and t.max_token_staleness != 0:
        # partial rollout trains tokens older weights sampled: uncorrected, each would weigh as if
        # the weights being trained sampled it (slime issue 2092, verl issue 6882); without TIS a
        # staleness bound k > 0 would still train tokens up to k versions old so
        raise ConfigError(
            "rollout.partial trains resumed tokens that older weights sampled: correct them with "
            "train.tis_cap (e.g. 2: each token weighted by min(pi_old / pi_engine, 2)) or mask "
            "them with train.max_token_staleness=0 (only the tokens of the weights being trained)"
        )
    if cfg.rollout.resumes() and cfg.rollout.top_p < 1 and t.tis_cap and t.max_token_staleness:
        # engine_logprobs_on_nucleus moves a token's engine log-prob onto the nucleus with the
        # nucleus mass of the weights being trained: exact for tokens they sampled, off by up to
        # 1 / top_p for a resumed one, whose weights' mass SGLang does not report
        # (srt/layers/sampler.py returns the full softmax's log-probs)
        raise ConfigError(
            "train.tis_cap with rollout.partial and rollout.top_p < 1: a resumed token's TIS "
            "weight needs the nucleus mass of the older weights that sampled it, which the engine "
            "does not report; set train.max_token_staleness=0 (older tokens masked out of the "
            "loss)"
        )
    if t.old_logprobs not in ("trainer", "engine"):
        raise ConfigError(f"train.old_logprobs={t.old_logprobs!r}: expected trainer or engine")
    if t.old_logprobs == "engine":
        conflicts = {
            "train.num_minibatches > 1 (later minibatches need pi_old, not the weights now)": (
                t.num_minibatches > 1
            ),
            "rollout.partial (resumed tokens were sampled by older weights)": (
                cfg.rollout.resumes()
            ),
            "train.tis_cap (TIS weighs pi_old / pi_engine: 1 everywhere)": t.tis_cap > 0,
            "rollout.top_p < 1 (the engine's log-probs are of the full softmax, not the nucleus)": (
                cfg.rollout.top_p < 1
            ),
        }
        named = [name for name, on in conflicts.items() if on]
        if named:
            raise ConfigError(
                "train.old_logprobs=engine takes pi_old from the engine, valid only where it is "
                f"the policy being trained; turn off: {'; '.join(named)}"
            )


def pi_old_source(trainer, step):
    """How this step gets pi_old, the log-probs (as the trainer scores them) of the weights that
    sampled: the weights as they are at the start of step `step` (but for partial rollout's older
    tokens, which TIS or the staleness mask handle). `train.old_logprobs: trainer` is "detached"
    with one minibatch and "recomputed" with several; `engine` is "engine":
    - "detached": the update's own forward's log-probs, detached. With one minibatch
      (train.num_minibatches=1, every shipped config but gsm8k_dapo.yaml) no optimizer step comes
      between pi_old and the update, on the same weights and inputs with no dropout (Qwen2's is 0):
      the two would give the same numbers, so the update's own, detached, are pi_old and the ratio
      is 1 (TRL does the same: trl/trainer/grpo_trainer.py, old_per_token_logps =
      per_token_logps.detach() with one iteration). Equal to "recomputed"'s loss and gradients to
      1e-6 on CPU (tests/test_update_passes.py), with one forward fewer;
    - "recomputed": a no-grad forward of every micro-batch before the first optimizer step. With
      several minibatches the later ones need the weights from before the first step;
    - "engine": the engine's sampling log-probs, no forward, except at this process's first step,
      where the log-prob gap check needs the trainer's own.
    The KL reference (train.kl_coef with kl_in=loss) keeps its own forward whatever the source."""
    t = trainer.cfg.train
    if t.old_logprobs == "engine" and step != trainer.first_step:
        return "engine"
    return "detached" if t.num_minibatches == 1 else "recomputed"


# ---------------------------------------------------------------- the stage
def update_policy(trainer, sequences, step):
    """`num_minibatches` clipped-ratio optimizer steps on `sequences` (each carrying its
    trajectory's advantage), against pi_old from `pi_old_source`: at the default
    (train.old_logprobs: trainer, one minibatch) each micro-batch's own forward, detached
    (`micro_batch_backward`), so nothing is computed before the first step; else
    pi_old_before_update's. The weights being trained are version `step` (the engine sampled this
    step with them): tokens an older one sampled (partial rollout) are stale.

    With several ranks each holds its own sequences (whole GRPO groups, so advantages were
    computed locally). Each rank's loss is divided by the *global* count of trained tokens (or
    sequences) and FSDP sums the gradients, so N ranks make the same update as one rank on the
    combined batch, in every loss mode. Minibatch i is every rank's i-th slice of its own
    sequences. A non-finite step is skipped and counted (`trainer.bad_steps`, the streak that
    `stop_after_bad_updates` reads)."""
    t = trainer.cfg.train
    minibatches, over_budget = make_minibatches(
        sequences, t, trainer.pad_id, trainer.device, trainer.route_replay.width
    )
    every_mb = [mb for minibatch in minibatches for mb in minibatch]
    stats = mask_stale_tokens(every_mb, step, t.max_token_staleness)
    stats |= layout_stats(every_mb, t.shared_prefix)
    stats["train/over_budget_sequences"] = summed(over_budget)
    source = pi_old_source(trainer, step)
    lr = trainer.scheduler.get_last_lr()[0]  # this step's (its first optimizer step's with several)
    token_stats = TokenMeans()
    losses = []
    grad_norms = []
    skipped = 0
    # FSDP2: each unit gathered once per optimizer step, not once per micro-batch and pass
    # (mark_last tells it which micro-batch's backward reshards; with train.fsdp_keep_gathered
    # off every one does; one rank: a no-op)
    with parallel.gathered_for_update(trainer.policy, t.fsdp_keep_gathered) as mark_last:
        # a pass before the first optimizer step only where one is needed (at the default, none:
        # pi_old comes detached from the update's own forward, in micro_batch_backward)
        if source != "detached":
            pi_old_before_update(trainer, every_mb, source)
        if trainer.reference is not None and t.kl_in == "loss":
            reference_logprobs(trainer, every_mb)
        for minibatch in minibatches:
            minibatch_loss, grad_norm, trained = optimizer_step(
                trainer,
                minibatch,
                token_stats,
                mark_last,
                pi_old_detached=source == "detached",
            )
            if trained:  # one that trained nothing (its 0 and 0) would pull the means down
                losses.append(minibatch_loss)
                grad_norms.append(grad_norm)
            skipped += not (math.isfinite(minibatch_loss) and math.isfinite(grad_norm))
    if source != "engine":  # engine vs trainer: only where the trainer computed pi_old
        stats |= logprob_gap(every_mb)
    stats |= offpolicy_stats(every_mb, t.tis_cap, trainer.cfg.rollout.top_p)
    if t.routing_replay:  # trained sequences the engine sent no routes for (their own routing)
        stats["train/unrouted_sequences"] = summed(sum(mb["unrouted"] for mb in every_mb))
    stats["train/skipped_updates"] = skipped
    # means over the step's minibatches that trained a token (0 when none did)
    stats["train/loss"] = sum(losses) / len(losses) if losses else 0.0
    stats["train/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
    stats |= token_stats.means()
    if stats.get("train/routes_refused"):
        log.warning(
            "routing replay: %.1f%% of the engine's expert choices name no expert or one twice "
            "(its MoE backend did not capture them?): routed by the trainer's routers instead",
            100 * stats["train/routes_refused"],
        )
    stats["train/lr"] = lr
    trainer.bad_steps = trainer.bad_steps + 1 if skipped else 0
    return stats


def stop_after_bad_updates(trainer, step):
    """NonFiniteError once `train.max_bad_updates` steps in a row skipped their update. The loop
    asks after the step is logged and dumped, so the step that stops the run can be read in
    TensorBoard and replayed (train.py --replay) like the skipped ones before it."""
    if trainer.bad_steps >= trainer.cfg.train.max_bad_updates:
        raise NonFiniteError(
            f"{trainer.bad_steps} steps in a row had a non-finite loss or gradient "
            f"(step {step})"
        )


def pi_old_before_update(trainer, micro_batches, source):
    """pi_old of every trained token before the first optimizer step (stored as
    mb["old_logprobs"]), from `source` (`pi_old_source`): the engine's log-probs ("engine"), or a
    no-grad forward of every micro-batch ("recomputed": several minibatches, whose later ones need
    the weights from before the first step)."""
    if source == "engine":
        for mb in micro_batches:
            mb["old_logprobs"] = mb["engine_logprobs"]
        return
    cfg = trainer.cfg
    with torch.no_grad(), compute_precision(trainer):
        for mb in micro_batches:
            with trainer.route_replay.replaying(mb):
                logprobs, _, full = sequence_logprobs(
                    trainer.policy,
                    mb,
                    cfg.rollout.temperature,
                    trainer.autocast_dtype,
                    top_p=cfg.rollout.top_p,
                    full=True,
                    compiled_head=cfg.train.compile,
                )
            mb["old_logprobs"] = logprobs
            if full is not None:  # top_p < 1
                engine_logprobs_on_nucleus(mb, logprobs, full)


def reference_logprobs(trainer, micro_batches):
    """The frozen KL reference's log-probs of every trained token (mb["ref_logprobs"]), for the
    KL term in the loss (train.kl_coef with kl_in=loss): always a no-grad forward of its own."""
    cfg = trainer.cfg
    with torch.no_grad(), compute_precision(trainer):
        for mb in micro_batches:
            mb["ref_logprobs"] = sequence_logprobs(
                trainer.reference,
                mb,
                cfg.rollout.temperature,
                trainer.autocast_dtype,
                top_p=cfg.rollout.top_p,
                compiled_head=cfg.train.compile,
            )[0]


def engine_logprobs_on_nucleus(mb, logprobs, full_logprobs):
    """With top_p < 1, move the micro-batch's engine log-probs onto the nucleus the engine sampled
    from, so that they compare with pi_old's, `logprobs` [B, T-1]; `full_logprobs`: the same
    forward's log-probs of the full softmax.
    SGLang returns log-probs of the full softmax at the temperature, taken before its top-p
    filter (sglang/srt/layers/sampler.py: `logprobs = torch.log(probs)`, the filter works on a
    sorted copy); the trainer scores the nucleus
    (loss.nucleus_edge). Each trained token's engine log-prob is lowered by the log of the nucleus's
    mass as the trainer measures it, taking the engine's nucleus to hold the same mass: the gap
    check and TIS then compare exactly what the full softmaxes of engine and trainer compare.
    Positions out of the loss keep the engine's value. The head computes both from one pass over
    the vocabulary (loss.head_logprobs); SGLang's own `return_sampling_mask` needs a finite top_k
    <= 4096, no use at a 152k vocabulary."""
    mb["engine_logprobs"] = mb["engine_logprobs"] + (logprobs - full_logprobs) * mb["loss_mask"]


def logprob_gap(micro_batches):
    """{"train/logprob_gap": mean |pi_old - engine| over the trained tokens the current weights
    sampled (older tokens differ by design), over all ranks' tokens; "train/logprob_gap_max": the
    largest rank's own, what the health check reads (memory.GapWatch: one rank's engine off
    would be diluted in the mean)}, read once after the update (one host sync)."""
    sums = []  # [gap sum, fresh tokens] per micro-batch, kept on the device
    for mb in micro_batches:
        fresh = mb["loss_mask"] * (mb["staleness"] == 0)
        difference = (mb["old_logprobs"] - mb["engine_logprobs"]).abs()
        # a NaN or -inf the engine gave a token it sampled is the worst gap (NaN compared as no
        # measurement: it switched the check off); a NaN of the trainer's own is the update's to
        # skip and count (NonFiniteError)
        difference = torch.where(mb["engine_logprobs"].isfinite(), difference, math.inf)
        # (checked second: at top_p < 1 engine_logprobs holds the trainer's too, on_nucleus)
        difference = torch.where(mb["old_logprobs"].isnan(), math.nan, difference)
        # selected, not multiplied: on a token left out (masked, stale), inf x 0 was NaN
        gap = torch.where(fresh > 0, difference, 0).sum()
        sums.append(torch.stack([gap, fresh.sum()]))
    gap, num_tokens = torch.stack(sums).sum(0).cpu() if sums else torch.zeros(2)
    mean = ratio(gap, num_tokens)
    if not mean.count:  # no token to measure on this rank: its 0 would read as a perfect match
        return {"train/logprob_gap": mean}
    return {"train/logprob_gap": mean, "train/logprob_gap_max": slowest(float(mean.value))}


def compute_precision(trainer):
    """One rank in bf16: autocast over the fp32 masters. Entered once around a whole pass (every
    micro-batch's forward and backward of an optimizer step, or every no-grad forward), not per
    call: autocast caches its bf16 copy of each fp32 leaf weight until the outermost context
    exits (aten/src/ATen/autocast_mode.cpp, cached_cast), so each weight is cast once per pass
    instead of once per micro-batch. A no-grad pass keeps a context of its own: a copy cast under
    no_grad has no graph, and reused by a grad forward it would stop the weights' gradients.
    With FSDP2 or in fp32: no autocast (its mixed-precision policy casts)."""
    dtype = trainer.autocast_dtype
    return torch.autocast(
        trainer.device.type, dtype=dtype or torch.float32, enabled=dtype is not None
    )


def optimizer_step(trainer, minibatch, token_stats, mark_last, pi_old_detached=False):
    """One clipped-ratio optimizer step over a minibatch's micro-batches (gradient accumulation),
    skipped when the loss or the gradient norm is not finite, or when no rank trains a token in
    it (its step would still move the weights: AdamW's momentum and decay). Adds each
    micro-batch's statistics to `token_stats`, kept on the device: the host reads the loss, the
    norm and the statistics once per minibatch, not per micro-batch (a read drains the GPU's
    queue). `pi_old_detached`
    (`pi_old_source` "detached"): each micro-batch's pi_old is this forward's log-probs, detached.
    `mark_last(flag)` (a function from parallel.gathered_for_update) is told whether the coming
    micro-batch is the minibatch's last.
    With top_p < 1 the head's nucleus reads the host once per 1,024-token chunk (loss.nucleus_edge).
    Returns (the minibatch's loss, its gradient norm, its trained count), all global over
    ranks."""
    t = trainer.cfg.train
    terms = loss.term_coefficients(t)
    trainer.optimizer.zero_grad(set_to_none=True)
    counts = torch.stack([loss.aggregation_count(mb["loss_mask"], t.loss_agg) for mb in minibatch])
    counts = counts.tolist()  # one host read, before this minibatch's forwards are queued
    trained = parallel.all_reduce([sum(counts)])[0]  # the loss denominator of all ranks
    total = max(trained, 1)
    losses = []
    with compute_precision(trainer):
        for i, (mb, count) in enumerate(zip(minibatch, counts)):
            mark_last(i == len(minibatch) - 1)
            losses.append(
                micro_batch_backward(trainer, mb, count, total, token_stats, terms, pi_old_detached)
            )
    grad_norm = torch.nn.utils.clip_grad_norm_(trainer.policy.parameters(), t.grad_clip)
    grad_norm = parallel.full_tensor(grad_norm).item()  # the minibatch's one read of the queue
    minibatch_loss = parallel.all_reduce([sum(torch.stack(losses).tolist())])[0]
    if not trained:
        # nothing to learn from (every sample masked, or more minibatches than sequences): the
        # gradient is 0, yet AdamW's step would move every weight by its momentum and decay. The
        # schedule goes on: it counts steps x num_minibatches slots (model.build_optimizer)
        log.info("no trained token in this minibatch: optimizer step skipped")
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.scheduler.step()
    elif math.isfinite(minibatch_loss) and math.isfinite(grad_norm):
        trainer.optimizer.step()
        trainer.scheduler.step()
    else:
        # the loss and norm are global, so every rank skips alike; NaN moments would poison
        # AdamW for good
        log.warning("non-finite loss %s or grad norm %s: update skipped", minibatch_loss, grad_norm)
        trainer.optimizer.zero_grad(set_to_none=True)
    return minibatch_loss, grad_norm, trained


def micro_batch_backward(trainer, mb, count, total, token_stats, terms, pi_old_detached):
    """The forward and backward of one micro-batch, its loss weighted by its share of the
    minibatch's denominator (`count` of `total`: accumulation == one big batch). Returns the
    weighted loss (a detached device scalar); adds its token statistics to `token_stats`."""
    # routing replay: the engine's experts in the forward, and in its recompute in the backward
    with trainer.route_replay.replaying(mb) as replay:
        mb_loss, loss_stats, entropy = micro_batch_loss(trainer, mb, terms, pi_old_detached)
        weighted = mb_loss * count / total
        weighted.backward()
    num_tokens = mb["loss_mask"].sum()
    token_stats.add("train/entropy", masked_mean(entropy.detach(), mb["loss_mask"]), num_tokens)
    for name, value in loss_stats.items():
        token_stats.add(f"train/{name}", value.detach(), num_tokens)
    if replay.width:  # routing replay: on every rank, even one that replayed nothing
        token_stats.add("train/route_agreement", *replay.agreement())
        token_stats.add("train/routes_refused", *replay.refused())
    return weighted.detach()


def micro_batch_loss(trainer, mb, terms, pi_old_detached):
    """The forward of one micro-batch and its loss: (loss, the loss's token statistics, the
    entropies). With `pi_old_detached`, its log-probs, detached, are pi_old."""
    t = trainer.cfg.train
    clip_low, clip_high = loss.clip_range(t)
    logprobs, entropy, full_logprobs = sequence_logprobs(
        trainer.policy,
        mb,
        trainer.cfg.rollout.temperature,
        trainer.autocast_dtype,
        entropy_grad="entropy" in terms,
        top_p=trainer.cfg.rollout.top_p,
        full=True,
        compiled_head=t.compile,
    )
    if pi_old_detached:
        mb["old_logprobs"] = logprobs.detach()
        if full_logprobs is not None:  # top_p < 1
            engine_logprobs_on_nucleus(mb, mb["old_logprobs"], full_logprobs)
    mb_loss, loss_stats = loss.policy_loss(
        logprobs,
        mb["old_logprobs"],
        mb["advantages"],
        mb["loss_mask"],
        clip_eps=clip_low,
        agg_mode=t.loss_agg,
        norm_length=trainer.cfg.rollout.max_trajectory_tokens(),  # Dr. GRPO's constant
        engine_logprobs=mb["engine_logprobs"] if t.tis_cap else None,
        tis_cap=t.tis_cap,
        clip_eps_high=clip_high,
        ratio_level=t.ratio_level,
        terms=terms,
        ref_logprobs=mb.get("ref_logprobs"),
        kl_estimator=t.kl_estimator,
        entropy=entropy,
    )
    return mb_loss, loss_stats, entropy


# ---------------------------------------------------------------- the tensor layout

# array typecode -> tensor dtype
TORCH_DTYPES = {"i": torch.int32, "f": torch.float32, "B": torch.uint8, "h": torch.int16}


def tensor_view(values):
    """A Sample's per-token array as a tensor sharing its memory (torch.tensor would walk it item
    by item)."""
    dtype = TORCH_DTYPES[values.typecode]
    return torch.frombuffer(values, dtype=dtype) if values else torch.empty(0, dtype=dtype)


def collate(samples, pad_id, rows=None, route_width=0, shared_prefix=False):
    """Right-padded [B, T] tensors. Position t of `targets` is the token predicted from input t.

    With `rows` (how many of the samples, in order, share each packed row; `pack_rows` chooses
    them), the model instead computes on `packed_ids` and `position_ids` [R, W] (W: the fullest
    row), and its output head only at `head_index`, the positions that predict a response token the
    sample trains (no loss reads a prompt token's log-prob, or a tool observation's). `gather`
    [B, T-1] says where each padded position's prediction sits in the head's output and `gathered`
    marks those positions, so the loss reads the same [B, T-1] layout. With `shared_prefix` too,
    samples side by side in a row with the same prompt compute it once (`row_segments`), and the
    batch says which segment each position belongs to (`documents`) and which one it also reads
    (`prefix_of`, -1: none), for `packed_mask`. With `route_width` (train.routing_replay: layers x
    top-k), `route_table`'s routes of the tokens the model computes on, in its input's order."""
    full = [s.prompt_ids + s.response_ids for s in samples]
    # a rank with nothing to train still runs padding micro-batches
    width = max(map(len, full), default=2)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    loss_mask = torch.zeros(len(samples), width - 1)
    engine_logprobs = torch.zeros(len(samples), width - 1)
    # weight version that sampled each target
    versions = torch.zeros(len(samples), width - 1, dtype=torch.long)
    for row, (s, ids) in enumerate(zip(samples, full)):
        input_ids[row, : len(ids)] = tensor_view(ids)  # copies, casting int32 -> int64
        attention_mask[row, : len(ids)] = 1
        first = len(s.prompt_ids) - 1  # logits at the last prompt position predict response token 0
        # an aborted row (merge drops them before the update) gets an all-zero mask: no loss,
        # no denominator
        if not s.masked:
            loss_mask[row, first : first + len(s.response_ids)] = tensor_view(s.loss_mask)
        engine_logprobs[row, first : first + len(s.response_ids)] = tensor_view(s.logprobs)
        versions[row, first : first + len(s.response_ids)] = tensor_view(s.versions)
    # what the model's input holds, piece by piece: (the samples whose routes it may take, first
    # token, end token, flat start); a shared prompt's piece lists every sample reading it
    pieces = [([i], 0, len(ids), i * width) for i, ids in enumerate(full)]
    batch = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,  # the padded model's mask; packed, only a token count
        targets=input_ids[:, 1:],
        loss_mask=loss_mask,
        engine_logprobs=engine_logprobs,
        versions=versions,
        # [B]: each sample's own values. A per-sample value a loss term of yours needs is added here
        # (every micro-batch, a rank's padding ones included, is built by this function), then
        # passed from micro_batch_loss into loss.policy_loss's `inputs` (its keys are fixed)
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float),
    )
    if rows:
        # row r holds samples bounds[r]:bounds[r + 1]
        bounds = list(itertools.accumulate(rows, initial=0))
        segments = [
            row_segments(samples, range(a, b), shared_prefix) for a, b in zip(bounds, bounds[1:])
        ]
        row_width = max(sum(end - lo for _, lo, end, _ in row) for row in segments)
        # Positions restart at 0 for each sequence, and every pad slot is at 0 too (a one-token
        # segment of its own): transformers (>= 4.53) then builds a block-diagonal causal mask per
        # row (the SDPA path), but only with no attention_mask and no cache
        # (masking_utils.find_packed_sequence_indices). A shared prompt's segments go on from its
        # positions instead, so such a batch brings its own mask (`packed_mask`).
        packed_ids = torch.full((len(rows), row_width), pad_id, dtype=torch.long)
        position_ids = torch.zeros((len(rows), row_width), dtype=torch.long)
        documents = torch.zeros((len(rows), row_width), dtype=torch.long)
        prefix_of = torch.full((len(rows), row_width), -1, dtype=torch.long)
        gather = torch.zeros((len(samples), width - 1), dtype=torch.long)
        gathered = torch.zeros((len(samples), width - 1), dtype=torch.bool)
        # flat positions in [R * W] whose hidden state predicts a token the sample trains (not a
        # tool observation)
        head_index, done = [], 0  # head positions so far, and their count
        pieces = []
        for r, row in enumerate(segments):
            start = r * row_width
            # the samples that read each shared prompt (route_table takes the first with routes)
            readers = {reads: [] for *_, reads in row}
            for i, *_, reads in row:
                readers[reads].append(i)
            for document, (i, lo, end, reads) in enumerate(row):
                flat = slice(start, start + end - lo)
                packed_ids.view(-1)[flat] = input_ids[i, lo:end]
                position_ids.view(-1)[flat] = torch.arange(lo, end)
                documents.view(-1)[flat] = document
                prefix_of.view(-1)[flat] = reads
                pieces.append((readers.get(document) or [i], lo, end, start))
                if end == len(full[i]):  # the segment with the response
                    # the positions predicting a token the sample trains (a masked one's too):
                    # not a tool's observation (merged turns), which no loss or statistic reads
                    trains = tensor_view(samples[i].loss_mask).nonzero().squeeze(-1)
                    at = len(samples[i].prompt_ids) - 1 + trains
                    gather[i, at] = torch.arange(done, done + len(at))
                    gathered[i, at] = True
                    head_index.append(start - lo + at)
                    done += len(at)
                start += end - lo
            # each pad slot a document of its own, as its restarting position makes it above
            pads = (r + 1) * row_width - start
            documents.view(-1)[start : start + pads] = torch.arange(len(row), len(row) + pads)
        batch |= dict(
            packed_ids=packed_ids,
            position_ids=position_ids,
            head_index=torch.cat(head_index),
            gather=gather,
            gathered=gathered,
        )
        computed = sum(end - lo for row in segments for _, lo, end, _ in row)
        batch["shared_prefix_tokens"] = torch.tensor(sum(map(len, full)) - computed)
        if shared_prefix:  # every micro-batch then the same mask function, shared or not (a
            # compiled FlexAttention would compile again for another)
            batch |= dict(documents=documents, prefix_of=prefix_of)
    if route_width:
        positions = (batch["packed_ids"] if rows else input_ids).numel()
        batch["routes"], batch["unrouted"] = route_table(samples, pieces, positions, route_width)
    return batch


def row_segments(samples, indices, shared_prefix=False):
    """What one packed row holds, in order, as segments (sample, first token, end token, reads):
    each of `samples[indices]`'s sequences whole (reads -1: no other segment), or, with
    `shared_prefix` (train.shared_prefix), for each run of 2+ neighbours with the same prompt of 2+
    tokens (`Sample.prompt_key`: with routing replay, routed alike too), that prompt except its last
    token once, then per sample a segment from that last token on (reads: the prompt's segment
    index, its index in the returned list). Three samples with prompt p0 p1 p2: [p0 p1], [p2 a...],
    [p2 b...], [p2 c...], the last three reading segment 0. The last prompt token is in each
    sample's segment because its output predicts the sample's first response token; each segment
    keeps its tokens' positions in the whole sequence. A run of G samples with prompt length L
    computes (G - 1) x (L - 1) positions fewer."""
    out, prefix = [], None  # prefix: (its segment index, its prompt's key) while a run goes on
    indices = list(indices)
    # (keys copy each prompt, and its routes: made once each, and only where compared)
    keys = [samples[i].prompt_key() if shared_prefix else None for i in indices] + [None]
    for k, i in enumerate(indices):
        prompt, key = samples[i].prompt_ids, keys[k]
        end = len(prompt) + len(samples[i].response_ids)
        if prefix is not None and key == prefix[1]:
            out.append((i, len(prompt) - 1, end, prefix[0]))
            continue
        prefix = None
        if shared_prefix and len(prompt) > 1 and key == keys[k + 1]:
            out.append((i, 0, len(prompt) - 1, -1))
            prefix = (len(out) - 1, key)
            out.append((i, len(prompt) - 1, end, prefix[0]))
        else:
            out.append((i, 0, end, -1))
    return out


def route_table(samples, pieces, positions, width):
    """Routing replay's routes for a micro-batch whose model input holds `positions` tokens, as
    `pieces` (the samples whose tokens a piece is, first token, end token, flat start) lay out the
    samples' tokens: [positions, width (layers x top-k)] int16, each token's experts as the engine
    routed them (Sample.routed_experts), runtime.routing.NO_ROUTE where the router keeps its own
    choice: padding, each sequence's last token (the engine never computes it; no loss reads its
    output) and a sample without routes of its length. A shared prompt's samples were routed alike
    on it (`row_segments` shares it so): it takes the routes of the first that has them. Returns
    (the table, how many unmasked samples had none: a count that should stay 0)."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples]  # routed tokens
    routed = [len(s.routed_experts) == n * width for s, n in zip(samples, lengths)]
    table = torch.full((positions, width), NO_ROUTE, dtype=torch.int16)
    for candidates, lo, end, start in pieces:
        i = next((i for i in candidates if routed[i]), None)
        if i is not None:
            n = min(end, lengths[i]) - lo
            table[start : start + n] = tensor_view(samples[i].routed_experts).view(-1, width)[
                lo : lo + n
            ]
    unrouted = sum(not r and not s.masked for r, s in zip(routed, samples))
    return table, torch.tensor(unrouted)


def sequence_logprobs(
    model,
    batch,
    temperature,
    autocast_dtype=None,
    entropy_grad=False,
    top_p=1.0,
    full=False,
    compiled_head=False,
):
    """Per-token log-probs and entropies [B, T-1] of `batch['targets']` under `model`, in fp32.

    For this call the model's output head returns log-probs (loss.head_logprobs, chunked over
    positions) instead of [B, T, V] logits: it still runs inside the model's forward, where FSDP2
    has gathered the head's weight as for the usual logits, but the full logits never exist. With
    one rank, `autocast_dtype` runs the matmuls in bf16 over the fp32 parameters (with FSDP2 its
    mixed precision policy does that, and autocast stays off). The entropies carry their graph
    only with `entropy_grad` (an entropy bonus in the loss). With `top_p` < 1, of the nucleus the
    engine sampled from (loss.nucleus_edge). With `full`, a third value: the log-probs of the full
    softmax (no graph; what the engine reports with top_p < 1), None at top_p 1, where they are
    the first. `compiled_head` (train.compile): the head's chunks compiled (loss.chunk_function).
    """
    head = model.get_output_embeddings()
    # model.fp32_head, in the model's config for the engine to read too (runtime/model.py)
    fp32_logits = getattr(model.config, "enable_lm_head_fp32", False)
    packed = "packed_ids" in batch
    input_ids = batch["packed_ids"] if packed else batch["input_ids"]
    # packed: only the positions that predict a response token (the next one in the row is its
    # target); padded: position t predicts target t (= input t + 1)
    index = batch["head_index"] if packed else None
    targets = input_ids.flatten()[index + 1] if packed else input_ids[:, 1:]

    def logprobs_head(hidden):  # hidden: [B, T, H]
        values = loss.head_logprobs(
            hidden if packed else hidden[:, :-1],
            head.weight,
            head.bias,
            targets,
            temperature,
            index=index,
            entropy_grad=entropy_grad,
            top_p=top_p,
            full=True,
            compiled=compiled_head,
            fp32_logits=fp32_logits,
        )
        # [B, T-1, 3] (packed: [N, 3]), where the logits would be
        return torch.stack(values, -1)

    head.forward = logprobs_head  # an instance attribute: shadows nn.Linear.forward until deleted
    try:
        # use_cache=False: the config's default (True for Qwen2.5) would build a DynamicCache that
        # keeps every layer's K/V alive through the no-grad pass (transformers utils/generic.py),
        # and packing needs it off
        inputs = (
            dict(position_ids=batch["position_ids"], attention_mask=packed_mask(model, batch))
            if packed
            else dict(attention_mask=batch["attention_mask"])
        )
        # for callers outside the update; inside compute_precision's context this nested one
        # keeps its cast cache (only the outermost exit clears it)
        with torch.autocast(
            input_ids.device.type,
            dtype=autocast_dtype or torch.float32,
            enabled=autocast_dtype is not None,
        ):
            # named logits, but logprobs_head's output: (log-prob, entropy, full log-prob) per
            # position
            out = model(input_ids=input_ids, use_cache=False, **inputs).logits
    finally:
        del head.forward
    if packed:  # back to the [B, T-1] layout the loss reads (gradients flow through the gather)
        if not len(out):  # no response token in the micro-batch: a zero row to gather from
            out = torch.cat([out, out.new_zeros(1, out.shape[-1])])
        out = out[batch["gather"]] * batch["gathered"].unsqueeze(-1)
    logprobs = out[..., 0]
    entropy = out[..., 1] if entropy_grad else out[..., 1].detach()
    if not full:
        return logprobs, entropy
    return logprobs, entropy, out[..., 2].detach() if top_p < 1 else None


def packed_mask(model, batch):
    """A packed micro-batch's attention mask, built at its first forward and kept in `batch` for
    the others (pi_old, the reference, the update: 2-4 per micro-batch); transformers would build
    one in every forward. FlexAttention: a BlockMask (`document_mask`). SDPA: None, where
    transformers reads the packing from position_ids, but for a shared prompt
    (train.shared_prefix), which position_ids cannot say: a dense [R, 1, W, W] boolean mask
    (transformers takes a 4D mask as it is: masking_utils.py, _preprocess_mask_arguments).

    A model whose layers attend within a sliding window (`config.sliding_window`) gets a mask per
    layer type, {"full_attention": ..., "sliding_attention": ...} (Gemma 3, by
    `config.layer_types`), or the windowed one for every layer where it names none (Mistral):
    transformers hands a BlockMask to every layer as it is (masking_utils.py,
    _preprocess_mask_arguments), so one mask would let a windowed layer attend past its window.
    (A shared prompt with a window is refused: runtime/model.py check_family.)"""
    flex = model.config._attn_implementation == "flex_attention"
    if "block_mask" in batch or not (flex or "prefix_of" in batch):
        return batch.get("block_mask")
    position_ids = batch["position_ids"]
    if "prefix_of" in batch:
        documents, prefix_of = batch["documents"], batch["prefix_of"]
        if flex:
            batch["block_mask"] = document_mask(position_ids, None, documents, prefix_of)
        else:
            queries = torch.arange(position_ids.shape[1], device=position_ids.device)
            causal = queries[:, None] >= queries[None, :]
            own = (documents[:, :, None] == documents[:, None, :]) & causal
            batch["block_mask"] = (own | (prefix_of[:, :, None] == documents[:, None, :]))[:, None]
        return batch["block_mask"]
    text = model.config.get_text_config()  # (a composite config keeps these in its text part)
    window = getattr(text, "sliding_window", None)  # None where no layer has one
    kinds = getattr(text, "layer_types", None)  # other kinds: refused, model.check_family
    if not window:
        batch["block_mask"] = document_mask(position_ids)
    elif kinds is None:
        batch["block_mask"] = document_mask(position_ids, window)
    else:
        batch["block_mask"] = {
            kind: document_mask(position_ids, window if kind == "sliding_attention" else None)
            for kind in set(kinds)
        }
    return batch["block_mask"]


# FlexAttention's block: the mask is kept per (query block, key block) of this many tokens
# (torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE)
MASK_BLOCK = 128


def document_ids(position_ids):
    """[B, T]: which packed sequence each token belongs to, rising along each row. A sequence
    starts where the position does not go on by one (transformers' rule,
    masking_utils.find_packed_sequence_indices)."""
    previous = torch.cat([position_ids[:, :1] - 1, position_ids[:, :-1]], dim=1)
    return (position_ids - previous != 1).cumsum(-1)


def causal_in_document(document, window=None, prefix_of=None):
    """FlexAttention's mask_mod for `document_ids`: a query sees the keys of its own sequence up
    to itself; with `window`, only the last `window` of them, itself included (transformers'
    sliding mask: masking_utils.py, sliding_window_overlay); with `prefix_of` (a shared prompt,
    `collate`), also every key of the segment prefix_of names (-1: none)."""

    def mask_mod(b, h, q, kv):
        return (document[b, q] == document[b, kv]) & (q >= kv)

    def windowed(b, h, q, kv):
        return mask_mod(b, h, q, kv) & (q - kv < window)

    def shared(b, h, q, kv):
        return mask_mod(b, h, q, kv) | (prefix_of[b, q] == document[b, kv])

    return windowed if window else shared if prefix_of is not None else mask_mod


def document_mask(position_ids, window=None, document=None, prefix_of=None):
    """Causal attention within each packed sequence of `position_ids` [B, T] (`document_ids`, or
    `document` given), as a BlockMask: what transformers' own packed mask allows (with `window`,
    its sliding one's; with `prefix_of`, each segment also reads its shared prompt).

    Built from each block's first and last sequence, never as tokens x tokens: torch's
    create_block_mask (uncompiled) evaluates the mask at every pair first, 2.2 G booleans at the
    47,104 tokens `auto` gives Qwen2.5-1.5B on an H200, where this reads [T / 128]^2 block pairs
    (135 k there). Sequences are contiguous and their ids rise along a row, so a key block j may
    hold a query block i's sequence only if their id ranges overlap; j < i, and both whole blocks
    of one sequence: every pair allowed (a "full" block, no mask_mod call); j == i, or ranges that
    overlap otherwise: some pairs (a partial block, `causal_in_document` decides per token). A
    shared prompt lies before its segments: key block j holds one a query of block i reads if one
    of i's prefix_of values is in j's id range; whole blocks, each query of i in or reading each
    sequence of j: full. Equal to create_block_mask's, block for block (tests/test_packing.py,
    tests/test_shared_prefix.py)."""
    from torch.nn.attention.flex_attention import BlockMask

    if window and prefix_of is not None:
        raise ValueError("a shared prompt under a sliding window is not supported")
    batch_size, width = position_ids.shape
    document = document_ids(position_ids) if document is None else document
    blocks = -(-width // MASK_BLOCK)

    def per_block(values, fill):  # [B, T] -> [B, blocks, MASK_BLOCK], `fill` past the last token
        padded = torch.nn.functional.pad(values, (0, blocks * MASK_BLOCK - width), value=fill)
        return padded.view(batch_size, blocks, MASK_BLOCK)

    # past the last token: -1, below every id, so a block's max is its last real token's
    padded = per_block(document, -1)
    first, last = padded[..., 0], padded.max(-1).values  # [B, blocks]
    index = torch.arange(blocks, device=position_ids.device)
    whole = (index + 1) * MASK_BLOCK <= width  # the last block may be cut short: never full
    q_first, q_last = first[:, :, None], last[:, :, None]
    kv_first, kv_last = first[:, None, :], last[:, None, :]
    causal = index[None, :] <= index[:, None]
    overlap = causal & (kv_last >= q_first) & (kv_first <= q_last)
    one_sequence = (q_first == q_last) & (kv_first == kv_last) & (q_first == kv_first)
    below = (index[None, :] < index[:, None]) & whole[:, None] & whole[None, :]
    full = one_sequence & below
    if window:  # query block i, key block j <= i: their nearest tokens are (i - j - 1) blocks + 1
        # apart, their farthest (i - j + 1) blocks - 1
        apart = index[:, None] - index[None, :]
        overlap &= (apart - 1) * MASK_BLOCK + 1 < window
        full &= (apart + 1) * MASK_BLOCK - 1 < window
    if prefix_of is not None:  # each query of block i against key block j's id range [c, d]:
        # [B, blocks, blocks, MASK_BLOCK] booleans
        own, reads = padded[..., None, :], per_block(prefix_of, -1)[..., None, :]
        c, d = kv_first[..., None], kv_last[..., None]
        # some query reads a prompt in j (its ids run contiguous)
        overlap |= causal & ((reads >= c) & (reads <= d)).any(-1)

        def seen(ids):  # every query of i in that sequence or reading it
            return ((own == ids) | (reads == ids)).all(-1)

        # every pair, where j holds at most two sequences (a prompt, then a segment reading it)
        full |= below & (kv_last - kv_first <= 1) & seen(c) & seen(d)
    partial = overlap & ~full

    def ordered(dense):  # [B, Q blocks, KV blocks] -> counts and indices, allowed ones first
        dense = dense[:, None].to(torch.int32)  # one mask for every head
        indices = torch.argsort(dense, dim=-1, descending=True, stable=True)
        return dense.sum(-1, dtype=torch.int32), indices.to(torch.int32)

    return BlockMask.from_kv_blocks(
        *ordered(partial),
        *ordered(full),
        BLOCK_SIZE=MASK_BLOCK,
        mask_mod=causal_in_document(document, window, prefix_of),
        seq_lengths=(width, width),
    )


def micro_batches(samples, size, pad_id, max_tokens=0, route_width=0, shared_prefix=False):
    """Collated micro-batches: with `max_tokens`, packed rows of at most that many positions
    (`pack_rows`), else padded ones of at most `size` samples, each padded only to its own
    longest row. Then padding micro-batches (nothing trained) up to the count of the rank that
    needs the most: with FSDP every forward and backward is a collective, so every rank
    must run the same number (verl equalises the same way). Returns (micro-batches, how many
    samples were longer than the budget: each got one of its own). `route_width`: collate's.
    `shared_prefix` (packed only): the samples that share a prompt are packed side by side
    (`prefix_units`), so collate computes it once for them."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    if max_tokens:
        units = (
            prefix_units(samples, max_tokens)
            if shared_prefix
            else [[i] for i in range(len(samples))]
        )
        # a unit's positions as collate lays it out: the first sample whole, each other one its
        # response and the prompt's last token
        sizes = [
            lengths[unit[0]] + sum(len(samples[i].response_ids) + 1 for i in unit[1:])
            for unit in units
        ]
        # [micro-batch][row][sample index]
        layout = [
            [[i for u in row for i in units[u]] for row in mb]
            for mb in pack_rows(sizes, max_tokens)
        ]
        indices = [[i for row in mb for i in row] for mb in layout]
        row_sizes = [[len(row) for row in mb] for mb in layout]
    else:
        indices = [
            list(range(start, min(start + size, len(samples))))
            for start in range(0, len(samples), size)
        ]
        row_sizes = [None] * len(indices)  # padded: one sample per row
    out = []
    for mb_indices, mb_row_sizes in zip(indices, row_sizes):
        mb = collate(
            [samples[i] for i in mb_indices], pad_id, mb_row_sizes, route_width, shared_prefix
        )
        out.append(mb)
    count = max(int(parallel.all_reduce([len(out)], op="max")[0]), 1)
    while len(out) < count:
        # a rank short of micro-batches runs fillers (FSDP2 gathers in every forward): 4 masked
        # samples, 2 to a packed row, so that no size is 0 or 1 and each row holds 2 documents,
        # as a real micro-batch's (one 2-token row made the compiled layer and head specialise)
        # (padded: as many rows as a real one, up to 2)
        # (masked: no loss reads them; loss_mask 1: the head runs on their position, as on a
        # real sample's)
        filler = [Sample([pad_id], [pad_id], [0.0], [1], group_id=0, masked=True)]
        filler *= 4 if max_tokens else min(size, 2)
        mb = collate(filler, pad_id, [2, 2] if max_tokens else None, route_width, shared_prefix)
        mb["filler"] = torch.ones(())  # its positions are padding (layout_stats)
        out.append(mb)
    return out, sum(n > max_tokens for n in lengths) if max_tokens else 0


def prefix_units(samples, max_tokens):
    """train.shared_prefix's packing units: the indices of the samples with the same prompt (a GRPO
    group's; `Sample.prompt_key`), in the order they first come, each group cut where its next
    sample would take the unit past `max_tokens` positions as collate lays it out (the prompt once,
    then per sample its response and the prompt's last token). A cut group's units each compute the
    prompt (but where two land side by side in a row). A unit sets its row's width (pack_rows):
    under FlexAttention a wide row costs only what its segments read, under SDPA's dense mask rows x
    width^2 whatever they hold (docs/RESULTS.md, "A group's prompt computed once": where each
    pays)."""
    groups = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.prompt_key(), []).append(i)
    units = []
    for members in groups.values():
        unit, size = [], 0
        for i in members:
            whole = len(samples[i].prompt_ids) + len(samples[i].response_ids)
            more = len(samples[i].response_ids) + 1
            if unit and size + more > max_tokens:
                units.append(unit)
                unit = []
            size = size + more if unit else whole
            unit.append(i)
        units.append(unit)
    return units


def pack_rows(lengths, max_tokens):
    """Indices of `lengths` (the samples' sequences; with train.shared_prefix, prefix_units'
    units) laid out as [micro-batch][row][index]. First-fit decreasing over the whole minibatch
    (longest first, each into the first row with room) into rows as wide as its longest item,
    then as few micro-batches as the budget allows (rows x width <= max_tokens, so the budget
    bounds the positions computed, hence memory), the rows shared out evenly. Rows come out
    nearly full (a few % padding at GRPO's 64 samples per rank; fewer samples leave more gaps),
    and none is wider than its longest item needs alone: with a dense block-diagonal mask (SDPA)
    attention costs width^2 per row whatever the row holds. An item longer than the budget gets a
    micro-batch of its own."""
    over = [[[i]] for i, n in enumerate(lengths) if n > max_tokens]
    fitting = sorted(
        (i for i, n in enumerate(lengths) if n <= max_tokens), key=lambda i: -lengths[i]
    )
    width = lengths[fitting[0]] if fitting else 1
    rows, room = [], []
    for i in fitting:
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    # as few micro-batches as the budget allows, their rows shared out evenly (sizes differ by at
    # most one): no 1-row remainder beside fuller micro-batches, whose shape would make a compiled
    # layer specialise again (torch.compile treats a size of 1 apart from the others). 1-row ones
    # remain where the budget holds 2 rows or fewer (3 rows at 2 a micro-batch: 1 + 2), and for
    # an item over the budget
    if not rows:
        return over
    count = -(-len(rows) // (max_tokens // width))
    bounds = [len(rows) * k // count for k in range(count + 1)]
    return over + [rows[a:b] for a, b in zip(bounds, bounds[1:])]


def layout_stats(micro_batches, shared_prefix=False):
    """What the model computed on: the sequences' tokens, the share of padding among the positions
    it ran (`padded_fraction`), the positions its output head ran on (packed: trained response
    tokens only, no tool observation), micro-batch count and sequence tokens per micro-batch. With
    train.shared_prefix, the positions a shared prompt saved (`shared_prefix_tokens`: tokens the
    model did not compute)."""
    tokens = sum(int(mb["attention_mask"].sum()) for mb in micro_batches if "filler" not in mb)
    # positions a shared prompt saved (collate counts them)
    saved = sum(int(mb.get("shared_prefix_tokens", 0)) for mb in micro_batches)
    positions = sum(
        (mb["packed_ids"] if "packed_ids" in mb else mb["attention_mask"]).numel()
        for mb in micro_batches
    )
    head = sum(
        len(mb["head_index"]) if "head_index" in mb else mb["targets"].numel()
        for mb in micro_batches
    )
    stats = {
        "train/tokens": summed(tokens),
        "train/padded_fraction": ratio(positions - tokens + saved, positions),
        "train/head_positions": summed(head),
        "train/micro_batches": summed(len(micro_batches)),
        "train/tokens_per_micro_batch": ratio(tokens, len(micro_batches)),
    }
    if shared_prefix:
        stats["train/shared_prefix_tokens"] = summed(saved)
    return stats


def mask_stale_tokens(micro_batches, version, max_staleness):
    """Each micro-batch's per-token staleness (weight versions between the policy being trained,
    `version`, and the one that sampled the token; 0 where nothing is trained). With
    `max_staleness` >= 0, older tokens leave the loss mask (the alternative to weighting them by
    TIS). Returns {"staleness/masked_tokens": the count masked}. Writes mb["staleness"], which
    old log-probs' gap and `offpolicy_stats` read: it runs first."""
    masked = 0
    for mb in micro_batches:
        mb["staleness"] = (version - mb["versions"]) * (mb["loss_mask"] > 0)
        if max_staleness >= 0:
            too_old = (mb["staleness"] > max_staleness) & (mb["loss_mask"] > 0)
            masked += int(too_old.sum())
            mb["loss_mask"] = mb["loss_mask"] * ~too_old
    return {"staleness/masked_tokens": summed(masked)}


def offpolicy_stats(micro_batches, tis_cap, top_p=1.0):
    """How much of the batch an older policy sampled (partial rollout resumes): the trained
    tokens per staleness (a histogram as staleness/tokens_<k> counts), and on the stale tokens
    the importance weight pi_old / pi_engine (capped by `tis_cap` when on) and the fraction the
    cap cut. Not at `top_p` < 1: the older weights' nucleus mass, which that weight needs, is
    not reported (check)."""
    trained = [mb["loss_mask"] > 0 for mb in micro_batches]
    staleness = torch.cat([mb["staleness"][m] for mb, m in zip(micro_batches, trained)])
    log_weight = torch.cat(
        [
            (mb["old_logprobs"] - mb["engine_logprobs"])[m & (mb["staleness"] > 0)]
            for mb, m in zip(micro_batches, trained)
        ]
    )
    stats = {f"staleness/tokens_{k}": summed((staleness == k).sum()) for k in range(4)}
    stats["staleness/tokens_4+"] = summed((staleness >= 4).sum())
    stats["train/stale_token_frac"] = ratio((staleness > 0).sum(), len(staleness))
    if len(log_weight) and top_p == 1:
        cap = math.log(tis_cap) if tis_cap else math.inf
        weights = log_weight.clamp(max=cap).exp()
        stats["train/stale_is_weight"] = ratio(weights.sum(), len(log_weight))
        stats["train/stale_is_capped_frac"] = ratio((log_weight > cap).sum(), len(log_weight))
    return stats


def make_minibatches(samples, cfg, pad_id, device, route_width=0):
    """The step's `cfg.num_minibatches` minibatches (`cfg`: TrainConfig), each a list of collated
    micro-batches on `device`: minibatch i is the i-th slice of this rank's samples. Collated
    once, read by every pass (a pi_old or reference forward where there is one, then the
    update). Every rank makes the same count
    (clip_grad_norm_ is a collective too). The slices differ by at most one sample (9 samples in 4
    minibatches: 2, 2, 2, 3; slices of ceil(9 / 4) left the last one empty, and 10 left it one
    sample that took a whole optimizer step). `route_width`: collate's. Returns (minibatches,
    sequences over the budget)."""
    n = cfg.num_minibatches
    bounds = [len(samples) * i // n for i in range(n + 1)]
    out = []
    over_budget = 0
    for start, end in zip(bounds, bounds[1:]):
        batches, over = micro_batches(
            samples[start:end],
            cfg.micro_batch_size,
            pad_id,
            max_tokens=cfg.max_tokens_per_micro_batch,
            route_width=route_width,
            shared_prefix=cfg.shared_prefix,
        )
        out.append([{key: value.to(device) for key, value in mb.items()} for mb in batches])
        over_budget += over
    return out, over_budget
