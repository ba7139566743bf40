"""Model families other than the demo's Qwen2 (bench/families.py builds each at the suite's small
shape): setup refuses by name what the trainer would train wrongly or not at all, the weight
check finds each engine tensor under the trainer's name for it (engine layouts read in SGLang's
model files), and a mixture of experts reaches the engine in its checkpoint's layout. The real
engine runs these families in bench/families.py (docs/RESULTS.md) and, for a Qwen3 mixture of
experts, in tests/test_own_task.py's countdown rehearsal."""

import functools
import os
import re
import sys
import warnings

import pytest
import safetensors.torch
import torch
import transformers

from conftest import REPO, tiny_config
import memory
import runtime.model as model
from runtime.engine import checkpoint_layout, weight_buckets

sys.path.insert(0, os.path.join(REPO, "bench"))
import families  # noqa: E402


def build(family, **fields):
    """A random model of `family` (bench/families.py's config, `fields` changed), in fp32."""
    config = families.family_config(family, vocab_size=300)
    for name, value in fields.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float()


@pytest.mark.parametrize(
    "family, refusal",
    [
        ("gemma2", r"changes the output head's logits \({'final_logit_softcapping': 30.0}\)"),
        ("granite", r"changes the output head's logits \({'logits_scaling': 4.0}\)"),
        ("llama_dynamic", r"rope_type 'dynamic' scales the rotary base for every position"),
        ("phi3_longrope_past", r"original_max_position_embeddings \(64\), which sequences"),
    ],
)
def test_setup_refuses_a_family_it_would_train_wrongly(family, refusal, tmp_path):
    """Gemma 2 soft-caps its logits and Granite scales them after the output head, where the
    update puts log-probs: they would be changed (the step-0 gap check stopped Granite only after
    the first rollout, blaming dtypes or rope). Dynamic NTK rope, and longrope past its original
    window, turn positions otherwise in the engine (the test below). Each is a ModelError from
    the check build_policy runs before the engine starts."""
    with pytest.raises(model.ModelError, match=refusal):
        model.check_family(tiny_config(tmp_path), build(family))


def test_setup_refuses_packing_for_a_model_that_carries_state_across_packed_sequences(tmp_path):
    """Qwen3-Next's linear-attention layers learn where a sequence starts from kernel arguments
    the trainer does not pass, not from position_ids restarting: packed behind another, a
    sequence scores otherwise than alone, which no later check names (the gap check blames
    dtypes, if a random model's gap shows it at all). Refused with packing, by name; padded rows
    (train.max_tokens_per_micro_batch=0) pass. The families that train pass packed (above)."""
    config = transformers.Qwen3NextConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=64,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"],
    )
    torch.manual_seed(0)
    hybrid = transformers.AutoModelForCausalLM.from_config(config).float()
    cfg = tiny_config(tmp_path)
    assert cfg.train.max_tokens_per_micro_batch  # the demo packs
    with pytest.raises(model.ModelError, match=r"a packed sequence scores otherwise behind"):
        model.check_family(cfg, hybrid)
    cfg.train.max_tokens_per_micro_batch = 0
    model.check_family(cfg, hybrid)
    cfg.model.attn_implementation = "flex_attention"  # (a GPU's): no mask for its linear layers
    with pytest.raises(model.ModelError, match=r"layers of kind \['linear_attention'\], where"):
        model.check_family(cfg, hybrid)


@pytest.mark.parametrize(
    "family, field",
    [("LlamaConfig", {"attention_dropout": 0.1}), ("MixtralConfig", {"router_jitter_noise": 0.01})],
)
def test_setup_refuses_a_forward_that_is_random_in_train_mode(family, field, tmp_path):
    """Dropout, or Mixtral's router jitter (which a scan of dropout fields missed), would make the
    trainer's log-probs random (the update's forwards run in train mode; the engine samples
    without): two train-mode forwards differ, refused with the fields that do it. A model in eval
    mode is put back in it."""
    from qwen_tiny import SHAPE

    config = getattr(transformers, family)(vocab_size=300, **SHAPE, **field)
    torch.manual_seed(0)
    policy = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with pytest.raises(
        model.ModelError, match=r"in train mode is random \(" + re.escape(str(field))
    ):
        model.check_family(tiny_config(tmp_path), policy)
    assert not policy.training


