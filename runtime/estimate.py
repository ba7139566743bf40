"""Per-GPU memory of a config, estimated without a GPU: what each phase of a step holds on one rank
(FSDP2 shards the trainer's fp32 state over the ranks; every rank holds a whole engine), and the
micro-batch token budget that fills the card (`train.max_tokens_per_micro_batch: auto`).

Arithmetic from the model's parameters (counted on its skeleton: `shape_of`) and the config, not a
measurement: the rules of thumb are in the comments, and the activation term is an estimate
(`saved_per_token`'s rule, scaled by the peaks measured on a GPU). bench/estimate_memory.py
prints it; bench/train_step.py --shape sets it beside the measured peak. Owns no state.
"""

import os
from typing import NamedTuple

from runtime import lora

# Public config.json values of the Qwen2 models the shipped configs name (hidden, intermediate,
# layers, attention heads, KV heads, vocab, tied input and output embeddings), for offline use
# (qwen2_config makes each a Qwen2Config; any other model.path is read from its config.json).
KNOWN_SHAPES = {
    "Qwen/Qwen2.5-1.5B-Instruct": (1536, 8960, 28, 12, 2, 151_936, True),
    "Qwen/Qwen2.5-3B-Instruct": (2048, 11008, 36, 16, 2, 151_936, True),
    "Qwen/Qwen2.5-7B-Instruct": (3584, 18944, 28, 28, 4, 152_064, False),
}
CONTEXT_GIB = 1.0  # CUDA context + NCCL buffers of the trainer process, and again of the engine's
# the engine's captured decode graphs (released with the "cuda_graph" tag: runtime/engine.py sets
# SGLANG_MEMORY_SAVER_CUDA_GRAPH=1, without which SGLang captures them outside the releasable
# region)
CUDA_GRAPH_GIB = 2.0
# The activations measured against the rule of thumb below (bf16 on an H200, torch 2.11: RESULTS.md,
# "The update at the GPU's speed"): eager layers held 1.13-1.14x it (Qwen2.5-1.5B at 4,096 tokens
# one rank, and at 32,768 under FSDP2), compiled ones 0.62-0.72x (1.5B at 32,768 tokens, 3B at
# 14,336; and under FSDP2 on one rank, 1.5B at 47,104 and 3B at 20,480, within 1%): Inductor
# recomputes elementwise results in the backward instead of saving them. Keyed by whether the
# layers are compiled.
ACTIVATION_FACTOR = {False: 1.13, True: 0.70}
# Compiled layers with LoRA adapters held 0.84x (Qwen2.5-7B, rank 64 on every projection, 15,756
# tokens; two runs, the same peak): 0.70 had the estimate 13% short. Fitted on that one arm, its
# cause not measured; eager layers with adapters not measured (taken as eager's).
LORA_COMPILED_FACTOR = 0.84
CHUNK_TOKENS = 1024  # loss.head_logprobs' chunk_tokens default (a stage: not imported here)
NUCLEUS_TOP_K = 256  # loss.NUCLEUS_TOP_K (the same; not imported either)
H100_80GB_GIB = 79.2  # what torch.cuda.mem_get_info reports as the total of an "80 GB" H100


class Shape(NamedTuple):
    """What the estimate reads of a model, counted on its skeleton (`shape_of`)."""

    hidden: int
    layers: int
    vocab: int
    kv_per_token: int  # K and V values one token holds in the engine's cache, all layers
    saved: tuple  # values the activation rule saves per token in each decoder layer
    params: int  # every parameter (a tied output head counted once)
    numels: dict  # {parameter name: elements}: what model.lora_also_train may name
    linears: dict  # {module name: (in, out)} of each nn.Linear: what LoRA may adapt
    embedding: str = "model.embed_tokens.weight"  # the input embedding's weight (`input_embedding`)


def qwen2_config(numbers):
    """A transformers Qwen2Config from a KNOWN_SHAPES tuple (its public config.json numbers)."""
    from transformers import Qwen2Config

    hidden, inter, layers, heads, kv_heads, vocab, tied = numbers
    return Qwen2Config(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        tie_word_embeddings=tied,
    )


