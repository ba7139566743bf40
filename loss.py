"""The policy loss as small pure tensor functions: per-token log-probs, the clipped surrogate (with
clip-higher, GSPO's sequence-level ratio, CISPO, and truncated importance sampling for
engine-vs-trainer mismatch), the extra per-token terms (KL to a reference, entropy bonus; `TERMS`,
a fork point), and the aggregation modes.

Owns no state, no model and no engine; update.py calls these on [B, T] tensors (padded rows, or
packed rows gathered back to that layout). Masked rows (padding and filler rows; aborted samples
never reach the update: merge.training_sequences drops them) are exactly equivalent to removed
rows under every function here, for finite values: an inf or NaN anywhere, masked too, makes the
loss or its gradient NaN (the update is then skipped and counted: update.NonFiniteError). Does
not own advantages (advantages.py).

To add a loss term: a function `(inputs) -> [B, T]` per-token values, its entry in TERMS, and
`train.loss_terms: {name: coefficient}` turns it on (README "Fork it"; tests/test_forks.py).
"""

import functools
import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from config import ConfigError, refuse_unread

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# token: PPO's clipped token ratio; sequence: GSPO; cispo: CISPO's clipped, stop-gradient weight
RATIO_LEVELS = ("token", "sequence", "cispo")
# GSPO's objective averages over sequences; the only mode it defines
SEQUENCE_RATIO_AGG = "seq-mean-token-mean"
# CISPO's objective is normalised over every token of the batch (MiniMax-M1, eq. 4)
CISPO_AGG = "token-mean"
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")  # train.kl_estimator: see kl_estimate
# train.kl_in: the KL to the reference as a loss term (GRPO's, Shao et al. 2024 eq. 3), or as a
# cost subtracted from each trajectory's reward before the group statistics (verl's
# use_kl_in_reward; advantages.reference_kl)
KL_PLACEMENTS = ("loss", "reward")


def _clipped_at(level):
    """(is_read, when) of a clip range of ratio level `level` (clip_range): read only where the
    ratio can leave 1. With one minibatch and the trainer's pi_old, pi_old is the update's own
    forward, detached (update.pi_old_source): the ratio is 1, never clipped."""
    return (
        lambda cfg: cfg.train.ratio_level == level
        and (cfg.train.num_minibatches > 1 or cfg.train.old_logprobs == "engine"),
        f"with train.ratio_level={level} and a ratio that can leave 1 (train.num_minibatches > "
        "1, or train.old_logprobs=engine)",
    )


# config.refuse_unread's table: the clip ranges each ratio level reads, and what only a KL
# reference reads
READ_WHEN = {
    "train.clip_eps": _clipped_at("token"),
    "train.clip_eps_high": _clipped_at("token"),
    "train.sequence_clip_eps": _clipped_at("sequence"),
    "train.sequence_clip_eps_high": _clipped_at("sequence"),
    "train.cispo_eps_low": _clipped_at("cispo"),
    "train.cispo_eps_high": _clipped_at("cispo"),
    "train.kl_estimator": (lambda cfg: cfg.train.kl_coef > 0, "with train.kl_coef > 0"),
}


def check(cfg):
    """The loss's choices and combinations (assemble.load_config calls this at load); a clip
    range another ratio level reads, or a KL setting without a reference, is refused."""
    t = cfg.train
    choices = {
        "train.loss_agg": (t.loss_agg, LOSS_AGG_MODES),
        "train.ratio_level": (t.ratio_level, RATIO_LEVELS),
        "train.kl_estimator": (t.kl_estimator, KL_ESTIMATORS),
        "train.kl_in": (t.kl_in, KL_PLACEMENTS),
    }
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{key}={value!r}: expected one of {allowed}")
    refuse_unread(cfg, READ_WHEN)
    unknown = sorted(set(t.loss_terms) - set(TERMS))
    if unknown:
        raise ConfigError(f"train.loss_terms: no term {unknown[0]!r}; loss.TERMS has {list(TERMS)}")
    # the built-in terms have their own switches: the KL needs the reference that kl_coef keeps
    owned = {"kl": "train.kl_coef (with train.kl_in=loss)", "entropy": "train.entropy_coef"}
    builtin = sorted(set(t.loss_terms) & set(owned))
    if builtin:
        name = builtin[0]
        raise ConfigError(f"train.loss_terms: {name!r} is set by {owned[name]}, not here")
    if t.ratio_level == "sequence" and t.loss_agg != SEQUENCE_RATIO_AGG:
        raise ConfigError(
            "train.ratio_level=sequence (GSPO) averages each sequence's objective over sequences: "
            f"it needs train.loss_agg={SEQUENCE_RATIO_AGG}, not {t.loss_agg!r}"
        )
    if t.ratio_level == "cispo" and t.loss_agg != CISPO_AGG:
        raise ConfigError(
            "train.ratio_level=cispo normalises over every token (MiniMax-M1, eq. 4): it needs "
            f"train.loss_agg={CISPO_AGG}, not {t.loss_agg!r}"
        )
    if t.tis_cap != 0 and not t.tis_cap >= 1:
        raise ConfigError(f"train.tis_cap={t.tis_cap}: expected 0 (off) or a cap >= 1")
    if t.kl_in == "reward" and not t.kl_coef:
        raise ConfigError("train.kl_in=reward needs train.kl_coef > 0 (0 keeps no reference)")
    if t.kl_in == "reward" and t.kl_coef and cfg.rollout.top_p < 1:
        raise ConfigError(
            "train.kl_in=reward reads the engine's log-probs, of the full softmax (SGLang's), and "
            "rollout.top_p < 1 samples from a nucleus: use train.kl_in=loss, or rollout.top_p=1"
        )


