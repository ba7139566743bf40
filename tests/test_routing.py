"""Rollout routing replay (train.routing_replay, runtime/routing.py) in the trainer, on small random
mixtures of experts (no engine): replaying a model's own choice changes nothing, bit for bit, in
each family ROUTERS knows; a replayed choice is the one the experts compute with, its gates are
the trainer's router's (which trains), also through gradient checkpointing's recompute; routes
sit where the model reads each token, packed and padded; a dense model is refused. The engine's
routes reach the update in tests/test_own_task.py's countdown run (a Qwen3 MoE)."""

import array
import dataclasses

import pytest
import torch
import transformers

from conftest import tiny_config
import merge
import runtime.model as model
import runtime.routing as routing
import update
import qwen_tiny
from sample import Sample

# the suite's small shape (tests/qwen_tiny.py, as bench/families.py builds other families)
SMALL = qwen_tiny.SHAPE | dict(vocab_size=64, num_experts_per_tok=2, tie_word_embeddings=False)
FAMILIES = {  # config class, its own fields: 4 experts, 2 a token
    # renormalised, as Qwen3-30B-A3B
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=4, moe_intermediate_size=16, norm_topk_prob=True),
    ),
    # no renormalisation (norm_topk_prob false, its default) and a shared expert
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16),
    ),
    "olmoe": ("OlmoeConfig", dict(num_experts=4)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4)),
}


def build(family):
    name, own = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, name)(**SMALL | own)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def own_routes(moe, input_ids):
    """[tokens, layers x top-k] int16: the experts `moe`'s routers choose for `input_ids`."""
    chosen = {}
    hooks = [
        router.register_forward_hook(lambda m, a, out, i=i: chosen.__setitem__(i, out[2]))
        for i, router in routing.routers(moe)
    ]
    with torch.no_grad():
        moe(input_ids=input_ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    return torch.cat([chosen[i] for i in sorted(chosen)], dim=-1).to(torch.int16)


def loss_and_grads(moe, input_ids, replay=None, routes=None):
    """The summed log-softmax of the next tokens and every parameter's gradient, with `routes`
    replayed (forward and backward inside the replay, as the update runs them)."""
    moe.zero_grad()
    batch = {} if routes is None else {"routes": routes}
    context = replay.replaying(batch) if replay else torch.enable_grad()
    with context:
        logits = moe(input_ids=input_ids, use_cache=False).logits
        value = logits[:, :-1].log_softmax(-1).gather(-1, input_ids[:, 1:, None]).sum()
        value.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in moe.named_parameters()}


def test_every_known_router_has_a_family_here():
    """A router added to ROUTERS needs a family in FAMILIES, which the exactness test below
    replays (its gates must be its router's, bit for bit)."""
    built = {type(router).__name__ for f in FAMILIES for _, router in routing.routers(build(f))}
    assert built == set(routing.ROUTERS)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_replaying_a_models_own_routes_changes_nothing(family, bf16):
    """Replaying the experts a model's routers choose gives its logits and every gradient bit
    for bit (in fp32 and under bf16 autocast, whose logits are bf16): each family's gates are
    computed as its router computes them, and replay agrees everywhere."""
    moe = build(family)
    input_ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    replay = routing.RouteReplay(moe, on=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        routes = own_routes(moe, input_ids)
        plain = loss_and_grads(moe, input_ids)
        replayed = loss_and_grads(moe, input_ids, replay, routes)
    assert torch.equal(plain[0], replayed[0])
    assert all(torch.equal(plain[1][n], replayed[1][n]) for n in plain[1])
    share, replayed_count = replay.agreement()
    assert (float(share), int(replayed_count)) == (1.0, 24 * 2)  # 24 tokens, 2 layers


def test_replayed_experts_compute_and_the_router_trains_also_through_checkpointing():
    """Routes other than the router's own (each expert id moved by one): the experts compute
    with exactly those, each gate is the router's softmax at them renormalised, the trainer's own
    choice agrees nowhere, the router's weight gets a gradient, and gradient checkpointing's
    recompute (inside the replay) gives the same gradients as keeping the activations."""
    moe = build("qwen3_moe")
    input_ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(2))
    moved = (own_routes(moe, input_ids) + 1) % 4
    seen = {}
    block = moe.model.layers[1].mlp
    block.experts.register_forward_hook(lambda m, args, out: seen.update(args=args))
    block.gate.register_forward_hook(lambda m, args, out: seen.update(logits=out[0]))
    replay = routing.RouteReplay(moe, on=True)
    logits, grads = loss_and_grads(moe, input_ids, replay, moved)
    _, experts, gates = seen["args"]
    assert torch.equal(experts, moved[:, 2:4].long())
    probs = seen["logits"].softmax(-1).gather(-1, experts)
    assert torch.allclose(gates, probs / probs.sum(-1, keepdim=True), atol=1e-6)
    assert float(replay.agreement()[0]) == 0.0
    assert not torch.equal(logits, loss_and_grads(moe, input_ids)[0])
    assert grads["model.layers.1.mlp.gate.weight"].abs().sum() > 0
    moe.gradient_checkpointing_enable()
    moe.train()  # transformers recomputes only in train mode
    _, recomputed = loss_and_grads(moe, input_ids, replay, moved)
    assert all(torch.allclose(grads[n], recomputed[n], atol=1e-6) for n in grads)


