"""The update computes nothing twice, and each saving keeps the result (to fp32 rounding, or
bit for bit where said): pi_old from the update's own forward
(one minibatch) against a forward of its own; the top-p nucleus and the full softmax from one head
pass; autocast casting each weight once per optimizer step; train.compile against eager. On CPU,
with the tiny Qwen2 (no engine)."""

import contextlib
import copy
import dataclasses
import json
import logging
import math
import os

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import dist_worker
import loss as losses
import runtime.model as model
import assemble as setup_run
import update
from config import ConfigError
from conftest import train_on
from test_packing import random_samples

PATHS = {
    "packed": ["train.max_tokens_per_micro_batch=40"],
    "padded": ["train.max_tokens_per_micro_batch=0", "train.micro_batch_size=3"],
}
# top-p moves the engine's log-probs onto the nucleus; TIS and partial rollout's stale tokens read
# pi_old; the KL reference keeps its own forward; the entropy bonus differentiates the entropy
EXTRAS = {
    "plain": [],
    "top_p_tis": ["rollout.top_p=0.8", "train.tis_cap=2.0"],
    "kl_entropy": [
        "train.kl_coef=0.1",
        "train.entropy_coef=0.01",
        "train.loss_agg=seq-mean-token-mean",
    ],
}


def update_with_gradients(trainer, samples, advantages):
    """(stats, {name: gradient}) of one update_policy: the gradients as the optimizer read them."""
    grads = {}
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p, n=n: grads.__setitem__(n, p.grad.clone()))
        for n, p in trainer.policy.named_parameters()
    ]
    stats = train_on(trainer, samples, advantages)
    for hook in hooks:
        hook.remove()
    return stats, grads


def one_update(tmp_path, sets, source=None, monkeypatch=None):
    """(stats, {name: gradient}) of one update of the seeded tiny policy on random_samples(3)
    (tokens 0-2 versions old, aborted rows, a 1-token response), pi_old from `source` if given."""
    cfg = dist_worker.parity_config(tmp_path, "token-mean", *sets)
    policy, _ = model.build_policy(cfg, None)
    reference = None
    if cfg.train.kl_coef:
        reference = model.build_policy(cfg, None)[0].requires_grad_(False).eval()
    trainer = setup_run.trainer_only(cfg, policy, reference=reference)
    if source:
        monkeypatch.setattr(update, "pi_old_source", lambda trainer, step: source)
    return update_with_gradients(trainer, *random_samples(3))


@pytest.mark.parametrize("lora", [[], ["model.lora_rank=4", "train.num_minibatches=2"]])
@pytest.mark.parametrize("extra", EXTRAS)
def test_an_update_draws_nothing_at_random(tmp_path, extra, lora):
    """Checkpoints hold no RNG state (runtime/checkpoint.py): an update leaves torch's global CPU
    RNG as it found it, with full weights and with LoRA, so nothing a checkpoint would have to
    hold is drawn (LoRA dropout drew from it: config.RETIRED). A guard for what a fork adds: it
    passes on the code before too, where dropout was off by default."""
    cfg = dist_worker.parity_config(tmp_path, "token-mean", *PATHS["packed"], *EXTRAS[extra], *lora)
    policy = model.build_policy(cfg, None)[0]
    reference = model.build_reference(cfg, policy)
    trainer = setup_run.trainer_only(cfg, policy, reference=reference)
    before = torch.get_rng_state()
    train_on(trainer, *random_samples(3))
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("extra", EXTRAS)
@pytest.mark.parametrize("path", PATHS)
def test_pi_old_from_the_update_forward_equals_a_forward_of_its_own(
    tmp_path, monkeypatch, path, extra
):
    """With one minibatch, pi_old taken from the update's own forward (detached) gives the loss,
    gradients and every statistic (the log-prob gap, TIS and staleness weights, clip fraction,
    entropy, KL) of the two-forward path, whatever the layout and the loss terms."""
    sets = PATHS[path] + EXTRAS[extra]
    cfg = dist_worker.parity_config(tmp_path, "token-mean", *sets)
    reference = model.build_policy(cfg, None)[0] if cfg.train.kl_coef else None
    trainer = setup_run.trainer_only(cfg, model.build_policy(cfg, None)[0], reference=reference)
    assert update.pi_old_source(trainer, step=0) == "detached"
    one, one_grads = one_update(tmp_path, sets)
    two, two_grads = one_update(tmp_path, sets, source="recomputed", monkeypatch=monkeypatch)
    assert one.keys() == two.keys() and "train/logprob_gap" in one
    for key in one:
        assert one[key] == pytest.approx(two[key], rel=1e-6, abs=1e-9), key
    assert one_grads.keys() == two_grads.keys()
    torch.testing.assert_close(one_grads, two_grads, rtol=1e-6, atol=1e-9)


def test_several_minibatches_keep_a_forward_for_pi_old(tmp_path):
    """pi_old_source: a forward of its own with several minibatches (later ones need the weights
    from before the first step), the engine's with old_logprobs=engine past the first step."""
    cfg = dist_worker.parity_config(tmp_path, "token-mean", "train.num_minibatches=2")
    trainer = setup_run.trainer_only(cfg, model.build_policy(cfg, None)[0])
    assert update.pi_old_source(trainer, step=0) == "recomputed"
    cfg = dist_worker.parity_config(tmp_path, "token-mean", "train.old_logprobs=engine")
    trainer = setup_run.trainer_only(cfg, model.build_policy(cfg, None)[0])
    assert update.pi_old_source(trainer, step=0) == "detached"  # the first step checks the gap
    assert update.pi_old_source(trainer, step=1) == "engine"


