"""Per-GPU memory of a config, estimated without a GPU: what each phase of a step holds on one rank
(FSDP2 shards the trainer's fp32 state over the ranks; every rank holds a whole engine), and the
micro-batch token budget that fills the card (`train.max_tokens_per_micro_batch: auto`).

Arithmetic from the model's shape and the config, not a measurement: the rules of thumb are in the
comments, and the activation term is an estimate (bf16 activations). bench/estimate_memory.py
prints it; bench/train_step.py --shape sets it beside the measured peak. Owns no state.
"""

import os

# Public config.json values (hidden, intermediate, layers, attention heads, KV heads, vocab, tied
# input and output embeddings), for offline use.
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


def model_shape(path):
    """(hidden, intermediate, layers, heads, KV heads, vocab, tied): a local HF folder's config,
    else a known public shape, else the hub (where reachable)."""
    if not os.path.isdir(path) and path in KNOWN_SHAPES:
        return KNOWN_SHAPES[path]
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        raise SystemExit(
            f"model.path={path!r}: no HF config reachable and no known shape; "
            "add it to KNOWN_SHAPES"
        )
    return shape_of(config)


def shape_of(c):
    """(hidden, intermediate, layers, heads, KV heads, vocab, tied) of a HF model config `c`."""
    return (
        c.hidden_size,
        c.intermediate_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.vocab_size,
        c.tie_word_embeddings,
    )


def also_trained(parts, embedding, tied, layers, hidden, sides):
    """The parameters model.lora_also_train trains in full: those whose name holds one of `parts`
    (runtime/lora.add_adapters' rule), by the Qwen2 names of the shape's tensors."""
    names = {"model.embed_tokens.weight": embedding, "model.norm.weight": hidden}
    if not tied:
        names["lm_head.weight"] = embedding
    layer = {"input_layernorm.weight": hidden, "post_attention_layernorm.weight": hidden}
    for projection, (fan_in, fan_out) in sides.items():
        block = "mlp" if projection in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        layer[f"{block}.{projection}.weight"] = fan_in * fan_out
        if projection in ("q_proj", "k_proj", "v_proj"):
            layer[f"{block}.{projection}.bias"] = fan_out
    names |= {f"model.layers.0.{name}": layers * count for name, count in layer.items()}
    return sum(count for name, count in names.items() if any(part in name for part in parts))


def reference_bytes(kl_coef, lora_rank, also, params, compute, adapters):
    """Bytes of the KL reference (model.build_reference) before sharding: none without a KL; a
    full-weight run's, an fp32 copy; a LoRA run's, nothing (the policy with its adapters off)
    unless model.lora_also_train moves the base, then a second adapted model (its base in the
    compute dtype, its adapters and also-trained weights fp32)."""
    if kl_coef == 0 or (lora_rank and not also):
        return 0
    return (params - also) * compute + (also + adapters) * 4 if lora_rank else params * 4


