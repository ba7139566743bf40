"""CPU compatibility stand-in for `sgl_kernel` (SGLang 0.5.23), used only when no GPU is present.

PyPI's sgl-kernel wheel is CUDA-only and fails to import without libcuda, yet SGLang's CPU engine
imports ops from it. runtime/engine.py puts this folder first on the engine processes' PYTHONPATH
on CPU machines. Only `assign_req_to_token_pool_cpu` is called on a CPU without AMX; every other
name resolves to a placeholder that raises with the op's name, so a new call path fails loudly.
"""

import functools

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """For request row r with token range [start, end): req_to_token[r, start:end] = next KV slots.

    req_pool_indices, start_offset, end_offset: [B]; out_cache_loc: [sum(end - start)] slot ids,
    laid out request after request; req_to_token: [num_req_slots, pool_len] (written in place).
    """
    written = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    ):
        assert (
            0 <= start <= end <= pool_len
        ), f"token range [{start}, {end}) outside pool length {pool_len}"
        req_to_token[row, start:end] = out_cache_loc[written : written + end - start]
        written += end - start


def __getattr__(name):
    """Any other op: a placeholder that raises when called (importing it must still work)."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing_op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU stand-in (cpu_compat/sgl_kernel)")

    missing_op.__name__ = name
    return missing_op


# SGLang's release/resume_memory_occupation call torch.get_device_module().synchronize(); with the
# CUDA build of torch and no GPU that resolves to torch.cuda and raises "Found no NVIDIA driver".
# Without a GPU the device the engine runs on is the CPU, so answer with torch.cpu.
# functools.wraps keeps `__wrapped__`, which torch._dynamo reads off torch.get_device_module when it
# traces (torch/_dynamo/variables/torch.py): without it FlexAttention's mask could not be compiled
# in a process that runs the engine.
if not torch.cuda.is_available():
    _get_device_module = torch.get_device_module

    @functools.wraps(_get_device_module)
    def _cpu_device_module(device=None):
        return torch.cpu if device is None else _get_device_module(device)

    torch.get_device_module = _cpu_device_module
