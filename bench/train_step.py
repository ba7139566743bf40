"""One full update (old log-probs, then the minibatch's forward, backward and optimizer step),
padded micro-batches against packed ones (`train.max_tokens_per_micro_batch`), on the same samples
and weights.

Two length mixes: `demo`, one real rollout of the CPU demo (configs/tiny.yaml: its engine, its
initial policy, 32 prompts x 8); and `gsm8k`, synthetic GSM8K-like samples, one rank's share of
configs/gsm8k.yaml (8 prompts x 8 samples; prompts ~150 tokens, shared by a group; responses
log-normal around 250 with a tail to the 1,024-token budget) on a Qwen2-shaped model (4 layers of
256, grouped KV heads, tied embeddings) with a 32,000-token vocabulary (Llama's and Mistral's;
Qwen's 151,936 made one update take minutes on 2 cores). The padded arm runs the config with
`train.max_tokens_per_micro_batch=0` (micro-batches of `micro_batch_size` rows, each as wide as its
longest); the packed arm's budget is the padded arm's largest micro-batch on these samples (rows x
width), so neither computes on more positions at once (memory grows with positions, and with rows x
width^2 in attention's dense mask: both are then bounded alike). The packed arm gains twice: fewer
padding positions, and an output head that runs only where a response token is predicted
(`head_positions`). This small model spends most of its compute in the head (32,000 x 256 against 4
layers of 256), a real one much less (Qwen2.5-1.5B: about 15%), so on a GPU the second gain is
smaller. Times: medians of `--repeats` alternated pairs (the arms take turns going first), after a
warm-up update of each arm (a compiled head's first call is not timed). Peak
memory: the most bytes held in live tensors at once during one update (less what was held before
it), from the profiler's count of every CPU tensor allocation and free
(`torch.profiler.profile(profile_memory=True)`): exact and the same on every run, unlike the
resident set, which the C allocator's retained pages move by megabytes. Measured after the timed
updates, so lazy imports and first-call workspaces are not counted. The packed arm holds one thing
more at equal positions: the rotary tables (cos, sin) per packed position, 2 x positions x head_dim
floats, where the padded rows share one row's (their position ids are all 0..width-1). Run from the
repo root: `python bench/train_step.py`. The last line is the machine-readable summary: train_step:
mix=demo speedup=<f> padded_fraction=<f> mix=gsm8k speedup=<f> padded_fraction=<f> peak_ratio=<f>
(padded_fraction: the packed path's; peak_ratio: packed peak / padded peak, the larger of the two
mixes).

`--shape qwen2.5-1.5b` (or qwen2.5-3b, qwen2.5-7b, tiny) instead times the trainer half at a real
model's shape, on a GPU where there is one: the model built from the public config's numbers with
random weights (no download) and its real vocabulary, fp32 masters with bf16 compute and one
rank's GSM8K-shaped batch (`gsm8k_samples`) at configs/gsm8k.yaml's budget, as that config trains.
The arms (`shape_arms`; `--arms` picks some, in order), each on the same samples after `--warmups`
untimed updates: `baseline` (the update before issue 42: 4,096-token micro-batches, eager, pi_old
from a forward of its own), `now-<attention>` (the config as shipped, with sdpa and, on a GPU,
FlexAttention), `top_p` and `top_p-peaked` (top_p 0.9 on random and on peaked logits: PEAKED_NORM;
each times top_p 1 too on the same model, the two in turns, and prints their ratio, `top_p_ratio`),
`lora` (`--lora R`), `shared` (train.shared_prefix: each group's prompt computed once, timed against
it computed per sample on the same model, in turns, `shared_prefix_ratio`; its tok_s counts the
sequences' tokens, its mfu the positions computed, `computed`), `fsdp` and `fsdp-eager` (`--fsdp`:
FSDP2 on one rank, what each of N ranks computes). Each prints train tokens/s (the real tokens of
its timed updates over their total time; `update_s`: their mean), `mfu` by the issue's 6N convention
(6 x matmul parameters x those tokens / time / the card's dense bf16 peak, named on the line; the
output head counted at every token, as the anchors are; neither attention's own FLOPs nor a
baseline's pi_old forward counted), `mfu_run` (the same with the head counted only where it ran, at
`head_positions`: lower, by the prompts' share of the head's FLOPs), recompiles after the warm-up,
and the update's peak memory (`torch.cuda.max_memory_allocated`; nan on CPU, where nothing measures
it) beside bench/estimate_memory.py's train phase for the same config on one rank (sharded for the
FSDP2 arms), less the CUDA contexts it adds (the allocator never sees them). On a GPU it first
checks that one update of a small fp32 model with FlexAttention's packed rows, each sample whole
and with its group's prompt shared, gives the padded update's gradients (`parity`; on CPU, packed
sdpa's).
`--lora R` adds an arm training rank-R adapters on every projection of a bf16 base
(runtime/lora.py), its peak beside the estimate for model.lora_rank=R; its MFU counts 4 x
parameters per token, as a frozen weight gets no gradient. For Qwen2.5-7B on one 80 GB card,
where full fine-tuning does not fit: `--shape qwen2.5-7b --lora 64 --arms lora`.
It imports nothing from SGLang: `python bench/train_step.py --shape qwen2.5-1.5b` runs where torch
(>= 2.6) and transformers (>= 4.56) are installed. The last line: train_step_gpu: device=<name>
shape=<s> best=<the now- arm of highest mfu> baseline_mfu=<f> mfu=<f> fsdp_mfu=<f> tok_s=<f>
peak_gib=<f> estimate_gib=<f> (nan for an arm not run); before it, each top_p arm's ratio and
the shared arm's.
"""

