"""model.fp32_head on the real engine: the engine's log-probs against the trainer's, with the
engine's head in bf16 and in fp32, each set by the trainer's model-config override on a folder
whose config.json does not say it. Each engine samples its own responses (temperature 1); the
trainer scores them with its bf16 head and with its fp32 head, bf16 compute both, and the last
lines give the mean |engine - trainer| log-prob over every response token for the four pairs.
The engine agrees best with the trainer's head of its own kind, where the flag reaches it.

The model is the demo's tiny Qwen2 with its final norm's weight scaled by `--scale` (a trained
model's peaked logits, where bf16's spacing between logits matters; at 30 every token is certain
and every log-prob 0). Run from the repo root: `python bench/fp32_head.py` (CPU: ~2 min, two
engine starts). Lines: fp32_head: engine=<bf16|fp32> trainer_bf16=<f> trainer_fp32=<f>
"""

import argparse
import atexit
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import assemble  # noqa: E402
import runtime.checkpoint as checkpoint  # noqa: E402
import runtime.model as model  # noqa: E402
import update  # noqa: E402
from rollout import RolloutEngine  # noqa: E402

PROMPTS = [[1, 5, 12], [1, 6, 4, 12], [1, 7, 12], [1, 5, 5, 12]]  # "<bos>1:", "<bos>23:", ...


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=8.0, help="the final norm's weight times")
    parser.add_argument("--samples", type=int, default=8, help="responses per prompt")
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="bench-fp32-head-")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    sets = [f"run.out={out}", "model.compute_dtype=bfloat16", "model.engine_dtype=bfloat16"]
    cfg = assemble.load_config("configs/tiny.yaml", sets)
    policy, tokenizer = model.build_policy(cfg, None)
    with torch.no_grad():
        policy.model.norm.weight.mul_(args.scale)
    model_dir = checkpoint.export_for_engine(policy, tokenizer, out)  # its config.json: off
    for engine_fp32 in (False, True):
        engine = RolloutEngine(
            model_dir, cfg.rollout, dtype="bfloat16", seed=0, fp32_head=engine_fp32
        )
        try:
            samples, _ = engine.generate(PROMPTS, args.samples, 1.0, cfg.rollout.max_new_tokens)
        finally:
            engine.shutdown()
        batch = update.collate([s for s in samples if not s.masked], pad_id=0)
        mask = batch["loss_mask"].bool()
        gaps = {}
        for trainer_fp32 in (False, True):
            policy.config.enable_lm_head_fp32 = trainer_fp32
            with torch.no_grad():
                logprobs, _ = update.sequence_logprobs(policy, batch, 1.0, torch.bfloat16)
            gaps[trainer_fp32] = (logprobs - batch["engine_logprobs"]).abs()[mask].mean().item()
        print(
            f"fp32_head: engine={'fp32' if engine_fp32 else 'bf16'} tokens={int(mask.sum())} "
            f"trainer_bf16={gaps[False]:.6f} trainer_fp32={gaps[True]:.6f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
