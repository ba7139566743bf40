"""The memory benchmarks and estimates that issue 10 names: their output lines, and the GPU configs'
estimated headroom on an 80 GB card."""

import os
import re
import runpy
import sys
import types

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(capsys, monkeypatch, script, *args):
    """The lines `python <script> <args>` prints, run in this process (the suite has torch and
    transformers imported already: a subprocess spent most of its 7-17 s importing them)."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", [script, *args])
    monkeypatch.setattr(sys, "path", [os.path.dirname(os.path.join(REPO, script)), *sys.path])
    capsys.readouterr()
    runpy.run_path(script, run_name="__main__")
    return capsys.readouterr().out.strip().splitlines()


@pytest.mark.parametrize("config", ["configs/gsm8k.yaml", "configs/gsm8k_tool.yaml"])
def test_gpu_configs_leave_15_percent_headroom_on_80_gb(config, capsys, monkeypatch):
    """bench/estimate_memory.py on each shipped GPU config, 1 and 8 ranks: the peak (the largest
    phase) leaves at least 15% of an 80 GB card free, and the breakdown names the activations and
    the engine's KV cache."""
    lines = run_bench(
        capsys, monkeypatch, "bench/estimate_memory.py", "--config", config, "--ranks", "8"
    )
    estimates = [
        dict(re.findall(r"(\w+)=(\S+)", line)) for line in lines if line.startswith("estimate:")
    ]
    assert [e["ranks"] for e in estimates] == ["1", "8"]
    for e in estimates:
        assert float(e["headroom"]) >= 0.15, e
        assert float(e["peak_gib"]) == max(
            float(e[k]) for k in ("rollout_gib", "train_gib", "sync_gib")
        )
    assert any("activations" in line for line in lines) and any(
        "engine KV cache" in line for line in lines
    )


def test_gradient_checkpointing_lowers_the_train_estimate():
    """Turning train.gradient_checkpointing on lowers the estimated train-phase memory (in this
    process: the bench's command line runs in the test above)."""
    from assemble import load_config
    from runtime.estimate import H100_80GB_GIB, estimate

    def train_bytes(checkpointing):
        sets = [
            "data.train_path=unused",
            "train.max_tokens_per_micro_batch=4096",  # auto would fill the card
            f"train.gradient_checkpointing={checkpointing}",
        ]
        cfg = load_config(os.path.join(REPO, "configs/gsm8k.yaml"), sets)
        return estimate(cfg, 1, H100_80GB_GIB * 2**30)[1]["train"]

    assert train_bytes(True) < train_bytes(False)


def test_all_at_once_counts_the_kv_cache_it_wakes_during_the_sync():
    """memory.mode=all_at_once wakes the KV cache (and CUDA graphs) with the engine's weights, while
    the trainer's weights are still on the card: its sync phase holds them on top of staged's (it
    was estimated as staged's, the KV cache left out)."""
    from assemble import load_config
    from runtime.estimate import H100_80GB_GIB, estimate

    def sync_phase(mode):
        sets = ["data.train_path=unused", f"memory.mode={mode}"]
        cfg = load_config(os.path.join(REPO, "configs/gsm8k.yaml"), sets)
        parts, phases = estimate(cfg, 8, H100_80GB_GIB * 2**30)
        return phases["sync"], parts["engine KV cache"] + parts["engine CUDA graphs"]

    staged, engine_memory = sync_phase("staged")
    all_at_once, _ = sync_phase("all_at_once")
    assert engine_memory > 10 * 2**30 and all_at_once == staged + engine_memory


