"""configs/gsm8k.yaml rehearsed on other model families: what a fork that changes `model.path` to
another architecture meets. Each family is a small random model built here from its transformers
config (no download) with a byte-level tokenizer trained on the shipped GSM8K rows
(tests/qwen_tiny.py's); each trains a few steps on CPU, full weights and LoRA, with every weight
push checked bit for bit against the engine (run.check_weights_every=1), and the engine's log-probs
against the trainer's (the step-0 gap check). A random model's GSM8K reward is 0 (no gradient), so
the reward here is the share of digits in the response (`digit_share`): the weights move.

python bench/families.py [--families llama,qwen3] [--steps 3] [--set run.nproc=2]; ~30 s a run,
one engine a rank.
One line per run: families: family=<f> lora=<rank> rc=<n> steps=<n> weight_checks=<n>
gap_max=<f> grad_norm_max=<f> seconds=<f>; a REFUSED family's run must stop at setup (rc 2) with
its ModelError, printed below its line. `--build FAMILY --folder DIR` only writes that model's
folder (tests/test_own_task.py trains the countdown example on a Qwen3 MoE so).

Adding a family: an entry in FAMILIES (and LORA_SETS where its projections are named otherwise),
then this script. Where a family differs, what it meets, and the SGLang file to read for it:
- setup's refusals, runtime/model.check_family: the layer layout, logits changed after the head
  (LOGIT_FIELDS), dropout, packed sequences that mix, attention kinds FlexAttention has no mask
  for, rotary scalings the engine turns otherwise (`rope_refusal`; srt/layers/rotary_embedding/);
- the weight check's names, memory.py: FUSED projections, the EXPERTS layout
  (srt/models/<family>.py, stacked_params_mapping, and the FusedMoE loader), VOCAB_TENSORS padded;
- the push's layout, runtime/engine.checkpoint_layout (transformers' own conversion);
- the packed mask, update.packed_mask (sliding windows per layer type);
- the memory estimate, runtime/estimate.py: `kv_values_per_token` (the engine's cache; MLA),
  `saved_per_token` (MLP widths, routed experts);
- a mixture of experts' router, for train.routing_replay: runtime/routing.ROUTERS (its gates at
  given experts, read from its router's forward; srt/layers/moe/topk.py records the engine's).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = os.path.join(ROOT, "tests", "data", "gsm8k_train_100.jsonl")
# the CPU sizes tests/test_gpu_readiness.py rehearses the GPU configs at
CPU_SIZES = [
    f"data.train_path={ROWS}",
    f"data.val_path={ROWS}",
    "data.num_val_prompts=4",
    "rollout.prompts_per_step=4",
    "rollout.engine_threads=1",
    "rollout.max_total_tokens=16384",
    "rollout.max_new_tokens=32",
    "train.threads=1",
    "model.attn_implementation=sdpa",  # FlexAttention has no backward on CPU (model.ATTENTION)
    "run.nproc=1",
    "run.check_weights_every=1",
    f"data.reward={os.path.abspath(__file__)}:digit_share",
]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


# Phi-3.5's rope scaling at the small shape's 8 frequencies: a factor per frequency for sequences
# within original_max_position_embeddings (a Phi3Config field of its own), larger ones past it
LONGROPE = {
    "rope_scaling": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
        "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0],
    }
}


# (transformers config class, its own fields): Qwen2 without tied embeddings (as Qwen2.5-7B),
# Qwen3 with a head_dim that is not hidden / heads (as Qwen3-4B), Llama, Mistral, Gemma 3 (a
# sliding window on every other layer, its embedding scaled, an unpadded vocabulary in the
# engine), Phi-3 (q, k, v and gate, up fused in the checkpoint), OLMo 2 (norms after attention
# and MLP), a Qwen3 mixture of experts (as Qwen3-30B-A3B: untied, 4 experts, 2 routed a token);
# three rotary scalings (Llama 3's, YaRN, Phi-3.5's longrope within its original window).
# Refused at setup (REFUSED): Gemma 2 (logits soft-capped), Granite (logits scaled), longrope past
# its original window and dynamic NTK rope (the engine rotates otherwise: model.rope_refusal)
FAMILIES = {
    "qwen2_untied": ("Qwen2Config", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True, "head_dim": 32}),
    "llama": ("LlamaConfig", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {"tie_word_embeddings": False}),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 24,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "phi3": ("Phi3Config", {"tie_word_embeddings": False}),
    "olmo2": ("Olmo2Config", {"tie_word_embeddings": False}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "tie_word_embeddings": False,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
        },
    ),
    "llama3_rope": (  # as Llama 3.x, its low frequencies stretched from this window on
        "LlamaConfig",
        {"tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE},
    ),
    "qwen2_yarn": (  # as Qwen2.5's long-context setting, a quarter of the positions trained
        "Qwen2Config",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        },
    ),
    "phi3_longrope": (  # as Phi-3.5: every sequence within its original window, short factors
        "Phi3Config",
        {"max_position_embeddings": 4096, "original_max_position_embeddings": 1024, **LONGROPE},
    ),
    "phi3_longrope_past": ("Phi3Config", {"original_max_position_embeddings": 64, **LONGROPE}),
    "llama_dynamic": (
        "LlamaConfig",
        {"tie_word_embeddings": True, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
    ),
    "gemma2": (
        "Gemma2Config",
        # hidden_act: SGLang's Gemma 2 reads it, and Gemma 2's released config.json holds it
        {"hidden_act": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0, "head_dim": 16},
    ),
    "granite": ("GraniteConfig", {"logits_scaling": 4.0, "tie_word_embeddings": True}),
}
# what a LoRA run of these families sets beside CPU_SIZES (model.lora_targets' default names
# layers they lack, a ConfigError): a mixture of experts holds its experts as one 3D tensor, no
# linear layer, so its attention is adapted; Phi-3 holds q, k, v and gate, up fused, and SGLang
# serves adapters of the fused layers as they are (sglang/srt/lora/lora.py, normalize_qkv_proj)
LORA_SETS = {
    "qwen3_moe": ["model.lora_targets=[q_proj,k_proj,v_proj,o_proj]"],
    "phi3": ["model.lora_targets=[qkv_proj,o_proj,gate_up_proj,down_proj]"],
}
LORA_SETS["phi3_longrope"] = LORA_SETS["phi3"]
# the families setup refuses with a named error: the run is expected to stop, before its engine
REFUSED = {"gemma2", "granite", "phi3_longrope_past", "llama_dynamic"}


def digit_share(response_text, answer, finished=True):
    """The reward: the share of the response's characters that are digits."""
    return sum(c.isdigit() for c in response_text) / max(len(response_text), 1)


