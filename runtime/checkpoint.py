"""Checkpoints: writing one atomically (sharded trained parameters + optimizer state, an HF export
or with LoRA the adapter in peft's format, the trainer state), finding the latest, and restoring a
run from it; and the HF folders the engine starts from (`export_for_engine`, `lora_served`,
`merged_export`).

Owns the layout of `checkpoints/step_N/`. Does not own the sharded state itself (parallel.py saves
and reshards it with torch.distributed.checkpoint), partial rollout's buffer form (partial.py), nor
when checkpoints are taken (train.py).
"""

import contextlib
import dataclasses
import fcntl
import io
import logging
import os
import pickle
import re
import shutil

import safetensors
import torch
import yaml
from torch.distributed.checkpoint import BytesStorageMetadata
from torch.distributed.checkpoint.api import CheckpointException

from config import config_yaml, load_yaml
import runtime.lora as lora
import runtime.model as model
import runtime.parallel as parallel

log = logging.getLogger("checkpoint")


def save(out_dir, step, run):
    """Every rank writes its shard of the trained parameters + optimizer state
    (torch.distributed.checkpoint, loadable at any world size); rank 0 writes the HF export (fp32,
    loadable by `from_pretrained` and SGLang), or with LoRA the adapter folder alone (lora.
    save_adapter: a 7B base would cost its 15 GB at every checkpoint, the adapters megabytes;
    `merged_export` writes the merged model when one is asked for), and the trainer state (step,
    scheduler, the skipped-update and log-prob-gap streaks, the partial-rollout buffer, every
    rank's prompt-stream position, which is the data position; tensors and plain values only,
    loaded with weights_only=True). Written to a temp dir, flushed to the disk, then renamed: a
    crash mid-write never leaves a half checkpoint behind."""
    final = os.path.join(out_dir, "checkpoints", f"step_{step:06d}")
    tmp, is_writer = final + ".tmp", parallel.rank() == 0
    if is_writer:
        remove(tmp)
    parallel.barrier()
    trainer, lora_run = run.trainer, bool(run.cfg.model.lora_rank)
    try:
        parallel.save_state(os.path.join(tmp, "sharded"), trainer.policy, trainer.optimizer)
    except CheckpointException as e:  # a BaseException (a full disk, say): train.py's one line
        why = "; ".join(f"rank {rank}: {error!r}" for rank, (error, _) in e.failures.items())
        raise CheckpointError(
            f"{tmp}: shards not written ({why}); earlier checkpoints stand"
        ) from None
    # collectives: the model (or the adapters) gathered one tensor at a time
    if lora_run:
        adapter = lora.adapter_tensors(trainer.policy, gather=parallel.full_tensor)
    else:
        full_state = parallel.full_state_dict(trainer.policy)
    # partial rollout's unfinished samples and held groups, every rank's: resumed, never lost or
    # trained twice (partial.PartialBuffer.checkpoint_state, a collective)
    buffer = run.buffer.checkpoint_state() if run.buffer else None
    positions = parallel.gather_objects(run.stream.position)
    if is_writer:
        try:
            if lora_run:
                config = lora.adapter_config(trainer.policy)
                lora.save_adapter(adapter, config, os.path.join(tmp, ADAPTER))
                run.tokenizer.save_pretrained(tmp)
            else:
                save_hf(trainer.policy, run.tokenizer, tmp, full_state)
            # what a resume is checked against
            with open(os.path.join(tmp, "config.yaml"), "w") as f:
                f.write(config_yaml(run.cfg))
            torch.save(
                {
                    "step": step,
                    "world_size": parallel.world_size(),
                    "scheduler": trainer.scheduler.state_dict(),
                    # the streaks that stop a run, which a resume continues
                    "bad_steps": trainer.bad_steps,
                    "gap_steps": run.gap_watch.over if run.gap_watch else 0,
                    "buffer": buffer,
                    "prompt_positions": positions,
                },
                os.path.join(tmp, "trainer_state.pt"),
            )
            sync_to_disk(tmp)  # the files' bytes before the rename that makes them a checkpoint
            # a step saved again (a second save of one step; train.py skips its own): the old
            # copy is renamed aside, not deleted in place, so no moment leaves a half-deleted
            # step_N that `latest` would pick (a crash between the renames leaves the copy
            # aside, which `complete_checkpoints` counts while no step_N stands beside it)
            aside = final + ".old"
            if os.path.exists(final):
                remove(aside)
                os.rename(final, aside)
            os.rename(tmp, final)
        # a full disk, say: train.py's one line (safetensors and torch.save raise their own
        # types for it; torch's RuntimeError may be a bug too: its traceback is logged first)
        except (OSError, RuntimeError, safetensors.SafetensorError) as e:
            if isinstance(e, RuntimeError):
                log.error("saving %s", final, exc_info=True)
            raise CheckpointError(
                f"saving {final}: {type(e).__name__}: {e} (a half-written {tmp} is never "
                "picked; earlier checkpoints stand)"
            ) from e
        try:  # the checkpoint is whole: what cannot be removed stays, more never fewer
            sync_to_disk(os.path.dirname(final), files=False)  # the renames themselves
            remove(aside)
            remove_old(out_dir, run.cfg.run.keep_checkpoints)
        except OSError as e:  # (NFS keeps .nfs files of one that another process has open)
            log.warning(
                "%s saved (its rename maybe not yet on disk); older ones stay: %s", final, e
            )
    parallel.barrier()  # no rank goes on (or reads it on resume) before the rename
    return final


