"""Programmatic dependent launch (PDL, sm90+) along a one-token decode step: each kernel launches while the one
before it still runs, so launch latency and a weight-streaming kernel's first loads overlap the kernel before.

Two constexpr-guarded instructions (GDC: emitted only where `enabled` says so; sm80-89 have neither):
- `launch_dependents`: once every program of this kernel has passed it, the next kernel (if launched with
  `launch_options`) may launch. The one-token 4-bit GEMV calls it after its K loop; the small kernels between the
  linears (RMSNorm, SwiGLU, q/k norm + RoPE, decode attention) at their top, through `start`.
- `wait`: returns when the kernel before has finished and its writes are visible. A kernel launched with
  `launch_options` loads nothing another kernel writes, and stores nothing, before it: the small kernels wait at
  their top (`start`); the GEMV first loads its first weight tile, which no kernel writes.
Kernels launched without the option wait for the one before as always, so ordering holds down the stream (a
kernel's wait returns after the one before has finished, which waited for its own predecessor). CUDA graphs
capture the programmatic edges. ENGINE_PDL=0 turns it off (A/B measurements), read when a kernel launches.
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
def start(GDC: tl.constexpr):
    """The top of a small kernel launched with `launch_options`: let the next kernel launch, then wait for the one
    before (nothing of this kernel's work overlaps; its launch and the next kernel's do)."""
    if GDC:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def wait(GDC: tl.constexpr):
    """Block until the kernel before has completed and its memory is visible (a no-op without PDL)."""
    if GDC:
        gdc_wait()