def test_a_minibatch_with_no_trained_token_leaves_the_weights_alone(tmp_path, caplog):
    """After a real update (AdamW holds momentum), an update whose samples are all masked, and
    minibatches beyond the sequences (4 minibatches of 2 sequences), take no optimizer step: their
    gradient is 0, yet AdamW's step would move every weight by its momentum and decay. The
    learning-rate schedule still advances a slot for each (it counts steps x num_minibatches;
    a reviewer found no test pinning it)."""
    cfg = dist_worker.parity_config(tmp_path, "token-mean", "train.weight_decay=0.1")
    trainer = setup_run.trainer_only(cfg, model.build_policy(cfg, None)[0])
    samples, advantages = random_samples(3)
    train_on(trainer, samples, advantages)
    weights = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    masked = [dataclasses.replace(s, masked=True) for s in samples]
    with caplog.at_level(logging.INFO, logger="update"):
        stats = train_on(trainer, masked, advantages)
    assert stats["train/loss"] == 0 and stats["train/skipped_updates"] == 0
    for name, p in trainer.policy.named_parameters():
        assert torch.equal(weights[name], p), name
    assert "optimizer step skipped" in caplog.text
    assert trainer.scheduler.last_epoch == 2  # the real update's slot and the skipped one's
    cfg = dist_worker.parity_config(tmp_path, "token-mean", "train.num_minibatches=4")
    trainer = setup_run.trainer_only(cfg, model.build_policy(cfg, None)[0])
    steps = []
    trainer.optimizer.register_step_post_hook(lambda *args: steps.append(1))
    stats = train_on(trainer, samples[:2], advantages[:2])
    assert len(steps) == 2  # one per minibatch that holds a sequence
    assert trainer.scheduler.last_epoch == 4  # and a slot for each of the 4
    # the logged loss and norm are means over the 2 that trained, as 2 minibatches give: the
    # empty ones' 0 had halved both (a reviewer's)
    cfg = dist_worker.parity_config(tmp_path, "token-mean", "train.num_minibatches=2")
    trainer = setup_run.trainer_only(cfg, model.build_policy(cfg, None)[0])
    two = train_on(trainer, samples[:2], advantages[:2])
    for key in ("train/loss", "train/grad_norm"):
        assert stats[key] == pytest.approx(two[key], rel=1e-6) and abs(two[key]) > 1e-3, key


def test_minibatches_split_the_samples_evenly(tmp_path):
    """train.num_minibatches slices this rank's samples into sizes that differ by at most one:
    9 in 4 are 2, 2, 2, 3 (slices of ceil(9 / 4) left the last one empty) and 10 are 2, 3, 2, 3
    (the last slice held one sample, which took a whole optimizer step)."""
    sets = ["train.num_minibatches=4", "train.max_tokens_per_micro_batch=0"]
    cfg = dist_worker.parity_config(tmp_path, "token-mean", *sets, "train.micro_batch_size=16")
    samples, _ = random_samples(3)
    for count, sizes in ((9, [2, 2, 2, 3]), (10, [2, 3, 2, 3])):
        minibatches, _ = update.make_minibatches(samples[:count], cfg.train, 0, torch.device("cpu"))
        assert [sum(len(mb["input_ids"]) for mb in m) for m in minibatches] == sizes


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_nucleus_from_the_top_k_equals_a_sort_of_the_vocabulary(top_p, monkeypatch):
    """loss.nucleus_edge finds the edge among the NUCLEUS_TOP_K likeliest tokens where they hold
    more than top_p, else by sorting the row: both give the nucleus of the whole sorted vocabulary
    (SGLang's rule), on peaked and flat rows alike; the full softmax's log-probs come from the
    same pass."""
    torch.manual_seed(0)
    vocab = 600
    # peaked rows (their top 8 hold most of the mass) and near-uniform ones (the sort's case)
    logits = torch.cat([torch.randn(5, 7, vocab) * 4, torch.randn(5, 7, vocab) * 0.1])
    targets = torch.randint(0, vocab, (10, 7))
    monkeypatch.setattr(losses, "NUCLEUS_TOP_K", 8)
    probs = logits.softmax(-1)
    ordered, order = probs.sort(-1, descending=True)
    dropped = torch.empty_like(ordered, dtype=torch.bool).scatter_(
        -1, order, ordered.cumsum(-1) - ordered > top_p
    )
    dropped.scatter_(-1, targets.unsqueeze(-1), False)
    expected = logits.masked_fill(dropped, float("-inf"))
    edge, _, _, wide = losses.nucleus_edge(logits, 1.0, top_p)
    assert torch.equal(losses.outside_nucleus(logits, edge, targets), dropped)
    want = expected.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    want_full = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
    # the flat rows (35 of 70) sort theirs and are scored over the whole vocabulary; at top_p 0.3
    # and 0.9 some peaked ones from their top k's slots, in the same call (at 0.999 their top 8
    # hold too little); all rows, and the peaked rows alone
    assert len(wide) >= 35 and (len(wide) < 70) == (top_p < 0.99)
    for rows in (slice(None), slice(0, 5)):
        scored = losses.token_logprobs(logits[rows], targets[rows], top_p=top_p, full=True)
        torch.testing.assert_close(scored[0], want[rows])
        torch.testing.assert_close(scored[2], want_full[rows])