def estimate(cfg, ranks, gpu_bytes, shape=None, budget=None, sharded=None):
    """{component: bytes} per rank, and the three phase totals. `shape`: a KNOWN_SHAPES tuple
    (default: `model.path`'s). `budget`: the micro-batch token budget (default: the config's,
    `auto` sized by `auto_budget`). `sharded`: whether the policy is an FSDP2 shard (default:
    with several ranks, `sharded_over`; True for FSDP2 on one rank, bench/train_step.py's arm)."""
    hidden, inter, layers, heads, kv_heads, vocab, tied = shape or model_shape(cfg.model.path)
    head_dim = hidden // heads
    # q/o, k/v (and q, k, v's biases), the MLP's three, two norms
    per_layer = (
        2 * hidden * hidden
        + 2 * hidden * kv_heads * head_dim
        + hidden
        + 2 * kv_heads * head_dim
        + 3 * hidden * inter
        + 2 * hidden
    )
    embedding = vocab * hidden  # the largest tensor; Qwen2.5 <= 3B ties it to the output head
    params = embedding * (1 if tied else 2) + layers * per_layer + hidden
    compute = 2 if cfg.model.compute_dtype == "bfloat16" else 4
    # LoRA (runtime/lora.py): the base frozen in the compute dtype; fp32 masters, gradients and
    # AdamW state for the adapters alone, rank x (in + out) per adapted projection
    kv = kv_heads * head_dim
    sides = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv)}
    sides |= {"o_proj": (hidden, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter)}
    sides["down_proj"] = (inter, hidden)
    m = cfg.model
    lora_rank = m.lora_rank
    adapters = layers * sum(lora_rank * sum(sides[t]) for t in m.lora_targets if t in sides)
    # and model.lora_also_train's weights, trained in full (fp32, with gradients and AdamW state)
    also = lora_rank and also_trained(m.lora_also_train, embedding, tied, layers, hidden, sides)
    trained = adapters + also if lora_rank else params
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
    # saved per token per layer: norms, q/k/v/o, attention out, gate/up/act/product, down (~10 H + 4
    # I values)
    # compiled layers (train.compile) save less
    factor = LORA_COMPILED_FACTOR if t.compile and lora_rank else ACTIVATION_FACTOR[t.compile]
    per_token_layer = (10 * hidden + 4 * inter) * compute * factor
    if t.gradient_checkpointing:  # only each layer's input, plus one layer recomputed at a time
        activations = tokens * (layers * hidden * compute + per_token_layer)
    else:
        activations = tokens * layers * per_token_layer
    kv_per_token = layers * 2 * kv_heads * head_dim * engine
    weights_engine = params * engine
    contexts = 2 * CONTEXT_GIB * 2**30
    if r.max_total_tokens:
        kv_cache = r.max_total_tokens * kv_per_token
    else:
        # SGLang: free memory before it loads (after both CUDA contexts) x mem_fraction_static, less
        # the weights (sglang mem_cache/kv_cache_configurator.py, `_profile_available_bytes`)
        kv_cache = max(r.mem_fraction_static * (gpu_bytes - contexts) - weights_engine, 0)
    sharded = sharded_over(ranks) if sharded is None else sharded
    trainer_params = "trainer params (fp32, sharded)"
    if lora_rank:
        trainer_params = "trainer params (base in compute dtype, fp32 adapters)"
    parts = {
        trainer_params: ((params - also) * compute + trained * 4 if lora_rank else params * 4)
        / ranks,
        "gradients (fp32, sharded)": trained * 4 / ranks,
        "AdamW state (fp32, sharded)": 2 * trained * 4 / ranks,
        # FSDP2 during the update: every unit stays gathered in the compute dtype from its first
        # forward to the last micro-batch's backward (parallel.gathered_for_update)
        "FSDP units gathered for the update": params * compute if sharded else 0,
        # (LoRA: the embedding has one only where model.lora_also_train trains it)
        "root gradient, unsharded fp32 (reduce-scatter)": (
            embedding * 4
            if sharded
            and (not lora_rank or any(p in "model.embed_tokens.weight" for p in m.lora_also_train))
            else 0
        ),
        # one rank: autocast caches a compute-dtype copy of every weight for the forward and
        # backward
        "autocast weight copies": (
            params * compute if not sharded and compute < 4 and not lora_rank else 0
        ),
        f"activations ({batch})": activations,
        # about 4 fp32 [chunk, vocab] tensors alive at once (the logits' fp32 copy, the shifted
        # log-probs, their exp, a product), and the head's fp32 hidden states
        "log-prob path (chunked head)": 4 * CHUNK_TOKENS * vocab * 4 + tokens * hidden * 4,
        # train.kl_coef > 0: the frozen reference, built like the policy (fp32, sharded like it),
        # stays on the GPU through the update (LoRA: the policy with its adapters off, nothing
        # more; but with model.lora_also_train, whose weights move, a second adapted model:
        # model.build_reference)
        "KL reference (sharded)": (
            reference_bytes(t.kl_coef, lora_rank, also, params, compute, adapters) / ranks
        ),
        # top_p < 1 (loss.nucleus_edge, loss.outside_nucleus), eager, per chunk: the search's fp32
        # copy, the masked logits (fp32), the drop mask, and for rows whose top k hold too little
        # a sort's values and int64 indices;
        # per token, its top k's values (compute dtype) and int64 indices, which the forward
        # keeps for the backward (loss.keep_nucleus_search)
        "top-p nucleus (chunked head)": (
            CHUNK_TOKENS * vocab * (4 + 4 + 1 + 12) + tokens * NUCLEUS_TOP_K * (compute + 8)
            if r.top_p < 1
            else 0
        ),
        "engine weights": weights_engine,
        "engine KV cache": kv_cache,
        "engine CUDA graphs": CUDA_GRAPH_GIB * 2**30,
        # weight sync: a bucket grows until it reaches bucket_mb, so it can hold bucket_mb + the
        # largest tensor, all in the engine's dtype (sglang_engine.weight_buckets casts each shard
        # before gathering it)
        # (LoRA: the adapter, pushed whole into the engine's pool)
        "weight-sync bucket": (
            adapters * 4 if lora_rank else cfg.memory.bucket_mb * 2**20 + embedding * engine
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


def sharded_over(ranks):
    """Whether the policy is an FSDP2 shard: with more than one rank."""
    return ranks > 1


def longest_sequence(cfg):
    """The longest sequence a step can train: the prompt limit plus the response budget."""
    r = cfg.rollout
    return cfg.data.max_prompt_len + (r.max_response_tokens or r.max_new_tokens * r.max_turns)


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
