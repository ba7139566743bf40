"""The policy model: built from the config (the CPU demo's tiny Qwen2) or loaded from a HF folder,
with float32 master weights whatever the compute dtype, and its optimizer and learning-rate
schedule.

Owns how the model, its tokenizer (the demo's char tokenizer, built locally) and optimizer are
made. Does not own sharding (parallel.py), checkpoints (checkpoint.py) or the engine's copy of
the weights (engine.py).
"""

import logging
import math

import torch
import torch.nn.functional as F

from config import ConfigError, read_config, refuse_unread
import runtime.lora as lora
import runtime.routing as routing
import runtime.seeds as seeds

log = logging.getLogger("model")

LR_SCHEDULES = ("constant", "cosine")  # train.lr_schedule: see lr_factor
DTYPES = ("float32", "bfloat16")  # model.compute_dtype, model.engine_dtype
# model.attn_implementation: the trainer's attention kernels (the engine has its own). With packed
# rows (train.max_tokens_per_micro_batch) attention is masked between sequences: "sdpa" by a dense
# [rows, width, width] boolean mask that transformers builds from the position ids (they restart
# at 0: masking_utils.find_packed_sequence_indices), which keeps torch's SDPA off its flash
# kernel, and "flex_attention" by FlexAttention's block mask (update.packed_mask builds it, once
# per micro-batch), whose compiled kernel skips the blocks no query attends to. FlexAttention has no
# backward on CPU (torch/nn/attention/flex_attention.py, _validate_device): there it can only
# compute log-probs, so a CPU run trains with sdpa (`check_attention`). With train.shared_prefix a
# batch brings its own mask instead (update.packed_mask): a segment reads its group's prompt.
ATTENTION = ("sdpa", "flex_attention")
# the tiny model's characters: the demo tasks' (task/tiny.py, tiny_tool.py); a task needing more
# adds them after these (task.data.vocabulary), so the demo's token ids never move
TINY_CHARS = "0123456789:a+-.=*/()?"


def build_char_tokenizer(chars=TINY_CHARS):
    """A character-level tokenizer built locally with `tokenizers` (no download), HF-wrapped."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *chars])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


# the tiny model's shape: a HF model's comes from its folder's config.json
TINY_SHAPE = (
    "model.hidden_size",
    "model.intermediate_size",
    "model.num_layers",
    "model.num_heads",
    "model.max_position_embeddings",
)
# config.refuse_unread's table: the LoRA fields, read only with adapters; the tiny model's shape;
# the cosine schedule's floor
READ_WHEN = {
    **{
        key: (lambda cfg: cfg.model.lora_rank > 0, "with model.lora_rank > 0")
        for key in (
            "model.lora_alpha",
            "model.lora_targets",
            "model.lora_also_train",
        )
    },
    **{key: (lambda cfg: cfg.model.path == "tiny", "with model.path: tiny") for key in TINY_SHAPE},
    "train.min_lr_ratio": (
        lambda cfg: cfg.train.lr_schedule == "cosine",
        "with lr_schedule cosine",
    ),
    "model.trust_remote_code": (
        lambda cfg: cfg.model.path != "tiny",
        "with a model loaded from model.path (tiny is built here)",
    ),
    "model.fp32_head": (
        lambda cfg: "bfloat16" in (cfg.model.compute_dtype, cfg.model.engine_dtype),
        "with model.compute_dtype or model.engine_dtype bfloat16 (float32 logits are float32)",
    ),
}


def check(cfg):
    """The model section's and the schedule's choices (assemble.load_config calls this)."""
    choices = {
        "model.compute_dtype": (cfg.model.compute_dtype, DTYPES),
        "model.engine_dtype": (cfg.model.engine_dtype, DTYPES),
        "model.attn_implementation": (cfg.model.attn_implementation, ATTENTION),
        "train.lr_schedule": (cfg.train.lr_schedule, LR_SCHEDULES),
    }
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ConfigError(f"{key}={value!r}: expected one of {allowed}")
    m = cfg.model
    refuse_unread(cfg, READ_WHEN)
    t = cfg.train
    if t.warmup_steps >= t.steps > 0:  # a short smoke run of a shipped config: said, not refused
        log.warning(
            "train.warmup_steps=%d >= train.steps=%d: the rate never reaches train.lr "
            "(%g; the last step's is %.3g of it), and train.lr_schedule never begins",
            t.warmup_steps,
            t.steps,
            t.lr,
            t.steps / t.warmup_steps,
        )
    # adapters live in the decoder layers: the output head is often the embedding itself (tied), and
    # a merged head would rewrite the embedding too
    outside = sorted({"lm_head", "embed_tokens"} & set(m.lora_targets)) if m.lora_rank else []
    if outside:
        raise ConfigError(
            f"model.lora_targets: {outside} are not adapted (the decoder layers' are)"
        )
    if m.lora_rank and not m.lora_targets:  # it failed later: no adapter, an empty optimizer
        raise ConfigError("model.lora_targets=[]: name the linear layers to adapt (q_proj, ...)")
    missing = missing_lora_targets(m.lora_targets) if m.lora_rank else []
    if missing:
        raise ConfigError(
            f"model.lora_targets={m.lora_targets}: add {missing}. SGLang serves q, k and v as one "
            "qkv_proj adapter made from q_proj's and v_proj's (k_proj's zero if absent), and "
            "gate_up_proj from gate_proj's (up_proj's zero if absent): without them it skips or "
            "refuses the others (sglang/srt/lora/lora.py, normalize_qkv_proj, "
            "normalize_gate_up_proj), and the engine would sample without what trains"
        )
    # the tiny model's heads split hidden_size evenly, each an even width for rotary embeddings
    # (RoPE rotates pairs of dimensions); otherwise the engine's process dies at its first forward
    if m.path == "tiny" and (m.hidden_size % m.num_heads or (m.hidden_size // m.num_heads) % 2):
        raise ConfigError(
            f"model.num_heads={m.num_heads} with model.hidden_size={m.hidden_size}: each head "
            "needs an even width, hidden_size / num_heads (for instance num_heads=4 with 64)"
        )


def missing_lora_targets(targets):
    """The projections SGLang's LoRA pool needs beside `targets` to serve them (model.check)."""
    missing = set()
    if {"q_proj", "k_proj", "v_proj"} & set(targets):
        missing |= {"q_proj", "v_proj"} - set(targets)
    if "up_proj" in targets:
        missing |= {"gate_proj"} - set(targets)
    return sorted(missing)


