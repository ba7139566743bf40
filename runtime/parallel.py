"""Data parallelism with PyTorch's own stack: starting the ranks (elastic_launch / torchrun),
sharding the policy with FSDP2, reductions across ranks, and sharded checkpoints
(torch.distributed.checkpoint).

Owns every torch.distributed call of the trainer. With one rank (no process group) each function is
the plain single-process equivalent, so train.py reads the same with 1 rank or 8. Does not own what
is reduced or saved (train.py decides), nor the engine (rollout.py: every rank has its own).
"""

import contextlib
import multiprocessing
import os
import pickle
import signal
import socket
import uuid
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)


class RankError(RuntimeError):
    """A rank of a multi-process run failed (the message carries that rank's error), or the
    ranks were launched across nodes."""


# ---------------------------------------------------------------- ranks
def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def local_rank():
    return int(os.environ.get("LOCAL_RANK", 0))


def gpu_index(device_count=None):
    """This rank's GPU: its LOCAL_RANK, or 0 when the launcher shows each rank one GPU (SLURM
    `--gpus-per-task=1`, or CUDA_VISIBLE_DEVICES set per rank): `cuda:LOCAL_RANK` would not exist
    there."""
    device_count = torch.cuda.device_count() if device_count is None else device_count
    return 0 if device_count == 1 else local_rank()