def test_setup_refuses_a_layout_without_decoder_layers_where_the_trainer_keeps_them(tmp_path):
    """GPT-2 keeps its blocks at transformer.h: named at setup (it stopped at the first weight
    check, as an engine holding another model)."""
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300)
    config.bos_token_id = config.eos_token_id = 0
    gpt2 = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(model.ModelError, match=r"\(GPT2LMHeadModel\) keeps no decoder layers"):
        model.check_family(tiny_config(tmp_path), gpt2)


def test_the_families_that_train_pass_the_setup_check(tmp_path):
    """Every family bench/families.py trains passes."""
    cfg = tiny_config(tmp_path)
    for family in set(families.FAMILIES) - families.REFUSED:
        model.check_family(cfg, build(family))


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_sliding_window_layers_get_their_window_in_packed_flexattention(family, monkeypatch):
    """Packed rows under FlexAttention: transformers hands a BlockMask to every layer as it is, so
    one document mask let Gemma 3's sliding-window layers (window 24 here; sequences up to 38
    tokens) attend past their window. update.packed_mask now gives each layer type its own mask (a
    Mistral with a window and no layer types: the windowed one for every layer), and the
    log-probs equal padded sdpa's, where transformers builds each layer's mask itself (forward:
    FlexAttention has no backward on CPU)."""
    import update
    from test_packing import packed, random_samples

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    policy = build(family, sliding_window=24).eval()
    samples, _ = random_samples(0)
    assert max(len(s.prompt_ids) + len(s.response_ids) for s in samples) > 24
    batch, layout = packed(samples)
    padded = update.collate([samples[i] for row in layout for i in row], pad_id=0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention on CPU says to compile it
        expected, _ = update.sequence_logprobs(policy, padded, 1.0)
        policy.set_attn_implementation("flex_attention")
        got, _ = update.sequence_logprobs(policy, batch, 1.0)
    real = batch["gathered"]
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=0)
    masks = batch["block_mask"]
    if family == "gemma3":  # one full and one sliding layer: a mask each
        assert isinstance(masks, dict) and set(masks) == {"full_attention", "sliding_attention"}
    else:
        assert masks.mask_mod.__name__ == "windowed"


def test_each_engine_tensor_is_found_under_the_trainers_name_for_it():
    """The weight check's map from the engine's tensor names (SGLang's layouts) to the trainer's:
    q, k, v fused by the engine from the trainer's three (Qwen2); fused already in the trainer
    (Phi-3: it tried the three parts, which Phi-3 does not hold, and refused every push); the
    experts' w13 and w2 (Qwen3 MoE); an engine name no trainer tensor makes, named, and an
    engine head of its own beside a trainer's tied one (SGLang's qwen3_moe never ties)."""
    name = memory.trainer_name
    qwen2 = dict(build("qwen2_untied").named_parameters())
    assert name("model.layers.0.self_attn.qkv_proj.weight", qwen2) == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
    ]
    phi3 = dict(build("phi3").named_parameters())
    for fused in ["self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"]:
        assert name(f"model.layers.1.{fused}", phi3) == f"model.layers.1.{fused}"
    moe = dict(build("qwen3_moe").named_parameters())
    assert name("model.layers.0.mlp.experts.w13_weight", moe) in moe
    assert moe[name("model.layers.0.mlp.experts.w2_weight", moe)].shape == (4, 64, 64)
    for engine_only in ["model.layers.0.mlp.experts.w13_weight", "model.vision_tower.weight"]:
        with pytest.raises(memory.WeightMismatchError, match="which no trainer tensor makes"):
            memory.trainer_tensor(engine_only, qwen2, torch.float32, lambda t: t)
    tied = dict(build("qwen3").named_parameters())  # its head is its embedding
    with pytest.raises(memory.WeightMismatchError, match="the trainer's head is its embedding"):
        memory.trainer_tensor("lm_head.weight", tied, torch.float32, lambda t: t)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3"])
