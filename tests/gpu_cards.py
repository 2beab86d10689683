"""Which card a GPU test runs as: the GPU's own architecture, or the one ENGINE_EMULATE_ARCH makes it (Triton then
compiles for that card: bench/emulated_paths.sh runs the GPU suites once per card)."""
from __future__ import annotations

import pytest
import torch

from engine.ops.platform import device_caps


def needs_card(arch: int) -> None:
    """Skip a test of sm`arch`'s paths where this process runs as an older card, which cannot run them (e4m3
    conversions before sm89, Hopper's tiles past an RTX card's shared memory): a real one or an emulated one."""
    caps = device_caps(torch.device("cuda"))
    if caps.capability < divmod(arch, 10):
        pytest.skip(f"sm{arch}'s paths: this process runs as {caps.name}")