def test_the_top_p_term_counts_the_kept_top_k_of_every_token_with_the_losss_constants():
    """The estimate's copies of loss.py's constants (runtime/ imports no stage) are loss.py's, and
    with top_p < 1 its nucleus term grows by each token's kept top-k (loss.keep_nucleus_search:
    NUCLEUS_TOP_K bf16 values and int64 indices) as the micro-batch grows."""
    import inspect

    import loss
    from assemble import load_config
    import runtime.estimate as estimate

    assert estimate.NUCLEUS_TOP_K == loss.NUCLEUS_TOP_K
    head = inspect.signature(loss.head_logprobs).parameters
    assert estimate.CHUNK_TOKENS == head["chunk_tokens"].default

    def nucleus_bytes(tokens, top_p):
        sets = ["data.train_path=unused", f"rollout.top_p={top_p}"]
        # (gsm8k.yaml's TIS on resumed tokens is refused at top_p < 1: older tokens masked)
        sets += ["train.max_token_staleness=0"] if top_p < 1 else []
        cfg = load_config(os.path.join(REPO, "configs/gsm8k.yaml"), sets)
        parts, phases = estimate.estimate(cfg, 1, estimate.H100_80GB_GIB * 2**30, budget=tokens)
        return parts["top-p nucleus (chunked head)"], phases["train"]

    assert nucleus_bytes(4096, 1.0)[0] == 0
    per_token = estimate.NUCLEUS_TOP_K * (2 + 8)  # gsm8k.yaml computes in bf16
    assert nucleus_bytes(8192, 0.9)[0] - nucleus_bytes(4096, 0.9)[0] == 4096 * per_token
    # and the train phase (what `auto` and the over-the-card warning read) holds it
    term, with_nucleus = nucleus_bytes(4096, 0.9)
    assert with_nucleus - nucleus_bytes(4096, 1.0)[1] == term > 0


# a smaller vocabulary than Qwen's (the full run needs ~12 GB and a minute), same sequence and
# micro-batch
@pytest.mark.background(
    "train_memory_bench",
    [sys.executable, "bench/train_memory.py", "--vocab", "16384", "--device", "cpu"],
)
def test_train_memory_bench_chunked_path_peaks_under_half_the_old_one(background_runs):
    """bench/train_memory.py on a 16k vocabulary ends with the issue's line, in which the chunked
    log-prob path peaks at less than half the memory of the full-logits path and the ratio
    printed is new / old."""
    line = background_runs.lines("train_memory_bench")[-1]
    match = re.fullmatch(
        r"train_memory: vocab=16384 seq_len=1024 micro_batch=4 old_peak_bytes=(\d+) "
        r"new_peak_bytes=(\d+) ratio=([\d.]+)",
        line,
    )
    assert match, line
    old = int(match[1])
    new = int(match[2])
    ratio = float(match[3])
    assert 0 < new < 0.5 * old and ratio == pytest.approx(new / old, abs=1e-3)


def test_auto_budget_fills_the_card_within_the_margin():
    """train.max_tokens_per_micro_batch: auto is the largest multiple of 1,024 tokens whose
    estimated train phase fits 85% of the card: one step more does not; a bigger card or more
    ranks (sharded state) get a bigger budget, and so do compiled layers (they save less); without
    a GPU the trainer takes 4,096."""
    sys.path.insert(0, REPO)
    import runtime.estimate as estimate
    import assemble as setup_run
    import runtime.model as model
    from assemble import load_config

    cfg = load_config(
        os.path.join(REPO, "configs", "gsm8k.yaml"),
        ["data.train_path=unused", "train.max_tokens_per_micro_batch=auto", "train.compile=false"],
    )
    card = estimate.H100_80GB_GIB * 2**30
    budgets = {}
    for ranks, gib in ((1, 79.2), (8, 79.2), (1, 139.8)):
        budget = estimate.auto_budget(cfg, ranks, gib * 2**30)
        train = lambda tokens: estimate.estimate(cfg, ranks, gib * 2**30, budget=tokens)[1]["train"]
        assert budget % 1024 == 0 and budget >= estimate.longest_sequence(cfg)
        assert train(budget) <= 0.85 * gib * 2**30 < train(budget + 1024)
        budgets[ranks, gib] = budget
    assert budgets[1, 79.2] < budgets[8, 79.2] and budgets[1, 79.2] < budgets[1, 139.8]
    cfg.train.compile = True  # one rank: compiled layers
    assert estimate.auto_budget(cfg, 1, card) > budgets[1, 79.2]
    cfg.train.compile = False
    # the estimate of an auto config is that of its budget
    assert estimate.estimate(cfg, 1, card) == estimate.estimate(
        cfg, 1, card, budget=budgets[1, 79.2]
    )
    tiny = load_config(
        os.path.join(REPO, "configs", "tiny.yaml"), ["train.max_tokens_per_micro_batch=auto"]
    )
    setup_run.trainer_only(tiny, model.build_policy(tiny, None)[0])
    assert tiny.train.max_tokens_per_micro_batch == estimate.CPU_AUTO_TOKENS