def rank_share(items):
    """This rank's contiguous share of a list (all of it with one rank)."""
    this_rank, world = rank(), world_size()
    return items[this_rank * len(items) // world : (this_rank + 1) * len(items) // world]


def under_launcher():
    """True in a process started by torchrun or elastic_launch (they set the rendezvous
    variables)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def default_nproc():
    """`run.nproc: 0` means every visible GPU, and 1 on a CPU machine."""
    return max(torch.cuda.device_count(), 1)


def launch(nproc, entrypoint, *args):
    """Run `entrypoint(*args)` in `nproc` fresh processes on this node (spawned, non-daemonic:
    each can start SGLang's scheduler processes), rendezvous on a free localhost port, no
    restarts. A rank that raises ends the job: the launcher stops the other ranks, and RankError
    carries the failing rank's error instead of a hang. SIGINT and SIGTERM are the ranks' to
    handle (`forward_to_ranks`), not torch elastic's: it would send each rank the signal again
    and SIGKILL them 30 s later, before a step and its checkpoint could finish, then raise."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        start_method="spawn",
        run_id=uuid.uuid4().hex,
        monitor_interval=0.5,
        signals_to_handle="SIGHUP,SIGQUIT",
    )
    # torch elastic's handlers for SIGHUP and SIGQUIT stay after it returns: put back too (an
    # engine's SIGQUIT handler in this process raised torch's SignalException after a launch)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGHUP, signal.SIGQUIT)}
    previous |= {
        sig: signal.signal(sig, forward_to_ranks) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        return elastic_launch(config, run_as_rank)(entrypoint, *args)
    except ChildFailedError as e:
        failures = [f"rank {r}: {failure_message(f)}" for r, f in sorted(e.failures.items())]
        raise RankError("; ".join(failures)) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def failure_message(failure):
    """A failed rank's error: torch elastic's `ProcessFailure.message` is the error file's
    record, a dict holding the message and the traceback as text, for a rank that raised
    (torch/distributed/elastic/multiprocessing/errors/__init__.py, `_get_error_data`): its
    message then (the traceback is in the launcher's log above); else torch's own text (a signal
    named, or where to read about tracebacks), with the exit code."""
    if isinstance(failure.message, dict):
        return failure.message.get("message") or f"exit code {failure.exitcode}"
    return f"{failure.message} (exit code {failure.exitcode})"


def run_as_rank(entrypoint, *args):
    """`entrypoint(*args)` in a rank, a Ctrl-C that raised there (before the rank's own handler is
    in: its imports, its config) returned as "SIGINT", the name a rank stopped by a signal returns.
    Raised, torch's process wrapper takes it for its parent's kill and exits 0 without a result
    (torch/multiprocessing/spawn.py, `_wrap`), and the launch waited for that result forever."""
    try:
        return entrypoint(*args)
    except KeyboardInterrupt:
        return "SIGINT"


def forward_to_ranks(signum, frame):
    """The launcher's SIGINT and SIGTERM: sent on to every rank (the processes this one started),
    whose StopSignal finishes the step, saves and returns the signal's name, which the launch
    returns. A Ctrl-C reaches the ranks from the terminal too: StopSignal takes a repeat within
    REPEAT_S as the same signal."""
    for rank in multiprocessing.active_children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank.pid, signum)


def init():
    """Join the process group the launcher set up; returns this rank's device. NCCL on GPUs (one
    per local rank), gloo on CPU. SGLang sets NCCL_CUMEM_ENABLE=0 in its processes: the trainer
    matches it so both sides' NCCL communicators use the same memory path. One node only
    (`one_node`)."""
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        torch.cuda.set_device(gpu_index())
    dist.init_process_group("nccl" if on_gpu else "gloo")
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    one_node(hosts)
    return torch.device("cuda", gpu_index()) if on_gpu else torch.device("cpu")


def one_node(hosts):
    """A RankError unless every rank (`hosts`: each one's host name) runs on one host: rank 0
    alone renames a checkpoint into place and writes the model folder every engine loads, which
    another node's disk would not hold. Read from the hosts, not the launcher's node count: srun
    with a task per GPU runs torchrun --nnodes=N on one host."""
    if len(set(hosts)) > 1:
        names = ", ".join(sorted(set(hosts))[:4])
        raise RankError(
            f"ranks on {len(set(hosts))} hosts ({names}): this trainer runs on one node (rank 0 "
            "writes the checkpoints and the engines' model folder)"
        )


def close():
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier():
    if dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------- sharding
def shard(model, compute_dtype):
    """FSDP2: each decoder layer and the root own a shard of the fp32 parameters;
    forward/backward all-gather them cast to `compute_dtype`, gradients reduce in fp32. Gradients
    are *summed* over ranks (no division): update.optimizer_step divides the loss by global counts,
    and FSDP's averaging is silently wrong on gloo (pytorch issue 162338). The divide factor is per
    FSDP module, so set it on each. The decoder layers are then handed back to Dynamo as plain
    modules (`as_plain_modules`)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    as_plain_modules(model.model.layers)
    return model


def as_plain_modules(layers):
    """Undo the mark fully_shard leaves on every module it manages "For Dynamo"
    (`_is_fsdp_managed_module`, torch/distributed/fsdp/_fully_shard/_fully_shard.py), so that a
    compiled decoder layer (runtime/model.py, compile_layers) is traced as any module is. Marked,
    Dynamo skips guards on the module and, under dynamic=True, reads its Python ints as symbols
    (torch/_dynamo/utils.py, is_int_specialization_case specializes other modules' ints only):
    `self_attn.head_dim` became a symbol, and so did the head count, on which Inductor's
    flex_attention lowering failed (an H200, docs/RESULTS.md). Unmarked, its ints are constants
    and its attributes guarded (LoRA's `lora_on` flip recompiles); its parameters stay the
    graph's inputs, and FSDP2's hooks run around `forward`, outside the compiled code. Only
    Dynamo reads the mark. Tested: tests/test_update_passes.py."""
    for layer in layers:
        for module in layer.modules():
            module.__dict__.pop("_is_fsdp_managed_module", None)
            module.__dict__.pop("_fsdp_use_orig_params", None)


@contextlib.contextmanager
def gathered_for_update(model, keep=True):
    """Within it, an FSDP2 policy's units stay gathered (all-gathered and cast to the compute dtype
    once) from their first forward to the last micro-batch's backward of each optimizer step:
    reshard_after_forward off keeps a unit gathered from its forward to its backward, and
    reshard_after_backward off keeps it for the next micro-batch's forward (FSDPParamGroup.unshard
    returns at once when `is_unsharded`; torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py).
    A no-grad pass inside it (pi_old's forward with several minibatches) leaves the units gathered
    for the first minibatch's forwards: the weights have not changed in between.
    Yields `last(flag)`: call it before each micro-batch with whether it is the minibatch's last,
    whose backward reshards, as the optimizer step that follows changes the shards. Gradients are
    still reduce-scattered after every micro-batch (set_requires_gradient_sync stays on): they stay
    sharded, where accumulating them unsharded would hold a whole fp32 gradient per rank. The
    cost: the whole model in the compute dtype on every rank during the update (the estimate's
    "FSDP units gathered"). On exit every unit is resharded and its flags are back to what `shard`
    set, so outside an update named_parameters() is the shards again. Without `keep`
    (train.fsdp_keep_gathered off), each layer is resharded after its forward and its backward as
    `shard` set, and resharded on exit all the same. Without FSDP: a no-op."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield lambda last: None
        return
    for unit in units:
        unit.set_reshard_after_forward(not keep and unit is not model, recurse=False)
    try:
        yield lambda last: model.set_reshard_after_backward(last or not keep)
    finally:
        model.set_reshard_after_backward(True)
        for unit in units:
            # True first: a unit whose forward raised (an out-of-memory error, say) is still in
            # its forward state, where reshard() returns without resharding unless it reshards
            # after forward (_fsdp_param_group.py, FSDPParamGroup.reshard)
            unit.set_reshard_after_forward(True, recurse=False)
            unit.reshard()
            # shard's defaults: decoder layers reshard after forward; the root does not (FSDP
            # leaves its parameters gathered for the backward that follows)
            unit.set_reshard_after_forward(unit is not model, recurse=False)


def full_tensor(tensor):
    """The whole tensor from a DTensor shard (a collective: every rank calls it in the same
    order), on the shard's device. A shard offloaded to the CPU (memory.py's rollout phase, when
    a LoRA checkpoint gathers its adapters) is gathered on its mesh's device: DTensor.full_tensor
    does not move it there (torch/distributed/tensor/_api.py, `redistribute`), and a NCCL group
    has no CPU backend. (On GPUs only: not run here, where gloo's mesh is the CPU.)"""
    if not hasattr(tensor, "full_tensor"):
        return tensor
    device, mesh = tensor.device, tensor.device_mesh.device_type
    if device.type == mesh:
        return tensor.full_tensor()
    return tensor.to(mesh).full_tensor().to(device)


# ---------------------------------------------------------------- reductions
def all_reduce(values, op="sum"):
    """Sum (or max) a list of numbers over ranks, returned as floats on every rank."""
    if not dist.is_initialized():
        return [float(v) for v in values]
    # NCCL reduces device tensors only (one small copy each way); gloo reduces CPU tensors
    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    )
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor.tolist()


def gather_objects(obj):
    """Every rank's `obj` (any picklable object), on every rank: a list of world_size."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------- checkpoints
@contextlib.contextmanager
def alone_is_intended():
    """Within it, torch.distributed.checkpoint's warning that it saves or loads in a single
    process (torch/distributed/checkpoint/utils.py) is not shown: with one rank and no process
    group that is what this trainer means, and it printed at every checkpoint."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "torch.distributed is disabled, unavailable or uninitialized", UserWarning
        )
        yield