def remove_old(out_dir, keep):
    """Remove every checkpoint but the newest `keep` (run.keep_checkpoints; 0 keeps all), by step,
    after the newest is complete: a crash mid-way leaves more, never fewer
    (`complete_checkpoints`)."""
    folders = complete_checkpoints(out_dir)
    kept = {step_of(folder) for folder in folders[-keep:]} if keep else set()
    for folder in folders if keep else []:
        if step_of(folder) not in kept:  # (a hand-made copy of a kept step stays too)
            remove(folder)


def remove(path):
    """Remove a folder the run wrote, or a link or file in its place (a checkpoint moved to another
    disk and linked back): the link goes, never what it points to. (rmtree refuses a link; with
    ignore_errors it left a linked temp folder for the save to write through, into the folder
    it named.)"""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):  # a link, or a file where a folder was expected
        os.unlink(path)


def sync_to_disk(folder, files=True):
    """fsync every file under `folder` (with `files`) and every folder's entries: a rename is
    atomic against a crash of the process, but after a power loss it may have reached the disk
    before the bytes of the files it names (ext4 and xfs write data later than metadata), leaving
    a complete-looking checkpoint of empty files. (torch.distributed.checkpoint's shards are
    fsynced already: torch/distributed/checkpoint/filesystem.py, FileSystemWriter's sync_files,
    True by default; a second fsync of them is cheap.)"""
    paths = [folder]
    if files:
        for root, folders, names in os.walk(folder):
            paths += [os.path.join(root, name) for name in names + folders]
    for path in reversed(paths):  # each folder after what it holds
        fd = os.open(path, os.O_RDONLY)  # a folder opens read-only too (POSIX)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


ADAPTER = "adapter"  # a LoRA checkpoint's adapter folder, in peft's format
MERGED = "merged"  # a LoRA checkpoint's merged HF export, written by merged_export when asked
BASE = "base"  # the tiny base a LoRA checkpoint's adapters sit on, written by lora_served for eval


def init_folder(folder, cfg):
    """The HF folder a policy restored from checkpoint `folder` is built from, before `restore`
    loads the sharded state into it: the checkpoint's own export, or with LoRA None (the base,
    from model.path: its checkpoints hold what trains alone)."""
    return None if cfg.model.lora_rank else folder


def lora_served(folder, cfg, chars):
    """LoRA checkpoint `folder` as training's engine served it: (the HF folder of the base the
    engine loads, the policy holding the checkpoint's adapters and what trained in full, which
    memory.push_weights then pushes: the adapter into the engine's LoRA pool). The base is
    model.path's, or the tiny one (built from train.seed) exported beside the checkpoint once, as
    folder/base. What eval serves: the engine adds the adapter's output to the base's, where a
    merged weight (`merged_export`) rounds W + scale x B A to the base's dtype (bf16 with bf16
    compute), losing part of a small update."""
    policy, tokenizer = model.build_policy(cfg, None, chars)  # the base, adapters at B = 0
    base = cfg.model.path
    if base == "tiny":
        base = os.path.join(folder, BASE)
        if not os.path.isdir(base):
            remove(base + ".tmp")
            save_hf(policy, tokenizer, base + ".tmp")
            os.rename(base + ".tmp", base)
    load_trained(folder, policy)
    return base, policy