def test_lora_fits_a_7b_policy_on_one_80_gb_card_where_full_training_does_not():
    """runtime/estimate.py with model.lora_rank (the base frozen in bf16, fp32 state for the
    adapters alone, the reference without a copy): Qwen2.5-7B with rank-64 adapters on every
    projection fits one 80 GB card beside its engine, 15% left; full fine-tuning does not fit
    even at a 1,024-token micro-batch (fp32 masters, gradients and AdamW state: 113 GiB)."""
    from assemble import load_config
    from runtime.estimate import H100_80GB_GIB, estimate

    card = H100_80GB_GIB * 2**30
    # with a KL term: a LoRA run's reference is the policy, adapters off (no second model)
    sets = ["data.train_path=unused", "model.path=Qwen/Qwen2.5-7B-Instruct", "train.kl_coef=0.01"]
    full = load_config(os.path.join(REPO, "configs/gsm8k.yaml"), sets)
    full.train.max_tokens_per_micro_batch = 1024
    assert max(estimate(full, 1, card)[1].values()) > card
    cfg = load_config(os.path.join(REPO, "configs/gsm8k.yaml"), [*sets, "model.lora_rank=64"])
    parts, phases = estimate(cfg, 1, card)
    assert max(phases.values()) <= 0.85 * card
    adapters = parts["AdamW state (fp32, sharded)"] / 8  # two fp32 moments per parameter
    assert 150e6 < adapters < 170e6  # 28 layers x 64 x (in + out) of 7 projections: 161.5 M
    assert parts["KL reference (sharded)"] == 0
    # autocast caches a bf16 copy of each fp32 leaf a matmul reads: the adapters', not the base's
    assert parts["autocast weight copies"] == adapters * 2


def test_the_lora_estimate_counts_what_trains_in_full_too():
    """The estimate's trained parameters (its AdamW state / 8) are those the LoRA policy trains:
    the adapters and what model.lora_also_train trains in full (configs/tiny_lora.yaml: the norms
    and the embedding, 16 bytes each with gradients and AdamW state, not the base's 2-4), by any
    part of a name (`self_attn`, `mlp`, `bias`, `embed` counted 0: the estimate's names lacked the
    blocks; a block of adapted layers is refused, so the attention alone is adapted there). With
    a KL, a reference that is a second adapted model (the base moves) is counted
    byte for byte; with two ranks, the embedding's root gradient wherever a part names it."""
    import runtime.model as model
    from assemble import load_config
    from runtime.estimate import estimate, shape_of

    attention = "model.lora_targets=[q_proj,k_proj,v_proj]"
    for also, *targets in (
        ("[norm,embed_tokens]",),
        ("[norm]",),
        ("[]",),
        ("[self_attn.o_proj]", attention),
        ("[mlp]", attention),
        ("[bias]",),
        ("[embed]",),
    ):
        sets = [f"model.lora_also_train={also}", "train.kl_coef=0.1", *targets]
        cfg = load_config(os.path.join(REPO, "configs/tiny_lora.yaml"), sets)
        policy, _ = model.build_policy(cfg, None)
        shape = shape_of(policy.config)
        parts, _ = estimate(cfg, 1, 80 * 2**30, shape=shape, budget=1024)
        trained = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        assert parts["AdamW state (fp32, sharded)"] / 8 == trained, also
        reference = model.build_reference(cfg, policy)
        own = [p for p in reference.parameters()] if also != "[]" else []  # [] : lora.Base
        real = sum(p.numel() * p.element_size() for p in own)
        assert parts["KL reference (sharded)"] == real, also
        parts, _ = estimate(cfg, 2, 80 * 2**30, shape=shape, budget=1024)
        root = [p for n, p in policy.named_parameters() if ".layers." not in n and p.requires_grad]
        root_gradient = parts["root gradient, unsharded fp32 (reduce-scatter)"]
        assert root_gradient == 4 * sum(p.numel() for p in root), also