def test_nucleus_ranked_by_bf16_logits_equals_a_sort_with_the_same_gradient(monkeypatch):
    """token_logprobs at top_p < 1 on bf16 logits (ties among them: bf16 has few values) and a
    temperature: the nucleus, whose top-k ranks the bf16 logits (`nucleus_edge`), is the sorted
    vocabulary's over the scaled fp32 ones (every token tied with the last one kept stays), and
    the log-probs and their gradient are those of the sorted nucleus's log-softmax, on peaked and
    flat rows, with the top-k and the sort alike."""
    torch.manual_seed(1)
    vocab = 512
    temperature = 0.7  # scaled = logits / temperature: the top-k still ranks the bf16 logits
    top_p = 0.9
    rows = torch.cat([torch.randn(4, 6, vocab) * 4, torch.randn(4, 6, vocab) * 0.1])
    logits = rows.round(decimals=1).bfloat16().requires_grad_()  # many equal values
    targets = torch.randint(0, vocab, (8, 6))
    monkeypatch.setattr(losses, "NUCLEUS_TOP_K", 16)
    scaled = logits.detach().float() / temperature
    probs = (scaled - scaled.logsumexp(-1, keepdim=True)).exp()
    ordered = probs.sort(-1, descending=True).values
    kept = ((ordered.cumsum(-1) - ordered) <= top_p).sum(-1, keepdim=True)
    dropped = probs < ordered.gather(-1, kept - 1)  # tokens tied with the last one kept all stay
    dropped.scatter_(-1, targets.unsqueeze(-1), False)
    reference = logits.float() / temperature
    want = reference.masked_fill(dropped, float("-inf")).log_softmax(-1)
    want = want.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert 0 < dropped.float().mean() < 1
    edge, _, _, wide = losses.nucleus_edge(logits.detach(), temperature, top_p)
    assert torch.equal(losses.outside_nucleus(logits.detach(), edge, targets), dropped)
    # all rows (the flat ones over the whole vocabulary), and the peaked ones alone (all from
    # their top k's slots)
    assert 0 < len(wide) < 48 and len(losses.nucleus_edge(logits[:4], temperature, top_p)[3]) == 0
    for rows in (slice(None), slice(0, 4)):
        (want_grad,) = torch.autograd.grad(want[rows].sum(), logits, retain_graph=True)
        logprobs, _ = losses.token_logprobs(logits[rows], targets[rows], temperature, top_p=top_p)
        (grad,) = torch.autograd.grad(logprobs.sum(), logits)
        torch.testing.assert_close(logprobs, want[rows])  # to rounding: the sums' order differs
        torch.testing.assert_close(grad, want_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nucleus_inside_the_top_k_is_scored_from_those_tokens_alone(dtype, monkeypatch):
    """Where every position's nucleus lies among its NUCLEUS_TOP_K likeliest tokens,
    token_logprobs scores K + 1 slots (loss.nucleus_slots: the top k and the sampled token), not
    the vocabulary: the log-probs, the entropies and their gradients (an entropy bonus's graph
    too) are the vocabulary's masked to the nucleus, to rounding, with sampled tokens inside the
    nucleus, outside it and outside the top k, at temperature 0.7. A row whose k-th token ties
    with one beyond the top k, both kept, scores the whole vocabulary: its nucleus is K + 1 wide."""
    torch.manual_seed(4)
    vocab, k = 300, 8  # the top k small against the vocabulary
    top_p, temperature = 0.8, 0.7
    monkeypatch.setattr(losses, "NUCLEUS_TOP_K", k)
    logits = (torch.randn(3, 10, vocab) * 5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (3, 10))
    targets[0] = logits.detach()[0].argmax(-1)  # a row of sampled tokens inside the nucleus
    edge, lse, top, wide = losses.nucleus_edge(logits.detach(), temperature, top_p)
    assert len(wide) == 0 and top.shape == (3, 10, k)
    drop = losses.outside_nucleus(logits.detach(), edge, targets)
    assert not drop.gather(-1, targets[..., None]).any() and drop[1:].gather(-1, top[1:]).any()
    for entropy_grad in (False, True):
        masked = (logits.float() / temperature).masked_fill(drop, float("-inf"))
        log_p = masked.log_softmax(-1)
        want = log_p.gather(-1, targets[..., None])[..., 0]
        want_entropy = -(log_p.exp() * log_p.masked_fill(drop, 0)).sum(-1)
        objective = want.sum() + (want_entropy.sum() if entropy_grad else 0)
        (want_grad,) = torch.autograd.grad(objective, logits)
        # no wide row: the whole vocabulary's path does not run (nothing put in place), whose
        # backward would add [rows, vocabulary] buffers to the slots' scatter
        with OpCounter(torch.ops.aten.index_put) as ops:
            logprobs, entropy, full = losses.token_logprobs(
                logits, targets, temperature, entropy_grad, top_p, full=True
            )
        assert ops.calls == {torch.ops.aten.index_put: 0}
        (grad,) = torch.autograd.grad(logprobs.sum() + entropy.sum() * entropy_grad, logits)
        torch.testing.assert_close(logprobs, want)
        torch.testing.assert_close(entropy, want_entropy.detach())
        torch.testing.assert_close(grad, want_grad)
        scaled = logits.detach().float() / temperature
        torch.testing.assert_close(
            full, scaled.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
        )
    # k + 1 equal logits, each 1 / (k + 1) of the mass: at top_p 0.8 the top k hold enough and
    # the k-th is the last one kept, yet the tie rule keeps all k + 1
    tied = torch.full((1, vocab), -10.0).to(dtype)
    tied[0, : k + 1] = 5.0
    assert losses.nucleus_edge(tied, 1.0, 0.8)[3].tolist() == [0]
    logprob = losses.token_logprobs(tied, torch.tensor([0]), top_p=0.8)[0]
    torch.testing.assert_close(logprob, torch.tensor([-math.log(k + 1)]), atol=1e-4, rtol=0)


class OpCounter(TorchDispatchMode):
    """Counts the calls of `ops` (overload packets) that run on a non-empty tensor: an op a
    selective checkpoint reads back from its forward never reaches this mode. Lets
    torch.compile'd code run under it (as SAC's own modes do), whose extern kernels (topk,
    nonzero, sort) dispatch through it."""

    @classmethod
    def ignore_compile_internals(cls):
        return True

    def __init__(self, *ops):
        super().__init__()
        self.ops = ops
        self.calls = dict.fromkeys(ops, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # any overload (sort.default, sort.stable), on some rows (an empty sort is no work)
        if func.overloadpacket in self.calls and args[0].numel():
            self.calls[func.overloadpacket] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("compiled, entropy_grad", [(False, False), (False, True), (True, False)])
def test_the_head_recompute_takes_the_nucleus_search_from_its_forward(
    compiled, entropy_grad, monkeypatch
):
    """At top_p < 1 each checkpointed head chunk runs the nucleus's top-k and nonzero once, in the
    forward, not again in the backward's recompute (loss.keep_nucleus_search), eager (with and
    without an entropy bonus's graph) and compiled (train.compile); its log-probs, entropies and
    gradients are bit for bit those of plain checkpointing, on peaked rows and flat ones (which
    sort their row, in the recompute too); compiled, two more chunk lengths compile nothing. The
    compiled case costs ~10 s on 2 cores: Inductor compiles the chunk's forward and backward."""
    from torch._dynamo.utils import counters
    from torch.utils.checkpoint import noop_context_fn

    torch.manual_seed(2)
    vocab, dim, tokens = 700, 16, 150
    monkeypatch.setattr(losses, "NUCLEUS_TOP_K", 32)
    # the first 100 positions peaked, the last 50 near-uniform (the top 32 hold too little)
    scale = torch.cat([torch.full((1, 100, 1), 4.0), torch.full((1, 50, 1), 0.02)], 1)
    hidden = torch.randn(1, tokens, dim) * scale
    weight = torch.randn(vocab, dim)
    # packed: the trained positions, in 3 chunks of 50 (the first all peaked, scored from the top
    # k's slots; the others with flat rows, the whole vocabulary)
    index = torch.cat([torch.randperm(100)[:50], torch.randperm(tokens)[:70]])
    targets = torch.randint(0, vocab, (120,))
    topk, nonzero = torch.ops.aten.topk, torch.ops.aten.nonzero
    sort = torch.ops.aten.sort  # the flat rows' (not kept: recomputed)
    head = dict(
        temperature=0.8, chunk_tokens=50, top_p=0.9, compiled=compiled, entropy_grad=entropy_grad
    )
    results = {}
    for kept in (True, False):
        if not kept:  # plain checkpointing: the recompute runs the whole chunk again
            monkeypatch.setattr(losses, "keep_nucleus_search", noop_context_fn)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        graphs = counters["stats"]["unique_graphs"]
        with OpCounter(topk, nonzero, sort) as ops:
            logprobs, entropy = losses.head_logprobs(h, w, None, targets, index=index, **head)
            (logprobs.sum() + entropy.sum()).backward()
        # compiled here first (no other test compiles the chunk at NUCLEUS_TOP_K 32), under SAC
        assert (counters["stats"]["unique_graphs"] > graphs) == (compiled and kept)
        results[kept] = (ops.calls, logprobs, entropy, h.grad, w.grad)
        if compiled and kept:  # other chunk lengths compile nothing more (dynamic shapes)
            graphs = counters["stats"]["unique_graphs"]
            for n in (77, 31):
                h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                out = losses.head_logprobs(h, w, None, targets[:n], index=index[:n], **head)
                out[0].sum().backward()
            assert counters["stats"]["unique_graphs"] == graphs
    (calls, *values), (plain_calls, *plain_values) = results[True], results[False]
    # 3 chunks, each in the forward and the recompute, the last two with flat rows to sort
    assert plain_calls == {topk: 6, nonzero: 6, sort: 4}
    assert calls == {topk: 3, nonzero: 3, sort: 4}
    assert values[0].isfinite().all() and (values[3] != 0).any()
    for value, plain in zip(values, plain_values):
        assert torch.equal(value, plain)


def test_compiled_at_top_p_only_the_logits_cross_the_nucleus_graph_break(monkeypatch):
    """Compiled (train.compile), the nucleus's search breaks the head chunk's graph (its nonzero
    is read on the host), and what is alive across a break is written to memory. At top_p < 1 the
    one vocabulary-wide tensor that crosses a break in the forward is the logits, which the
    projection writes anyway (loss.token_logprobs finds the nucleus's edge before it makes their
    fp32 copy); top_p 1 has no break. Inductor's head then gives the eager log-probs, entropies
    and gradients to rounding. Costs ~15 s on 2 cores: Inductor compiles the chunk's pieces."""
    torch.manual_seed(3)
    vocab, dim, tokens = 701, 16, 60
    # dynamo guards this global: a compile of its own, apart from the recompute test's at 32
    monkeypatch.setattr(losses, "NUCLEUS_TOP_K", 24)
    scale = torch.cat([torch.full((1, 40, 1), 4.0), torch.full((1, 20, 1), 0.02)], 1)
    hidden, weight = torch.randn(1, tokens, dim) * scale, torch.randn(vocab, dim)
    targets = torch.randint(0, vocab, (1, tokens))
    # temperature 0.8: the fp32 copy is a new tensor (fp32 logits at 1 would be their own copy)
    temperature = 0.8
    crossing = []  # per graph dynamo hands a backend: its vocabulary-wide outputs

    def example_tensors(nodes):
        """The tensors among the fake values dynamo traced `nodes` with (not sizes or None)."""
        values = [node.meta.get("example_value") for node in nodes if hasattr(node, "meta")]
        return [value for value in values if isinstance(value, torch.Tensor)]

    def record(graph_module, example_inputs):
        """A backend that notes each graph's [..., vocab] outputs that are written out: not
        views of one of its inputs (which cross a break without a copy). Compiled with static
        shapes, so each size is a number (dynamic ones would also hand it SymInts)."""
        graph = graph_module.graph
        storage = lambda value: StorageWeakRef(value.untyped_storage())
        read = {storage(v) for v in example_tensors(graph.find_nodes(op="placeholder"))}
        outputs = example_tensors(graph.find_nodes(op="output")[0].args[0])
        written = [v for v in outputs if storage(v) not in read]
        crossing.append([v.shape for v in written if v.shape[-1:] == (vocab,)])
        return graph_module.forward

    # top_p 0.9 on every row (some flat: the vocabulary masked) and on the peaked rows alone (the
    # top k's slots scored)
    for top_p, rows in ((1.0, tokens), (0.9, tokens), (0.9, 40)):
        crossing.clear()
        chunk = torch.compile(losses._linear_token_logprobs, backend=record, dynamic=False)
        h, w = hidden[:, :rows].clone().requires_grad_(), weight.clone().requires_grad_()
        try:
            chunk(h, w, None, targets[:, :rows], temperature, None, False, top_p)
        finally:
            torch._dynamo.reset()  # nothing compiled for `record` outlives the test
        crossed = [shape for graph in crossing for shape in graph]
        if top_p == 1:
            assert len(crossing) == 1 and crossed == []
        else:  # the projection's output, and nothing else of [tokens, vocab]
            assert len(crossing) > 1, "no graph break at top_p < 1: nothing crosses one"
            assert crossed == [(1, rows, vocab)]
    results = {}
    for compiled in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = losses.head_logprobs(
            h, w, None, targets, temperature, chunk_tokens=25, top_p=0.9, compiled=compiled
        )
        (out[0].sum() + out[1].sum()).backward()
        results[compiled] = (*out, h.grad, w.grad)
    assert results[False][0].isfinite().all()
    torch.testing.assert_close(results[True], results[False], rtol=1e-4, atol=1e-5)


def test_one_rank_bf16_update_at_top_p_keeps_the_nucleus_search_exactly(tmp_path, monkeypatch):
    """The one-rank bf16 update (autocast over fp32 masters) at top_p < 1, packed: the same loss
    and gradients, bit for bit, with the nucleus's search kept for the recompute as without. The
    backward runs inside the update's autocast context (update.compute_precision), whose cast
    cache the recompute finds filled: run outside it, the recompute of a later chunk casts the
    head's weight where its forward did not, and torch 2.14's selective checkpoint refuses the
    extra call ("invocation index ... not found in storage")."""
    from torch.utils.checkpoint import noop_context_fn

    sets = PATHS["packed"] + ["model.compute_dtype=bfloat16", "rollout.top_p=0.8"]
    cfg = dist_worker.parity_config(tmp_path, "token-mean", *sets)
    head_logprobs = losses.head_logprobs  # in chunks of 8 positions: several per micro-batch
    monkeypatch.setattr(
        losses, "head_logprobs", lambda *a, **k: head_logprobs(*a, **k, chunk_tokens=8)
    )
    results = []
    for kept in (True, False):
        if not kept:
            monkeypatch.setattr(losses, "keep_nucleus_search", noop_context_fn)
        policy, _ = model.build_policy(cfg, None)
        trainer = setup_run.trainer_only(cfg, policy, autocast_dtype=torch.bfloat16)
        with OpCounter(torch.ops.aten.topk) as ops:
            results.append(update_with_gradients(trainer, *random_samples(3)))
        results[-1] += (ops.calls[torch.ops.aten.topk],)
    (stats, grads, topk), (plain_stats, plain_grads, plain_topk) = results
    assert stats["train/micro_batches"] >= 3 and stats == plain_stats
    assert plain_topk == 2 * topk > 2 * stats["train/micro_batches"]  # several chunks each
    assert grads.keys() == plain_grads.keys()
    assert all(torch.equal(grads[name], plain_grads[name]) for name in grads)


def test_fp32_head_logits_are_the_bf16_products_summed_in_fp32(tmp_path):
    """model.fp32_head (loss.head_logits): the head's logits are the bf16 values' products summed
    and kept in fp32, as SGLang's enable_lm_head_fp32 computes them, not rounded to bf16 (1/8
    apart near 32); the backward is autocast's bf16 linear's, bit for bit, for the same incoming
    gradient. A reviewer found the bf16 rounding to be most of the log-prob error against a
    float64 twin on a tiny policy with peaked logits, which noise GSPO's 3e-4 clip range cut: with
    fp32_head the error is less than half, and the update trains with it; compiled, the same
    head. (~6 s: Inductor compiles the head's chunk.)"""
    torch.manual_seed(0)
    hidden = (torch.randn(6, 64) * 3).requires_grad_()
    weight = torch.randn(40, 64).requires_grad_()  # an fp32 master, as on one rank
    exact = hidden.bfloat16().double() @ weight.bfloat16().double().t()
    incoming = torch.randn(6, 40)
    grads = {}
    for fp32 in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = losses.head_logits(hidden, weight, None, fp32_logits=fp32)
        assert logits.dtype == (torch.float32 if fp32 else torch.bfloat16)
        error = (logits.double() - exact).abs().max().item()
        assert error < 1e-5 if fp32 else error > 1e-2, error
        grads[fp32] = torch.autograd.grad(logits.float(), (hidden, weight), incoming)
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    # the policy's log-probs against its float64 twin, under the one-rank autocast
    errors = {}
    for fp32 in (False, True):
        sets = ["model.compute_dtype=bfloat16"] + ["model.fp32_head=true"] * fp32
        cfg = dist_worker.parity_config(tmp_path, "token-mean", *sets)
        policy, _ = model.build_policy(cfg, None)
        assert getattr(policy.config, "enable_lm_head_fp32", False) == fp32  # what SGLang reads
        with torch.no_grad():
            policy.model.norm.weight.mul_(30)  # a trained model's peaked logits
        samples, advantages = random_samples(3)
        batch = update.collate(samples, pad_id=0)
        with torch.no_grad():
            reference, _ = update.sequence_logprobs(copy.deepcopy(policy).double(), batch, 1.0)
            logprobs, _ = update.sequence_logprobs(policy, batch, 1.0, torch.bfloat16)
        mask = batch["loss_mask"].bool()
        errors[fp32] = (logprobs.double() - reference)[mask].abs().mean().item()
        if fp32:  # and an update through it, at top_p too (the nucleus search kept)
            cfg = dist_worker.parity_config(tmp_path, "token-mean", *sets, "rollout.top_p=0.8")
            trainer = setup_run.trainer_only(cfg, policy, autocast_dtype=torch.bfloat16)
            stats, gradients = update_with_gradients(trainer, samples, advantages)
            assert math.isfinite(stats["train/loss"]) and gradients
            assert all(torch.isfinite(g).all() for g in gradients.values())
    assert errors[True] < errors[False] / 2, errors
    # compiled (train.compile), the same bit for bit: Inductor's default drops a cast down and back
    # up within a graph, so the fp32 weight reached the matmul unrounded (0.2 off here)
    targets = torch.randint(0, 40, (6,))
    results = []
    for compiled in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            values, _ = losses.head_logprobs(
                hidden[None], weight, None, targets[None], 1.0, chunk_tokens=4, top_p=0.8,
                compiled=compiled, fp32_logits=True,
            )  # fmt: skip
        results.append((values, *torch.autograd.grad(values.sum(), (hidden, weight))))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_fp32_head_is_the_runs_setting_in_every_folder_and_a_resume_may_change_it(tmp_path, caplog):
    """model.fp32_head lives in the model's config (enable_lm_head_fp32), which every folder the
    trainer writes holds and SGLang reads. A reviewer found it only ever set: a run with it off,
    from a folder written with it on, ran fp32 logits anyway, and a resume that changed it left
    the engine (which loads the checkpoint's folder) with the old one. Now the run's setting is
    written either way (said where it turns a folder's off), and the engine is given it whatever
    its folder says. One update casts the head's weight once a micro-batch (a reviewer counted
    two a chunk), and a frozen head (LoRA's) gets no gradient computed."""
    import runtime.checkpoint as checkpoint
    import task.data as tasks

    sets = PATHS["packed"] + ["model.compute_dtype=bfloat16", "model.fp32_head=true"]
    on = dist_worker.parity_config(tmp_path, "token-mean", *sets)
    policy, tokenizer = model.build_policy(on, None)
    run = setup_run.Run(
        on,
        trainer=setup_run.trainer_only(on, policy, autocast_dtype=torch.bfloat16),
        tokenizer=tokenizer,
        stream=tasks.PromptStream([], 0),
    )
    with CastCounter(policy.named_parameters()) as counter:
        stats, _ = update_with_gradients(run.trainer, *random_samples(3))
    head = "model.embed_tokens.weight"  # tied: the head's weight
    assert policy.lm_head.weight is policy.model.embed_tokens.weight
    assert counter.casts[head] == stats["train/micro_batches"] >= 2
    folder = checkpoint.save(str(tmp_path / "run"), 1, run)
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["enable_lm_head_fp32"] is True
    off = dataclasses.replace(on, model=dataclasses.replace(on.model, fp32_head=False))
    with caplog.at_level(logging.WARNING, logger="model"):
        again, _ = model.build_policy(off, folder)
    assert again.config.enable_lm_head_fp32 is False and "says enable_lm_head_fp32" in caplog.text
    # a resume may change it: the engine gets the run's setting whatever its folder says
    # (runtime/engine.py, start_sglang's json_model_override_args), and the change is logged
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert checkpoint.check_resume(folder, off)["step"] == 1
    assert "resume: model.fp32_head=False (the checkpoint had True)" in caplog.text
    # eval serves a checkpoint with the head it trained with, though the run's config.yaml (a
    # later resume's) says otherwise (a reviewer found the latest setting served)
    import argparse

    import extras.eval as evaluation
    from config import config_yaml

    (tmp_path / "run" / "config.yaml").write_text(config_yaml(off))
    args = argparse.Namespace(run=str(tmp_path / "run"), model=None, step=1, set=[])
    assert evaluation.model_folder(args)[0].model.fp32_head is True
    # the engine's override (None: none, the folder decides), on a nested text model's config too
    from runtime.engine import head_override

    assert head_override(folder, None) == {} and head_override(folder, False) == {
        "enable_lm_head_fp32": False
    }
    nested = tmp_path / "nested"
    nested.mkdir()
    (nested / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 8}}))
    assert head_override(str(nested), True)["text_config"] == {"enable_lm_head_fp32": True}
    # a frozen head: no gradient for it
    hidden = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    frozen = torch.randn(40, 64, dtype=torch.bfloat16)
    logits = losses.Fp32Logits.apply(hidden, frozen)
    logits.sum().backward()
    assert hidden.grad is not None and frozen.grad is None