import argparse
import atexit
import gc
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch
from packaging.version import Version

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import runtime.checkpoint as checkpoint  # noqa: E402
import estimate_memory  # noqa: E402  (bench/, beside this file)
from advantages import group_advantages  # noqa: E402
from metrics import local_values  # noqa: E402
import update as update_stage  # noqa: E402  (`update` is this file's padded/packed update)
from update import update_policy  # noqa: E402
import runtime.parallel as parallel  # noqa: E402
import assemble as setup_run  # noqa: E402
import task.data as tasks  # noqa: E402
import rollout  # noqa: E402
import runtime.model as model  # noqa: E402
import runtime.lora as lora  # noqa: E402
from assemble import load_config  # noqa: E402
from sample import Sample  # noqa: E402

VOCAB = 32_000  # the gsm8k mix's vocabulary
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (config, overrides); the gsm8k mix builds its own Qwen2-shaped model (see `policy_for`)
MIXES = {
    "demo": ("configs/tiny.yaml", []),
    "gsm8k": (
        "configs/gsm8k.yaml",
        # padded micro-batches of 4 rows (the packed arm's budget is their largest)
        ["data.train_path=unused", "model.compute_dtype=float32", "model.attn_implementation=sdpa"]
        + ["train.max_tokens_per_micro_batch=0", "train.micro_batch_size=4"],
    ),
}


def demo_samples(out_dir, num_prompts=0, seed=0):
    """One rollout of the CPU demo's first step (`num_prompts`: 0 = the demo's), from the real
    engine, with GRPO advantages of random rewards (the update's cost depends on the lengths, not
    the rewards)."""
    cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"), [f"run.out={out_dir}"])
    policy, tokenizer = model.build_policy(cfg, None)
    engine = rollout.RolloutEngine(
        checkpoint.export_for_engine(policy, tokenizer, out_dir), cfg.rollout, seed=seed
    )
    try:
        prompts = tasks.PromptStream(tasks.build_task(cfg, tokenizer).train_prompts, seed).take(
            num_prompts or cfg.rollout.prompts_per_step
        )
        samples, _ = engine.generate(
            [p.prompt_ids for p in prompts], cfg.rollout.group_size, 1.0, cfg.rollout.max_new_tokens
        )
    finally:
        engine.shutdown()
    return samples


def gsm8k_samples(num_samples=64, seed=0, vocab=VOCAB, response_median=None):
    """Groups of 8 sharing a prompt of ~N(150, 30) tokens, responses log-normal (median
    `response_median`; by default e^5.5, ~245, as GSM8K's) cut at the 1,024-token budget."""
    mu = 5.5 if response_median is None else math.log(response_median)
    rng = random.Random(seed)
    samples = []
    for i in range(num_samples):
        if i % 8 == 0:
            prompt = [
                rng.randrange(vocab) for _ in range(min(max(int(rng.gauss(150, 30)), 40), 512))
            ]
        num_response = min(max(int(rng.lognormvariate(mu, 0.7)), 1), 1024)
        samples.append(
            Sample(
                prompt,
                [rng.randrange(vocab) for _ in range(num_response)],
                [-1.0] * num_response,
                [1] * num_response,
                group_id=i // 8,
                trajectory_id=i,
            )
        )
    return samples


def policy_for(mix, cfg):
    """The mix's model, seeded: the demo's tiny model, or a small Qwen2 with Qwen's vocabulary."""
    if mix == "demo":
        return model.build_policy(cfg, None)[0]
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=704,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=2048,
        )
    ).float()


def train_on(trainer, samples, advantages):
    """update.update_policy on `samples` given their advantages (the step writes them on the
    samples)."""
    for sample, advantage in zip(samples, advantages.tolist()):
        sample.advantage = advantage
    return local_values(update_policy(trainer, samples, step=0))


def largest_padded_micro_batch(samples, size):
    """Positions (rows x width) of the padded arm's largest micro-batch: the packed arm's budget."""
    chunks = [samples[i : i + size] for i in range(0, len(samples), size)]
    return max(len(c) * max(len(s.prompt_ids) + len(s.response_ids) for s in c) for c in chunks)