def small_configs():
    """One small config per family the estimate must count as transformers builds it: Qwen2 (q,
    k and v biases, tied), Qwen3 (head_dim 32 where hidden / heads is 16, q and k norms), Llama
    and Mistral (no biases, an output head of their own); the suite's small Qwen2's shape, whose
    MLP weights are larger than its embedding of 96 tokens."""
    import transformers
    from qwen_tiny import SHAPE

    common = dict(vocab_size=96, **SHAPE)
    return {
        "qwen2": transformers.Qwen2Config(tie_word_embeddings=True, **common),
        "qwen3": transformers.Qwen3Config(tie_word_embeddings=True, head_dim=32, **common),
        "llama": transformers.LlamaConfig(tie_word_embeddings=False, **common),
        "mistral": transformers.MistralConfig(tie_word_embeddings=False, **common),
    }


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "mistral"])
def test_the_estimate_counts_each_architecture_as_transformers_builds_it(family):
    """A model.path of another family (Qwen3's head_dim of 128 is not hidden / heads at 0.6B and
    4B; Llama has no attention biases) gets its own parameters counted: the fp32 masters are 4
    bytes per parameter of the model built from the config, the engine's KV cache per token is
    what the model's own cache holds per token, and a LoRA run's trained parameters are those
    runtime/lora.add_adapters makes trainable on that model (a formula from hidden / heads, as
    before, left out 9% of Qwen3-4B). On two ranks the root FSDP unit's gradient is that of
    every parameter outside the decoder layers: the embedding, the final norm and an untied head
    (it counted the embedding alone)."""
    import torch
    from transformers import AutoModelForCausalLM

    import runtime.lora as lora
    from assemble import load_config
    from runtime.estimate import estimate, shape_of

    config = small_configs()[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    shape = shape_of(config)
    cfg = load_config(os.path.join(REPO, "configs/tiny.yaml"), ["rollout.max_total_tokens=1000"])
    parts, _ = estimate(cfg, 1, 80 * 2**30, shape=shape, budget=1024)
    assert parts["trainer params (fp32, sharded)"] == 4 * sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        cache = model(torch.tensor([[1, 2, 3]]), use_cache=True).past_key_values
    cached = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers)
    assert parts["engine KV cache"] == 1000 * cached / 3 * 4  # fp32 engine, 1,000 tokens
    largest = max(p.numel() for p in model.parameters())  # a bucket holds bucket_mb and one more
    assert parts["weight-sync bucket"] == cfg.memory.bucket_mb * 2**20 + largest * 4
    parts, _ = estimate(cfg, 2, 80 * 2**30, shape=shape, budget=1024)
    root = [p for n, p in model.named_parameters() if ".layers." not in n]  # parallel.shard's
    assert parts["root gradient, unsharded fp32 (reduce-scatter)"] == 4 * sum(
        p.numel() for p in root
    )
    lora_cfg = load_config(
        os.path.join(REPO, "configs/tiny_lora.yaml"), ["model.lora_also_train=[norm]"]
    )
    m = lora_cfg.model
    lora.add_adapters(model, m.lora_rank, m.lora_alpha, m.lora_targets, torch.float32, ["norm"])
    parts, _ = estimate(lora_cfg, 1, 80 * 2**30, shape=shape, budget=1024)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert parts["AdamW state (fp32, sharded)"] / 8 == trained