def save_state(path, model, optimizer):
    """Sharded state of the trained parameters + the optimizer under `path` (every rank writes its
    shard). Loadable at any world size, 1 included: torch.distributed.checkpoint reshards on
    load. An optimizer that has not stepped yet is saved as a fresh one (`fresh_state`)."""
    if not optimizer.state:
        fresh_state(model, optimizer)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    with alone_is_intended():
        dcp.save(
            {"model": trained_only(model, model_state), "optimizer": optimizer_state},
            checkpoint_id=path,
        )


def fresh_state(model, optimizer):
    """Gives an AdamW that has not stepped yet the state it would start its first step with.
    get_state_dict fills an empty state by stepping once with zero gradients and lr 0 (torch/
    distributed/checkpoint/state_dict.py, `_init_optim_state`): the weights stay, but `step`
    becomes 1, and the next real update, bias-corrected as a second step, was ~26% smaller, in the
    live optimizer and in the checkpoint. Step 0 with zero moments is exactly a fresh AdamW's
    (AdamW is torch/optim/adam.py's Adam: its `_init_group` starts there)."""
    get_state_dict(model, optimizer)
    for state in optimizer.state.values():
        state["step"].zero_()


def load_state(path, model, optimizer=None):
    """Read back what `save_state` wrote (`optimizer` None: the model's part alone), resharded to
    this world size; nothing in the folder is unpickled beyond tensors, plain values and the
    checkpoint library's own metadata classes. Frozen parameters keep the values they were built
    with (strict=False below: dcp.load already raised on any trained one the folder lacks)."""
    if optimizer is None:
        state = {"model": trained_only(model, get_model_state_dict(model))}
    else:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": trained_only(model, model_state), "optimizer": optimizer_state}
    with alone_is_intended():
        dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
    options = StateDictOptions(strict=False)
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=options)
    else:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=options,
        )