class ModelError(RuntimeError):
    """The policy model cannot be built or loaded."""


def build_policy(cfg, init_dir, chars=TINY_CHARS, check=True):
    """(policy, tokenizer), parameters in float32 whatever the compute dtype: they are the master
    weights AdamW updates (compute runs in `model.compute_dtype`, the engine in
    `model.engine_dtype`). The dtype is explicit: transformers 5 would load "auto" (bfloat16 for
    Qwen). `model.path: tiny` builds the demo model from the config (random init, seeded);
    anything else loads a HF checkpoint. `init_dir` (a resumed checkpoint) wins over both.
    `chars`: the tiny model's characters (task.data.vocabulary: the task's). `check`:
    `check_family` first (build_reference's second copy of the same model skips it)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    path = init_dir or cfg.model.path
    try:
        tokenizer = load_tokenizer(cfg, path, chars)
        if cfg.model.path == "tiny":
            if init_dir:
                model = AutoModelForCausalLM.from_pretrained(
                    init_dir, dtype=torch.float32, trust_remote_code=False
                )
                if model.config.vocab_size != len(tokenizer):  # the task brings its characters
                    raise ModelError(
                        f"{init_dir} holds a tiny model of {model.config.vocab_size} tokens, but "
                        f"data.task={cfg.data.task!r} needs {len(tokenizer)}: resume with the "
                        "task it was trained on, or start a new run (another run.out)"
                    )
            else:
                m = cfg.model
                torch.manual_seed(seeds.derive(cfg.train.seed, "model"))
                config = Qwen2Config(
                    vocab_size=len(tokenizer),
                    hidden_size=m.hidden_size,
                    intermediate_size=m.intermediate_size,
                    num_hidden_layers=m.num_layers,
                    num_attention_heads=m.num_heads,
                    num_key_value_heads=m.num_heads,
                    max_position_embeddings=m.max_position_embeddings,
                    tie_word_embeddings=True,
                    bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                    torch_dtype="float32",
                )
                model = Qwen2ForCausalLM(config).float()
        else:
            # off unless the config turns it on: a folder's code runs here
            trust = cfg.model.trust_remote_code
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, trust_remote_code=trust
            )
    except (OSError, ValueError) as e:  # no such folder; a config.json transformers cannot read
        raise unloadable(path, e) from None
    if check:
        check_family(cfg, model)
    model.set_attn_implementation(cfg.model.attn_implementation)
    # model.fp32_head, where the trainer (update.sequence_logprobs) and SGLang read it: the
    # model's config (its LogitsProcessor reads enable_lm_head_fp32: logits_processor.py), which
    # every folder written from here holds (the engine is also given it: start_sglang). Set
    # either way: a folder this trainer wrote with it on says so too
    if getattr(model.config, "enable_lm_head_fp32", False) and not cfg.model.fp32_head:
        log.warning("%s's config.json says enable_lm_head_fp32: off (model.fp32_head)", path)
    model.config.enable_lm_head_fp32 = cfg.model.fp32_head
    if cfg.model.lora_rank:  # a frozen base in the compute dtype, fp32 adapters (runtime/lora.py)
        m = cfg.model
        torch.manual_seed(seeds.derive(cfg.train.seed, "lora"))
        base_dtype = getattr(torch, m.compute_dtype)
        try:
            lora.add_adapters(
                model,
                m.lora_rank,
                m.lora_alpha,
                m.lora_targets,
                base_dtype,
                m.lora_also_train,
            )
        except ValueError as e:  # a name the model does not have: only the model can tell
            raise ConfigError(str(e)) from None
    # each decoder layer's activations recomputed in the backward
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.train.compile:
        compile_layers(model)
    return model.train(), tokenizer  # from_pretrained returns eval mode, where checkpointing is off


# config fields by which a family's forward changes its logits after the output head
# (transformers' modeling_gemma2.py, modeling_granite.py, modeling_cohere.py)
LOGIT_FIELDS = ("final_logit_softcapping", "logits_scaling", "logit_scale")


def check_family(cfg, model):
    """Refuse, before the engine starts, a model this trainer would train wrongly or not at all:
    - the decoder layers must be `model.model.layers` (compile_layers, FSDP2's units, the weight
      check's names): GPT-2's `transformer.h` is not;
    - no randomness in train mode (dropout, router jitter): the update's forwards run in it, the
      engine samples without;
    - its forward must return what its output head computes: the update replaces the head with
      one that returns log-probs (update.sequence_logprobs), so a family that changes its logits
      after the head (Gemma 2 soft-caps them, Granite scales them) would get those log-probs
      changed instead. One forward of 4 tokens, so a family never seen here is caught too;
    - with packing (train.max_tokens_per_micro_batch), a sequence must score the same behind
      any other: the update tells each layer where a sequence starts only by position_ids
      restarting (update.pack_rows), so a layer that carries state along the row (Qwen3-Next's
      linear attention: 5e-2 off) would mix them. Two forwards of 3 + 4 tokens;
    - with FlexAttention, only full and sliding-window layers (update.packed_mask builds their
      masks; Llama 4's chunked attention would attend across its chunks);
    - its rotary embedding must be the engine's at every length this config trains
      (`rope_refusal`);
    - with train.routing_replay, routers whose gates runtime/routing.py computes;
    - with train.shared_prefix, no sliding window or other layer kind (`update.packed_mask`).
    (Layers with a sliding window, Gemma 3's, get their own packed mask: update.packed_mask.)"""
    path = cfg.model.path
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ModelError(
            f"model.path={path!r} ({type(model).__name__}) keeps no decoder layers at "
            "model.model.layers, where this trainer compiles, shards and checks them (the layout "
            "of Llama, Qwen, Mistral, Phi-3, OLMo 2 and Gemma 3's text model, gemma3_text): not "
            "supported"
        )
    if model.get_output_embeddings() is None:
        raise ModelError(
            f"model.path={path!r} ({type(model).__name__}) has no output head "
            "(get_output_embeddings), where the update computes log-probs: not supported"
        )
    text = model.config.get_text_config()
    # the update's forwards run in train mode, the engine samples without randomness of its own:
    # two train-mode forwards must agree (dropout, Mixtral's router jitter, PhiMoE's sampled
    # experts would not)
    mode = model.training
    model.train()
    with torch.no_grad():
        twice = [
            model(input_ids=torch.arange(4).unsqueeze(0), use_cache=False).logits for _ in range(2)
        ]
    model.train(mode)
    if not torch.equal(*twice):
        fields = {
            field: value
            for field, value in text.to_dict().items()
            if any(word in field for word in ("dropout", "pdrop", "jitter", "noise"))
            and isinstance(value, (int, float))
            and value > 0
        }
        raise ModelError(
            f"model.path={path!r} ({type(model).__name__}): its forward in train mode is random "
            f"({fields or 'by a rule of its own'}): the trainer's log-probs would be, where the "
            "engine's are not, and the policy ratio with them. Set these fields to 0 in its "
            "config.json"
        )
    # what the output head returns, and what its weight and bias give (the update computes with
    # those: a head whose forward is more than a linear layer would be skipped), by a hook
    head = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda m, i, out: head.append((out, F.linear(i[0], m.weight, getattr(m, "bias", None))))
    )
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.arange(4).unsqueeze(0), use_cache=False).logits
    finally:
        hook.remove()
    if not torch.equal(head[0][0], head[0][1]):
        raise ModelError(
            f"model.path={path!r} ({type(model).__name__}): its output head "
            f"({type(model.get_output_embeddings()).__name__}) computes more than its weight and "
            "bias give, and the update computes log-probs from those (update.sequence_logprobs): "
            "not supported"
        )
    if not torch.equal(logits, head[0][0]):
        fields = {f: getattr(model.config, f) for f in LOGIT_FIELDS if hasattr(model.config, f)}
        raise ModelError(
            f"model.path={path!r} ({type(model).__name__}): its forward changes the output head's "
            f"logits ({fields or 'by a rule of its own'}), and the update computes log-probs in "
            "the head's place (update.sequence_logprobs), so they would be changed instead: not "
            "supported"
        )
    if cfg.train.max_tokens_per_micro_batch:
        # one 4-token sequence packed behind two different 3-token ones: the same shapes, so
        # rounding is the same (bit for bit for the dense families, 5e-7 apart for a MoE's
        # grouped experts); what leaks from the sequence before moves it (Qwen3-Next: 5e-2)
        position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
        with torch.no_grad():
            scored = [
                model(
                    torch.tensor([first + [6, 7, 8, 9]]),
                    position_ids=position_ids,
                    use_cache=False,  # with a cache, no packing read (masking_utils.py)
                )
                .logits[:, 3:]
                .log_softmax(-1)
                for first in ([0, 1, 2], [3, 4, 5])
            ]
        gap = (scored[0] - scored[1]).abs().max()
        if gap > 1e-3:
            raise ModelError(
                f"model.path={path!r} ({type(model).__name__}): a packed sequence scores "
                f"otherwise behind another sequence (log-probs {gap:.1e} apart): a layer carries "
                "state across the restart of position_ids by which the update packs. Set "
                "train.max_tokens_per_micro_batch=0 (padded rows)"
            )
    kinds = set(getattr(text, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if kinds and cfg.model.attn_implementation == "flex_attention":
        raise ModelError(
            f"model.path={path!r} ({type(model).__name__}): layers of kind {sorted(kinds)}, where "
            "update.packed_mask builds FlexAttention masks for full and sliding-window attention "
            "only. Set model.attn_implementation=sdpa"
        )
    # every layer must attend to all it precedes: one mask serves them all
    window = getattr(text, "sliding_window", None)
    others = set(getattr(text, "layer_types", None) or ()) - {"full_attention"}
    if cfg.train.shared_prefix and (window or others):
        raise ModelError(
            f"model.path={path!r} ({type(model).__name__}): layers attend within a window or "
            f"chunk ({window or sorted(others)}), and a shared prompt's segments sit past other "
            "segments in their row, farther than their positions say: update.packed_mask has no "
            "such mask for them. Set train.shared_prefix=false"
        )
    # (estimate.longest_sequence's sum, written out: importing runtime/estimate here would make
    # the longest import chain 7)
    longest = cfg.data.max_prompt_len + cfg.rollout.max_trajectory_tokens()  # prompt + response
    refusal = rope_refusal(text, longest)
    if refusal:
        raise ModelError(f"model.path={path!r} ({type(model).__name__}): {refusal}: not supported")
    if cfg.train.routing_replay and not routing.routers(model):
        raise ModelError(
            f"model.path={path!r} ({type(model).__name__}): train.routing_replay replays a "
            "mixture of experts' routing through the routers runtime/routing.ROUTERS knows "
            f"({', '.join(routing.ROUTERS)}); this model's: "
            f"{routing.router_classes(model) or 'none (a dense model)'}"
        )


def rope_refusal(config, longest):
    """Why SGLang's rotary embedding would turn queries and keys otherwise than transformers' for a
    text `config` whose sequences reach `longest` tokens, or None. The rope types default, linear,
    llama3 and yarn give both the same rotations, bit for bit (tests/test_families.py, with full
    rotary dimensions; neither YaRN's mscale fields nor a partial rotary factor compared), and any
    other type is refused as never compared; read in
    sglang/srt/layers/rotary_embedding/ (factory.py, rope_variant.py) and transformers'
    modeling_rope_utils.py, two do not:
    - dynamic (NTK): SGLang scales the base once, for every position; transformers keeps it
      unscaled up to original_max_position_embeddings and rescales per forward past it;
    - longrope (Phi-3.5): each switches a whole forward to the long factors once one position is
      past original_max_position_embeddings, at lengths one apart (SGLang: a position > it,
      transformers: the largest position + 1 > it), and the engine's batches are not the
      trainer's micro-batches. So a sequence's rotations would depend on what it was batched with.
      Where every sequence fits original_max_position_embeddings, both take the short factors."""
    parameters = getattr(config, "rope_parameters", None) or {}
    if all(isinstance(value, dict) for value in parameters.values()) and parameters:
        kinds = list(parameters.values())  # per layer type (Gemma 3's sliding and full)
    else:
        kinds = [parameters]
    for rope in kinds:
        kind = rope.get("rope_type", "default")
        if kind not in ("default", "linear", "llama3", "yarn", "longrope", "dynamic"):
            return (
                f"its rope_type {kind!r} was never compared with SGLang's (default, linear, "
                "llama3, yarn and longrope were: tests/test_families.py)"
            )
        if kind == "dynamic":
            return (
                "its rope_type 'dynamic' scales the rotary base for every position in SGLang and "
                "only past original_max_position_embeddings in transformers, so the engine samples "
                "from other rotations than the trainer scores"
            )
        original = rope.get("original_max_position_embeddings")
        if kind == "longrope" and original and longest > original:
            return (
                f"its rope_type 'longrope' switches a whole batch to the long factors once a "
                f"position passes original_max_position_embeddings ({original}), which sequences "
                f"of this config reach ({longest} tokens: data.max_prompt_len plus the response "
                "budget), and the engine's batches are not the trainer's: keep them within it"
            )
    return None


def build_reference(cfg, policy, chars=TINY_CHARS):
    """The KL reference (None unless train.kl_coef > 0): the initial policy, frozen. Built again
    from model.path, also after a resume (never copied from the policy); for a LoRA run whose base
    stays frozen, the policy itself with its adapters off (lora.Base: no second model). With
    model.lora_also_train the base moves too, so the reference is built again."""
    if cfg.train.kl_coef == 0:
        return None
    if cfg.model.lora_rank and not cfg.model.lora_also_train:
        return lora.Base(policy)
    return build_policy(cfg, None, chars, check=False)[0].requires_grad_(False).eval()


def compile_layers(model):
    """train.compile: torch.compile with dynamic shapes (every micro-batch has its own token count:
    one graph serves them all) of each decoder layer's forward, on one rank and under FSDP2 alike.
    Only `forward` is replaced, on each module instance, so parameter names (checkpoints, the
    weight sync) do not change and FSDP2's hooks, which run around a layer's forward in
    Module.__call__, stay outside the compiled code. The layers share one class's code, so
    Dynamo compiles it once, not once per layer (modules are inlined as inputs:
    torch._dynamo.config.inline_inbuilt_nn_modules, on by default).

    Under FSDP2 this needs parallel.as_plain_modules (called by parallel.shard): FSDP2's mark for
    Dynamo made a layer's head count a symbol, on which Inductor's flex_attention lowering failed.
    With it, on an H200 (torch 2.11, docs/RESULTS.md), FSDP2 on one rank reached MFU 0.43-0.44 at
    Qwen2.5-1.5B, against 0.40 with only each layer's norms and MLP compiled (the earlier way).
    """
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)


def check_folder_code(cfg, source, sets):
    """A config that came with a run folder (eval --run, train.py --replay's dump), not from the
    command line: its model.trust_remote_code would run the Python files of that folder's
    checkpoints (transformers' auto_map) as its model loads. Refused unless `sets` (the command's
    --set) turn it on too."""
    key = "model.trust_remote_code"
    allowed = read_config(
        None, [s for s in sets if s.startswith(key + "=")]
    ).model.trust_remote_code
    if cfg.model.trust_remote_code and not allowed:
        raise ConfigError(
            f"{source} sets {key}: true: loading its model runs the Python files in its "
            f"checkpoint folders. Read them first; to run them, add --set {key}=true"
        )


def load_tokenizer(cfg, path, chars=TINY_CHARS):
    """The tokenizer of the model at `path` (a HF folder, or `tiny`'s, rebuilt of `chars`: for a
    folder with a Qwen2 config.json, AutoTokenizer returns Qwen2Tokenizer, whose byte-level
    pre-tokenizer and normalisation change the ids)."""
    if cfg.model.path == "tiny":
        return build_char_tokenizer(chars)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    # no such folder or hub id, a folder without tokenizer files (ValueError): named
    # (assemble.setup loads it first)
    except (OSError, ValueError) as e:
        raise unloadable(path, e) from None


def unloadable(path, error):
    """The ModelError for a model or tokenizer at `path` that transformers could not load."""
    reason = str(error).strip().partition("\n")[0] or type(error).__name__  # (a bare ValueError())
    return ModelError(f"model.path={path!r} could not be loaded: {reason}")


def check_attention(cfg, device):
    """Fail before the first step where the configured attention cannot train on `device`."""
    if cfg.model.attn_implementation == "flex_attention" and device.type != "cuda":
        raise ModelError(
            "model.attn_implementation=flex_attention trains on a GPU only: torch's FlexAttention "
            "has no backward on CPU. Set model.attn_implementation=sdpa on this machine."
        )
    if cfg.train.shared_prefix and cfg.model.attn_implementation != "flex_attention":
        if device.type == "cuda":
            # a row holds whole groups, up to the budget wide (update.prefix_units): SDPA's dense
            # mask costs rows x width^2 (47,104^2 booleans at a 1.5B model's budget on an H200),
            # where FlexAttention's blocks cost what each segment reads
            raise ModelError(
                "train.shared_prefix under model.attn_implementation=sdpa would attend over dense "
                "rows as wide as the token budget: on a GPU set "
                "model.attn_implementation=flex_attention (or train.shared_prefix=false)"
            )
    if cfg.model.attn_implementation == "flex_attention" or cfg.train.compile:
        # transformers compiles flex_attention once (integrations/flex_attention.py) and Dynamo
        # compiles a variant per grad mode and mask layout it meets (the update's micro-batches
        # vary in width; one BlockMask per micro-batch, update.packed_mask, keeps them few). Past
        # recompile_limit (8 by default) it would silently run the unfused path that builds the
        # full [T, T] scores. train.compile's head likewise: one function for the policy and the
        # frozen KL reference, a variant per grad mode, weight that trains or not, 0 or 1 head
        # positions (8 are reached with 2 minibatches and a KL term; past them: eager, slower).
        # Raised deliberately, a process-wide setting
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)


def build_optimizer(policy, t):
    """AdamW over the fp32 masters, and its learning-rate schedule (`lr_factor`)."""
    optimizer = torch.optim.AdamW(
        [p for p in policy.parameters() if p.requires_grad],  # with LoRA: the adapters alone
        lr=t.lr,
        betas=(t.adam_beta1, t.adam_beta2),
        weight_decay=t.weight_decay,
    )
    num_updates = t.steps * t.num_minibatches
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda update: lr_factor(update, num_updates, t)
    )
    return optimizer, scheduler


def lr_factor(update, num_updates, t):
    """The learning rate of optimizer step `update` (0-based, of `num_updates`) as a fraction of
    `t.lr`: a linear warmup over the first `t.warmup_steps` steps' updates (`t.num_minibatches`
    each), then constant, or a cosine from 1 down to `t.min_lr_ratio` at the last update, begun
    where the warmup ends (as nanoGPT's get_lr). The decay is why the CPU demo ends where it
    peaked (configs/tiny.yaml)."""
    warmup = t.warmup_steps * t.num_minibatches
    if update < warmup:
        return (update + 1) / warmup
    if t.lr_schedule == "constant":
        return 1.0
    decay = num_updates - 1 - warmup  # updates after the first past the warmup
    progress = min((update - warmup) / decay, 1.0) if decay > 0 else 1.0
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return t.min_lr_ratio + (1.0 - t.min_lr_ratio) * cosine