class CastCounter(TorchDispatchMode):
    """Counts the casts of each parameter (by storage) to bfloat16."""

    def __init__(self, params):
        super().__init__()
        self.pointers = {p.data_ptr(): name for name, p in params}
        self.casts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            name = self.pointers.get(args[0].data_ptr())
            if name:
                self.casts[name] = self.casts.get(name, 0) + 1
        return func(*args, **kwargs)


def test_one_rank_bf16_casts_each_weight_once_per_optimizer_step(tmp_path, monkeypatch):
    """One rank under bf16 autocast: each matmul weight is cast once per optimizer step (the
    autocast context spans every micro-batch's forward and backward), not once per micro-batch,
    and the gradients are those of a context per forward, exactly."""
    sets = ["train.max_tokens_per_micro_batch=40", "model.compute_dtype=bfloat16"]
    cfg = dist_worker.parity_config(tmp_path, "token-mean", *sets)
    results = []
    for hoisted in (True, False):
        if not hoisted:  # each forward in its own autocast (sequence_logprobs'), as before
            monkeypatch.setattr(update, "compute_precision", lambda t: contextlib.nullcontext())
        policy, _ = model.build_policy(cfg, None)
        trainer = setup_run.trainer_only(cfg, policy, autocast_dtype=torch.bfloat16)
        samples, advantages = random_samples(3)
        counter = CastCounter(policy.named_parameters())
        with counter:
            stats, grads = update_with_gradients(trainer, samples, advantages)
        results.append((counter.casts, grads, stats["train/micro_batches"]))
    (casts, grads, micro_batches), (casts_before, grads_before, _) = results
    assert micro_batches >= 3
    # every projection's weight and bias, and the tied embedding as the output head
    linear = {
        f"{module_name}.{n}"
        for module_name, module in policy.named_modules()
        if isinstance(module, torch.nn.Linear)
        for n, _ in module.named_parameters()
        if module_name != "lm_head"
    }
    assert set(casts) == linear | {"model.embed_tokens.weight"}
    assert all(count == 1 for count in casts.values()), casts
    assert all(casts_before[n] >= micro_batches for n in casts)
    torch.testing.assert_close(grads, grads_before, rtol=0, atol=0)