def update(mix, samples, packed, on_start=None):
    """One update_policy from the seeded initial weights; returns (seconds, its stats)."""
    config, sets = MIXES[mix]
    cfg = load_config(os.path.join(ROOT, config), sets)
    cfg.train.max_tokens_per_micro_batch = (
        largest_padded_micro_batch(samples, cfg.train.micro_batch_size) if packed else 0
    )
    policy = policy_for(mix, cfg)
    run = setup_run.trainer_only(cfg, policy)
    advantages, _ = group_advantages(
        torch.randn(len(samples), generator=torch.Generator().manual_seed(0)),
        torch.tensor([s.group_id for s in samples]),
        torch.ones(len(samples), dtype=torch.bool),
    )
    if on_start:
        on_start()
    start = time.perf_counter()
    stats = train_on(run, samples, advantages)
    return time.perf_counter() - start, stats


def peak_bytes(mix, samples, packed):
    """The most bytes held in live CPU tensors during one update, above the count when it began
    (run after the timed updates of both arms: first-call allocations are not the update's)."""
    return profiled(lambda: update(mix, samples, packed))[1]


def profiled(fn):
    """(fn(), the most bytes its CPU tensors held at once above the count when it began), from the
    profiler's count of every allocation and free (`profile_memory=True`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    with tempfile.TemporaryDirectory() as out_dir:
        trace = os.path.join(out_dir, "trace.json")
        prof.export_chrome_trace(trace)  # its "[memory]" events carry the allocator's running total
        with open(trace) as f:
            totals = [
                e["args"]["Total Allocated"]
                for e in json.load(f)["traceEvents"]
                if e.get("name") == "[memory]"
            ]
    return result, max(totals) - totals[0]


# --shape: the trainer half at a real model's shape (public config.json numbers; see
# estimate_memory.KNOWN_SHAPES). tiny: a small Qwen2 for the CPU run in the suite.
SHAPES = {
    "tiny": (128, 512, 2, 4, 2, 4096, True),
    "qwen2.5-1.5b": estimate_memory.KNOWN_SHAPES["Qwen/Qwen2.5-1.5B-Instruct"],
    "qwen2.5-3b": estimate_memory.KNOWN_SHAPES["Qwen/Qwen2.5-3B-Instruct"],
    "qwen2.5-7b": estimate_memory.KNOWN_SHAPES["Qwen/Qwen2.5-7B-Instruct"],
}
# Dense bf16 tensor-core peaks, TFLOP/s, from NVIDIA's datasheets (without sparsity), matched in
# order against torch.cuda.get_device_name(); any other device: --peak-tflops, or measured.
BF16_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("A100", 312.0))
MIN_VERSIONS = {"torch": "2.6", "transformers": "4.56"}  # FlexAttention training; set_attn_impl.


def check_versions():
    """Exit with a clear message where torch or transformers is older than this mode needs."""
    import transformers

    for name, module in (("torch", torch), ("transformers", transformers)):
        if Version(module.__version__) < Version(MIN_VERSIONS[name]):
            raise SystemExit(
                f"bench/train_step.py --shape needs {name} >= {MIN_VERSIONS[name]} "
                "(FlexAttention training, model.set_attn_implementation); "
                f"found {module.__version__}"
            )


def shape_policy(shape, device, layers=None):
    """A Qwen2 of `shape` with random fp32 weights (seeded), built on `device`."""
    from transformers import Qwen2ForCausalLM

    config = estimate_memory.qwen2_config(shape)
    config.num_hidden_layers = layers or config.num_hidden_layers
    config.max_position_embeddings = 4096
    torch.manual_seed(0)
    with device:  # allocated and initialised there (a 7B model would not fit the host twice)
        return Qwen2ForCausalLM(config).float().train()


def bf16_peak(device, dtype, override):
    """(FLOP/s, how it was found): the flag, the card's datasheet, else the best of a few large
    matmuls timed here in the compute dtype (a CPU has no datasheet figure to compare with)."""
    if override:
        return override * 1e12, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in BF16_PEAK_TFLOPS:
            if key in name:
                return tflops * 1e12, f"datasheet dense bf16 {tflops:g} TFLOP/s"
    n = 2048
    a = torch.randn(n, n, dtype=dtype, device=device)
    best = 0.0
    for _ in range(6):  # the first warms up
        start = time.perf_counter()
        a @ a
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best, f"measured {dtype} matmul {best / 1e12:.3f} TFLOP/s"


def matmul_params(policy):
    """N of the 6N convention: the parameters a token meets (norms and biases included, as the
    anchors count them; an untied input embedding left out: a lookup, not a matmul), and of a
    mixture of experts' 3D weights ([experts, ...] a layer, named `experts`) the share a token is
    routed through, num_experts_per_tok of the experts."""
    top_k = getattr(policy.config.get_text_config(), "num_experts_per_tok", None)
    total = sum(
        (
            p.numel() * top_k // p.shape[0]
            if ".experts." in name and p.dim() == 3 and top_k
            else p.numel()
        )
        for name, p in policy.named_parameters()
    )
    embedding = policy.get_input_embeddings().weight
    tied = embedding is policy.get_output_embeddings().weight
    return total if tied else total - embedding.numel()


def model_flops(policy, adapters, tokens, head_positions, seconds):
    """(FLOP/s by the 6N convention, FLOP/s of the matmuls that ran) of updates that trained
    `tokens` in `seconds`. 6N: 6 x matmul_params per trained token (4 with LoRA: a frozen weight
    gets no gradient), the output head included at every token, as the issue's anchors are
    counted. What ran: the head only at `head_positions` (the packed head skips prompt positions),
    the rest at every token. Neither counts attention's own FLOPs nor the old log-probs' forward."""
    per_token = 4 if adapters else 6
    total = matmul_params(policy)
    head = policy.get_output_embeddings().weight.numel()
    convention = per_token * total * tokens / seconds
    ran = per_token * ((total - head) * tokens + head * head_positions) / seconds
    return convention, ran


def timed_update(trainer, samples, advantages, device, pi_old=None):
    """One update_policy (`pi_old`: force update.pi_old_source's answer, as the baseline arm's
    separate forward); returns (seconds, its stats, the peak bytes the allocator held: a GPU's,
    0 on CPU)."""
    for sample, advantage in zip(samples, advantages.tolist()):
        sample.advantage = advantage
    forced = update_stage.pi_old_source
    if pi_old:
        update_stage.pi_old_source = lambda trainer, step: pi_old
    try:
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        stats = local_values(update_policy(trainer, samples, step=0))
        if device.type == "cuda":
            torch.cuda.synchronize()
            return time.perf_counter() - start, stats, torch.cuda.max_memory_allocated(device)
        return time.perf_counter() - start, stats, 0
    finally:
        update_stage.pi_old_source = forced


def gpu_profile(trainer, samples, advantages, device, pi_old=None):
    """(share of the GPU's kernel time in matmuls, kernel launches, the ops with the most kernel
    time) of one update, from torch.profiler. Its table has a row per kernel and a row per op that
    counts the kernels the op launched (torch/autograd/profiler_util.py,
    FunctionEvent.self_device_time_total): the total is the kernel rows' alone, the matmuls' the
    aten::mm/addmm/bmm/_scaled_mm rows', the top list the op rows' (CUPTI's overhead records,
    listed with a device time, left out everywhere). Until 2026-11-27 the total summed both kinds
    of row, counting most kernels twice: the shares printed before are about half the true ones."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_update(trainer, samples, advantages, device, pi_old)
    events = prof.key_averages()
    events = [e for e in events if e.key not in CUPTI_OVERHEADS]
    ops = [e for e in events if e.device_type.name == "CPU"]
    total = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    matmul = sum(
        e.self_device_time_total
        for e in ops
        if e.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm")
    )
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    top = sorted(ops, key=lambda e: -e.self_device_time_total)[:PROFILE_TOP]
    # where the rest of the time goes: kernel ms in this update, in all and under each op
    listed = " ".join(f"{e.key}={e.self_device_time_total / 1e3:.1f}" for e in top)
    return matmul / max(total, 1), kernels, f"kernel_ms={total / 1e3:.1f} {listed}"