def test_a_choice_no_router_makes_is_refused_and_counted():
    """Routes no router could choose: all zeros (what SGLang's zeroed capture buffer holds when
    its MoE backend skips the capture), an expert id past the layer's, one id twice. Each such
    token x layer choice is routed by the trainer's router instead (the forward is the model's
    own, bit for bit) and counted in `refused`; a possible choice beside them is replayed."""
    moe = build("qwen3_moe")
    input_ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(2))
    own = own_routes(moe, input_ids)
    replay = routing.RouteReplay(moe, on=True)
    unreplayed, _ = loss_and_grads(moe, input_ids)
    impossible = torch.zeros_like(own)  # every token, every layer: experts 0, 0
    impossible[1::3] = 4  # 4 experts: ids 0-3
    impossible[2::3] = torch.tensor([3, 3], dtype=torch.int16).repeat(own.shape[1] // 2)
    logits, _ = loss_and_grads(moe, input_ids, replay, impossible)
    assert torch.equal(logits, unreplayed)
    share, sent = replay.refused()
    assert float(share) == 1.0 and int(sent) == own.numel() // 2  # token x layer choices
    assert int(replay.agreement()[1]) == 0  # nothing replayed
    mixed = impossible.clone()
    mixed[:5] = (own[:5] + 1) % 4  # possible, and not the router's own choice
    logits, _ = loss_and_grads(moe, input_ids, replay, mixed)
    assert not torch.equal(logits, unreplayed)
    assert float(replay.refused()[0]) == 0.5 and int(replay.agreement()[1]) == 10


def test_the_update_logs_and_warns_about_refused_routes(tmp_path, caplog):
    """Through update.update_policy: samples whose routes are SGLang's zeroed buffer train on the
    trainer's own routing, with train/routes_refused 1 and a warning naming the likely cause."""
    from assemble import trainer_only
    from conftest import train_on

    moe = build("qwen3_moe")
    cfg = tiny_config(tmp_path, "train.routing_replay=true", "model.compute_dtype=float32")
    trainer = trainer_only(cfg, moe)
    ids = torch.randint(1, 64, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    samples = [routed_sample(moe, ids, 4, group_id=0) for _ in range(2)]
    for sample in samples:
        sample.routed_experts = array.array("h", [0] * len(sample.routed_experts))
    stats = train_on(trainer, samples, torch.tensor([1.0, -1.0]))
    assert stats["train/routes_refused"] == 1.0 and stats["train/unrouted_sequences"] == 0
    assert "name no expert or one twice (its MoE backend did not capture them?)" in caplog.text


def routed_sample(moe, ids, prompt_len, group_id=0):
    """A Sample of `ids` whose routes are `moe`'s own choice for its tokens but the last, as the
    engine returns them."""
    routes = own_routes(moe, torch.tensor([ids]))[:-1]
    return Sample(
        ids[:prompt_len],
        ids[prompt_len:],
        [0.0] * (len(ids) - prompt_len),
        [1] * (len(ids) - prompt_len),
        group_id=group_id,
        routed_experts=array.array("h", routes.flatten().tolist()),
    )


@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_routes_sit_where_the_model_reads_each_token(layout):
    """Three sequences of different lengths, each with its own routing recorded alone: collated
    (padded rows, packed into one row, or packed with their common 3-token prompt computed once,
    train.shared_prefix, by the samples routed alike on it), the trainer's own
    choice agrees with every replayed route and the log-probs are the unreplayed ones; the same
    routes one token off agree far less (what the check would see of a misplaced route). A
    sample without routes, or with routes of another length, is counted and routes itself."""
    moe = build("qwen3_moe")
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (7, 11, 5)]
    if layout == "shared":
        seqs = [seqs[0][:3] + ids[3:] for ids in seqs]
    samples = [routed_sample(moe, ids, 3) for ids in seqs]
    samples.append(Sample(seqs[0][:3], seqs[0][3:], [0.0] * 4, [1] * 4, group_id=0))
    cut = samples[0].routed_experts[:-4]  # a token short (2 layers x 2 experts): not placed
    samples.append(dataclasses.replace(samples[0], routed_experts=cut))
    rows = None if layout == "padded" else [len(samples)]
    replay = routing.RouteReplay(moe, on=True)
    mb = update.collate(samples, 0, rows, replay.width, shared_prefix=layout == "shared")
    assert int(mb["unrouted"]) == 2 and ("prefix_of" in mb) == (layout == "shared")
    with torch.no_grad():
        plain = update.sequence_logprobs(moe, mb, 1.0)[0]
        with replay.replaying(mb):
            replayed = update.sequence_logprobs(moe, mb, 1.0)[0]
    share, count = replay.agreement()
    routed = sum(n - 1 for n in map(len, seqs))
    if layout == "shared":  # the prompt's 2 routed tokens once, not three times
        routed -= 2 * 2
        # a sample without routes computes its prompt apart (7 tokens) and routes itself; the
        # routed ones still compute theirs once (2 of its tokens saved twice)
        led = update.collate([samples[3], *samples[:3]], 0, [4], replay.width, shared_prefix=True)
        assert (led["routes"][:7] == routing.NO_ROUTE).all() and int(led["unrouted"]) == 1
        assert (led["routes"][7:9] != routing.NO_ROUTE).all()
        assert int(led["shared_prefix_tokens"]) == 2 * 2
    assert int(count) == 2 * routed and float(share) == 1.0  # 2 layers
    assert torch.equal(plain, replayed)
    shifted = dict(mb, routes=torch.roll(mb["routes"], 1, dims=0))
    with torch.no_grad(), replay.replaying(shifted):
        update.sequence_logprobs(moe, shifted, 1.0)
    assert float(replay.agreement()[0]) < 0.5  # 0.15 here


def test_a_prompt_routed_otherwise_is_not_shared():
    """train.shared_prefix computes a group's prompt once, so replays one routing of it: a member
    whose prompt was routed otherwise (a held group's member resumed under newer weights is
    prefilled, so routed, anew) computes its prompt apart, under its own routes; members routed
    alike still share it. (It took the first member's routes.)"""
    moe = build("qwen3_moe")
    ids = torch.randint(1, 64, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    a, b, c = (routed_sample(moe, ids[:4] + ids[4 + k :], 4) for k in range(3))
    b.routed_experts[:4] = array.array("h", [(e + 1) % 4 for e in b.routed_experts[:4]])
    samples = [a, c, b]
    assert update.prefix_units(samples, 100) == [[0, 1], [2]]
    replay = routing.RouteReplay(moe, on=True)
    mb = update.collate(samples, 0, [3], replay.width, shared_prefix=True)
    assert int(mb["shared_prefix_tokens"]) == 3  # a's and c's prompt, less its last token, once
    # b's segment, whole and last in the row: its own routes at its prompt's first token
    start = mb["routes"].shape[0] - len(b.prompt_ids + b.response_ids)
    assert mb["routes"][start].tolist() == list(b.routed_experts[:4])


def test_a_merged_or_resumed_sequence_takes_the_routes_of_its_last_request():
    """Two turns with a tool observation between: the merged sequence carries the second turn's
    routes (that request's prompt held the first turn and the observation), and they sit on its
    tokens; a continuation (partial rollout) carries its own, which cover the resumed tokens."""
    moe = build("qwen3_moe")
    ids = torch.randint(1, 64, (16,), generator=torch.Generator().manual_seed(4)).tolist()
    first = routed_sample(moe, ids[:9], 4)  # prompt 4, response 5
    second = routed_sample(moe, ids, 11)  # prompt: turn one, an observation of 2; response 5
    second.turn = 1
    (merged,), _ = merge.merge_trajectory([first, second], max_seq_len=64)
    assert merged.routed_experts == second.routed_experts
    # a continuation: the resumed request's prompt is the first's whole sequence
    more = routed_sample(moe, ids[:9] + ids[11:], 9)
    continued = first.continued_by(more)
    assert continued.routed_experts == more.routed_experts
    nothing = routing.RouteReplay(moe, on=True)  # no forward yet: 0 and 0, a rank's share of none
    assert [float(value) for value in nothing.agreement()] == [0.0, 0.0]
    replay = routing.RouteReplay(moe, on=True)
    for sequence, routed in ((merged, 15), (continued, 13)):  # every token but the last
        mb = update.collate([sequence], 0, [1], replay.width)
        with torch.no_grad(), replay.replaying(mb):
            update.sequence_logprobs(moe, mb, 1.0)
        assert int(mb["unrouted"]) == 0
        assert [float(value) for value in replay.agreement()] == [1.0, 2 * routed]


def test_routes_survive_a_checkpoint_of_their_sample():
    """A sample's routes, and a sample without, as partial rollout's checkpoint writes them (read
    back with weights_only) and back."""
    import io

    for routes in ([0, 3, -1, 2], []):
        sample = Sample([1, 2], [3, 4], [0.0, 0.0], [1, 1], group_id=0, routed_experts=routes)
        buffer = io.BytesIO()
        torch.save(sample.to_state(), buffer)
        buffer.seek(0)
        assert Sample.from_state(torch.load(buffer, weights_only=True)) == sample


def test_routing_replay_on_a_dense_model_is_refused(tmp_path):
    """train.routing_replay with the demo's dense Qwen2: refused at setup, naming what it
    replays through."""
    cfg = tiny_config(tmp_path, "train.routing_replay=true")
    with pytest.raises(model.ModelError, match=r"routing_replay .* none \(a dense model\)"):
        model.build_policy(cfg, None)