def test_compiled_layers_and_head_make_the_eager_update_without_recompiling(tmp_path):
    """train.compile: the update of compiled decoder layers and head equals the eager one (fp32,
    to kernel rounding), the parameter names are unchanged, and after the first update three new
    length mixes compile nothing more (dynamic shapes). Costs ~60 s on 2 cores: Inductor compiles
    a layer's and the head's forward and backward once."""
    from torch._dynamo.utils import counters

    results = {}
    for compiled in (False, True):
        sets = PATHS["packed"] + [f"train.compile={compiled}"]
        cfg = dist_worker.parity_config(tmp_path, "token-mean", *sets)
        trainer = setup_run.trainer_only(cfg, model.build_policy(cfg, None)[0])
        stats, grads = update_with_gradients(trainer, *random_samples(3))
        results[compiled] = (stats["train/loss"], grads)
        if compiled:
            graphs = counters["stats"]["unique_graphs"]
            for seed in (4, 5, 6):
                train_on(trainer, *random_samples(seed))
            assert counters["stats"]["unique_graphs"] == graphs
    (eager_loss, eager), (compiled_loss, compiled) = results[False], results[True]
    scale = max(g.abs().max() for g in eager.values())
    assert compiled.keys() == eager.keys()  # the same parameter names
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-5)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("keep", [True, False])
def test_an_error_inside_an_fsdp2_update_leaves_every_unit_sharded(keep, tmp_path):
    """An exception in a forward inside parallel.gathered_for_update (an out-of-memory error, say)
    leaves its unit in the forward state, where reshard() did nothing while the unit kept its
    parameters gathered: the root and that layer stayed whole (plain tensors, not shards), which a
    caller going on would push or checkpoint. Now every unit is a shard again, and the next
    update runs, with train.fsdp_keep_gathered on or off (off, it returned before cleaning up).
    One gloo rank."""
    import tempfile

    import torch.distributed as dist

    import runtime.parallel as parallel

    own_group = not dist.is_initialized()
    if own_group:
        rendezvous = f"file://{tempfile.mkdtemp(dir=tmp_path)}/rendezvous"
        dist.init_process_group("gloo", init_method=rendezvous, rank=0, world_size=1)
    try:
        cfg = dist_worker.parity_config(tmp_path, "token-mean", *PATHS["packed"])
        policy = parallel.shard(model.build_policy(cfg, None)[0], torch.float32)

        def out_of_memory(module, inputs):
            raise RuntimeError("CUDA out of memory (raised by the test)")

        hook = policy.model.layers[1].mlp.register_forward_pre_hook(out_of_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            with parallel.gathered_for_update(policy, keep):
                policy(torch.tensor([[4, 5, 6, 7]]))
        hook.remove()
        assert all(type(p.data).__name__ == "DTensor" for p in policy.parameters())
        trainer = setup_run.trainer_only(cfg, policy)
        assert math.isfinite(train_on(trainer, *random_samples(3))["train/loss"])
    finally:
        if own_group:
            dist.destroy_process_group()


def test_fsdp_keep_gathered_off_gathers_each_layer_per_micro_batch_for_the_same_update(tmp_path):
    """train.fsdp_keep_gathered=false (for a model whose gathered copy does not fit): a decoder
    layer is a shard again when each micro-batch's forward reaches it, where by default it stays
    gathered from the first micro-batch's; the update is the same, loss and gradients bit for
    bit. One gloo rank, packed micro-batches of <= 40 tokens."""
    import tempfile

    import torch.distributed as dist

    import runtime.parallel as parallel

    own_group = not dist.is_initialized()
    if own_group:
        rendezvous = f"file://{tempfile.mkdtemp(dir=tmp_path)}/rendezvous"
        dist.init_process_group("gloo", init_method=rendezvous, rank=0, world_size=1)
    try:
        results = {}
        for keep in (True, False):
            cfg = dist_worker.parity_config(tmp_path, "token-mean", *PATHS["packed"])
            cfg.train.fsdp_keep_gathered = keep  # after loading: one rank's config refuses it
            policy = parallel.shard(model.build_policy(cfg, None)[0], torch.float32)
            sharded_at_forward = []  # prepended: before FSDP2's own pre-forward gathers the layer
            policy.model.layers[1].register_forward_pre_hook(
                lambda layer, args: sharded_at_forward.append(
                    type(layer.mlp.down_proj.weight).__name__ == "DTensor"
                ),
                prepend=True,
            )
            stats = train_on(setup_run.trainer_only(cfg, policy), *random_samples(6))
            results[keep] = stats["train/loss"], dist_worker.full_grads(policy), sharded_at_forward
        (kept_loss, kept_grads, kept_at), (loss, grads, at) = results[True], results[False]
        assert len(at) >= 2 and at == [True] * len(at)  # gathered again for every micro-batch
        assert kept_at == [True] + [False] * (len(at) - 1)  # gathered once
        assert loss == kept_loss
        assert all(torch.equal(grads[name], kept_grads[name]) for name in kept_grads)
    finally:
        if own_group:
            dist.destroy_process_group()


def test_a_layer_compiled_whole_under_fsdp2_has_a_constant_head_count(tmp_path):
    """Under FSDP2 (one gloo rank, in this process) a decoder layer compiled whole with dynamic
    shapes, as train.compile does on each of N ranks, is traced with `self_attn.head_dim` as the
    constant it is (parallel.as_plain_modules: FSDP2's mark for Dynamo made it a symbol, and
    Inductor's flex_attention lowering failed on the symbolic head count on an H200); the layers
    share their graphs, three more length mixes compile nothing, and the update equals eager
    FSDP2's. The backend is aot_eager (Dynamo and
    AOTAutograd, no Inductor: the tracing is what the mark changed), and it records each graph."""
    import tempfile

    import torch.distributed as dist
    from torch._dynamo.backends.registry import lookup_backend

    import runtime.parallel as parallel

    own_group = not dist.is_initialized()
    if own_group:
        rendezvous = f"file://{tempfile.mkdtemp(dir=tmp_path)}/rendezvous"
        dist.init_process_group("gloo", init_method=rendezvous, rank=0, world_size=1)
    graphs = []

    def recording(graph, example_inputs):
        """Each graph's symbolic inputs and its first reshapes, read before AOTAutograd takes it."""
        inputs = [n for n in graph.graph.nodes if n.op == "placeholder"]
        symbols = [n.name for n in inputs if isinstance(n.meta.get("example_value"), torch.SymInt)]
        shapes = [n.args[1] for n in graph.graph.nodes if n.target == "view"]
        graphs.append((symbols, shapes[:3]))
        return lookup_backend("aot_eager")(graph, example_inputs)

    try:
        results = {}
        for compiled in (False, True):
            cfg = dist_worker.parity_config(tmp_path, "token-mean", *PATHS["packed"])
            policy, _ = model.build_policy(cfg, None)
            if compiled:  # compile_layers' call, with the recording backend
                for layer in policy.model.layers:
                    layer.forward = torch.compile(layer.forward, dynamic=True, backend=recording)
            trainer = setup_run.trainer_only(cfg, parallel.shard(policy, torch.float32))
            stats, grads = update_with_gradients(trainer, *random_samples(3))
            results[compiled] = (
                stats["train/loss"],
                {n: g.full_tensor() for n, g in grads.items()},
            )
            if compiled:
                first = len(graphs)  # a variant per mask layout the micro-batches have
                for seed in (4, 5, 6):
                    train_on(trainer, *random_samples(seed))
        head_dim = policy.model.layers[0].self_attn.head_dim
    finally:
        if own_group:
            dist.destroy_process_group()
    assert len(graphs) == first  # shared by every layer; no new length mix compiles
    for symbols, shapes in graphs:
        assert not [name for name in symbols if name.startswith("l_self_")], symbols
        assert shapes and all(shape[-1] == head_dim for shape in shapes), shapes
    (eager_loss, eager), (compiled_loss, compiled) = results[False], results[True]
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-6)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-7)


