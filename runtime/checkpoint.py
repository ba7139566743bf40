"""Checkpoints: writing one atomically (sharded model + optimizer state, an HF export, the trainer
state), finding the latest, and restoring a run from it; and the HF folder the engine starts from.

Owns the layout of `checkpoints/step_N/`. Does not own the sharded state itself (parallel.py saves
and reshards it with torch.distributed.checkpoint), partial rollout's buffer form (partial.py), nor
when checkpoints are taken (train.py).
"""

import logging
import os
import random
import re
import shutil

import torch

from partial import merge_states
import runtime.parallel as parallel

log = logging.getLogger("checkpoint")


def save(out_dir, step, run):
    """Every rank writes its shard of model + optimizer state (torch.distributed.checkpoint,
    loadable at any world size); rank 0 writes the HF export (fp32, loadable by `from_pretrained`
    and SGLang) and the trainer state (step, scheduler, RNG, the partial-rollout buffer, every
    rank's prompt-stream position, which is the data position; tensors and plain values only,
    loaded with weights_only=True). Written to a temp dir then renamed: a crash mid-write never
    leaves a half checkpoint behind."""
    final = os.path.join(out_dir, "checkpoints", f"step_{step:06d}")
    tmp, is_writer = final + ".tmp", parallel.rank() == 0
    if is_writer:
        shutil.rmtree(tmp, ignore_errors=True)
    parallel.barrier()
    trainer = run.trainer
    parallel.save_state(os.path.join(tmp, "sharded"), trainer.policy, trainer.optimizer)
    # a collective: gathered one tensor at a time to rank 0
    full_state = parallel.full_state_dict(trainer.policy)
    # partial rollout's unfinished samples and held groups, every rank's: resumed, never lost or
    # trained twice
    buffers = parallel.gather_objects(run.buffer.state_dict() if run.buffer else None)
    positions = parallel.gather_objects(run.stream.position)
    if is_writer:
        save_hf(trainer.policy, run.tokenizer, tmp, full_state)
        torch.save(
            {
                "step": step,
                "world_size": parallel.world_size(),
                "scheduler": trainer.scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate(),
                "buffer": merge_states(buffers) if run.buffer else None,
                "prompt_positions": positions,
            },
            os.path.join(tmp, "trainer_state.pt"),
        )
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    parallel.barrier()  # no rank goes on (or reads it on resume) before the rename
    return final


def latest(out_dir):
    """The newest complete checkpoint folder, by step, or None: only names `save` writes,
    step_<digits> (a half-written `.tmp`, or a `step_000200_copy2` someone made, never match)."""
    folder = os.path.join(out_dir, "checkpoints")
    names = os.listdir(folder) if os.path.isdir(folder) else []
    steps = [int(name[5:]) for name in names if re.fullmatch(r"step_\d+", name)]
    return os.path.join(folder, f"step_{max(steps):06d}") if steps else None


def read_trainer_state(folder):
    """Step, scheduler and RNG state. Plain tensors and values only: loading never runs pickled
    code."""
    return torch.load(os.path.join(folder, "trainer_state.pt"), weights_only=True)


def restore(folder, state, policy, optimizer, scheduler):
    """Model and optimizer shards (resharded to this world size), scheduler and RNG (rank 0's, on
    every rank)."""
    parallel.load_state(os.path.join(folder, "sharded"), policy, optimizer)
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    log.info(
        "resumed from %s at step %d (written by %d ranks, now %d)",
        folder,
        state["step"],
        state["world_size"],
        parallel.world_size(),
    )


def save_hf(policy, tokenizer, folder, state_dict=None):
    """A HF folder (safetensors, fp32) that `from_pretrained` and the engine load."""
    policy.save_pretrained(folder, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def export_for_engine(policy, tokenizer, out_dir):
    """The engine loads weights from a folder, like any checkpoint: rank 0 writes the initial policy
    there (every rank holds the same unsharded one at this point), the others wait for it."""
    model_dir = os.path.join(out_dir, "model")
    if parallel.rank() == 0:
        save_hf(policy, tokenizer, model_dir)
    parallel.barrier()
    return model_dir