PROFILE_TOP = 8  # ops printed per arm with --profile
# CUPTI's overhead records (CUpti_ActivityOverheadKind, cupti_activity.h), which the profiler lists
# beside the kernels with a device time: no kernel ran (run 11 counted 70-134 ms of "Command
# Buffer Full", the launch queue full)
CUPTI_OVERHEADS = {
    "Buffer Flush",
    "Instrumentation",
    "Resource",
    "Runtime Triggered Module Loading",
    "Lazy Function Loading",
    "Command Buffer Full",
    "Activity Buffer Request",
    "UVM Activity Init",
}


def parity(device, attention):
    """One update of a small fp32 Qwen2 (tiny's shape) on the same samples, padded with sdpa
    against packed with `attention`, each sample whole and with each group's prompt shared
    (train.shared_prefix): the same loss and gradients, or exit. FlexAttention on a GPU (on CPU it
    has no backward: the suite checks its forward, tests/test_packing.py and
    tests/test_shared_prefix.py), sdpa on CPU."""
    samples = gsm8k_samples(16, seed=1, vocab=SHAPES["tiny"][5])
    advantages = torch.randn(len(samples), generator=torch.Generator().manual_seed(1))
    results = []
    for arm_attention, budget, shared in (
        ("sdpa", 0, False),
        (attention, 4096, False),
        (attention, 4096, True),
    ):
        cfg = shape_config(
            [
                "model.compute_dtype=float32",
                "train.compile=false",
                f"model.attn_implementation={arm_attention}",
                f"train.max_tokens_per_micro_batch={budget}",
                f"train.shared_prefix={str(shared).lower()}",
            ]
        )
        policy = shape_policy(SHAPES["tiny"], device)
        policy.set_attn_implementation(arm_attention)
        run = setup_run.trainer_only(cfg, policy, device)
        stats = train_on(run, samples, advantages)
        results.append((stats["train/loss"], [p.grad.clone() for p in policy.parameters()]))
    (padded_loss, padded), *packed_arms = results
    for (packed_loss, packed), how in zip(packed_arms, ("", ", prompt shared,")):
        # relative to the largest gradient: a mask that leaks between sequences moves log-probs
        # by ~0.1 (tests/test_packing.py), far above fp32 kernels' rounding
        diff = max((a - b).abs().max().item() for a, b in zip(padded, packed))
        scale = max(a.abs().max().item() for a in padded)
        print(
            f"parity: packed {attention}{how} vs padded sdpa, one fp32 update: loss "
            f"{packed_loss:.6f} vs {padded_loss:.6f}, max gradient difference "
            f"{diff / scale:.2e} of the largest"
        )
        if diff > 1e-2 * scale or abs(packed_loss - padded_loss) > 1e-3 * max(abs(padded_loss), 1):
            raise SystemExit(f"parity: packed {attention}{how} does not make the padded update")