def build_folder(family, folder, **fields):
    """A random model of `family` (its config's `fields` changed) with the GSM8K tokenizer, saved
    as a HF folder."""
    import torch
    import transformers

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    sys.path.insert(0, ROOT)
    import qwen_tiny

    with open(ROWS) as f:
        rows = [json.loads(line) for line in f]
    tokenizer = qwen_tiny.build_tokenizer([f"{r['question']}\n{r['answer']}" for r in rows])
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(0)
    config = family_config(family, len(tokenizer), end)
    for name, value in fields.items():
        setattr(config, name, value)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.float().save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def family_config(family, vocab_size, end=0):
    """`family`'s transformers config at the suite's small Qwen2's shape (tests/qwen_tiny.py),
    changed by its FAMILIES fields (a mixture of experts names its experts' width there)."""
    import transformers

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import qwen_tiny

    name, own = FAMILIES[family]
    return getattr(transformers, name)(  # the family's own fields over the small shape's
        vocab_size=vocab_size,
        bos_token_id=end,
        eos_token_id=end,
        pad_token_id=end,
        **qwen_tiny.SHAPE | own,
    )


def rehearse(folder, out, lora_rank, steps, sets=()):
    """(return code or "timeout", {tag: values} of the run's TensorBoard scalars (none if it
    ended before its loop), seconds, stderr's tail)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    command = [sys.executable, "train.py", "--config", "configs/gsm8k.yaml", "--out", out]
    for item in [f"model.path={folder}", f"model.lora_rank={lora_rank}", f"train.steps={steps}"]:
        command += ["--set", item]
    for item in CPU_SIZES + list(sets):
        command += ["--set", item]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
        rc, tail = done.returncode, done.stderr[-2000:]
    except subprocess.TimeoutExpired as e:
        partial = e.stderr or b""  # bytes on POSIX, whatever `text` says
        rc, tail = "timeout", str(partial[-2000:], errors="replace") if partial else ""
    seconds = time.perf_counter() - start
    logged = {}
    if os.path.isdir(os.path.join(out, "tb")):  # a run that failed before its loop wrote none
        events = EventAccumulator(os.path.join(out, "tb"))
        events.Reload()
        logged = {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    return rc, logged, seconds, tail


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lora", default="0,8", help="LoRA ranks to run each family at (0: full)")
    parser.add_argument(
        "--set", action="append", default=[], help="SECTION.KEY=VALUE for every run (run.nproc=2)"
    )
    parser.add_argument("--build", choices=FAMILIES, help="only write this family's model folder")
    parser.add_argument("--folder", help="--build: where")
    args = parser.parse_args()
    if args.build and not args.folder:
        parser.error("--build needs --folder")
    if args.build:
        return build_folder(args.build, args.folder)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="families-") as scratch:
        for family in args.families.split(","):
            folder = os.path.join(scratch, family)
            build_folder(family, folder)
            for rank in map(int, args.lora.split(",")):
                out = os.path.join(scratch, f"run-{family}-{rank}")
                sets = (LORA_SETS.get(family, []) if rank else []) + args.set
                rc, logged, seconds, tail = rehearse(folder, out, rank, args.steps, sets)
                get = lambda tag: max(logged.get(tag, [float("nan")]))  # noqa: E731
                print(
                    f"families: family={family} lora={rank} rc={rc} "
                    f"steps={len(logged.get('train/loss', []))} "
                    f"weight_checks={len(logged.get('timing/check_weights_s', []))} "
                    f"gap_max={get('train/logprob_gap'):.2e} "
                    f"grad_norm_max={get('train/grad_norm'):.3g} seconds={seconds:.0f}",
                    flush=True,
                )
                if family in REFUSED:  # stopped at setup with its named error, or a failure
                    refusal = [line for line in tail.splitlines() if "error: ModelError" in line]
                    print("\n".join(refusal), flush=True)
                    failed += rc != 2 or not refusal
                elif rc:
                    failed += 1
                    print(tail, file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
