"""Running another architecture's kernels on this GPU (ENGINE_EMULATE_ARCH, kernel_config.py).

platform.py makes every dispatch see that card's DeviceCaps (its paths, tiles, FP8 decode, no PDL); this module
makes Triton compile each kernel as for that card too: its instruction selection (mma.sync and cp.async where the
card has no wgmma or TMA, no e4m3 conversions before sm89), then PTX and a cubin for the GPU that runs them (an
sm80 kernel's instructions all exist on sm90). A kernel that needs more shared memory than the emulated card
gives one program is refused at load, as the card's driver would refuse it. Set up once, before the first kernel
compiles (dispatch.triton_available); cuBLAS and cuDNN still choose their own kernels for the real GPU.
"""
from __future__ import annotations

import json

import triton


class SharedMemoryLimit:
    """A kernel-load hook: refuses a kernel whose shared memory exceeds `limit` bytes (the emulated card's)."""

    def __init__(self, arch: int, limit: int):
        self.arch, self.limit = arch, limit

    def __call__(self, module, function, name: str, metadata_group: dict[str, str], hash: str) -> None:
        path = metadata_group.get(f"{name}.json")
        if path is None:
            return
        with open(path) as f:
            shared = json.load(f).get("shared", 0)
        if shared > self.limit:
            raise triton.runtime.errors.OutOfResources(shared, self.limit, f"shared memory (emulated sm{self.arch})")


def compile_for(arch: int, shared_memory_per_block: int) -> None:
    """Every Triton kernel compiled from now on targets sm`arch` and fits its shared memory."""
    knobs = triton.knobs.runtime
    knobs.override_arch = f"sm{arch}"
    if not any(isinstance(h, SharedMemoryLimit) for h in knobs.kernel_load_start_hook.calls):
        knobs.kernel_load_start_hook.add(SharedMemoryLimit(arch, shared_memory_per_block))