def merged_export(folder, cfg, chars):
    """LoRA checkpoint `folder`'s model as one HF folder of merged weights, for a deployment that
    wants one (`from_pretrained`, any engine), built once on the CPU and kept as folder/merged:
    the base from model.path, the checkpoint's adapters and what trained in full, W + scale x B A
    in the base's dtype. With bf16 compute that rounding loses part of a small update: eval
    serves the adapter instead (`lora_served`)."""
    out = os.path.join(folder, MERGED)
    if not os.path.isdir(out):
        policy, tokenizer = model.build_policy(cfg, None, chars)
        load_trained(folder, policy)
        remove(out + ".tmp")
        save_hf(policy, tokenizer, out + ".tmp")
        os.rename(out + ".tmp", out)
    return out


def load_trained(folder, policy):
    """Checkpoint `folder`'s trained parameters (its sharded state) into `policy`."""
    try:
        parallel.load_state(os.path.join(folder, "sharded"), policy)
    except CheckpointException as e:
        raise CheckpointError(f"{folder} cannot be loaded: {e}") from None


def complete_checkpoints(out_dir):
    """The complete checkpoint folders under `out_dir`, by step ascending: only names `save`
    writes, step_<digits> (a half-written `.tmp`, or a `step_000200_copy2` someone made, never
    match), each as named (a hand-made `step_11` too), and a `step_<digits>.old` with no
    step_<digits> beside it: the complete copy `save` renames aside to save a step again, left
    so by a crash before the new copy took its name."""
    folder = os.path.join(out_dir, "checkpoints")
    found = set(os.listdir(folder) if os.path.isdir(folder) else [])
    names = [name for name in found if re.fullmatch(r"step_\d+", name)]
    names += [
        name
        for name in found
        if re.fullmatch(r"step_\d+\.old", name) and name.removesuffix(".old") not in found
    ]
    # of two folders of one step, the name `save` writes last: the newest is the one it wrote;
    # then by name (two hand-made names, step_11 and step_0011, came in the set's order: which
    # one --resume took changed with PYTHONHASHSEED)
    names.sort(key=lambda name: (step_of(name), name.startswith(f"step_{step_of(name):06d}"), name))
    return [os.path.join(folder, name) for name in names]


def step_of(folder):
    """The step a checkpoint folder's name (step_<digits>, maybe .old) says."""
    return int(re.match(r"step_(\d+)", os.path.basename(folder))[1])


@contextlib.contextmanager
def only_run(out_dir):
    """Held while one train.py writes `out_dir`: a second run on the same folder (a job started
    twice, another terminal) is refused at its start. Two such runs wrote each other's
    checkpoints away (one's save of a step replaced the other's; its temp folder was removed
    mid-write, leaving a newest checkpoint without shards). An flock: the OS releases it when the
    process ends, however it ends."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "run.lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(
                f"run.out={out_dir!r}: another train.py is writing this folder; wait for it to "
                "end, or pass another --out"
            ) from None
        except OSError as e:  # a filesystem without flock (Lustre mounted noflock, say)
            log.warning("%s: no lock (%s): a second run on this folder is not refused", out_dir, e)
        yield


def latest(out_dir):
    """The newest complete checkpoint folder, by step (`complete_checkpoints`), or None."""
    folders = complete_checkpoints(out_dir)
    return folders[-1] if folders else None


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed: damaged, holding more than data, or written for
    another model shape. `check_resume` finds it before any model or engine starts, except damage
    inside a tensor's bytes, which only `restore` reads."""


# the fields that fix the weights' shapes (and which weights): a resume cannot change them
MODEL_SHAPE = (
    "path",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "max_position_embeddings",
)

# with LoRA, which weights the checkpoint's adapters (and those trained in full) are, and how the
# adapters' update is scaled: a resume cannot change them either
LORA_SHAPE = ("lora_rank", "lora_alpha", "lora_targets", "lora_also_train")