def model_shape(path, trust_remote_code=False):
    """The Shape of `model.path`: a local HF folder's config, else a known public shape, else the
    hub (where reachable)."""
    if not os.path.isdir(path) and path in KNOWN_SHAPES:
        return shape_of(qwen2_config(KNOWN_SHAPES[path]))
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        raise SystemExit(
            f"model.path={path!r}: no HF config reachable and no known shape; "
            "add it to KNOWN_SHAPES"
        )
    return shape_of(config, trust_remote_code)


def kv_values_per_token(config):
    """K and V values one token holds in a KV cache, over all layers, for a HF model config:
    layers x 2 x KV heads x head_dim. head_dim where the config gives it (Qwen3's 128 is not
    hidden / heads), else hidden / heads; the KV heads are the attention heads where the config
    names none (plain multi-head attention, as GPT-2's); a latent (MLA) cache where the config has
    one. memory.Ledger and `shape_of` read it."""
    c = config.get_text_config()
    if getattr(c, "kv_lora_rank", None):  # multi-head latent attention (DeepSeek-V2/V3): SGLang
        # caches one compressed latent and the rope part a token per layer (sglang/srt/mem_cache/
        # memory_pool.py, MLATokenToKVPool: kv_lora_rank + qk_rope_head_dim)
        return c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return c.num_hidden_layers * 2 * kv_heads * head_dim


def shape_of(config, trust_remote_code=False):
    """The Shape of the model a HF config describes, counted on its skeleton: the model built on
    the meta device (shapes, no memory; well under a second at 7B), so each decoder with
    Llama-style config fields (hidden_size, intermediate_size, num_hidden_layers, ...) is counted
    as transformers builds it, not by one family's formula: Qwen2's q, k and v biases, Llama's
    projections without them, Qwen3's head_dim of 128 where hidden / heads is 80 (Qwen3-4B: a
    formula from hidden / heads left out 9% of its parameters)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    c = model.config.get_text_config()
    return Shape(
        hidden=c.hidden_size,
        layers=c.num_hidden_layers,
        vocab=c.vocab_size,
        kv_per_token=kv_values_per_token(model.config),
        saved=saved_per_token(c, model.named_parameters()),
        params=sum(p.numel() for p in model.parameters()),  # each tied tensor once
        numels={name: p.numel() for name, p in model.named_parameters()},
        linears={
            name: (m.in_features, m.out_features)
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)
        },
        embedding=input_embedding(model),
    )


def input_embedding(model):
    """The name of `model`'s input embedding weight (Shape's default where the model cannot say:
    transformers raises NotImplementedError for a remote-code model it cannot resolve)."""
    usual = Shape._field_defaults["embedding"]
    try:
        embedding = model.get_input_embeddings()
    except NotImplementedError:
        return usual
    return next((f"{n}.weight" for n, m in model.named_modules() if m is embedding), usual)


def saved_per_token(config, named_parameters):
    """The values the activation rule of thumb saves per token in each decoder layer of a text
    `config` with these parameters: norms, q/k/v/o and attention out, ~10 x hidden; then 4 x the
    MLP width a token passes through (gate, up, their activation, product). A dense MLP's width is
    its down_proj's input. A mixture of experts (transformers 5 keeps a layer's experts as one 3D
    down_proj, [experts, hidden, width]) sends each token through num_experts_per_tok experts:
    that many widths, and 2 x hidden per copy (the token gathered in, and each expert's output
    before the weighted sum: grouped_mm_experts_forward in transformers' integrations/moe.py,
    the default experts implementation). A shared expert adds its own width. On CPU, what autograd
    saves is 1.0-1.3x this rule for dense and MoE layers alike; the dense rule had MoE layers at
    1.6-2.0x their dense family's ratio (tests/test_estimates.py). The router's probabilities
    (experts values a token) are left out. A layer with no down_proj (a family naming its MLP
    otherwise) gets the config's intermediate_size."""
    width, copies = {}, {}
    for name, p in named_parameters:
        parts = name.split(".")
        if "layers" not in parts or "down_proj" not in parts[-2:] or p.dim() < 2:  # (a bias)
            continue
        layer = int(parts[parts.index("layers") + 1])
        if p.dim() == 3:  # the experts: [experts, hidden, width], or [experts, width, hidden]
            # (a family that names its top-k otherwise: counted as if every expert ran, an upper
            # bound. Not caught: transformers' Llama 4 runs every expert on every token, while its
            # config says 1)
            top_k = getattr(config, "num_experts_per_tok", None) or p.shape[0]
            expert = p.shape[2] if p.shape[1] == config.hidden_size else p.shape[1]
            width[layer] = width.get(layer, 0) + top_k * expert
            copies[layer] = top_k
        else:  # nn.Linear's weight: [hidden, width]
            width[layer] = width.get(layer, 0) + p.shape[1]
    hidden = config.hidden_size
    return tuple(
        10 * hidden
        + 4 * (width[i] if i in width else config.intermediate_size)
        + 2 * copies.get(i, 0) * hidden
        for i in range(config.num_hidden_layers)
    )


