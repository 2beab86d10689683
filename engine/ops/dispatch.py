"""Choosing between a Triton kernel and its torch reference.

Triton runs only on CUDA tensors, only when triton imports, and never when ENGINE_DISABLE_TRITON=1 (used to
measure or debug the references on a GPU)."""
from __future__ import annotations

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    if os.environ.get("ENGINE_DISABLE_TRITON", "0") == "1":
        return False
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()