def test_the_weight_push_sends_the_tensors_of_the_checkpoint_the_engine_loaded(family, tmp_path):
    """transformers 5 trains a mixture of experts with each layer's experts in one 3D tensor; its
    checkpoint (what the engine loads and takes in a push) holds one tensor per expert and
    projection. The push's buckets hold exactly what save_pretrained writes, bit for bit (they
    held the 3D tensors, which the engine has no name for: the run stopped at its first push). A
    dense model's are its parameters as they are."""
    build(family).save_pretrained(tmp_path)
    saved = safetensors.torch.load_file(os.path.join(tmp_path, "model.safetensors"))
    # as the trainer loads a model.path: from_pretrained keeps the conversions it applied
    policy = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    pushed = {}
    buckets = weight_buckets(
        list(policy.named_parameters()),
        torch.float32,
        1 << 30,
        lambda tensor: tensor,
        checkpoint_layout(policy),
    )
    for bucket, _ in buckets:
        pushed |= {name: tensor.clone() for name, tensor in bucket}
    assert sorted(pushed) == sorted(saved)
    assert all(torch.equal(pushed[name], saved[name]) for name in saved)
    if family == "qwen3_moe":
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in pushed


def test_mfu_counts_the_experts_a_token_is_routed_through():
    """bench/train_step.py's MFU counts 6 x matmul_params per token. For a mixture of experts
    that is what a token multiplies, num_experts_per_tok of each layer's experts (it counted them
    all: 2 of 4 routed, twice the experts' FLOPs): matmul_params, less the 1-D norm weights,
    equals the FLOPs torch's counter sees in a forward of one-token rows, over 2 per token
    (transformers' eager experts, whose per-expert matmuls the counter sees; attention's own
    FLOPs, which the MFU leaves out, are not in the count either: the counter has no formula for
    CPU SDPA)."""
    from torch.utils.flop_counter import FlopCounterMode

    from train_step import matmul_params

    policy = build("qwen3_moe")
    policy.set_experts_implementation("eager")
    rows = 64
    with FlopCounterMode(display=False) as counted, torch.no_grad():
        policy(input_ids=torch.randint(0, 300, (rows, 1)))
    vectors = sum(p.numel() for p in policy.parameters() if p.dim() == 1)
    assert matmul_params(policy) - vectors == counted.get_total_flops() / 2 / rows


def rotations(config, length):
    """Queries turned by transformers' rotary embedding (the trainer's) and by SGLang's (the
    engine's, built as its llama.py and qwen2.py build it: get_rope with the config's
    rope_parameters) at positions 0..length-1: the largest difference."""
    from sglang.srt.layers.rotary_embedding.factory import get_rope
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = transformers.AutoModelForCausalLM.from_config(config)
    head = config.hidden_size // config.num_attention_heads
    rope = dict(config.rope_parameters)
    engine = get_rope(head, head, config.max_position_embeddings, rope["rope_theta"], True, rope)
    torch.manual_seed(0)
    queries = torch.randn(1, config.num_attention_heads, length, head)
    cos, sin = model.model.rotary_emb(queries, torch.arange(length)[None])
    trainer, _ = apply_rotary_pos_emb(queries, queries, cos, sin)
    flat = queries[0].transpose(0, 1).reshape(length, -1)
    turn = getattr(engine, "forward_native", engine.forward)  # longrope's has forward only
    turned, _ = turn(torch.arange(length), flat.clone(), flat.clone())
    return (trainer - turned.reshape(length, -1, head).transpose(0, 1)[None]).abs().max().item()