def shape_config(sets):
    """configs/gsm8k.yaml as one rank trains it, with `sets` on top."""
    return load_config(os.path.join(ROOT, "configs/gsm8k.yaml"), ["data.train_path=unused", *sets])


def shape_arms(args, device, shipped):
    """{arm name: (config overrides, compiled layers, pi_old source or None, FSDP2)}. `baseline` is
    the update as shipped before issue 42 as near as this code runs it: configs/gsm8k.yaml's
    attention at its 4,096-token budget, eager, pi_old from a forward of its own. The others run
    the config as shipped now (max_tokens_per_micro_batch auto, train.compile) with each
    attention, with top_p 0.9, and as FSDP2 on one rank (what each of N ranks computes), also
    eager there (`fsdp-eager`)."""
    compiled = args.compile == "true"
    attentions = ["sdpa", "flex_attention"] if device.type == "cuda" else ["sdpa"]
    shipped_attention = [f"model.attn_implementation={shipped}"]
    arms = {
        "baseline": (
            shipped_attention + ["train.max_tokens_per_micro_batch=4096"],
            False,
            "recomputed",
            False,
        )
    }
    for attention in attentions:
        arms[f"now-{attention}"] = (
            [f"model.attn_implementation={attention}"],
            compiled,
            None,
            False,
        )
    if args.top_p < 1:
        # older tokens masked (update.check refuses TIS on resumed tokens at top_p < 1 with
        # gsm8k.yaml's partial rollout); here every token is of the weights trained: none is
        top_p = [f"rollout.top_p={args.top_p}", "train.max_token_staleness=0"]
        arms["top_p"] = (shipped_attention + top_p, compiled, None, False)
        arms["top_p-peaked"] = arms["top_p"]  # with PEAKED_NORM: see there
    if args.lora:  # the base frozen in bf16, fp32 adapters on every projection (runtime/lora.py)
        lora_sets = [f"model.lora_rank={args.lora}", f"model.lora_alpha={2 * args.lora}"]
        arms["lora"] = (shipped_attention + lora_sets, compiled, None, False)
    # each group's prompt computed once; timed against it computed per sample, in turns
    arms["shared"] = (shipped_attention + ["train.shared_prefix=true"], compiled, None, False)
    if args.fsdp:
        arms["fsdp"] = (shipped_attention, compiled, None, True)
        if compiled:  # with --compile false every arm is eager
            arms["fsdp-eager"] = (shipped_attention, False, None, True)
    if not args.arms:
        return arms
    unknown = [name for name in args.arms if name not in arms]
    if unknown:  # a misspelt arm would otherwise be skipped in silence
        raise SystemExit(f"train_step: no arm {unknown} here; these run: {list(arms)}")
    return {name: arms[name] for name in args.arms}  # in the order asked: first what matters most


# Random weights give near-uniform next-token distributions (logits' std ~0.8 over 151,936 tokens),
# whose top-p nucleus is most of the vocabulary: loss.nucleus_edge sorts every row, the worst case.
# The `top_p-peaked` arm sets the final norm's weight to this at Qwen2.5-1.5B's hidden size (1,536;
# scaled by sqrt(1,536 / hidden) at others, as the logits' std grows with sqrt(hidden)), so the
# logits' std is ~6: the top 256 tokens then hold the nucleus at every position (mean top-1
# probability ~0.4), as a trained model's do nearly everywhere; it times the nucleus's common
# case (the tiny shape's dry run too, where 8.0 left 169 of 1,024 rows wide). The matmuls are
# unchanged.
PEAKED_NORM = 8.0


