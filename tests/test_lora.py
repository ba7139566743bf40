"""LoRA (model.lora_rank, runtime/lora.py): the adapters start as the base and train alone, merged
weights (a deployment's HF folder) compute what the adapters do, the KL reference is the policy
with its adapters off (equal to a separately built base, no second model), the fields LoRA reads
are refused without it, and a LoRA run trains on the real engine, which serves the base and the
adapter from its LoRA pool (the log-prob gap, the base's and the adapter's checksums), replays a
step and resumes exactly."""

import json
import re
import sys

import pytest
import torch

import runtime.lora as lora
import runtime.model as model
import update
from assemble import load_config
from config import ConfigError
from conftest import scratch, tiny_config
from test_packing import random_samples

LORA = ["model.lora_rank=4", "model.lora_alpha=8"]


def test_adapters_start_as_the_base_train_alone_and_merge_exactly(tmp_path):
    cfg = tiny_config(tmp_path, *LORA)
    base, _ = model.build_policy(tiny_config(tmp_path), None)
    policy, tokenizer = model.build_policy(cfg, None)
    ids = torch.randint(4, len(tokenizer), (2, 12), generator=torch.Generator().manual_seed(0))
    # B starts at zero: the adapted model is the base, exactly
    torch.testing.assert_close(policy(ids).logits, base(ids).logits, rtol=0, atol=0)
    layers = lora.adapted(policy)
    assert len(layers) == 7 * cfg.model.num_layers  # every projection of every decoder layer
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable == {f"{name}.lora_{x}" for name in layers for x in "AB"}
    optimizer, _ = model.build_optimizer(policy, cfg.train)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(trainable)
    frozen = {n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad}
    policy(ids, labels=ids).loss.backward()
    optimizer.step()
    for name, parameter in policy.named_parameters():
        if name in frozen:
            assert torch.equal(parameter, frozen[name]), name  # the base never moves
    assert all(m.lora_B.abs().sum() > 0 for m in layers.values())
    # the merged weights (what the engine serves and a HF folder holds) compute the same model
    merged = dict(lora.merged_weights(policy))
    assert not any(".lora_" in name for name in merged)
    base.load_state_dict(merged, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(base(ids).logits, policy(ids).logits, rtol=1e-5, atol=1e-5)
    # the update is scaled by alpha / rank (8 / 4), in the layer and in what the engine is told
    # (a reviewer found a scale of alpha consistent everywhere, so nothing else caught it)
    name, layer = next(iter(layers.items()))
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        update = 2.0 * x @ layer.lora_A.T @ layer.lora_B.T
        torch.testing.assert_close(
            layer(x), torch.nn.functional.linear(x, frozen[name + ".weight"], layer.bias) + update
        )
    assert lora.adapter_config(policy)["lora_alpha"] == 8 and lora.adapter_config(policy)["r"] == 4


def test_lora_also_train_trains_those_parameters_in_full(tmp_path):
    """model.lora_also_train (peft's modules_to_save): the named parameters train beside the
    adapters, fp32, and the engine gets them as they are."""
    cfg = tiny_config(tmp_path, *LORA, "model.lora_also_train=[norm,embed_tokens]")
    policy, _ = model.build_policy(cfg, None)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    full = {n for n in trainable if ".lora_" not in n}
    assert full == {n for n, _ in policy.named_parameters() if "norm" in n or "embed_tokens" in n}
    assert all(p.dtype == torch.float32 for n, p in policy.named_parameters() if n in full)
    assert full <= dict(lora.merged_weights(policy)).keys()


def test_with_bf16_compute_the_base_is_bf16_and_the_adapters_train_in_fp32(tmp_path):
    """model.compute_dtype=bfloat16 (the GPU configs'), on CPU: the frozen base is held in bf16
    (no fp32 master), the adapters in fp32, and an autocast forward and backward reaches them."""
    cfg = tiny_config(tmp_path, *LORA, "model.compute_dtype=bfloat16")
    policy, tokenizer = model.build_policy(cfg, None)
    dtypes = {n: p.dtype for n, p in policy.named_parameters()}
    assert all(d == torch.float32 for n, d in dtypes.items() if ".lora_" in n)
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if ".lora_" not in n)
    ids = torch.randint(4, len(tokenizer), (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        policy(ids, labels=ids).loss.backward()
    assert all(
        p.grad is not None and p.grad.dtype == torch.float32
        for n, p in policy.named_parameters()
        if ".lora_A" in n
    )


def test_the_reference_is_the_policy_with_its_adapters_off(tmp_path):
    """lora.Base(policy), the KL reference of a LoRA run, gives the log-probs of a base model built
    on its own, after the adapters trained; the policy's own differ."""
    cfg = tiny_config(tmp_path, *LORA)
    policy, _ = model.build_policy(cfg, None)
    with torch.no_grad():
        for module in lora.adapted(policy).values():
            module.lora_B.normal_(0, 0.05)  # as after training
    separate, _ = model.build_policy(tiny_config(tmp_path), None)
    samples, _ = random_samples(0)
    batch = update.micro_batches(samples, 16, 0)[0][0]  # (micro-batches, over-long count)
    with torch.no_grad():
        reference = update.sequence_logprobs(lora.Base(policy), batch, 1.0)[0]
        base = update.sequence_logprobs(separate, batch, 1.0)[0]
        adapted = update.sequence_logprobs(policy, batch, 1.0)[0]
    torch.testing.assert_close(reference, base, rtol=0, atol=1e-6)
    assert (adapted - base).abs().max() > 1e-3


def test_lora_fields_are_refused_without_lora():
    for item in ("model.lora_alpha=32", "model.lora_targets=[q_proj]"):
        with pytest.raises(ConfigError, match="read only with model.lora_rank > 0"):
            load_config("configs/tiny.yaml", [item])
    load_config("configs/tiny.yaml", [*LORA, "model.lora_targets=[q_proj,v_proj]"])
    # a scale alpha / rank past float32's range would make the untrained adapters' 0 x inf NaN
    with pytest.raises(ConfigError, match=r"model.lora_alpha=1e\+308.*<= 1000000.0"):
        load_config("configs/tiny.yaml", ["model.lora_rank=1", "model.lora_alpha=1e308"])
    # what SGLang's pool cannot serve alone (it skipped or refused them, so the engine sampled
    # without what trained): q, k or v without q_proj and v_proj; up_proj without gate_proj
    for targets, missing in (
        ("[v_proj]", "['q_proj']"),
        ("[q_proj,k_proj]", "['v_proj']"),
        ("[up_proj,down_proj]", "['gate_proj']"),
    ):
        with pytest.raises(ConfigError, match=re.escape(f"add {missing}")):
            load_config("configs/tiny.yaml", [*LORA, f"model.lora_targets={targets}"])
    load_config("configs/tiny.yaml", [*LORA, "model.lora_targets=[q_proj,v_proj,gate_proj]"])
    with pytest.raises(ConfigError, match="lora_targets=\\[\\]: name the linear layers"):
        load_config("configs/tiny.yaml", [*LORA, "model.lora_targets=[]"])
    # the output head is the embedding itself in the tiny model: a merged head would rewrite both
    with pytest.raises(ConfigError, match=r"\['lm_head'\] are not adapted"):
        load_config("configs/tiny.yaml", [*LORA, "model.lora_targets=[q_proj,lm_head]"])
    # a name the model does not have (a typo would train less than it says): refused once the
    # model is built, before any engine
    for item, message in (
        ("model.lora_targets=[q_proj,v_proj,k_prj]", r"\['k_prj'\] name no linear layer"),
        ("model.lora_also_train=[nrom]", r"\['nrom'\] are in no parameter's name"),
        # a part in an adapted weight's name would train it in full under its adapter: an empty
        # one, in every name, the whole model (a reviewer found '.' and 'weight' accepted)
        ("model.lora_also_train=[norm,'']", r"\[''\] would train the adapted weights in full"),
        ("model.lora_also_train=['.']", r"\['.'\] would train the adapted weights in full"),
        ("model.lora_also_train=[weight]", r"\['weight'\] would train the adapted weights"),
        ("model.lora_also_train=[layers]", r"'layers' is in model.layers.0.self_attn.q_proj"),
        ("model.lora_also_train=[' ']", r"\[' '\] are in no parameter's name"),
        # the tiny model's projections are 64 features on their smaller side
        ("model.lora_rank=65", r"lora_rank=65 is above every adapted layer's rank \(at most 64\)"),
    ):
        with pytest.raises(ConfigError, match=message):
            model.build_policy(load_config("configs/tiny.yaml", [*LORA, item]), None)


def test_the_engine_arguments_for_lora_on_each_device():
    """What start_sglang passes SGLang with LoRA (the GPU branch is not run here, its arguments
    are): on a GPU, the base backed up to host memory across a release (the sync pushes only the
    adapter) and SGLang's own LoRA backend; on CPU the torch_native backend. Without LoRA,
    neither."""
    from runtime.engine import engine_device_args

    pool = {"rank": 8, "targets": ("q_proj", "v_proj")}
    gpu, cpu = engine_device_args(True, 3, pool), engine_device_args(False, 0, pool)
    assert (
        gpu["enable_weights_cpu_backup"] and "lora_backend" not in gpu and gpu["base_gpu_id"] == 3
    )
    assert cpu["lora_backend"] == "torch_native" and "enable_weights_cpu_backup" not in cpu
    for args in (gpu, cpu):
        assert (
            args["enable_lora"] and args["max_lora_rank"] == 8 and args["max_loras_per_batch"] == 2
        )
        assert args["lora_target_modules"] == ["q_proj", "v_proj"] and args["lora_strict_loading"]
    plain = engine_device_args(True, 0, None)
    assert "enable_lora" not in plain and "enable_weights_cpu_backup" not in plain


LORA_RUN = scratch("lora_run")


@pytest.mark.background("lora_run", [sys.executable, "tests/lora_worker.py", LORA_RUN])
def test_a_lora_run_syncs_the_adapter_alone_and_resumes_exactly(background_runs):
    """Two steps of the demo with adapters, a KL reference, top-p 0.9 and partial rollout on an
    engine with SGLang's LoRA pool (tests/lora_worker.py, its own process: see there why): a
    cancelled tail is suspended; each step's sync loads the adapter alone (the engine loaded the
    base from its folder), the engine's log-probs through the adapter match the trainer's (gap at
    fp32 level), the base's checksums and the adapter's (on arrival, in the engine) hold every
    step, only the adapters move; its checkpoint holds the adapters alone, which eval serves on the
    base as training did (the merged model on demand); step 1 replays exactly; a resume from the
    checkpoint makes the uninterrupted run's next update, and one with another train.seed (the
    tiny base is rebuilt from it) is refused."""
    result = json.loads(background_runs.lines("lora_run")[-1])
    assert result["full_pushes"] == 0 and result["adapter"] == "policy_v2"
    # the engine serves base + adapter (its top-p nucleus too), to rounding (measured: > 0; a
    # step whose groups all wait for a suspended member trains no fresh token and logs 0)
    assert all(gap < 1e-4 for gap in result["gaps"]) and max(result["gaps"]) > 0
    # a cancelled tail was suspended for a later step (partial rollout; at step 0 every sample of
    # the untrained model may run to the same length and finish before the abort lands)
    assert max(result["suspended"]) > 0
    assert all(".lora_" in name for name in result["moved"])  # the base stays as built
    assert set(result["lora_B"]) <= set(result["moved"])
    assert result["resume_differs"] == []
    # the checkpoint holds what trains (the adapters) and their AdamW state, not the base: no
    # HF export, the adapter in peft's folder (equal to the policy's), the merged model on demand
    assert not any(name.endswith(".safetensors") for name in result["files"])
    assert {"adapter", "sharded", "trainer_state.pt", "config.yaml"} <= set(result["files"])
    assert result["sharded_model"] and all(".lora_" in k for k in result["sharded_model"])
    assert result["adapter_saved"]
    # eval serves the checkpoint as training served it: the base (the tiny one exported beside
    # the checkpoint) and the adapter in the engine's pool, checked on arrival; the merged export
    # (it was eval's: bf16 rounding of W + BA lost most of a small update) is for a deployment
    base, adapter, base_gap, served = result["eval_served"]
    assert base == "checkpoints/step_000002/base" and adapter == "policy_v2"
    assert base_gap == 0 and served
    assert result["weights"] == "checkpoints/step_000002/merged" and result["merged_gap"] < 1e-5
    # the tiny base is rebuilt from train.seed on resume: another seed would move it under the
    # trained adapters, so it is refused
    assert "train.seed=7, but" in result["other_seed"], result["other_seed"]
    # bit for bit on CPU: loss, gradient norm and the weights after, against step 2's checkpoint
    exact, weights_differ, loss, grad_norm = result["replay"]
    assert exact and weights_differ == 0 and grad_norm > 0, result["replay"]
    # every push carried the adapter's checksums (run.check_weights_every=1) and passed; one whose
    # bytes differ from their checksums ends the engine with a named error
    assert result["mismatch"].startswith("EngineDiedError"), result["mismatch"]
    stderr = background_runs.result("lora_run").stderr
    assert "[LORA-CHECK] rank0 adapter sync MISMATCH of 28 expected: 1 value-diff" in stderr


@pytest.mark.background(
    "lora_sync_bench",
    [sys.executable, "bench/lora_sync.py", "--hidden", "128", "--layers", "2", "--repeats", "1"],
)
def test_the_lora_sync_bench_pushes_fewer_bytes_and_serves_the_adapter(background_runs):
    """bench/lora_sync.py, small (its own engine, in the background): the adapter moves fewer
    bytes than the whole model, and the engine serves it (log-prob gap at fp32 level)."""
    line = background_runs.lines("lora_sync_bench")[-1]
    match = re.fullmatch(
        r"lora_sync: full_bytes=(\d+) adapter_bytes=(\d+) full_s=[\d.]+ adapter_s=[\d.]+ "
        r"bytes_ratio=[\d.]+ time_ratio=[\d.]+ gap=(\S+)",
        line,
    )
    assert match and int(match[1]) > int(match[2]) and float(match[3]) < 1e-4, line