def reference_bytes(kl_coef, lora_rank, also, params, compute, adapters):
    """Bytes of the KL reference (model.build_reference) before sharding: none without a KL; a
    full-weight run's, an fp32 copy; a LoRA run's, nothing (the policy with its adapters off)
    unless model.lora_also_train moves the base, then a second adapted model (its base in the
    compute dtype, its adapters and also-trained weights fp32)."""
    if kl_coef == 0 or (lora_rank and not also):
        return 0
    return (params - also) * compute + (also + adapters) * 4 if lora_rank else params * 4


def estimate(cfg, ranks, gpu_bytes, shape=None, budget=None, sharded=None):
    """{component: bytes} per rank, and the three phase totals. `shape`: a Shape (default:
    `model.path`'s). `budget`: the micro-batch token budget (default: the config's,
    `auto` sized by `auto_budget`). `sharded`: whether the policy is an FSDP2 shard (default:
    with several ranks, `sharded_over`; True for FSDP2 on one rank, bench/train_step.py's arm)."""
    shape = shape or model_shape(cfg.model.path, cfg.model.trust_remote_code)
    params = shape.params
    compute = 2 if cfg.model.compute_dtype == "bfloat16" else 4
    logit = 4 if cfg.model.fp32_head else compute  # the head's logits (loss.head_logits)
    # LoRA (runtime/lora.py): the base frozen in the compute dtype; fp32 masters, gradients and
    # AdamW state for the adapters alone, rank x (in + out) per adapted projection
    m = cfg.model
    lora_rank = m.lora_rank
    adapters = sum(
        lora_rank * (fan_in + fan_out)
        for name, (fan_in, fan_out) in shape.linears.items()
        if lora.is_target(name, m.lora_targets)
    )
    # and model.lora_also_train's weights, trained in full (fp32, with gradients and AdamW state)
    also = lora_rank and sum(
        n for name, n in shape.numels.items() if lora.is_also_trained(name, m.lora_also_train)
    )
    trained = adapters + also if lora_rank else params
    # FSDP2's root unit holds every parameter outside the decoder layers (parallel.shard): the
    # embedding, the final norm, an untied output head; what of it trains has a root gradient
    root_trained = sum(
        n
        for name, n in shape.numels.items()
        if ".layers." not in name
        and (not lora_rank or lora.is_also_trained(name, m.lora_also_train))
    )
    root = sum(n for name, n in shape.numels.items() if ".layers." not in name)
    engine = 2 if cfg.model.engine_dtype == "bfloat16" else 4
    r, t = cfg.rollout, cfg.train
    seq_len = longest_sequence(cfg)
    if budget is None:
        budget = t.max_tokens_per_micro_batch
        if budget == "auto":
            budget = auto_budget(cfg, ranks, gpu_bytes, shape)
    # packed: at most the token budget in a micro-batch, or one sequence longer than it; padded:
    # rows x longest
    tokens = max(budget, seq_len) if budget else t.micro_batch_size * seq_len
    batch = f"{tokens} tokens, packed" if budget else f"{t.micro_batch_size} x {seq_len} tokens"
    # saved per token in each layer: `saved_per_token`'s values, scaled by what the GPU runs held;
    # compiled layers (train.compile) save less
    factor = LORA_COMPILED_FACTOR if t.compile and lora_rank else ACTIVATION_FACTOR[t.compile]
    per_token_layer = [values * compute * factor for values in shape.saved]
    sharded = sharded_over(ranks) if sharded is None else sharded
    if t.gradient_checkpointing:  # each layer's input and the final norm's, in the residual
        # stream's dtype, plus one layer recomputed at a time
        inputs = (shape.layers + 1) * shape.hidden * residual_bytes(m, shape, sharded, compute)
        activations = tokens * (inputs + max(per_token_layer))
    else:
        activations = tokens * sum(per_token_layer)
    kv_per_token = shape.kv_per_token * engine
    weights_engine = params * engine
    contexts = 2 * CONTEXT_GIB * 2**30
    if r.max_total_tokens:
        kv_cache = r.max_total_tokens * kv_per_token
    else:
        # SGLang: free memory before it loads (after both CUDA contexts) x mem_fraction_static, less
        # the weights (sglang mem_cache/kv_cache_configurator.py, `_profile_available_bytes`)
        kv_cache = max(r.mem_fraction_static * (gpu_bytes - contexts) - weights_engine, 0)
    trainer_params = "trainer params (fp32, sharded)"
    if lora_rank:
        trainer_params = "trainer params (base in compute dtype, fp32 adapters)"
    parts = {
        trainer_params: ((params - also) * compute + trained * 4 if lora_rank else params * 4)
        / ranks,
        "gradients (fp32, sharded)": trained * 4 / ranks,
        "AdamW state (fp32, sharded)": 2 * trained * 4 / ranks,
        # FSDP2 during the update: every unit stays gathered in the compute dtype from its first
        # forward to the last micro-batch's backward (parallel.gathered_for_update); with
        # train.fsdp_keep_gathered off, the root (gathered from its forward to its backward) and
        # two decoder layers (one computing, the next one's all-gather in flight)
        "FSDP units gathered for the update": (
            (params if t.fsdp_keep_gathered else root + 2 * largest_layer(shape)) * compute
            if sharded
            else 0
        ),
        # (LoRA: only what model.lora_also_train trains of the root)
        "root gradient, unsharded fp32 (reduce-scatter)": root_trained * 4 if sharded else 0,
        # one rank: autocast caches a compute-dtype copy of every fp32 leaf a matmul reads, for
        # the forward and backward (aten/src/ATen/autocast_mode.cpp, cached_cast; LoRA: the
        # adapters and what trains in full, an upper bound: an untied embedding is looked up)
        "autocast weight copies": (
            (adapters + also if lora_rank else params) * compute
            if not sharded and compute < 4
            else 0
        ),
        f"activations ({batch})": activations,
        # about 4 fp32 [chunk, vocab] tensors alive at once (the logits' fp32 copy, the shifted
        # log-probs, their exp, a product), and the head's fp32 hidden states
        "log-prob path (chunked head)": 4 * CHUNK_TOKENS * shape.vocab * 4
        + tokens * shape.hidden * 4,
        # train.kl_coef > 0: the frozen reference, built like the policy (fp32, sharded like it),
        # stays on the GPU through the update (LoRA: the policy with its adapters off, nothing
        # more; but with model.lora_also_train, whose weights move, a second adapted model:
        # model.build_reference)
        "KL reference (sharded)": (
            reference_bytes(t.kl_coef, lora_rank, also, params, compute, adapters) / ranks
        ),
        # top_p < 1 (loss.nucleus_scores), eager, per chunk, at worst (every row's nucleus beyond
        # its top k, a near-uniform model's; a row inside it scores K + 1 slots, not V): the
        # search's fp32 copy, the wide rows' logits (compute dtype) and masked fp32 copy, the
        # drop mask, a sort's values and int64 indices;
        # per token, its top k's values (compute dtype) and int64 indices, which the forward
        # keeps for the backward (loss.keep_nucleus_search)
        # (model.fp32_head: the logits fp32, 4 bytes for each `compute` here)
        "top-p nucleus (chunked head)": (
            CHUNK_TOKENS * shape.vocab * (4 + logit + 4 + 1 + logit + 8)
            + tokens * NUCLEUS_TOP_K * (logit + 8)
            if r.top_p < 1
            else 0
        ),
        "engine weights": weights_engine,
        "engine KV cache": kv_cache,
        "engine CUDA graphs": CUDA_GRAPH_GIB * 2**30,
        # weight sync: a bucket grows until it reaches bucket_mb, so it can hold bucket_mb + the
        # largest tensor, all in the engine's dtype (runtime/engine.weight_buckets casts each shard
        # before gathering it)
        # (LoRA: the adapter, pushed whole into the engine's pool); a mixture of experts' fused
        # tensor is held twice while engine.checkpoint_layout splits it (its gate and up halves
        # are copies)
        "weight-sync bucket": (
            adapters * 4
            if lora_rank
            else cfg.memory.bucket_mb * 2**20 + largest_pushed(shape.numels) * engine
        ),
        "CUDA contexts (trainer + engine)": contexts,
    }
    trainer_state = sum(
        v for k, v in parts.items() if k.startswith(("trainer", "gradients", "AdamW"))
    )
    train_extra = (
        "FSDP units gathered for the update",
        "root gradient, unsharded fp32 (reduce-scatter)",
        "autocast weight copies",
        "log-prob path (chunked head)",
        "top-p nucleus (chunked head)",
        "KL reference (sharded)",
    )
    phases = {
        # rollout: engine resident, trainer params and optimizer offloaded to the CPU
        "rollout": weights_engine + kv_cache + parts["engine CUDA graphs"] + contexts,
        # train: engine released (weights, KV cache, CUDA graphs); trainer state, gathered units,
        # activations
        "train": trainer_state + sum(parts[k] for k in train_extra) + activations + contexts,
        # sync (staged): optimizer offloaded, gradients freed; trainer params + engine weights + one
        # bucket
        "sync": parts[trainer_params] + weights_engine + parts["weight-sync bucket"] + contexts,
    }
    if cfg.memory.mode == "all_at_once":  # the sync wakes the KV cache with the weights
        # (memory.MemoryPhases.to_sync wakes every tag), before the trainer's weights leave
        phases["sync"] += kv_cache + parts["engine CUDA graphs"]
    if cfg.memory.mode == "off":  # nothing released: everything at once
        phases = {name: sum(parts.values()) for name in phases}
    return parts, phases