def saved_values_per_token(config, tokens=128):
    """What autograd saves in an fp32 forward through the decoder layers of the model `config`
    describes, in values per token per layer: each storage once, the model's own parameters
    left out."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    own = {p.data_ptr() for p in model.parameters()}
    kept = {}

    def pack(tensor):
        if tensor.data_ptr() not in own:
            kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.model(input_ids=torch.randint(0, config.vocab_size, (1, tokens)))
    return sum(kept.values()) / 4 / tokens / config.num_hidden_layers


def test_the_activation_rule_follows_what_a_mixture_of_experts_saves():
    """estimate.saved_per_token against what autograd saves (CPU, fp32): each mixture of experts
    (Qwen3 MoE as Qwen3-30B-A3B, 8 experts of 96 a token where the dense width is 768; Qwen2 MoE
    with a shared expert; Mixtral, 2 of 8 experts of the dense width) is within 8% of its dense
    family's measured / rule ratio (the GPU-fitted ACTIVATION_FACTOR is that ratio's). The dense
    rule, which read the config's intermediate_size, had them 1.6-2.0x their family's: 8 routed
    widths, and each routed copy's hidden states gathered in and out."""
    import transformers

    from runtime.estimate import shape_of

    common = dict(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        intermediate_size=768,
    )
    moe = dict(num_experts_per_tok=8, moe_intermediate_size=96, num_experts=16)
    pairs = {
        "qwen3": (
            transformers.Qwen3Config(head_dim=64, **common),
            transformers.Qwen3MoeConfig(head_dim=64, **common, **moe),
        ),
        "qwen2": (
            transformers.Qwen2Config(**common),
            transformers.Qwen2MoeConfig(shared_expert_intermediate_size=384, **common, **moe),
        ),
        "llama": (
            transformers.LlamaConfig(**common),
            transformers.MixtralConfig(num_local_experts=8, num_experts_per_tok=2, **common),
        ),
    }
    for family, (dense, experts) in pairs.items():
        ratio = {}
        for name, config in (("dense", dense), ("experts", experts)):
            rule = shape_of(config).saved
            assert len(rule) == config.num_hidden_layers
            ratio[name] = saved_values_per_token(config) / (sum(rule) / len(rule))
        assert abs(ratio["experts"] / ratio["dense"] - 1) < 0.08, (family, ratio)


def test_fsdp_keep_gathered_off_counts_the_root_and_two_layers_and_is_offered_when_over():
    """With train.fsdp_keep_gathered off, an FSDP2 rank holds gathered the root unit (everything
    outside the decoder layers, kept from its forward to its backward) and two decoder layers
    (one computing, the next one's all-gather in flight), in the compute dtype, counted from the
    model transformers builds; the whole model with it on. Over the card on several ranks, the
    switch is a lever; on one rank (no FSDP2) or already off, it is not."""
    from transformers import AutoModelForCausalLM

    from assemble import load_config
    from runtime.estimate import estimate, levers, shape_of

    config = small_configs()["llama"]
    built = AutoModelForCausalLM.from_config(config)
    shape = shape_of(config)
    root = sum(p.numel() for n, p in built.named_parameters() if ".layers." not in n)
    layer = sum(p.numel() for p in built.model.layers[0].parameters())
    gathered = "FSDP units gathered for the update"
    for keep, expected in [
        (True, sum(p.numel() for p in built.parameters())),
        (False, root + 2 * layer),
    ]:
        sets = ["rollout.max_total_tokens=1000", "model.compute_dtype=bfloat16", "run.nproc=2"]
        cfg = load_config(
            os.path.join(REPO, "configs/tiny.yaml"), sets + [f"train.fsdp_keep_gathered={keep}"]
        )
        assert estimate(cfg, 2, 80 * 2**30, shape=shape, budget=1024)[0][gathered] == 2 * expected
        assert ("train.fsdp_keep_gathered=false" in levers(cfg, "train", ranks=8)) is keep
        assert "train.fsdp_keep_gathered=false" not in levers(cfg, "train", ranks=1)


