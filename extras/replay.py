"""Study one step on its own: dump what a step trained on, and replay its update without the engine.

With `run.dump_rollouts: true` every step writes its trained sequences (token ids, loss masks,
engine log-probs, weight versions, rewards) and their advantages, with the loss and gradient norm
the update logged, to RUN/rollouts/step_NNNNNN/rank_0.pt. `python train.py --replay
RUN/rollouts/step_NNNNNN` then loads the policy as it was before that step (the checkpoint of step
N, or the seeded initial policy for step 0), runs the same update in the trainer alone and prints
both figures against the logged ones, and the weights it ends at against checkpoint N + 1's where
one was kept: on CPU they are equal, bit for bit. A dump older than the oldest checkpoint kept
(run.keep_checkpoints) is removed. Owns the dump format and the replay; the update itself is
update.update_policy.
"""

import contextlib
import dataclasses
import logging
import math
import os
import re

import torch

import update
from config import ConfigError, read_config, shown
import runtime.checkpoint as checkpoint
import runtime.parallel as parallel
from runtime.model import TINY_CHARS, build_policy, build_reference, check_folder_code
from task.data import vocabulary
from sample import Sample

log = logging.getLogger("replay")


def check(cfg):
    """run.dump_rollouts needs checkpoints during the run (assemble.load_config calls this)."""
    if cfg.run.dump_rollouts and cfg.run.checkpoint_every == 0 and cfg.train.steps > 1:
        raise ConfigError(
            "run.dump_rollouts=true with run.checkpoint_every=0: a dump is replayed from the "
            "checkpoint of its step, and none is written before the end, so every step after the "
            "first would leave a dump (~0.4 MB a rank at GSM8K's shape) that nothing replays or "
            "removes; set run.checkpoint_every (1 replays any step)"
        )


def dump(cfg, step, start_step, sequences, stats):
    """Write this rank's step `step` (`start_step`: its process's first, where
    train.old_logprobs=engine still ran the trainer's forward) under cfg.run.out: plain lists and
    tensors (read back with weights_only), and the config it trained with (a later --resume
    --set rewrites RUN/config.yaml). Each sequence carries its advantage. One that cannot be
    written (a full disk) is a warning, not the run's end: the training state is intact, only
    this step cannot be replayed."""
    folder = os.path.join(cfg.run.out, "rollouts", f"step_{step:06d}")
    path = os.path.join(folder, f"rank_{parallel.rank()}.pt")
    dumped = {
        "step": step,
        "start_step": start_step,  # the first step of the process that trained it
        "sequences": [s.to_state() for s in sequences],
        "loss": stats["train/loss"],
        "grad_norm": stats["train/grad_norm"],
        "config": dataclasses.asdict(cfg),
    }
    try:
        os.makedirs(folder, exist_ok=True)
        torch.save(dumped, path + ".tmp")
        os.replace(path + ".tmp", path)  # whole or absent
    except (OSError, RuntimeError) as e:  # (torch.save's writer raises RuntimeError)
        log.warning("step %d's rollouts not dumped (it cannot be replayed): %s", step, e)
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        with contextlib.suppress(OSError):
            os.rmdir(folder)  # where no other rank's dump is in it
        return
    if parallel.rank() == 0:
        remove_unreplayable(cfg.run.out)


def remove_unreplayable(out_dir):
    """Remove the dumps older than the oldest checkpoint kept: run.keep_checkpoints removed the
    checkpoints they start from (step 0's stays: it starts from the seeded initial policy). So
    the dumps are bounded as the checkpoints are (keep_checkpoints: 0 keeps every one); before,
    a dump a step (~0.4 MB a rank at GSM8K's shape) piled up for the whole run. (Between two
    checkpoints of run.checkpoint_every > 1, a dump has none to start from either: they stay.)"""
    kept = checkpoint.complete_checkpoints(out_dir)
    folder = os.path.join(out_dir, "rollouts")
    if not kept or not os.path.isdir(folder):
        return
    oldest = checkpoint.step_of(kept[0])
    for name in os.listdir(folder):
        if re.fullmatch(r"step_\d{6,}", name) and 0 < int(name[5:]) < oldest:
            try:
                checkpoint.remove(os.path.join(folder, name))
            except OSError as e:  # (an open file on NFS, say): it stays, the run goes on
                log.warning("%s stays: %s", os.path.join(folder, name), e)


@dataclasses.dataclass
class Replayed:
    """A replayed step beside what training logged and saved. The loss and gradient norm come
    before the optimizer step; the weights after it, so they also check what the step's AdamW
    state, settings and learning rate did."""

    loss: float
    grad_norm: float
    logged_loss: float
    logged_grad_norm: float
    after: str  # checkpoint N + 1, the weights the step trained
    weights_differ: int | None  # parameters not equal to `after`'s (None: no such checkpoint kept)

    @property
    def exact(self):
        """True: the loss, the gradient norm (a non-finite step's NaN as its logged NaN) and the
        weights after the step bit for bit; False: one differs; None: the figures agree and no
        checkpoint N + 1 was kept to compare the weights with (they alone would miss another
        learning rate or AdamW setting)."""

        def same(a, b):
            return a == b or (math.isnan(a) and math.isnan(b))

        figures = same(self.loss, self.logged_loss) and same(self.grad_norm, self.logged_grad_norm)
        if not figures or self.weights_differ:
            return False
        return None if self.weights_differ is None else True