# `auto` leaves this share of the card to what the estimate does not see: allocator fragmentation
# and cached blocks, and the estimate's own error
AUTO_MARGIN = 0.15
AUTO_STEP = 1024  # the budget is a multiple of this many tokens
CPU_AUTO_TOKENS = 4096  # `auto` without a GPU (no card to fill): enough for the CPU demo's batch


def residual_bytes(m, shape, sharded, compute):
    """Bytes of one value of the residual stream (each decoder layer's input): the embedding's
    output dtype. One rank in bf16 runs autocast over fp32 weights, and an embedding is not
    autocast: fp32, and each layer's bf16 output added to it stays fp32 (a gradient-checkpointed
    run saves it so: counted at 2 bytes, `auto` filled an 80 GB card past its size). FSDP2
    computes with compute-dtype weights, and a LoRA base is stored in that dtype, unless
    model.lora_also_train trains the embedding (fp32)."""
    fp32_embedding = not m.lora_rank or lora.is_also_trained(shape.embedding, m.lora_also_train)
    return 4 if not sharded and fp32_embedding else compute


def largest_layer(shape):
    """The parameters of the largest decoder layer (FSDP2's unit: parallel.shard)."""
    layers = {}
    for name, n in shape.numels.items():
        if ".layers." in name:
            index = name.split(".layers.")[1].split(".")[0]
            layers[index] = layers.get(index, 0) + n
    return max(layers.values(), default=0)


