"""Choosing between a Triton kernel and its torch reference.

Triton runs only on CUDA tensors, only when triton imports, and never when the kernel configuration turns it off
(`KernelConfig.triton`, ENGINE_DISABLE_TRITON=1: to measure or debug the references on a GPU). Every launch
asks here first, so this is also where an emulated architecture (ENGINE_EMULATE_ARCH) reaches Triton's compiler
before its first kernel (emulation.py)."""
from __future__ import annotations

import functools

import torch

from engine.ops.kernel_config import kernel_config


@functools.cache
def _triton_ready(emulate_arch: int | None) -> bool:
    """Whether triton imports; the first time, with an emulated architecture, Triton compiles for it from then on
    (emulation.py)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    if emulate_arch is not None:
        from engine.ops.emulation import compile_for
        from engine.ops.platform import DeviceCaps
        compile_for(emulate_arch, DeviceCaps.for_arch(emulate_arch).shared_memory_per_block)
    return True


def triton_available() -> bool:
    config = kernel_config()
    return config.triton and _triton_ready(config.emulate_arch)


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()