def largest_micro_batch(samples, budget, shared=False):
    """Positions (rows x width, padding included) of the largest packed micro-batch of `samples`
    at `budget`: what the memory estimate is taken at, less than a budget the batch does not
    fill. `shared` (train.shared_prefix): as collate lays out a group's prompt once."""
    if shared:
        batches, _ = update_stage.micro_batches(samples, 1, 0, budget, shared_prefix=True)
        return max(mb["packed_ids"].numel() for mb in batches)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    layout = update_stage.pack_rows(lengths, budget)
    return max(len(mb) * max(lengths[i] for row in mb for i in row) for mb in layout)


def fsdp_one_rank(device):
    """A process group of one rank (NCCL on a GPU, gloo on CPU) for the FSDP2 arm."""
    import torch.distributed as dist

    if not dist.is_initialized():
        rendezvous = tempfile.mkdtemp()  # a file, not a port: nothing to collide on
        atexit.register(shutil.rmtree, rendezvous, ignore_errors=True)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"file://{rendezvous}/rendezvous",
            rank=0,
            world_size=1,
        )


def shape_main(args):
    """Each arm of `shape_arms` at a real model's shape: see the module docstring."""
    check_versions()
    from torch._dynamo.utils import counters

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    shape = SHAPES[args.shape]
    counted = estimate_memory.shape_of(estimate_memory.qwen2_config(shape))  # for the estimate
    # CPU (tiny): sdpa, as FlexAttention has no backward there, and float32, as a CPU without
    # bf16 matmul units emulates them tens of times slower
    cpu = ["model.attn_implementation=sdpa", "model.compute_dtype=float32"]
    base = shape_config([] if device.type == "cuda" else cpu)
    dtype = getattr(torch, base.model.compute_dtype)
    autocast = dtype if dtype != torch.float32 else None
    card = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    contexts = 2 * estimate_memory.CONTEXT_GIB * 2**30  # trainer + engine: not the allocator's
    failures = []  # each printed as it happens; the run's exit status at its end
    try:  # the arms still run after a failed parity check
        if device.type == "cuda":
            parity(device, "flex_attention")
        else:
            parity(device, "sdpa")
            print("packed flex_attention: not run (FlexAttention has no backward on CPU)")
    except (Exception, SystemExit) as e:
        failures.append(f"parity: failed: {type(e).__name__}: {str(e)[:500]}")
        print(failures[-1], flush=True)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device={device_name} torch={torch.__version__} "
        f"transformers={__import__('transformers').__version__} shape={args.shape} {shape}"
    )
    # the first `warmups` mixes warm up (compiles, autotunes); the 3 after are timed, each a new
    # set of lengths
    mixes = [
        gsm8k_samples(
            args.gsm8k_samples, seed=seed, vocab=shape[5], response_median=args.response_median
        )
        for seed in range(args.warmups + 3)
    ]
    advantages = torch.randn(args.gsm8k_samples, generator=torch.Generator().manual_seed(0))
    peak_flops, peak_source = bf16_peak(device, dtype, args.peak_tflops)
    policy = None
    figures = {}
    for name, (sets, compiled, pi_old, fsdp) in shape_arms(
        args, device, base.model.attn_implementation
    ).items():
        # nothing of the last arm's model may outlive it (an arm that failed included): FSDP2's
        # stayed alive through these names and counted in the next arm's peak (11.5 GiB at 1.5B)
        trainer = module = norm = None
        try:  # a config refused is this arm's failure, not the run's
            cfg = shape_config((cpu if device.type != "cuda" else []) + sets)
            adapters = cfg.model.lora_rank > 0
            if fsdp or adapters or policy is None:  # a fresh model where an arm changes it
                policy = None
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                policy = shape_policy(shape, device)
            for module in policy.model.layers.modules():  # compiled or eager, per arm
                module.__dict__.pop("forward", None)
            if adapters:  # after the line above: an adapted layer's forward is its own too
                m = cfg.model
                lora.add_adapters(policy, m.lora_rank, m.lora_alpha, m.lora_targets, dtype)
            if compiled:
                model.compile_layers(policy)
            policy.set_attn_implementation(cfg.model.attn_implementation)
            if fsdp:
                fsdp_one_rank(device)
                policy = parallel.shard(policy, dtype)
            cfg.train.compile = compiled
            norm = policy.model.norm.weight
            saved_norm = norm.detach().clone()
            if name.endswith("peaked"):
                with torch.no_grad():
                    norm.fill_(PEAKED_NORM * math.sqrt(1536 / policy.config.hidden_size))
            trainer = setup_run.trainer_only(cfg, policy, device, None if fsdp else autocast)
            budget = cfg.train.max_tokens_per_micro_batch
            # a top_p arm times top_p 1 too, on the same model, the two in turns (ABBA), and the
            # shared arm its prompts computed per sample: their ratio is then side by side, free
            # of the drift between arms run minutes apart
            section, field = (
                (cfg.train, "shared_prefix") if name == "shared" else (cfg.rollout, "top_p")
            )
            settings = (getattr(section, field),)
            settings += (1.0,) if name.startswith("top_p") else (False,) if name == "shared" else ()
            for samples in mixes[: args.warmups]:  # warm-up: compiles, autotunes
                for value in settings:
                    setattr(section, field, value)
                    timed_update(trainer, samples, advantages, device, pi_old)
            graphs = counters["stats"]["unique_graphs"]
            seconds = {value: [] for value in settings}  # per timed update
            # per timed update of the arm's own setting: trained tokens, positions the model
            # computed (fewer where a prompt is shared), head positions
            tokens, computed, heads = [], [], []
            peak = ran = 0  # the most bytes held; the largest micro-batch's positions
            for turn, samples in enumerate(mixes[args.warmups :] * args.repeats):
                for value in settings if turn % 2 == 0 else settings[::-1]:
                    setattr(section, field, value)
                    elapsed, stats, arm_peak = timed_update(
                        trainer, samples, advantages, device, pi_old
                    )
                    seconds[value].append(elapsed)
                    peak = max(peak, arm_peak)
                    if value == settings[0]:
                        tokens.append(stats["train/tokens"])
                        saved = stats.get("train/shared_prefix_tokens", 0)
                        computed.append(stats["train/tokens"] - saved)
                        heads.append(stats["train/head_positions"])
                ran = max(ran, largest_micro_batch(samples, budget, cfg.train.shared_prefix))
            setattr(section, field, settings[0])
            recompiles = counters["stats"]["unique_graphs"] - graphs
            card_bytes = card or 80 * 2**30
            estimate = estimate_memory.estimate(
                cfg, 1, card_bytes, counted, budget=int(ran), sharded=fsdp
            )[1]["train"]
            timed = seconds[settings[0]]
            tok_s = sum(tokens) / sum(timed)
            mfu, mfu_run = model_flops(policy, adapters, sum(computed), sum(heads), sum(timed))
            mfu, mfu_run = mfu / peak_flops, mfu_run / peak_flops
            share, kernels, ops = (
                gpu_profile(trainer, mixes[-1], advantages, device, pi_old)
                if device.type == "cuda" and args.profile
                else (float("nan"), 0, "")
            )
            figures[name] = dict(
                tok_s=tok_s,
                mfu=mfu,
                update_s=sum(timed) / len(timed),
                peak=peak if device.type == "cuda" else float("nan"),
                estimate=estimate - contexts,
                ratio=sum(timed) / sum(seconds[settings[1]]) if len(settings) > 1 else None,
            )
            paired = figures[name]["ratio"]
            print(
                f"train_step_gpu: device={device_name} shape={args.shape} arm={name} "
                f"attention={cfg.model.attn_implementation} budget={budget} compile={compiled} "
                f"pi_old={pi_old or update_stage.pi_old_source(trainer, 0)} "
                f"top_p={cfg.rollout.top_p} "
                f"tok_s={tok_s:.1f} mfu={mfu:.3f} mfu_run={mfu_run:.3f} "
                f"update_s={figures[name]['update_s']:.3f} "
                + (f"{field}_ratio={paired:.3f} " if paired else "")
                + f"peak_gib={figures[name]['peak'] / 2**30:.3f} "
                f"estimate_gib={(estimate - contexts) / 2**30:.3f} "
                f"recompiles={recompiles} matmul_share={share:.3f} kernels={kernels} "
                f"tokens={sum(tokens) // len(tokens)} computed={sum(computed) // len(computed)}",
                flush=True,
            )
            if ops:
                print(f"profile: arm={name} {ops}", flush=True)
            if name.startswith("top_p"):  # now: a later arm's timeout or failure cannot lose it
                valid = "" if recompiles == 0 else ": not valid, it recompiled while timed"
                print(
                    f"{name}: update time at top_p {args.top_p} / at 1 = {paired:.3f} (one "
                    f"model, the two in turns; recompiles after warm-up {recompiles}{valid})",
                    flush=True,
                )
            with torch.no_grad():
                norm.copy_(saved_norm)
            if adapters or fsdp:  # not the plain model the next arm starts from
                policy = None
        except Exception as e:  # one arm's failure must not cost the others' figures
            print(
                f"train_step_gpu: arm={name} failed: {type(e).__name__}: {str(e)[:500]}", flush=True
            )
            failures.append(f"arm={name} failed")
            policy = None
    print(f"mfu peak: {peak_source}")
    now = [n for n in figures if n.startswith("now-")]
    if now:
        summary(args, figures, now, device_name)
    elif "lora" not in figures:  # --arms lora: that arm's line is the summary
        failures.append("no arm of the shipped path ran")
    if failures:  # the exit status says what the lines above did
        raise SystemExit("train_step_gpu: " + "; ".join(failures))