def trained_only(model, state):
    """A model state dict without its frozen parameters (a LoRA run's base): those are rebuilt
    from model.path, never saved, so a LoRA checkpoint holds the adapters and their AdamW state
    alone (megabytes, not the model). Every name of a tied parameter is left out
    (StateDictOptions(ignore_frozen_params) drops only the first: a tied head stayed)."""
    names = model.named_parameters(remove_duplicate=False)
    frozen = {name for name, parameter in names if not parameter.requires_grad}
    return {name: value for name, value in state.items() if name not in frozen}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a `.metadata` file admitting only the classes torch.distributed.checkpoint writes
    there (tensor and bytes entries, chunk and storage records, sizes, dtypes, a path); any other
    global, which is how a pickle runs code, is an UnpicklingError."""

    MODULES = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {
            "Size",
            *(name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)),
        },
        # DCP keeps the checkpoint's path; Python 3.13 pickles it from pathlib._local
        "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
        "pathlib._local": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    }

    def find_class(self, module, name):
        if name in self.MODULES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")


def read_metadata(path):
    """The sharded state's index (`path`/.metadata). torch unpickles it unrestricted
    (torch/distributed/checkpoint/filesystem.py, FileSystemReader.read_metadata), so a checkpoint
    from elsewhere could run code on load: read with MetadataUnpickler instead."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = MetadataUnpickler(f).load()
    if not isinstance(metadata, dcp.Metadata):
        raise pickle.UnpicklingError(f"{path}/.metadata holds a {type(metadata).__name__}")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """FileSystemReader with the metadata read by `read_metadata`; the tensors it reads itself
    with torch.load(weights_only=True) (filesystem.py, read_data)."""

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:  # per-rank metadata: not written by save_state
            raise pickle.UnpicklingError("per-rank checkpoint metadata is not read")
        metadata = read_metadata(self.path)
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as the base class does
        return metadata


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DefaultLoadPlanner reads each non-tensor value (the optimizer's lr, betas, flags) with
    torch.load with weights_only off (default_planner.py, load_bytes): each is first loaded with
    weights_only=True, which admits only tensors and plain values and raises on anything else;
    the same bytes then go to the base class."""

    def load_bytes(self, read_item, value):
        torch.load(value, weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)


def full_state_dict(model):
    """The whole fp32 model on rank 0's CPU (empty elsewhere), gathered one tensor at a time: for
    the HF export. A collective: every rank calls it."""
    if not dist.is_initialized():
        return {name: tensor.detach() for name, tensor in model.state_dict().items()}
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
