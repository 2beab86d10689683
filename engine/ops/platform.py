"""What the kernels may use on a device: one DeviceCaps per device, built once from torch's device properties. Every
choice of kernel, tile or instruction that depends on the GPU reads it here (the quantized linears' dispatch table,
programmatic dependent launch, the attention tiles, the fp8 KV cache's e4m3 decode), so that they agree.

Device classes, by what the kernels use:
- sm80 / sm86 (A100, RTX 30): no FP8 tensor cores. FP8 weights run weight-only (e4m3 decoded with integer ops).
- sm89 (RTX 40): FP8 tensor cores (W8A8 through Triton's mma), no wgmma, no programmatic dependent launch.
- sm90 (H100, H200): wgmma (the tiles tuned on Hopper: swap-AB so that dequantized weights feed the wgmma from
  registers, the FP8 one-launch kernel, cuBLAS's block-scaled FP8 GEMM, cuDNN attention) and PDL.
- sm100 / sm120 (Blackwell): FP8 tensor cores and PDL (griddepcontrol is sm90+ PTX, not Hopper's own), but no
  wgmma: they take sm89's paths and tiles, which fit any of them (sm120 has 99 KB of shared memory per program,
  where Hopper's tiles need more). Nothing is measured on Blackwell yet; the Hopper-tuned paths would need a
  measurement there before they move.
The Triton interpreter (CPU tensors, tests) gets INTERPRETER: Hopper's tiles (what the GPU runs by default), no
FP8 conversions, no PDL, no inline PTX.

Overriding, for tests and benchmarks: `with override_caps(DeviceCaps.for_arch(86)): ...` makes every dispatch
see an RTX 30 card; ENGINE_EMULATE_ARCH (kernel_config.py) does the same for a whole process, keeping the real
card's SM count.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from engine.ops.kernel_config import kernel_config

# Architectures the engine is compiled and checked for (tests/test_ops_portable.py): SM count of a typical card
# and the shared memory one program may opt in to (A100, RTX 3090, RTX 4090, H100, B200, RTX 5090).
KNOWN_ARCHS: dict[int, tuple[int, int]] = {80: (108, 166912), 86: (82, 101376), 89: (128, 101376),
                                           90: (132, 232448), 100: (148, 232448), 120: (170, 101376)}


@dataclass(frozen=True)
class DeviceCaps:
    name: str
    capability: tuple[int, int]
    sm_count: int
    shared_memory_per_block: int   # bytes one program may opt in to
    fp8_tensor_cores: bool         # e4m3 dots and conversions (sm89+)
    wgmma: bool                    # Hopper's warpgroup MMA (sm90 only): the Hopper-tuned paths and tiles
    pdl: bool                      # programmatic dependent launch (griddepcontrol, sm90+)
    ptx: bool = True               # inline PTX (tl.inline_asm_elementwise): every CUDA target, not the interpreter

    @classmethod
    def for_capability(cls, capability: tuple[int, int], sm_count: int, shared_memory_per_block: int,
                       name: str = "") -> DeviceCaps:
        return cls(name=name or f"sm{capability[0]}{capability[1]}", capability=capability, sm_count=sm_count,
                   shared_memory_per_block=shared_memory_per_block, fp8_tensor_cores=capability >= (8, 9),
                   wgmma=capability == (9, 0), pdl=capability >= (9, 0))

    @classmethod
    def for_arch(cls, arch: int, sm_count: int | None = None) -> DeviceCaps:
        """A typical card of architecture `arch` (e.g. 86), with KNOWN_ARCHS' SM count unless given."""
        if arch not in KNOWN_ARCHS:
            raise ValueError(f"unknown architecture sm{arch}: one of {sorted(KNOWN_ARCHS)}")
        sms, shared = KNOWN_ARCHS[arch]
        return cls.for_capability(divmod(arch, 10), sm_count or sms, shared, name=f"sm{arch} (emulated)")


INTERPRETER = DeviceCaps(name="Triton interpreter", capability=(9, 0), sm_count=4, shared_memory_per_block=1 << 30,
                         fp8_tensor_cores=False, wgmma=True, pdl=False, ptx=False)

_probed: dict[tuple[int, int | None], DeviceCaps] = {}
_override: DeviceCaps | None = None


def device_caps(device: torch.device) -> DeviceCaps:
    """The capabilities the kernels see on `device` (an override if one is set)."""
    if _override is not None:
        return _override
    if device.type != "cuda":
        return INTERPRETER
    index = device.index if device.index is not None else torch.cuda.current_device()
    arch = kernel_config().emulate_arch
    caps = _probed.get((index, arch))
    if caps is None:
        caps = _probed[(index, arch)] = _probe(index, arch)
    return caps


def _probe(index: int, emulate_arch: int | None) -> DeviceCaps:
    props = torch.cuda.get_device_properties(index)
    if emulate_arch is not None:
        return DeviceCaps.for_arch(emulate_arch, sm_count=props.multi_processor_count)
    return DeviceCaps.for_capability((props.major, props.minor), props.multi_processor_count,
                                     getattr(props, "shared_memory_per_block_optin", 48 * 1024), props.name)


def set_caps_override(caps: DeviceCaps | None) -> None:
    """Every device reports `caps` until this is called again with None."""
    global _override
    _override = caps


@contextmanager
def override_caps(caps: DeviceCaps | None = None, **changes) -> Iterator[DeviceCaps]:
    """Every dispatch sees `caps` inside the block (or, with only `changes`, the current device's caps with those
    fields replaced: e.g. override_caps(fp8_tensor_cores=False) on a CUDA device)."""
    before = _override
    base = caps if caps is not None else device_caps(torch.device("cuda") if torch.cuda.is_available()
                                                     else torch.device("cpu"))
    set_caps_override(replace(base, **changes))
    try:
        yield _override
    finally:
        set_caps_override(before)