def summary(args, figures, now, device_name):
    """The shared arm's ratio, and the last line: the best of the shipped path's arms (`now`)."""
    best = max(now, key=lambda n: figures[n]["mfu"])
    if "shared" in figures:
        print(
            "shared: update time with each group's prompt computed once / per sample = "
            f"{figures['shared']['ratio']:.3f} (one model, the two in turns)"
        )
    # an arm not run (or failed) prints nan, never a figure it did not measure
    baseline, fsdp = (figures.get(arm, {}).get("mfu", float("nan")) for arm in ("baseline", "fsdp"))
    f = figures[best]
    print(
        f"train_step_gpu: device={device_name} shape={args.shape} best={best} "
        f"baseline_mfu={baseline:.3f} mfu={f['mfu']:.3f} fsdp_mfu={fsdp:.3f} "
        f"tok_s={f['tok_s']:.1f} peak_gib={f['peak'] / 2**30:.3f} "
        f"estimate_gib={f['estimate'] / 2**30:.3f}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repeats", type=int, default=3, help="alternated padded/packed pairs per mix"
    )
    parser.add_argument(
        "--response-median",
        type=float,
        default=None,
        help="--shape: the responses' median length (default ~245, GSM8K's; a short answer to a "
        "long prompt, as countdown's, is where a shared prompt saves most)",
    )
    parser.add_argument(
        "--gsm8k-samples", type=int, default=64, help="one rank's batch in configs/gsm8k.yaml"
    )
    parser.add_argument(
        "--demo-prompts", type=int, default=0, help="the demo mix's prompts (0: the demo's 32)"
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads (the engine is shut down first)"
    )
    parser.add_argument(
        "--shape", choices=SHAPES, help="time the trainer half at this model's shape (see above)"
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=0, help="--shape: the device's bf16 peak for MFU"
    )
    parser.add_argument(
        "--compile",
        choices=("true", "false"),
        default="true",
        help="--shape: train.compile in the arms of the path as shipped",
    )
    parser.add_argument(
        "--top-p", type=float, default=0.9, help="--shape: an arm at this top_p (1: none)"
    )
    parser.add_argument(
        "--fsdp", action="store_true", help="--shape: FSDP2 arms on one rank (compiled and eager)"
    )
    parser.add_argument(
        "--lora", type=int, default=0, help="--shape: an arm with LoRA adapters of this rank"
    )
    parser.add_argument(
        "--warmups", type=int, default=1, help="--shape: untimed updates, each a new length mix"
    )
    parser.add_argument(
        "--arms",
        type=lambda text: text.split(","),
        default=None,
        help="--shape: only these arms, in this order (comma-separated names, as printed)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="--shape: matmul share and kernels (GPU)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.shape:
        return shape_main(args)
    out_dir = tempfile.mkdtemp(prefix="bench-train-step-")
    atexit.register(shutil.rmtree, out_dir, ignore_errors=True)  # at exit: its model and run files
    summary, peak_ratios = [], []
    for mix, samples in (
        ("demo", demo_samples(out_dir, args.demo_prompts)),
        ("gsm8k", gsm8k_samples(args.gsm8k_samples)),
    ):
        seconds, stats = {False: [], True: []}, {}
        for packed in (False, True):  # warm-up, each arm: first calls (a compiled head's graph)
            update(mix, samples[:8], packed)
        for repeat in range(args.repeats):
            for packed in ((False, True) if repeat % 2 == 0 else (True, False)):
                elapsed, stats[packed] = update(mix, samples, packed)
                seconds[packed].append(elapsed)
        peaks = {packed: peak_bytes(mix, samples, packed) for packed in (False, True)}
        padded_s, packed_s = statistics.median(seconds[False]), statistics.median(seconds[True])
        for packed, name in ((False, "padded"), (True, "packed")):
            s = stats[packed]
            print(
                f"{mix} {name}: update_s={statistics.median(seconds[packed]):.3f} (repeats "
                f"{' '.join(f'{x:.3f}' for x in seconds[packed])}) tokens={s['train/tokens']} "
                f"micro_batches={s['train/micro_batches']} "
                f"head_positions={s['train/head_positions']} "
                f"padded_fraction={s['train/padded_fraction']:.3f} "
                f"tokens_per_s={s['train/tokens'] / statistics.median(seconds[packed]):.0f} "
                f"peak_mib={peaks[packed] / 2**20:.2f}"
            )
        summary.append(
            f"mix={mix} speedup={padded_s / packed_s:.3f} "
            f"padded_fraction={stats[True]['train/padded_fraction']:.3f}"
        )
        peak_ratios.append(peaks[True] / peaks[False])
    print(f"train_step: {' '.join(summary)} peak_ratio={max(peak_ratios):.3f}")


if __name__ == "__main__":
    main()
