"""Programmatic dependent launch (PDL, sm90+) along a one-token decode step: each kernel launches while the one
before it still runs, so launch latency and a weight-streaming kernel's first loads overlap the kernel before.

Two constexpr-guarded instructions (GDC: emitted only where `enabled` says so; sm80-89 have neither):
- `launch_dependents`: once every program of this kernel has passed it, the next kernel (if launched with PDL:
  `options`) may launch. The one-token linears (4-bit GEMV, FP8 weight-only GEMV and one-launch W8A8)
  call it after their K loop; the small kernels between the linears (RMSNorm, SwiGLU, q/k norm + RoPE,
  decode attention) at their top, through `start`.
- `wait`: returns when the kernel before has finished and its writes are visible. A kernel launched with
  `options` loads nothing another kernel writes, and stores nothing, before it: the small kernels wait at their
  top (`start`); a GEMV first loads its first weight tile, which no kernel writes; the one-launch W8A8 kernel
  waits before its K loop (its pipelined loads of x start there).
Kernels launched without PDL wait for the one before as always, so ordering holds down the stream (a kernel's
wait returns after the one before has finished, which waited for its own predecessor). CUDA graphs capture the
programmatic edges. Only one-token launches use PDL: with more tokens the linears are GEMMs that neither let the
next kernel launch early nor wait, and the small kernels launched as their dependents measured 3% slower at
batch 8 (docs/perf-log.md).
Where: DeviceCaps.pdl (engine/ops/platform.py: sm90 and later); KernelConfig.pdl=False (ENGINE_PDL=0) turns it
off for A/B measurements.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.ops.kernel_config import kernel_config
from engine.ops.platform import device_caps


def enabled(device: torch.device, tokens: int) -> bool:
    """PDL for a launch over `tokens` tokens on `device`: one token, a device with PDL (DeviceCaps.pdl), and the
    kernel configuration allows it."""
    return tokens == 1 and kernel_config().pdl and device_caps(device).pdl


def options(device: torch.device, tokens: int) -> dict:
    """Keyword arguments for the launch of a kernel with a GDC constexpr: the constexpr, and where PDL is
    enabled, the launch as a programmatic dependent."""
    return {"GDC": True, "launch_pdl": True} if enabled(device, tokens) else {"GDC": False}


@triton.jit
def launch_dependents(GDC: tl.constexpr):
    """Let the next kernel launch (if launched with PDL) once every program of this one has passed here."""
    if GDC:
        gdc_launch_dependents()


@triton.jit
def start(GDC: tl.constexpr):
    """The top of a small kernel launched with `options`: let the next kernel launch, then wait for the one before
    (nothing of this kernel's work overlaps; its launch and the next kernel's do)."""
    if GDC:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def wait(GDC: tl.constexpr):
    """Block until the kernel before has completed and its memory is visible (a no-op without PDL)."""
    if GDC:
        gdc_wait()
