"""Programmatic dependent launch (PDL, sm90+): a weight-streaming kernel starts while the small kernel before it
still runs, and loads its first weight tiles (which no kernel writes) before it waits for that kernel's outputs.

Two sides, each a constexpr-guarded instruction (GDC: emitted only where `enabled` says so; sm80-89 have neither):
- `launch_dependents` at the top of the kernels that run right before a one-token linear (RMSNorm, SwiGLU,
  decode attention): once every program of such a kernel has started, the next kernel may launch.
- `wait` in a kernel launched with `launch_options(device)` (the one-token 4-bit GEMV): it returns when the kernel
  before has finished and its writes are visible. Such a kernel loads nothing that another kernel writes, and
  stores nothing, before its wait; kernels launched without the option wait for the one before as always, so
  ordering holds down the stream. CUDA graphs capture the programmatic edges.
ENGINE_PDL=0 turns both off (A/B measurements), read when a kernel launches.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """PDL for kernels launched on `device`: a CUDA device of compute capability 9.0 or later, and ENGINE_PDL
    is not 0."""
    if device.type != "cuda" or os.environ.get("ENGINE_PDL", "1") == "0":
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """Launch keyword arguments for a kernel that calls `wait`: launched as a programmatic dependent where
    enabled."""
    return {"launch_pdl": True} if enabled(device) else {}


@triton.jit
def launch_dependents(GDC: tl.constexpr):
    """Let the next kernel launch (if launched with PDL) once every program of this one has passed here."""
    if GDC:
        gdc_launch_dependents()


@triton.jit
def wait(GDC: tl.constexpr):
    """Block until the kernel before has completed and its memory is visible (a no-op without PDL)."""
    if GDC:
        gdc_wait()