def largest_pushed(numels):
    """Values of the largest tensor one push holds at once: the largest parameter, or twice a
    mixture of experts' fused one (named `.experts.`), held whole beside its per-expert copies."""
    experts = max((n for name, n in numels.items() if ".experts." in name), default=0)
    return max(max(numels.values()), 2 * experts)


def levers(cfg, phase, ranks=1):
    """The settings that would lower `phase`'s estimate from where this config stands (a lever
    already pulled, or one that changes nothing at this budget, is left out)."""
    m, t = cfg.model, cfg.train
    if cfg.memory.mode == "off":  # every phase holds everything
        return ["memory.mode: staged"]
    if phase == "rollout":  # with mem_fraction_static alone the KV cache is sized to fit
        return ["a smaller rollout.max_total_tokens"]
    found = [] if m.lora_rank else ["LoRA (model.lora_rank)"]
    found.append("more ranks (run.nproc)")  # the trainer's fp32 state is sharded over them
    if phase == "sync":
        return found + ["a smaller memory.bucket_mb"]
    if not t.gradient_checkpointing:
        found.append("train.gradient_checkpointing")
    if sharded_over(ranks) and t.fsdp_keep_gathered:
        found.append("train.fsdp_keep_gathered=false")
    if t.max_tokens_per_micro_batch and t.max_tokens_per_micro_batch > longest_sequence(cfg):
        found.append("a smaller train.max_tokens_per_micro_batch")  # down to the longest sequence
    if not t.max_tokens_per_micro_batch and t.micro_batch_size > 1:
        found.append("a smaller train.micro_batch_size")
    return found