def clip_range(t):
    """(low, high) clip epsilons of the ratio, [1 - low, 1 + high], from TrainConfig `t`: GSPO's
    own with ratio_level=sequence, CISPO's with ratio_level=cispo."""
    if t.ratio_level == "sequence":
        return t.sequence_clip_eps, t.sequence_clip_eps_high
    if t.ratio_level == "cispo":
        return t.cispo_eps_low, t.cispo_eps_high
    return t.clip_eps, t.clip_eps_high or t.clip_eps


# ---------------------------------------------------------------- extra per-token terms
# Each term: (inputs) -> [B, T] per-token values, added to the loss times its coefficient and
# aggregated like the surrogate. `inputs` is a dict of [B, T] tensors: logprobs (with grad),
# old_logprobs, loss_mask, entropy (with its graph only when the entropy term is on),
# engine_logprobs (None unless train.tis_cap), ref_logprobs (None without a KL reference),
# advantages [B, 1] (a per-sample value: [B] would broadcast against T), and kl_estimator and
# norm_length (the token budget, Dr. GRPO's constant).
def kl_penalty(inputs):
    """The KL to the frozen reference (GRPO's, Shao et al. 2024 eq. 3), per `kl_estimate`."""
    return kl_estimate(inputs["logprobs"], inputs["ref_logprobs"], inputs["kl_estimator"])


def entropy_bonus(inputs):
    """An entropy bonus (verl's entropy_coeff): minus the token entropy, so the loss falls as it
    rises."""
    return -inputs["entropy"]


TERMS = {"kl": kl_penalty, "entropy": entropy_bonus}


def term_coefficients(t):
    """{term name: coefficient} of every term TrainConfig `t` turns on: the KL with kl_in=loss
    (kl_coef), the entropy bonus (entropy_coef), and train.loss_terms."""
    terms = {"kl": t.kl_coef if t.kl_in == "loss" else 0.0, "entropy": t.entropy_coef}
    return {name: coef for name, coef in (terms | t.loss_terms).items() if coef}