def test_a_run_that_cannot_fit_the_card_is_warned_with_what_lowers_it(caplog):
    """assemble.size_micro_batches with an 80 GB card (what setup passes on a GPU, before the
    engine starts): the shipped GPU config on 1 and 8 ranks gets its `auto` budget and no
    warning; Qwen2.5-7B trained in full on one card (train phase ~138 GiB at the longest
    sequence, where a smaller budget changes nothing) is warned, naming the phase, the bench
    command for this card and rank count, and only the levers that would lower it; with LoRA,
    nothing; a KV pool larger than the card names the rollout; memory.mode off names the whole
    peak and the staged mode."""
    import types

    import runtime.estimate as estimate
    from assemble import load_config, size_micro_batches

    card = estimate.H100_80GB_GIB * 2**30
    sets = [f"data.train_path={os.path.join(REPO, 'tests/data/gsm8k_train_100.jsonl')}"]
    seven_b = "model.path=Qwen/Qwen2.5-7B-Instruct"

    def setup_warnings(*more):
        """What size_micro_batches logs at WARNING for gsm8k.yaml with `more`, and its budget."""
        cfg = load_config(os.path.join(REPO, "configs/gsm8k.yaml"), sets + list(more))
        known = estimate.KNOWN_SHAPES[
            cfg.model.path if "7B" in cfg.model.path else "Qwen/Qwen2.5-1.5B-Instruct"
        ]
        policy = types.SimpleNamespace(config=estimate.qwen2_config(known))
        caplog.clear()
        with caplog.at_level("WARNING", logger="setup"):
            size_micro_batches(cfg, policy, card)
        return [r.getMessage() for r in caplog.records], cfg.train.max_tokens_per_micro_batch

    warnings, budget = setup_warnings()
    assert warnings == [] and budget % estimate.AUTO_STEP == 0  # auto sized for the card
    cfg = load_config(os.path.join(REPO, "configs/gsm8k.yaml"), sets)
    assert estimate.over_the_card(cfg, 8, card) is None
    (full,), budget = setup_warnings(seven_b)
    assert budget == estimate.longest_sequence(cfg)  # the floor: nothing smaller fits either
    assert full.startswith("the estimated train phase is 138.")
    assert "--ranks 1 --gpu-gib 79.2" in full and "LoRA (model.lora_rank)" in full
    assert "train.gradient_checkpointing" in full and "max_tokens_per_micro_batch" not in full
    (checkpointed,), _ = setup_warnings(seven_b, "train.gradient_checkpointing=true")
    assert "gradient_checkpointing" not in checkpointed
    assert setup_warnings(seven_b, "model.lora_rank=64")[0] == []
    (pool,), _ = setup_warnings("rollout.max_total_tokens=10000000")
    assert "rollout phase" in pool and "rollout.max_total_tokens" in pool
    (everything,), _ = setup_warnings(seven_b, "memory.mode=off")
    assert "memory.mode: off holds it all" in everything
    assert everything.endswith("memory.mode: staged would lower it")


def test_an_mlp_with_biases_is_counted_as_without():
    """A down_proj bias (Llama's mlp_bias) is no MLP width: the rule reads the weight (the bias
    made shape_of raise an IndexError at every GPU setup)."""
    import transformers

    from runtime.estimate import shape_of

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    biased = shape_of(transformers.LlamaConfig(mlp_bias=True, **small)).saved
    assert biased == shape_of(transformers.LlamaConfig(**small)).saved == (10 * 64 + 4 * 128,) * 2


