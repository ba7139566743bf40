"""Rollout routing replay (R3, `train.routing_replay`): a mixture of experts' routers in the trainer
send each token to the experts the engine sent it to.

Why: engine and trainer compute the router's logits with different kernels (and in bf16), so a
token whose top-k experts nearly tie can go to another expert in each; the trainer then scores a
different network than the one that sampled, and the policy ratio carries that gap. Replaying the
engine's choice removes that part of the gap (the kernels' rounding stays). Only the choice is
replayed: each chosen expert's gate weight is still the trainer's router's softmax at it, so the
router trains (as Megatron's `moe_enable_routing_replay`, verl's and slime's R3 do).

The KL reference routes itself: it is another model, whose routing the engine never saw. Partial
rollout: a sample resumed across steps has its earlier tokens' routes from the engine's prefill of
the resumed request, under the newer weights (each push flushes its cache), not from when they
were sampled; a finished member of a group held across steps keeps routes from older weights.
Their tokens are stale either way (weighted by train.tis_cap or masked by
train.max_token_staleness, where set).

Owns the routers it knows (ROUTERS: each family's gate weights at given experts), the hooks that
replace a router's choice, and how often the trainer's own choice agrees. Does not own where the
routes come from (runtime/engine.py's Engine.request asks SGLang, inflight.Rollout.generate_one puts
them in sample.Sample) nor their layout in a micro-batch (update.route_table: one row per input
token of a top-k slot per decoder layer, SGLang's numbering, dense layers included; a token's row
whole, or NO_ROUTE throughout where the router keeps its own choice).
"""

import contextlib
import functools

import torch

NO_ROUTE = -1  # a token the router routes itself (padding, a sequence's last token, no route)


def softmax_gates(router, logits, experts):
    """Qwen2 MoE, Qwen3 MoE and OLMoE (their TopKRouter.forward in transformers): a softmax over
    every expert in fp32, the chosen experts' shares, renormalised with `norm_topk_prob`, in the
    logits' dtype."""
    gates = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts)
    if router.norm_topk_prob:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return gates.to(logits.dtype)


def mixtral_gates(router, logits, experts):
    """Mixtral (MixtralTopKRouter.forward): always renormalised, kept in fp32."""
    gates = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
    return gates / gates.sum(dim=-1, keepdim=True)


# router class -> its gate weights at given experts; every one returns (logits, gates, experts).
# A family is added here after reading its router's forward: the test replays a model's own
# choice and must get its outputs and gradients bit for bit (tests/test_routing.py)
ROUTERS = {
    "Qwen2MoeTopKRouter": softmax_gates,
    "Qwen3MoeTopKRouter": softmax_gates,
    "OlmoeTopKRouter": softmax_gates,
    "MixtralTopKRouter": mixtral_gates,
}


def routers(model):
    """(decoder layer index, router) of every known router, by layer: SGLang numbers a route's
    layers so (srt/state_capturer/routed_experts.py: one slot per decoder layer, a dense
    layer's left 0)."""
    return [
        (index, module)
        for index, layer in enumerate(model.model.layers)
        for module in layer.modules()
        if type(module).__name__ in ROUTERS
    ]


def router_classes(model):
    """Names of the classes in `model` that look like a router (for the refusal's message)."""
    return sorted(
        {type(m).__name__ for m in model.modules() if "router" in type(m).__name__.lower()}
    )


class RouteReplay:
    """The policy's routers, hooked once when `on`; a forward inside `replaying(batch)` routes
    each token as batch["routes"] says ([tokens, `width`], NO_ROUTE: its own choice). Off, or
    outside `replaying`, the hooks return the router's own output untouched."""

    def __init__(self, model, on):
        self.table = None  # the routes of the forward in progress
        self.counts = {}  # layer -> (tokens replayed, of them the trainer's choice agreed)
        found = routers(model) if on else []
        # the numbers a token's route holds: layers x top-k (0: off)
        self.width = len(model.model.layers) * found[0][1].top_k if found else 0
        self.hooks = [
            router.register_forward_hook(functools.partial(self.hook, index))
            for index, router in found
        ]

    @contextlib.contextmanager
    def replaying(self, batch):
        """Replay batch["routes"] (if it has them) in every forward inside, and in the
        recomputed forwards of gradient checkpointing: enclose the backward too."""
        table = batch.get("routes") if self.hooks else None
        self.table = table if table is not None and table.shape[1] else None  # 0: none came
        self.counts = {}
        try:
            yield self
        finally:
            self.table = None

    # Run eagerly under train.compile: each layer's hook has its own `layer`, which Dynamo would
    # make a constant, compiling the decoder layer once per layer (past its recompile limit, not at
    # all). A break here costs little: transformers' experts break the graph next to it anyway.
    @torch.compiler.disable
    def hook(self, layer, router, args, output):
        if self.table is None:
            return output
        logits, _, own = output
        k = own.shape[-1]
        if self.table.shape != (own.shape[0], self.width):
            raise RuntimeError(
                f"routing replay: routes of shape {tuple(self.table.shape)} for the "
                f"{own.shape[0]} tokens that {type(router).__name__} routes (layer {layer}), "
                f"{self.width} numbers a token"
            )
        # this decoder layer's top-k slot of each token's row (whole, or NO_ROUTE throughout)
        given = self.table[:, layer * k : (layer + 1) * k].long()
        sent = given[:, :1] != NO_ROUTE
        # refused: a choice no router makes, k distinct experts of this layer's. SGLang's capture
        # buffer starts zeroed, and a top-k output format that skips the capture leaves it so
        # (srt/layers/moe/topk.py: TRITON_KERNEL and BYPASSED return before
        # _post_process_topk_ids; state_capturer/base.py): all zeros replayed, every token's
        # experts 0, 0, ... (on a random model, log-probs 6e-3 off, with nothing said)
        ids = given.sort(dim=-1).values
        possible = (ids[:, :1] >= 0) & (ids[:, -1:] < logits.shape[-1])
        possible &= (ids[:, 1:] != ids[:, :-1]).all(dim=-1, keepdim=True)
        replayed = sent & possible
        experts = torch.where(replayed, given, own)
        agree = (experts.sort(dim=-1).values == own.sort(dim=-1).values).all(dim=-1)
        # stored, not added: a recomputed forward (gradient checkpointing) overwrites its own
        self.counts[layer] = (
            replayed.sum(),
            (agree & replayed[:, 0]).sum(),
            sent.sum(),
            (sent & ~possible).sum(),
        )
        return logits, ROUTERS[type(router).__name__](router, logits, experts), experts

    def agreement(self):
        """(the share of replayed token x layer choices the trainer's routers made too, how many
        were replayed) in the last forward inside `replaying`, as tensors (0 and 0 where none
        was): what metrics.TokenMeans.add takes, on every rank alike."""
        return self.share(1, of=0)

    def refused(self):
        """(the share of the engine's token x layer choices refused as no router's: routed by the
        trainer's router instead, how many the engine sent), as `agreement`."""
        return self.share(3, of=2)

    def share(self, part, of):
        """(sum of counts[part] / sum of counts[of], sum of counts[of]) over the layers."""
        zero = torch.zeros((), dtype=torch.long)
        total = sum((c[of] for c in self.counts.values()), zero)
        return sum((c[part] for c in self.counts.values()), zero) / total.clamp(min=1), total