def kl_estimate(logprobs, ref_logprobs, estimator="k3"):
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by pi (Schulman 2020,
    "Approximating KL divergence"), with r = log pi_ref - log pi:
    k1 = -r (unbiased, can be negative); k2 = r^2 / 2 (biased, low variance); k3 = exp(r) - r - 1
    (unbiased, >= 0: GRPO's, Shao et al. 2024 eq. 4); low_var_kl: k3 with verl's clamps (r to
    [-20, 20] before exp, the estimate to [-10, 10]; verl trainer/ppo/core_algos.py, kl_penalty).
    Worked example, log pi = -1.0, log pi_ref = -1.2: k1 0.2, k2 0.02, k3 exp(-0.2) + 0.2 - 1 =
    0.01873."""
    r = ref_logprobs - logprobs
    if estimator == "k1":
        return -r
    if estimator == "k2":
        return 0.5 * r**2
    if estimator == "k3":
        return torch.exp(r) - r - 1
    if estimator == "low_var_kl":
        r = r.clamp(-20, 20)
        return (torch.exp(r) - r - 1).clamp(-10, 10)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def token_logprobs(logits, target_ids, temperature=1.0, entropy_grad=False, top_p=1.0, full=False):
    """Log-prob of each target token and the entropy of each position's distribution.

    logits: [B, T, V], target_ids: [B, T] -> (logprobs [B, T] fp32, entropy [B, T] fp32, no
    autograd). The engine samples from softmax(logits / temperature), cut to its top-p nucleus
    when top_p < 1 (`nucleus_scores`), so the trainer scores that same distribution; otherwise the
    ratio and the engine/trainer gap would compare different policies, and the gradient would push
    on tokens that could never be sampled. The entropy is a statistic, computed without a graph so
    it keeps nothing alive, unless `entropy_grad` (train.entropy_coef > 0 differentiates it). With
    `full`, a third value: the targets' log-probs under the full softmax (no graph), which the
    engine reports with top_p < 1 (update.engine_logprobs_on_nucleus), from the same pass.

    At top_p 1, one pass over the vocabulary as far as eager kernels allow: one log-sum-exp, one
    shifted copy, its exp and one product-sum; `train.compile` fuses them (head_logprobs). At
    top_p < 1, a search over it and then, nearly everywhere, a few hundred tokens a position.
    """
    if top_p < 1:
        scores = nucleus_scores(logits, target_ids, temperature, entropy_grad, top_p)
    else:
        scaled = scaled_logits(logits, temperature)
        target = scaled.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
        scores = softmax_scores(scaled, target, scaled.logsumexp(-1), entropy_grad)
    logprobs, entropy, full_logprobs = scores
    return (logprobs, entropy, full_logprobs.detach()) if full else (logprobs, entropy)


def softmax_scores(scaled, target, full_lse, entropy_grad, nucleus=False):
    """(log-probs, entropies, the full softmax's log-probs), each [...]: of the targets' scaled
    logits `target` [...] under the softmax of `scaled` [..., S] (the scaled logits of the whole
    vocabulary, or of a nucleus's slots), whose log-sum-exp over the whole vocabulary is
    `full_lse` [...]. With `nucleus`, the tokens outside it are at -inf in `scaled` and the
    log-probs are the nucleus's."""
    lse = scaled.logsumexp(-1) if nucleus else full_lse
    # with `entropy_grad` (an entropy bonus in the loss) the entropy keeps its graph
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        log_probs = scaled - lse.unsqueeze(-1)
        # a token outside the nucleus has p = 0 and log p = -inf: it adds 0, not 0 x -inf = NaN
        # (masked before the product, so no NaN reaches the backward either)
        finite = log_probs.masked_fill(scaled.isneginf(), 0.0) if nucleus else log_probs
        entropy = -(log_probs.exp() * finite).sum(-1)
    return target - lse, entropy, target - full_lse


def nucleus_scores(logits, target_ids, temperature, entropy_grad, top_p):
    """softmax_scores of each position's top-p nucleus (logits [..., V], target_ids [...] ->
    three [...]), found first from the logits alone (`nucleus_edge`). Where the nucleus lies among
    the position's NUCLEUS_TOP_K likeliest tokens (its k-th is below the edge: every token beyond
    is too), as a trained model's does nearly everywhere, it is scored from those K and the
    sampled token (`nucleus_slots`): past the edge's search, nothing more over the vocabulary,
    forward or backward, but a gather and its scatter. Elsewhere (`wide`: a near-uniform row),
    from the whole vocabulary with every token outside the nucleus at -inf, its scores put in
    its place. A compiled chunk has a graph for none, one and several wide rows (dynamo
    specializes sizes 0 and 1 anyway)."""
    shape = target_ids.shape
    logits, target_ids = logits.flatten(0, -2), target_ids.flatten()  # [N, V], [N]
    # Compiled, the edge's search breaks the graph (a nonzero read on the host), and what lives
    # across a break is written to memory: here the logits, which the projection wrote anyway,
    # and no fp32 copy of them (RESULTS)
    edge, lse, top, wide = nucleus_edge(logits, temperature, top_p)
    slots, target = nucleus_slots(logits, top, edge, target_ids, temperature)
    scores = softmax_scores(slots, target, lse, entropy_grad, nucleus=True)
    if len(wide):  # none in nearly every chunk of a trained model: no second gradient over V
        rows, ids = logits[wide], target_ids[wide]
        scaled = scaled_logits(rows, temperature)
        target = scaled.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        scaled = scaled.masked_fill(outside_nucleus(rows, edge[wide], ids), float("-inf"))
        whole = softmax_scores(scaled, target, lse[wide], entropy_grad, nucleus=True)
        # out of place: the graph flows to both, and a wide row's slot scores get no gradient
        scores = [part.index_put((wide,), value) for part, value in zip(scores, whole)]
    return [score.view(shape) for score in scores]


def scaled_logits(logits, temperature):
    """logits / temperature in fp32: the logits the engine samples from (x / 1.0 is x: at
    temperature 1 a vocabulary-wide pass saved)."""
    scaled = logits.float()
    return scaled / temperature if temperature != 1.0 else scaled


# `nucleus_edge` looks for the edge among each position's this many likeliest tokens first
NUCLEUS_TOP_K = 256


def nucleus_edge(logits, temperature, top_p):
    """(edge, lse, top, wide) from logits [..., V], without a graph: `edge` [...], the least logit
    the engine's top-p nucleus keeps at each position (in the logits' dtype); `lse` [...], the
    log-sum-exp of the scaled logits (the full softmax's, fp32); `top` [..., K], the indices of
    each position's K = min(NUCLEUS_TOP_K, V) likeliest tokens; `wide` [W], the positions
    (flattened) whose nucleus may reach beyond them. SGLang's rule (sglang/srt/layers/sampler.py,
    top_k_top_p_min_p_sampling_from_probs_torch, the CPU's; a GPU's flashinfer sampler keeps the
    same nucleus up to ties, not read here): in descending probability, a token stays while the
    mass before it is <= top_p. So the nucleus is every token whose logit is at least the edge
    (`outside_nucleus`; tokens tied with the last one kept all stay). A logit, not a probability:
    the mask is then a comparison of stored values, exact wherever it is computed (a compiled
    head's two graphs agree bit for bit), with no exp over the vocabulary.

    Cost: the edge is found among each position's NUCLEUS_TOP_K likeliest tokens (a top-k of the
    logits in their compute dtype, bf16: half the bytes, and the order of the probabilities),
    which holds it wherever they weigh more than top_p, as a trained model's do nearly
    everywhere. `wide` are the positions whose k-th token is kept: their top k hold too little (a
    near-uniform distribution: the edge is beyond them), or a token beyond may tie with the edge.
    They sort their whole row. One host read per call finds them (a nonzero); a checkpointed
    head's recompute reuses the forward's (keep_nucleus_search). Only the logits are read, and no
    vocabulary-wide tensor outlives the call (compiled, nothing of [..., V] crosses its graph
    break but the logits)."""
    with torch.no_grad():
        flat = logits.flatten(0, -2)  # [N, V], in the compute dtype
        lse = scaled_logits(flat, temperature).logsumexp(-1, keepdim=True)  # [N, 1]
        top = flat.topk(min(NUCLEUS_TOP_K, flat.shape[-1]), -1)  # descending
        edge = nucleus_cut(top.values, lse, temperature, top_p)
        # the k-th kept: the top k hold too little (the edge is beyond), or a token beyond may tie
        wide = (top.values[:, -1] >= edge).nonzero().squeeze(-1)
        ordered = flat[wide].sort(-1, descending=True).values  # (none wide: nothing sorted)
        edge[wide] = nucleus_cut(ordered, lse[wide], temperature, top_p)
    shape = logits.shape[:-1]
    return edge.view(shape), lse.view(shape), top.indices.unflatten(0, shape), wide


def nucleus_slots(logits, top, edge, target_ids, temperature):
    """(slots [..., K + 1], target [...]), fp32 with the graph: the scaled logits of
    - slots 0 .. K-1: each position's top k tokens (`top`, from nucleus_edge), at -inf where the
      token is below the edge or is the sampled one (the last slot has it);
    - slot K: its sampled token, never at -inf (as in outside_nucleus: the engine drew it).
    So the finite slots are the nucleus and the sampled token, each once, and `target` is the
    sampled token's scaled logit. Where the nucleus lies inside the top k (a position not
    `wide`), the log-softmax of these K + 1 slots is the whole vocabulary's masked to the nucleus,
    at a fraction of the work: no fp32 copy, mask, exp or gradient over the vocabulary, only a
    gather of K + 1 logits and, backward, its scatter."""
    ids = torch.cat([top, target_ids.unsqueeze(-1)], -1)
    chosen = logits.gather(-1, ids)  # [..., K + 1], in the logits' dtype
    with torch.no_grad():
        in_top = torch.arange(ids.shape[-1], device=ids.device) < ids.shape[-1] - 1
        drop = in_top & ((chosen < edge.unsqueeze(-1)) | (ids == target_ids.unsqueeze(-1)))
    scaled = scaled_logits(chosen, temperature)
    return scaled.masked_fill(drop, float("-inf")), scaled[..., -1]


def nucleus_cut(ordered, lse, temperature, top_p):
    """The least logit kept, per row of `ordered` [N, K], logits in descending order (`lse`
    [N, 1]: their rows' log-sum-exp): the j-th stays while the mass before it, cumsum - p, is
    <= top_p (the first always does)."""
    probs = (scaled_logits(ordered, temperature) - lse).exp()
    kept = ((probs.cumsum(-1) - probs) <= top_p).sum(-1, keepdim=True)
    return ordered.gather(-1, kept.clamp(min=1) - 1).squeeze(-1)


def outside_nucleus(logits, edge, target_ids):
    """[..., V] bool, no graph: True for each token whose logit is below its position's `edge`
    (nucleus_edge), but never for the sampled token (`target_ids`): the engine drew it, and a
    bf16 engine may draw the nucleus's edge a hair differently. Elementwise only (the target
    found by comparing indices, not scattered into the mask), so a compiled head computes it
    inside the kernels that read it (the backward keeps it, one byte a token and entry)."""
    with torch.no_grad():
        vocab = torch.arange(logits.shape[-1], device=logits.device)
        return (logits < edge.unsqueeze(-1)) & (vocab != target_ids.unsqueeze(-1))


def _linear_token_logprobs(
    hidden,
    weight,
    bias,
    target_ids,
    temperature,
    index=None,
    entropy_grad=False,
    top_p=1.0,
    fp32_logits=False,
):
    """One chunk of head_logprobs: the projection (`head_logits`) and token_logprobs, with the
    full softmax's log-probs always (a third value)."""
    return token_logprobs(
        head_logits(hidden if index is None else hidden[index], weight, bias, fp32_logits),
        target_ids,
        temperature,
        entropy_grad,
        top_p,
        full=True,
    )


def head_logits(hidden, weight, bias, fp32_logits=False):
    """The output projection's logits: F.linear, in the compute dtype. With `fp32_logits`
    (model.fp32_head) and a bf16 compute dtype, the same products of bf16 values, summed and kept
    in fp32 (`Fp32Logits`): not rounded to bf16, whose spacing is 1/16 to 1/8 at |logits| of 16
    to 32, larger than what one optimizer step moves them (a reviewer found GSPO's 3e-4 sequence
    clip range cutting a quarter of an on-policy batch's tokens on that noise alone). SGLang
    computes the engine's logits alike when the model's config says enable_lm_head_fp32
    (sglang/srt/layers/logits_processor.py, `_compute_lm_head`)."""
    dtype = compute_dtype(hidden, weight)
    if not fp32_logits or dtype == torch.float32:
        return F.linear(hidden, weight, bias)
    logits = Fp32Logits.apply(hidden.to(dtype), weight.to(dtype))
    return logits if bias is None else logits + bias.to(dtype).float()


def compute_dtype(hidden, weight):
    """The dtype the head's matmul runs in: autocast's (one rank), else the weight's (FSDP2: its
    mixed precision gathered the weight in the compute dtype)."""
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    return weight.dtype


class Fp32Logits(torch.autograd.Function):
    """hidden [N, H] @ weight [V, H].T, both in a 16-bit compute dtype, -> [N, V] fp32 logits:
    each product exact in fp32 and summed there, as the usual matmul does before it rounds its
    output. A GPU runs the 16-bit matmul with an fp32 output (`torch.mm(..., out_dtype=)`, not
    run here: no GPU in this project's tests), a CPU the fp32 matmul of the same values (CPU
    torch has no such kernel). The backward is the 16-bit linear's (as autocast runs it): the
    logits' gradient rounded to the compute dtype, a matmul for each input that needs one (torch
    gives `mm.dtype` no derivative: torch 2.14, "derivative for aten::mm is not implemented")."""

    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.save_for_backward(hidden, weight)
        flat = hidden.reshape(-1, hidden.shape[-1])
        with torch.autocast(flat.device.type, enabled=False):  # it would cast them back
            if flat.is_cuda:
                logits = torch.mm(flat, weight.t(), out_dtype=torch.float32)
            else:
                logits = flat.float() @ weight.float().t()
        return logits.view(*hidden.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        grad = grad.to(hidden.dtype)
        grad_hidden = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:  # (not for a frozen head: LoRA's)
            flat = grad.reshape(-1, grad.shape[-1])
            grad_weight = flat.t() @ hidden.reshape(-1, hidden.shape[-1])
        return grad_hidden, grad_weight


# with top_p < 1 a checkpointed head chunk keeps these ops' outputs from its forward for the
# backward's recompute (`keep_nucleus_search`): the nucleus's top-k (NUCLEUS_TOP_K indices and
# values a token, kept for the whole micro-batch: runtime/estimate.py counts them) and the rows it
# sends to a full sort (a nonzero, read on the host)
NUCLEUS_SEARCH = [torch.ops.aten.topk.default, torch.ops.aten.nonzero.default]


def keep_nucleus_search():
    """Selective checkpointing's (forward, recompute) contexts for a head chunk at top_p < 1
    (torch/utils/checkpoint.py, `create_selective_checkpoint_contexts`; its dispatch modes let
    torch.compile'd code run under them): the forward saves the outputs of the NUCLEUS_SEARCH ops,
    the backward's recompute reads them back instead of running them, and recomputes every other
    op as plain checkpointing does, so the result is the same bit for bit. Why: on an H200 the
    top-k was about half of what top_p adds to the update's kernel time, run twice (RESULTS, run
    11), and the recompute's nonzero stopped the host in the middle of the backward.

    Safe because torch hands the k-th call of an op its k-th saved output, and `nucleus_edge` calls
    each op once, and the rows it sorts and nucleus_scores scores over the whole vocabulary are
    the saved nonzero's: the recompute makes the same calls in the same order. A second topk or
    nonzero (a boolean index, torch.where(mask)) in a chunk must keep that order; an extra call
    in the recompute is torch's error, not a wrong value. Under autocast the weight's cast must
    be the same call too: the backward runs inside the forward's autocast context
    (update.compute_precision spans both), whose cache still holds the cast weight. Outside it, a
    later chunk's recompute would cast it where its forward found it cached, and torch 2.14
    refuses that extra call (tests/test_update_passes.py)."""
    return create_selective_checkpoint_contexts(NUCLEUS_SEARCH)


@functools.cache
def compiled_chunk(fp32_logits=False):
    """`head_logprobs(compiled=True)`'s chunk: `_linear_token_logprobs` as one torch.compile'd
    function (its elementwise passes over the vocabulary fused), shapes dynamic so a new chunk
    length does not recompile; made once per process, compiled at its first call. With
    `fp32_logits` Inductor keeps each cast's rounding (emulate_precision_casts): by default it
    drops a cast down and back up within a graph, so one rank's fp32 weight, cast to bf16 for
    `head_logits`, reached the fp32 matmul unrounded (tested: 0.2 off the bf16 values' products)."""
    options = {"emulate_precision_casts": True} if fp32_logits else None
    return torch.compile(_linear_token_logprobs, dynamic=True, options=options)


def chunk_function(compiled, fp32_logits=False):
    """The per-chunk function head_logprobs runs: `_linear_token_logprobs`, or `compiled_chunk`."""
    return compiled_chunk(fp32_logits) if compiled else _linear_token_logprobs


def head_logprobs(
    hidden,
    weight,
    bias,
    target_ids,
    temperature=1.0,
    chunk_tokens=1024,
    index=None,
    entropy_grad=False,
    top_p=1.0,
    full=False,
    compiled=False,
    fp32_logits=False,
):
    """token_logprobs(F.linear(hidden, weight, bias), ...) without ever holding the [B, T, V]
    logits.

    hidden: [B, T, H], weight: [V, H], target_ids: [B, T] -> (logprobs [B, T], entropy [B, T]),
    fp32 (with `full`, a third: the full softmax's log-probs, no graph). With `index` [N]
    (positions of hidden flattened to [B * T, H]; target_ids [N]): only there, -> ([N], [N]);
    each chunk gathers its positions inside its checkpoint, so no [N, H] copy outlives the
    forward. The output projection runs on about `chunk_tokens` tokens (over the batch) at a
    time, and with autograd each chunk is checkpointed: its logits and their fp32 copies are
    freed after the forward and recomputed in the backward. Peak memory is then a few chunks of
    [chunk_tokens, V], not several full [B, T, V] fp32 tensors (at Qwen's vocabulary 151,936: 0.6
    GB per fp32 copy of 1,024 tokens, against 2.5 GB per copy of a micro-batch of 4 x 1,024). The
    cost: the projection and the chunk's other ops run twice; with top_p < 1 the nucleus's top-k
    and nonzero do not, their outputs kept for the backward (keep_nucleus_search: NUCLEUS_TOP_K
    values and int64 indices a position, ~2.5 KB in bf16, until the micro-batch's backward).
    `compiled` (train.compile): each chunk's work is one torch.compile'd function
    (`chunk_function`). `fp32_logits` (model.fp32_head): the logits summed and kept in fp32
    (`head_logits`).
    """
    # (hidden, positions, targets): chunks of positions, gathered from the flat hidden states
    if index is not None:
        flat, dim = hidden.flatten(0, 1), 0
        chunks = [
            (flat, i, targets)
            for i, targets in zip(index.split(chunk_tokens), target_ids.split(chunk_tokens))
        ]
    else:  # chunks of about chunk_tokens over the batch: views, no copy
        step, dim = max(chunk_tokens // max(hidden.shape[0], 1), 1), 1
        chunks = [
            (h, None, targets)
            for h, targets in zip(hidden.split(step, dim=1), target_ids.split(step, dim=1))
        ]
    function = chunk_function(compiled, fp32_logits)
    if fp32_logits:  # the head's weight cast once for every chunk, as autocast's cache would
        weight = weight.to(compute_dtype(hidden, weight))
    # top_p < 1: the recompute takes the nucleus's search from the forward (keep_nucleus_search)
    kept = {"context_fn": keep_nucleus_search} if top_p < 1 else {}
    outputs = []
    for h, i, targets in chunks:
        args = (h, weight, bias, targets, temperature, i, entropy_grad, top_p, fp32_logits)
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            outputs.append(checkpoint(function, *args, use_reentrant=False, **kept))
        else:
            outputs.append(function(*args))
    logprobs, entropies, full_logprobs = (torch.cat(parts, dim) for parts in zip(*outputs))
    return (logprobs, entropies, full_logprobs) if full else (logprobs, entropies)


def aggregate(per_token, loss_mask, mode, norm_length=1):
    """Reduce a [B, T] per-token loss to a scalar; rows whose mask is all zero count nowhere.

    token-mean: sum / number of trained tokens (DAPO, Yu et al. 2025: long answers weigh more).
    seq-mean-token-sum: mean over sequences of each sequence's token sum.
    seq-mean-token-mean: mean over sequences of each sequence's token mean (original GRPO).
    seq-mean-token-sum-norm: token sum / (sequences * norm_length), a constant length (Dr. GRPO,
    Liu et al. 2025), so no length bias enters through the normaliser.
    A new mode: its branch here, its divisor in `aggregation_count`, its name in LOSS_AGG_MODES.
    """
    mask = loss_mask.to(per_token.dtype)
    token_sum = (per_token * mask).sum(-1)  # [B]
    token_count = mask.sum(-1)  # [B]
    num_seqs = (token_count > 0).sum().clamp(min=1)
    if mode == "token-mean":
        return token_sum.sum() / token_count.sum().clamp(min=1)
    if mode == "seq-mean-token-sum":
        return token_sum.sum() / num_seqs
    if mode == "seq-mean-token-mean":
        return (token_sum / token_count.clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        return token_sum.sum() / (num_seqs * norm_length)
    raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {LOSS_AGG_MODES}")


def aggregation_count(loss_mask, mode):
    """What `aggregate` divides by: trained tokens (token-mean) or surviving sequences (the
    rest), not clamped (a batch with nothing to train counts 0). Weighting micro-batch losses by
    count / total count makes gradient accumulation exact, and with the total summed over ranks,
    so is data parallelism. A new mode names its divisor here too (update.py weights by it)."""
    token_count = loss_mask.sum(-1)  # [B]
    if mode == "token-mean":
        return token_count.sum()
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        return (token_count > 0).sum()
    raise ValueError(f"unknown loss aggregation mode {mode!r}: aggregation_count names no divisor")


def policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    loss_mask,
    clip_eps=0.2,
    agg_mode="token-mean",
    norm_length=1,
    engine_logprobs=None,
    tis_cap=0.0,
    clip_eps_high=None,
    ratio_level="token",
    terms=None,
    ref_logprobs=None,
    kl_estimator="k3",
    entropy=None,
):
    """Clipped surrogate objective of PPO/GRPO with an optional KL penalty to a reference, and
    optional truncated importance sampling for tokens the engine sampled from a different
    distribution.

    The ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]; clip_eps_high > clip_eps is DAPO's
    clip-higher (Yu et al. 2025, sec. 3.1: 0.2 / 0.28), which lets unlikely tokens rise and keeps
    entropy up; None = symmetric. ratio_level="sequence" is GSPO (Zheng et al. 2025, eq. 7): one
    ratio per sequence, the geometric mean of its token ratios, clipped per sequence (with GSPO's
    own small range, ~3e-4/4e-4), defined with seq-mean-token-mean only.

    GSPO with TIS: each token keeps its own TIS weight, multiplying its term of the sequence
    objective (GSPO's token form, eq. 10). TRL's sequence form, one TIS weight per sequence, gives a
    different gradient. This is a choice: truncated importance sampling (Yao et al. 2025) corrects
    each token's sampling mismatch, and the token form keeps that correction per token.

    ratio_level="cispo" is CISPO (MiniMax-M1, Chen et al. 2025, eq. 4-5): every token's term is
    -sg(clip(ratio, 1 - clip_eps, 1 + clip_eps_high)) * A * log pi, so a token whose ratio is
    clipped keeps its gradient (PPO's min zeroes it), only its weight is bounded; defined with
    token-mean.

    `terms` ({name: coefficient}, names from TERMS) adds coefficient x each term's per-token
    values to every token's objective, aggregated like the rest: the KL to the reference (`kl`,
    on `ref_logprobs` with `kl_estimator`), the entropy bonus (`entropy`, on `entropy` carrying
    its graph), and your own.

    logprobs (with grad), old_logprobs, ref_logprobs, engine_logprobs, entropy: [B, T];
    advantages: [B]; loss_mask: [B, T]. Returns (loss, stats): detached clip fractions (all, the
    top's), pi_old -> pi's KL, the reference's KL, importance weights and each extra term's mean
    over trained tokens.
    """
    log_ratio = logprobs - old_logprobs  # [B, T]
    if ratio_level == "sequence":
        if agg_mode != SEQUENCE_RATIO_AGG:
            raise ValueError(
                f"ratio_level='sequence' (GSPO) is defined with {SEQUENCE_RATIO_AGG!r}, not "
                f"{agg_mode!r}"
            )
        # GSPO's token form (eq. 10 there): every token carries sg(s_i) * pi_t / sg(pi_t). Its value
        # is the sequence ratio s_i; its gradient, averaged over the sequence's tokens, is exactly
        # grad s_i.
        mask = loss_mask.to(log_ratio.dtype)
        sequence_log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(
            -1, keepdim=True
        ).clamp(min=1)
        log_ratio = sequence_log_ratio.detach() + logprobs - logprobs.detach()
    elif ratio_level == "cispo" and agg_mode != CISPO_AGG:
        raise ValueError(f"ratio_level='cispo' is defined with {CISPO_AGG!r}, not {agg_mode!r}")
    elif ratio_level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio level {ratio_level!r}; expected one of {RATIO_LEVELS}")
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(-1)  # [B, 1]: every token of a sample shares its outcome advantage
    high = clip_eps if clip_eps_high is None else clip_eps_high
    if ratio_level == "cispo":
        weight = ratio.detach().clamp(1 - clip_eps, 1 + high)
        per_token = -weight * adv * logprobs
        clipped_tokens = (weight != ratio.detach()).float()
    else:
        unclipped = ratio * adv
        clipped = ratio.clamp(1 - clip_eps, 1 + high) * adv
        per_token = -torch.minimum(unclipped, clipped)
        clipped_tokens = (unclipped > clipped).float()
    stats = {
        "clip_frac": aggregate(clipped_tokens, loss_mask, "token-mean").detach(),
        # the top's share (ratio > 1 + clip_eps_high, clip-higher's side); the rest the bottom's
        "clip_frac_high": aggregate(
            clipped_tokens * (ratio.detach() > 1), loss_mask, "token-mean"
        ).detach(),
        # mean log(pi_old / pi) over the trained tokens (verl's ppo_kl): how far the update's
        # earlier minibatches moved pi from pi_old; 0 in the first
        "ppo_kl": aggregate(-log_ratio.detach(), loss_mask, "token-mean"),
    }
    if engine_logprobs is not None:
        # The engine sampled from mu, not from pi_old (other kernels and precision; an older weight
        # version once generations resume across steps). Truncated importance sampling (Yao et al.
        # 2025, "Your efficient RL framework secretly brings you off-policy RL training") weights
        # each token's surrogate by min(pi_old / mu, C): a constant, so PPO's clip still acts on pi
        # / pi_old alone.
        if tis_cap < 1:
            raise ValueError(f"tis_cap={tis_cap}: a cap below 1 would down-weight on-policy tokens")
        log_weight = (old_logprobs - engine_logprobs).detach()  # [B, T]
        # capped before exp: never inf
        tis_weight = torch.exp(log_weight.clamp(max=math.log(tis_cap)))
        per_token = per_token * tis_weight
        stats["tis_weight"] = aggregate(tis_weight, loss_mask, "token-mean")
        stats["tis_capped_frac"] = aggregate(
            (log_weight > math.log(tis_cap)).float(), loss_mask, "token-mean"
        )
    if ref_logprobs is not None:  # a reference in the loss (train.kl_in: loss)
        kl = kl_estimate(logprobs.detach(), ref_logprobs, kl_estimator)
        stats["kl"] = aggregate(kl, loss_mask, "token-mean")
    inputs = dict(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        engine_logprobs=engine_logprobs,
        ref_logprobs=ref_logprobs,
        entropy=entropy,
        advantages=adv,  # [B, 1]
        loss_mask=loss_mask,
        kl_estimator=kl_estimator,
        norm_length=norm_length,
    )
    for name, coef in (terms or {}).items():
        values = TERMS[name](inputs)  # [B, T] (a term may return [B, 1]: broadcast)
        # a [B] or a scalar would broadcast silently (along T where B == T): named instead
        if not (
            torch.is_tensor(values)
            and values.dim() == 2
            and values.shape[0] == len(per_token)
            and values.shape[1] in (1, per_token.shape[1])
        ):
            raise ValueError(
                f"loss term {name!r} returned {tuple(getattr(values, 'shape', ()))}: a term "
                f"returns per-token values [B, T] = {tuple(per_token.shape)}, or [B, 1]"
            )
        per_token = per_token + coef * values
        if name != "kl":
            values = values.detach().expand_as(per_token)
            stats[f"term_{name}"] = aggregate(values, loss_mask, "token-mean")
    return aggregate(per_token, loss_mask, agg_mode, norm_length), stats