@pytest.mark.parametrize(
    "family, rope",
    [
        ("llama", None),
        ("llama", {"rope_type": "linear", "factor": 4.0}),
        ("llama3_rope", None),
        ("qwen2_yarn", None),
        ("phi3_longrope", None),
        ("phi3_longrope_past", None),
        ("llama_dynamic", None),
    ],
)
def test_setup_lets_through_exactly_the_rotary_scalings_the_engine_turns_alike(
    family, rope, monkeypatch
):
    """For each rope type, SGLang's rotary embedding against transformers' at the lengths a run
    trains: bit for bit equal where model.rope_refusal lets the config through (default, linear,
    Llama 3's, YaRN, longrope within its original window), different where it refuses (dynamic
    NTK at any length; longrope one position past its window, where SGLang keeps the short
    factors and transformers takes the long ones; further past it both take the long ones, but
    for a whole batch, which is not the same batch in the engine and the trainer). The step-0
    log-prob gap check did not stop them: the small random models' log-probs barely depend on
    positions (bench/families.py ran dynamic NTK with a gap of 7.6e-4)."""
    from sglang.srt.layers.rotary_embedding import base

    # the engine's processes run with SGLANG_USE_CPU_ENGINE=1 (runtime/engine.py), which SGLang
    # reads once, at import, into base._is_cpu; without it, its rotary layer imports vLLM's kernels
    monkeypatch.setattr(base, "_is_cpu", True)
    config = families.family_config(family, vocab_size=300)
    if rope:
        config = transformers.LlamaConfig(**{**config.to_dict(), "rope_scaling": rope})
    text = config.get_text_config()
    original = text.rope_parameters.get("original_max_position_embeddings")
    for length in sorted({40, 300} if not original else {40, original + 1}):
        differ = rotations(text, length) > 0
        refused = model.rope_refusal(text, length) is not None
        assert differ == refused, (family, length, differ)
    if family in families.REFUSED:
        assert refused


def test_setup_refuses_an_output_head_that_computes_more_than_its_weights(tmp_path):
    """The update computes log-probs from the head's weight and bias (update.sequence_logprobs),
    never calling its forward: a head whose forward does more (here, doubles its logits) would
    be skipped, and the logits-after-the-head check saw nothing, as the model's logits are the
    head's."""

    class DoubledHead(torch.nn.Linear):
        def forward(self, hidden):
            return 2 * super().forward(hidden)

    policy = build("llama")
    old = policy.lm_head
    policy.lm_head = DoubledHead(old.in_features, old.out_features, bias=False)
    policy.lm_head.weight = old.weight
    with pytest.raises(model.ModelError, match=r"its output head \(DoubledHead\) computes more"):
        model.check_family(tiny_config(tmp_path), policy)


def test_a_latent_attention_cache_is_counted_as_sglang_keeps_it():
    """DeepSeek-V3's multi-head latent attention: SGLang caches kv_lora_rank + qk_rope_head_dim
    values a token per layer (MLATokenToKVPool), not K and V per head (128 heads of 64: 28x)."""
    from runtime.estimate import kv_values_per_token

    config = transformers.DeepseekV3Config(
        num_hidden_layers=3, kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=128
    )
    assert kv_values_per_token(config) == 3 * (512 + 64)


def test_a_rope_type_never_compared_with_the_engines_is_refused():
    """transformers has rope types beyond those the test above compares (proportional, Gemma
    4's): refused as never compared, not let through; the compared ones, per layer type too."""
    from types import SimpleNamespace

    unknown = SimpleNamespace(rope_parameters={"rope_type": "proportional", "rope_theta": 1e4})
    assert "rope_type 'proportional' was never compared" in model.rope_refusal(unknown, 100)
    per_layer = {"full_attention": {"rope_type": "default"}, "sliding_attention": {}}
    assert model.rope_refusal(SimpleNamespace(rope_parameters=per_layer), 100) is None