def over_the_card(cfg, ranks, gpu_bytes, shape=None):
    """None where the estimate's largest phase fits a card of `gpu_bytes`; else a warning that
    names the phase, its estimate and what lowers it (assemble.size_micro_batches logs it at
    setup, before the engine starts). A warning, not an error: an estimate, within 10% of the
    peaks measured on an H200 (docs/RESULTS.md), not a measurement."""
    _, phases = estimate(cfg, ranks, gpu_bytes, shape)
    phase = max(phases, key=phases.get)
    if phases[phase] <= gpu_bytes:
        return None
    what = f"{phase} phase" if cfg.memory.mode != "off" else "peak (memory.mode: off holds it all)"
    gib = gpu_bytes / 2**30
    return (
        f"the estimated {what} is {phases[phase] / 2**30:.1f} GiB a rank, more than this "
        f"{gib:.1f} GiB card: expect an out-of-memory error. bench/estimate_memory.py with this "
        f"config and --ranks {ranks} --gpu-gib {gib:.1f} lists each term; "
        f"{' or '.join(levers(cfg, phase, ranks))} would lower it"
    )


def sharded_over(ranks):
    """Whether the policy is an FSDP2 shard: with more than one rank."""
    return ranks > 1


def longest_sequence(cfg):
    """The longest sequence a step can train: the prompt limit plus the response budget."""
    return cfg.data.max_prompt_len + cfg.rollout.max_trajectory_tokens()


def auto_budget(cfg, ranks, gpu_bytes, shape=None):
    """`train.max_tokens_per_micro_batch: auto`: the largest multiple of AUTO_STEP tokens whose
    estimated train phase fits (1 - AUTO_MARGIN) of a card of `gpu_bytes`, at least the longest
    sequence. The train phase grows linearly in the budget (activations, the head's hidden
    states), so two estimates give its slope."""
    seq_len = longest_sequence(cfg)

    def at(tokens):
        return estimate(cfg, ranks, gpu_bytes, shape, budget=tokens)[1]["train"]

    per_token = (at(2 * seq_len) - at(seq_len)) / seq_len
    room = (1 - AUTO_MARGIN) * gpu_bytes - (at(seq_len) - seq_len * per_token)
    return max(int(room / per_token) // AUTO_STEP * AUTO_STEP, seq_len)
