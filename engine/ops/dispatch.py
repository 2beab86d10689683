"""Choosing between a Triton kernel and its torch reference.

Triton runs only on CUDA tensors, only when triton imports, and never when the kernel configuration turns it off
(`KernelConfig.triton`, ENGINE_DISABLE_TRITON=1: to measure or debug the references on a GPU)."""
from __future__ import annotations

import functools

import torch

from engine.ops.kernel_config import kernel_config


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def triton_available() -> bool:
    return kernel_config().triton and _triton_imports()


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()
