"""CPU compatibility for SGLang's engine processes, run by Python at their start (cpu_compat/ is on
the PYTHONPATH of the engine's processes on a CPU machine only: runtime/engine.py).

Pinned host memory needs a CUDA driver, yet SGLang's LoRA layers and its torch_native LoRA backend
pin unconditionally (sglang/srt/lora/layers.py: torch.tensor(..., pin_memory=True);
lora/backend/torch_backend.py: .pin_memory()), and so does the routed experts' host buffer
(srt/state_capturer/base.py through srt/mem_cache/pool_host/common.py's cudaHostRegister): each
raises without one. They are built before the engine first imports sgl_kernel, so the stand-in
there is too late. Pinning only speeds host-to-GPU copies, and a CPU engine makes none: in the
processes multiprocessing spawns (the engine's scheduler and detokenizer; the trainer's own
process is left as it is) it is a no-op.
"""

import sys

if "multiprocessing.spawn" in " ".join(getattr(sys, "orig_argv", [])):
    import functools

    import torch

    if not torch.cuda.is_available():

        def _unpinned(factory):
            @functools.wraps(factory)
            def call(*args, pin_memory=False, **kwargs):
                return factory(*args, **kwargs)

            return call

        for _name in ("tensor", "empty", "zeros"):
            setattr(torch, _name, _unpinned(getattr(torch, _name)))
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self

        class _NoCudart:
            """cudaHostRegister and its inverse, as a CPU engine needs them: nothing to do."""

            def cudaHostRegister(self, *args):
                return 0

            def cudaHostUnregister(self, *args):
                return 0

        torch.cuda.cudart = _NoCudart  # called: `torch.cuda.cudart()` gives the object