# what a damaged or hostile file raises while it is read (a SafetensorError subclasses none)
UNREADABLE = (
    OSError,
    EOFError,
    ValueError,
    RuntimeError,
    KeyError,
    IndexError,
    TypeError,
    AttributeError,
    pickle.UnpicklingError,
    safetensors.SafetensorError,
)
TRAINER_STATE = {"step", "world_size", "scheduler", "buffer"}


def check_resume(folder, cfg):
    """The trainer state of checkpoint `folder` (and under "config", the config it was written
    with: None before checkpoints held one), once every file a resume reads is found whole and
    holding data only, and its model fields and seed (a tiny LoRA run's: its task too) equal
    `cfg`'s; each other change is logged.
    Runs before the engine starts: a bad checkpoint costs seconds, not an engine start. A
    CheckpointError says which file or field."""
    try:
        state = read_trainer_state(folder)
        if not (isinstance(state, dict) and TRAINER_STATE <= state.keys()) or not isinstance(
            state["step"], int
        ):
            raise ValueError("trainer_state.pt holds no trainer state")
        check_sharded(os.path.join(folder, "sharded"))
        for name in os.listdir(folder):
            if name.endswith(".safetensors"):  # the HF export the engine and the policy load
                with safetensors.safe_open(os.path.join(folder, name), "pt") as f:
                    f.keys()  # reads and checks the header against the file's size
    except UNREADABLE as e:
        raise CheckpointError(f"{folder} cannot be resumed: {type(e).__name__}: {e}") from None
    saved = read_saved_config(folder)
    # a HF model's shape is its folder's: only the tiny model's comes from these fields
    tiny, lora = cfg.model.path == "tiny", cfg.model.lora_rank > 0
    names = (MODEL_SHAPE if tiny else ("path",)) + (LORA_SHAPE if lora else LORA_SHAPE[:1])
    compared = [("model", name) for name in names]
    # the seed orders the prompts the checkpoint's stream position counts in (task/data.py), and
    # a tiny model is built from it: a LoRA base, a KL reference, the tiny task's prompts
    compared += [("train", "seed")]
    # and with the task's vocabulary (another would put the trained adapters on another model)
    compared += [("data", "task")] if tiny and lora else []
    for section, name in compared if saved is not None else ():
        if name not in saved.get(section, {}):  # a field newer than the checkpoint
            continue
        was, now = saved[section][name], getattr(getattr(cfg, section), name)
        if isinstance(was, list) and isinstance(now, list):  # names: their order does not count
            was, now = sorted(was), sorted(now)
        if was != now:
            raise CheckpointError(
                f"--resume: {section}.{name}={now!r}, but {folder} was written with {was!r}: its "
                "weights, and the prompts its position counts, are that setting's. Start a new "
                "run (another run.out) to change it."
            )
    for key, (was, now) in changed_settings(saved, cfg).items():
        log.warning("resume: %s=%r (the checkpoint had %r) applies from here on", key, now, was)
    return state | {"config": saved}


def changed_settings(saved, cfg):
    """{section.key: (the checkpoint's value, cfg's)} of each setting a resume changes (none for a
    checkpoint without its config; `auto` against the number it became is no change). Each is
    logged: a resume takes the config's settings, and some change more than they say (train.steps
    stretches the learning-rate schedule; rollout.group_size, the groups still held)."""
    changed = {}
    for section, values in dataclasses.asdict(cfg).items():
        for key, now in values.items():
            was = (saved or {}).get(section, {}).get(key, now)  # absent: newer than the checkpoint
            if isinstance(was, (list, tuple)) and isinstance(now, (list, tuple)):
                was, now = list(was), list(now)
            if was != now and now != "auto":
                changed[f"{section}.{key}"] = (was, now)
    return changed


def check_sharded(path):
    """What dcp.load would otherwise find only after the engine started: every shard's bytes are
    there, in the folder, and every non-tensor value (the optimizer's lr, betas, flags; written
    with torch.save) loads with weights_only=True. Raises one of UNREADABLE."""
    metadata = parallel.read_metadata(path)
    values = {
        name
        for name, item in metadata.state_dict_metadata.items()
        if isinstance(item, BytesStorageMetadata)
    }
    for index, entry in metadata.storage_data.items():
        if os.path.basename(entry.relative_path) != entry.relative_path:
            raise ValueError(f"a shard outside the checkpoint: {entry.relative_path!r}")
        shard = os.path.join(path, entry.relative_path)
        if os.path.getsize(shard) < entry.offset + entry.length:
            raise ValueError(f"{shard} is cut short")
        if index.fqn in values:
            with open(shard, "rb") as f:
                f.seek(entry.offset)
                torch.load(io.BytesIO(f.read(entry.length)), weights_only=True)