@pytest.mark.parametrize(
    "case, layer_input_bytes",
    [("one rank", 4), ("FSDP2", 2), ("LoRA", 2), ("LoRA, embedding trained", 4)],
)
def test_checkpointed_layer_inputs_are_counted_in_the_residual_streams_dtype(
    case, layer_input_bytes
):
    """With gradient checkpointing each decoder layer's input is what stays saved: the estimate
    counts it in the dtype a bf16 forward really hands the layers (a hook reads it). One rank runs
    autocast over fp32 weights, where the embedding's output, and so the residual stream, stays
    fp32 (counted at 2 bytes, `auto` filled an 80 GB card past its size); FSDP2 computes with bf16
    weights; a LoRA base is stored in bf16, unless its embedding trains in full."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    import qwen_tiny
    import runtime.lora as lora
    from runtime.estimate import residual_bytes, shape_of

    config = Qwen2Config(**qwen_tiny.SHAPE, vocab_size=64, tie_word_embeddings=False)
    policy = AutoModelForCausalLM.from_config(config)
    lora_rank, also = (
        (4, ["embed_tokens"] if "embedding" in case else []) if "LoRA" in case else (0, [])
    )
    if lora_rank:
        lora.add_adapters(policy, lora_rank, 8, ["q_proj"], torch.bfloat16, also)
    elif case == "FSDP2":  # its mixed-precision policy gathers each unit in the compute dtype
        policy.to(torch.bfloat16)
    seen = []
    for layer in [*policy.model.layers, policy.model.norm]:
        layer.register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(
                (args or (kwargs["hidden_states"],))[0].element_size()
            ),
            with_kwargs=True,
        )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        policy(torch.tensor([[1, 2, 3]]))
    m = types.SimpleNamespace(lora_rank=lora_rank, lora_also_train=also)
    counted = residual_bytes(m, shape_of(config), sharded=case == "FSDP2", compute=2)
    assert seen == [layer_input_bytes] * 3 and counted == layer_input_bytes


def test_a_model_that_cannot_name_its_embedding_gets_the_usual_name():
    """estimate.input_embedding: a remote-code model transformers cannot resolve raises
    NotImplementedError from get_input_embeddings; the shape then takes the usual name (read only
    for model.lora_also_train) instead of failing every estimate."""
    import torch

    from runtime.estimate import input_embedding

    class Unresolved(torch.nn.Module):
        def get_input_embeddings(self):
            raise NotImplementedError

    class Named(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(4, 2)

        def get_input_embeddings(self):
            return self.wte

    assert input_embedding(Unresolved()) == "model.embed_tokens.weight"
    assert input_embedding(Named()) == "wte.weight"


def test_sharded_terms_divide_by_the_ranks_and_checkpointing_saves_every_layers_input():
    """On 8 ranks each term named sharded is an eighth of one rank's (the same policy sharded:
    both estimated as FSDP2 shards), and with gradient checkpointing the activations are each
    layer's input and the final norm's (layers + 1, in the residual stream's dtype) plus one
    layer's recompute: a reviewer found both formulas free to change under every test (the
    gradients counted unsharded, the final norm's input dropped)."""
    from assemble import load_config
    from runtime.estimate import H100_80GB_GIB, estimate, model_shape, residual_bytes

    sets = ["data.train_path=unused", "train.max_tokens_per_micro_batch=4096"]
    cfg = load_config(os.path.join(REPO, "configs/gsm8k.yaml"), sets)
    gpu = H100_80GB_GIB * 2**30
    one, _ = estimate(cfg, 1, gpu, sharded=True)
    eight, _ = estimate(cfg, 8, gpu, sharded=True)
    sharded = [name for name in one if name.endswith("sharded)")]
    assert "gradients (fp32, sharded)" in sharded and "AdamW state (fp32, sharded)" in sharded
    for name in sharded:
        assert eight[name] == pytest.approx(one[name] / 8), name

    def activations(checkpointing):
        cfg.train.gradient_checkpointing = checkpointing
        parts, _ = estimate(cfg, 1, gpu)
        return next(v for k, v in parts.items() if k.startswith("activations"))

    shape = model_shape(cfg.model.path)
    saved_input = residual_bytes(cfg.model, shape, False, 2) * shape.hidden
    # a dense model's layers save alike: without checkpointing, layers x one layer's
    one_layer = activations(False) / shape.layers
    expected = 4096 * (shape.layers + 1) * saved_input + one_layer
    assert activations(True) == pytest.approx(expected)
