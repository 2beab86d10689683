"""The kernels' configuration: one frozen dataclass, read from the environment once, at the first kernel launch of
the process. This is the only module in engine/ops and engine/model that reads os.environ; the hot path reads the
dataclass (a module global), never the environment.

    ENGINE_DISABLE_TRITON=1   triton=False: every op runs its torch reference, on the GPU too (to measure or debug
                              the references)
    ENGINE_PDL=0              pdl=False: no programmatic dependent launch on sm90+ (A/B measurements; pdl.py)
    ENGINE_EMULATE_ARCH=86    emulate_arch=86: the dispatch sees the device capabilities of that architecture on
                              whatever GPU runs (engine/ops/platform.py): e.g. an H100 runs the paths and tiles
                              an RTX 30 card would take (FP8 weight-only, Ampere's tiles, no PDL). One of
                              platform.KNOWN_ARCHS: 80, 86, 89, 90, 100, 120.

Benchmarks and tests set it in-process: `set_kernel_config(KernelConfig(...))`, or `with
override_kernel_config(pdl=False): ...` for a block.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace

# Switches that existed once, with what replaces them: set, they fail at start-up instead of being ignored.
REMOVED = {
    "ENGINE_WNA16_KERNELS": "the 4-bit kernels' A/B mode is gone; bench/tune_wna16.py times explicit configs",
    "ENGINE_FP8_KERNELS": "the FP8 one-launch kernel is Hopper's only path up to 16 tokens; bench/bench_quant.py "
                          "times explicit configs",
    "ENGINE_FP8_WEIGHT_ONLY": "set ENGINE_EMULATE_ARCH=86 (or 80) to run the weight-only FP8 path of GPUs without "
                              "FP8 tensor cores",
}


@dataclass(frozen=True)
class KernelConfig:
    triton: bool = True
    pdl: bool = True
    emulate_arch: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> KernelConfig:
        for name, instead in REMOVED.items():
            if name in env:
                raise ValueError(f"{name} is no longer read: {instead}")
        arch = env.get("ENGINE_EMULATE_ARCH", "").strip().lower().removeprefix("sm").removeprefix("_") or None
        if arch is not None and not arch.isdigit():
            raise ValueError(f"ENGINE_EMULATE_ARCH={env['ENGINE_EMULATE_ARCH']!r}: give an architecture number "
                             f"such as 86 or sm86")
        return cls(triton=env.get("ENGINE_DISABLE_TRITON", "0") != "1", pdl=env.get("ENGINE_PDL", "1") != "0",
                   emulate_arch=int(arch) if arch is not None else None)


_current: KernelConfig | None = None


def kernel_config() -> KernelConfig:
    """The process's kernel configuration (read from the environment on the first call)."""
    global _current
    if _current is None:
        _current = KernelConfig.from_env()
    return _current


def set_kernel_config(config: KernelConfig | None) -> None:
    """Replace the configuration for the rest of the process (None: read the environment again on next use)."""
    global _current
    _current = config


@contextmanager
def override_kernel_config(**changes) -> Iterator[KernelConfig]:
    """The current configuration with `changes` inside the block; the one before after it."""
    before = kernel_config()
    set_kernel_config(replace(before, **changes))
    try:
        yield kernel_config()
    finally:
        set_kernel_config(before)