def replay(folder, sets=()):
    """Re-run the update dumped in `folder` (RUN/rollouts/step_NNNNNN) on one rank; returns its
    Replayed. The dump's config is the step's, as it was: of `sets` (train.py's --set) one key
    alone is read, model.trust_remote_code (true lets a dump whose config has it load its
    model: check_folder_code); any other key is refused (it would change nothing)."""
    ignored = [s for s in sets if not s.startswith("model.trust_remote_code=")]
    if ignored:
        raise ConfigError(
            f"--replay {folder} re-runs the step with the config it trained with: --set "
            f"{shown(ignored)} would change nothing (only model.trust_remote_code=true is read)"
        )
    if not os.path.isdir(folder):
        parent = os.path.dirname(os.path.abspath(folder))
        dumps = sorted(os.listdir(parent)) if os.path.isdir(parent) else []
        found = f"; {parent} holds {shown(dumps)}" if dumps else ""
        raise ConfigError(
            f"--replay {folder}: no such folder (expected RUN/rollouts/step_NNNNNN, six digits"
            f"{found})"
        )
    ranks = sorted(f for f in os.listdir(folder) if f.startswith("rank_"))
    if ranks != ["rank_0.pt"]:
        raise ConfigError(f"--replay {folder}: replays a one-rank run's dump, found {ranks}")
    try:
        dumped = torch.load(os.path.join(folder, "rank_0.pt"), weights_only=True)
    except Exception as e:  # truncated, or not torch.save's format: torch names no one error
        raise ConfigError(f"--replay {folder}: rank_0.pt does not load: {e}") from e
    needed = {"step", "start_step", "sequences", "loss", "grad_norm"}
    if not isinstance(dumped, dict) or not needed <= set(dumped):
        raise ConfigError(f"--replay {folder}: rank_0.pt is not a dump (it needs {sorted(needed)})")
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(folder)))
    # the config the step trained with (a dump from before dumps held it: the run's config.yaml),
    # types and bounds read again (config.read_config); its choices were checked by
    # assemble.load_config when the run started (importing that here would put the whole setup
    # under train.py's import of this module)
    if "config" in dumped:
        cfg = read_config(values=dumped["config"])
    else:
        cfg = read_config(os.path.join(run_dir, "config.yaml"), [])
    check_folder_code(cfg, f"--replay {folder}", sets)
    # the step's thread count, as assemble.setup sets it: on CPU, a weight's gradient is a sum
    # over tokens split by thread, and 4 threads against 1 moved its last bit (a correct step on
    # a bigger machine was "not exact")
    torch.set_num_threads(cfg.train.threads)
    step = dumped["step"]
    # the policy before step N: after N updates (step 0: the seeded initial one)
    before = os.path.join(run_dir, "checkpoints", f"step_{step:06d}")
    if step > 0 and not os.path.isdir(before):
        keep = "and run.keep_checkpoints=0 " if cfg.run.keep_checkpoints else ""
        raise ConfigError(
            f"--replay {folder}: no checkpoint {before} to start from; dump with "
            f"run.checkpoint_every=1 {keep}to replay any step"
        )
    chars = vocabulary(cfg, TINY_CHARS)
    policy, _ = build_policy(cfg, checkpoint.init_folder(before, cfg) if step > 0 else None, chars)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    compute = getattr(torch, cfg.model.compute_dtype)
    reference = build_reference(cfg, policy, chars)
    trainer = update.Trainer.build(
        cfg,
        policy.to(device),
        device,
        reference=reference.to(device) if isinstance(reference, torch.nn.Module) else reference,
        autocast_dtype=compute if compute != torch.float32 else None,
        first_step=dumped["start_step"],
    )
    if step > 0:  # AdamW's moments and the schedule, as they were
        state = checkpoint.check_resume(before, cfg)
        checkpoint.restore(before, state, trainer, cfg.train)
    sequences = [Sample.from_state(s) for s in dumped["sequences"]]
    stats = update.update_policy(trainer, sequences, step=step)
    after = os.path.join(run_dir, "checkpoints", f"step_{step + 1:06d}")
    return Replayed(
        stats["train/loss"],
        stats["train/grad_norm"],
        dumped["loss"],
        dumped["grad_norm"],
        after,
        weights_differ(policy, after, cfg, chars) if os.path.isdir(after) else None,
    )


def weights_differ(policy, after, cfg, chars):
    """How many of `policy`'s parameters are not bit for bit those of checkpoint `after` (its
    sharded state, loaded as a resume loads it)."""
    saved, _ = build_policy(cfg, checkpoint.init_folder(after, cfg), chars)
    checkpoint.load_trained(after, saved)
    saved = dict(saved.named_parameters())
    return sum(
        not torch.equal(tensor.detach().cpu(), saved[name].detach())
        for name, tensor in policy.named_parameters()
    )