def test_the_logged_lr_is_the_one_the_update_used(tmp_path):
    """train/lr is the learning rate of the step's optimizer step, read before the scheduler
    moves on (it was the next step's): with warmup, 1/4 of lr at the first of 4 warmup steps,
    the optimizer's lr then."""
    sets = ["train.warmup_steps=4", "train.lr=1e-3", "train.lr_schedule=constant"]
    cfg = dist_worker.parity_config(tmp_path, "token-mean", *sets)
    trainer = setup_run.trainer_only(cfg, model.build_policy(cfg, None)[0])
    used = trainer.optimizer.param_groups[0]["lr"]
    stats = train_on(trainer, *random_samples(3))
    assert used == pytest.approx(1e-3 / 4) and stats["train/lr"] == pytest.approx(used)
    stats = train_on(trainer, *random_samples(3), step=1)
    assert stats["train/lr"] == pytest.approx(2e-3 / 4)


def test_a_kl_term_without_a_reference_is_refused_at_build(tmp_path):
    """train.kl_coef > 0 (kl_in=loss) for a trainer given no KL reference: named when it is built
    (the update skipped the reference's pass and the loss failed on None, a TypeError)."""
    cfg = dist_worker.parity_config(tmp_path, "token-mean", "train.kl_coef=0.1")
    with pytest.raises(ConfigError, match="train.kl_coef > 0 with train.kl_in=loss needs"):
        setup_run.trainer_only(cfg, model.build_policy(cfg, None)[0])
