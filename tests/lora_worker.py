"""The LoRA run that tests/test_lora.py checks, in a process of its own: it starts an engine with
SGLang's LoRA pool, and an engine's shutdown kills every child process of its process (SGLang's
Engine.shutdown: kill_process_tree of the caller), the shared engine's too. Two demo steps with
adapters and a KL reference; then what their checkpoint holds, what eval serves from it, its
merged export, a replay of step 1, an exact resume, and a corrupted adapter push refused by the
engine; prints one JSON line of what the test asserts.
Run: python tests/lora_worker.py OUT_DIR"""

import json
import os
import sys

import safetensors.torch
import torch
from transformers import AutoModelForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.chdir(REPO)

import train  # noqa: E402
from conftest import tiny_config, train_on  # noqa: E402
from test_train import rollout_batch, scalars  # noqa: E402
import extras.eval as evaluation  # noqa: E402
import extras.replay as replay  # noqa: E402
import memory  # noqa: E402
import runtime.checkpoint as checkpoint  # noqa: E402
import runtime.lora as lora  # noqa: E402
import runtime.parallel as parallel  # noqa: E402
from runtime.engine import EngineDiedError, adapter_checksums  # noqa: E402
from runtime.model import TINY_CHARS  # noqa: E402
from task.data import vocabulary  # noqa: E402

LORA = ["model.lora_rank=4", "model.lora_alpha=8"]


def main(out):
    sets = [
        *LORA,
        "run.val_every=100",
        "train.kl_coef=0.01",
        "run.check_weights_every=1",
        "run.checkpoint_every=1",
        "run.dump_rollouts=true",
        # what a run does beside LoRA: top-p (the engine's nucleus scored), a cancelled tail
        # suspended and resumed (partial rollout, its buffer checkpointed)
        "rollout.top_p=0.9",
        "rollout.cancel=count",
        "rollout.drop_rate=0.25",
        "rollout.partial=true",
        "train.max_token_staleness=0",  # (top-p: a resumed token's TIS weight is unknown)
        # a KV pool for ~20 requests at once: they run in waves, so the last wave is still running
        # or queued when 3/4 have finished (at top_p 0.9 the untrained model seldom samples its end
        # token: every request of one wave finishes at the same step, too late for an abort)
        "rollout.max_total_tokens=1024",
    ]
    run = train.setup(tiny_config(out, "train.steps=2", *sets))
    try:
        base = {n: p.detach().clone() for n, p in run.trainer.policy.named_parameters()}
        pushes = []
        run.engine.update_weights = lambda *a, **k: pushes.append(a)  # no full push from here on
        train.train(run)
        del run.engine.update_weights
        trained_adapter = run.engine.adapter  # what the last step's sync loaded
        logged = scalars(out)
        policy = run.trainer.policy
        moved = {n for n, p in policy.named_parameters() if not torch.equal(p, base[n])}
        # step 2's checkpoint: the adapters and their AdamW state, in peft's folder too
        folder = checkpoint.latest(out)
        try:  # it holds no base: the tiny one is built again from train.seed, so another is refused
            checkpoint.check_resume(
                folder, tiny_config(out, "train.steps=3", "train.seed=7", *sets)
            )
            other_seed = "accepted"
        except checkpoint.CheckpointError as e:
            other_seed = str(e)
        sharded = parallel.read_metadata(os.path.join(folder, "sharded")).state_dict_metadata
        saved = safetensors.torch.load_file(
            os.path.join(folder, "adapter/adapter_model.safetensors")
        )
        adapters = {name: t.clone() for name, t in lora.adapter_tensors(policy).items()}
        # what extras/eval.py --run serves: the base the engine loads, the checkpoint's adapter
        # pushed into its pool as training pushes it (checked as it arrives)
        _, _, _, (base, adapted) = evaluation.model_folder(evaluation.parse_args(["--run", out]))
        memory.push_weights(run.engine, adapted, 2, 1 << 20, check=True)
        ids = torch.randint(4, 20, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), lora.adapters_off(policy):
            base_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            base_gap = (base_model(ids).logits - policy(ids).logits).abs().max().item()
        served = all(
            torch.equal(t, adapters[name]) for name, t in lora.adapter_tensors(adapted).items()
        )
        # the merged export, for a deployment (one HF folder): what the policy computes
        weights = checkpoint.merged_export(folder, run.cfg, vocabulary(run.cfg, TINY_CHARS))
        merged = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
        with torch.no_grad():
            merged_gap = (merged(ids).logits - policy(ids).logits).abs().max().item()
        replayed = replay.replay(os.path.join(out, "rollouts", "step_000001"))
        # resume from step 2's checkpoint: the same next update on the same samples
        samples, advantages = rollout_batch(run)
        train_on(run, samples, advantages)
        resumed = train.setup(
            tiny_config(out, "train.steps=3", *sets), resume=True, engine=run.engine
        )
        train_on(resumed, samples, advantages)
        differ = [
            name
            for (name, a), (_, b) in zip(
                run.trainer.policy.named_parameters(), resumed.trainer.policy.named_parameters()
            )
            if not torch.equal(a, b)
        ]
        result = {
            "full_pushes": len(pushes),
            "adapter": trained_adapter,
            "gaps": logged["train/logprob_gap"],
            "suspended": logged["partial/suspended"],
            "moved": sorted(moved),
            "lora_B": sorted(n for n, _ in run.trainer.policy.named_parameters() if ".lora_B" in n),
            "resume_differs": differ,
            "files": sorted(os.listdir(folder)),
            "sharded_model": sorted(k for k in sharded if k.startswith("model.")),
            "adapter_saved": sorted(saved) == sorted(adapters)
            and all(torch.equal(saved[n], t) for n, t in adapters.items()),
            "weights": os.path.relpath(weights, out),
            "merged_gap": merged_gap,
            "eval_served": [os.path.relpath(base, out), run.engine.adapter, base_gap, served],
            "other_seed": other_seed,
            "replay": [replayed.exact, replayed.weights_differ, replayed.loss, replayed.grad_norm],
        }
        # last (it ends the engine): what arrives differs from what was hashed before the push;
        # the engine's own check on arrival refuses it
        wrong = {name: t.clone() for name, t in lora.adapter_tensors(policy).items()}
        checksums = adapter_checksums(wrong)
        next(iter(wrong.values())).add_(1.0)
        try:
            run.engine.load_adapter(wrong, lora.adapter_config(policy), 99, checksums)
            result["mismatch"] = "accepted"
        except EngineDiedError as e:
            result["mismatch"] = f"{type(e).__name__}: {e}"
    finally:
        run.engine.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