def read_saved_config(folder):
    """The config a checkpoint was written with (its config.yaml, parsed safely), or None for a
    checkpoint written before checkpoints held one."""
    path = os.path.join(folder, "config.yaml")
    if not os.path.isfile(path):
        log.warning(
            "%s holds no config.yaml: its model shape is not checked, nor the settings a resume "
            "changes listed",
            folder,
        )
        return None
    try:
        with open(path, encoding="utf-8") as f:
            saved = load_yaml(f)
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise CheckpointError(f"{path} cannot be read: {type(e).__name__}: {e}") from None
    if not (isinstance(saved, dict) and isinstance(saved.get("model"), dict)):
        raise CheckpointError(f"{path}: its model section is not a mapping")
    if not all(isinstance(section, dict) for section in saved.values()):
        raise CheckpointError(f"{path}: a section of it is not a mapping")
    return saved


def read_trainer_state(folder):
    """Step, scheduler, streaks and the data position. Plain tensors and values only: loading never
    runs pickled code."""
    return torch.load(os.path.join(folder, "trainer_state.pt"), weights_only=True)


def restore(folder, state, trainer, t):
    """Model and optimizer shards (resharded to this world size), scheduler and the skipped-update
    streak; then the optimizer settings of `t` (train config) replace the checkpoint's. (No RNG
    state: each rollout seeds its requests, rollout.rollout_seed, read by the engine with
    rollout.deterministic only, and the update draws nothing at random.) The trainer's half: the
    data position, the log-prob gap's streak and partial rollout's held samples are restored by
    assemble.setup."""
    try:
        parallel.load_state(os.path.join(folder, "sharded"), trainer.policy, trainer.optimizer)
    except CheckpointException as e:  # a BaseException: what check_resume cannot see (a flipped
        # byte inside a tensor's shard, say) would end the run with a traceback
        raise CheckpointError(f"{folder} cannot be restored: {e}") from None
    trainer.scheduler.load_state_dict(state["scheduler"])
    # the schedule counts optimizer steps, train.num_minibatches a step: another number places the
    # checkpoint's position in the new count (read as is, it was that many steps back)
    was = (state.get("config") or {}).get("train", {}).get("num_minibatches")
    if isinstance(was, int) and was > 0:
        trainer.scheduler.last_epoch = trainer.scheduler.last_epoch * t.num_minibatches // was
    apply_optimizer_settings(trainer.optimizer, trainer.scheduler, t)
    trainer.bad_steps = state.get("bad_steps", 0)  # absent from checkpoints before 2026-11-27
    log.info(
        "resumed from %s at step %d (written by %d ranks, now %d); the next update's learning "
        "rate: %.3g",  # a longer train.steps stretches the schedule: the rate can jump up
        folder,
        state["step"],
        state["world_size"],
        parallel.world_size(),
        trainer.scheduler.get_last_lr()[0],
    )


def apply_optimizer_settings(optimizer, scheduler, t):
    """A resume trains with the config's lr, betas and weight decay (each change logged by
    check_resume): AdamW's moments and step counts come from the checkpoint, its settings do not
    (lowering lr to go on past an unstable stretch is the common case). The schedule's shape was
    never saved: LambdaLR keeps no function in its state, so warmup and decay are the config's
    already."""
    scheduler.base_lrs = [t.lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = t.lr
        group["lr"] = t.lr * factor(scheduler.last_epoch)
        group["betas"] = (t.adam_beta1, t.adam_beta2)
        group["weight_decay"] = t.weight_decay
    # what get_last_lr() reports (train/lr): LRScheduler keeps it apart from the groups' lr
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def save_hf(policy, tokenizer, folder, state_dict=None):
    """A HF folder (safetensors) that `from_pretrained` and the engine load; with LoRA adapters,
    of merged weights (lora.merged_weights)."""
    if state_dict is None:
        state_dict = dict(lora.merged_weights(policy))
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
