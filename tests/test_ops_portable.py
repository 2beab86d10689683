"""Every Triton kernel compiles for the GPUs people run the engine on, and fits their shared memory.

The engine is measured on an H200 (sm90), but users have A100s (sm80), RTX 30 (sm86) and RTX 40 (sm89) cards:
a tile tuned on Hopper can need more shared memory than the 99 KB one program gets on a consumer card, and an
FP8 type compiles only where the hardware has it. tests/portable_compile.py compiles each kernel the engine
launches at Qwen3-VL-8B's shapes for one architecture, without a GPU (Triton ships ptxas), choosing paths and
tiles through the engine's own dispatch. ./run_tests.sh installs triton (the test extras) on Linux x86-64, where
its wheel carries ptxas; elsewhere the test is skipped.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia.compiler", reason="needs triton with its CUDA backend")

from portable_compile import SHARED_LIMIT  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# What every architecture launches: the decoder's attention (decode and prefill), the ViT's, the 4-bit paths
# (GEMV, GEMM, dequantize), FP8 weight-only (GPUs without FP8 tensor cores, and K not a multiple of the block)
# and the elementwise kernels.
EVERYWHERE = {"_decode_kernel", "_decode_reduce_kernel", "_prefill_kernel", "_varlen_split_kernel",
              "_qk_rope_kernel", "_store_kvcache_kernel", "_vision_rope_kernel", "_layer_norm_kernel",
              "_rms_norm_kernel", "_silu_and_mul_kernel", "_patchify_kernel", "_embedding_kernel",
              "_wna16_gemv_kernel", "_wna16_dequant_kernel", "_wna16_gemm_kernel",
              "_fp8_gemv_kernel", "_fp8_gemm_kernel", "_fp8_dequant_kernel", "_splitk_reduce_kernel"}
FP8_TENSOR_CORES = {"_w8a8_block_kernel", "_fp8_act_quant_kernel"}   # sm89+: e4m3 activations
HOPPER = {"_w8a8_one_launch_kernel"}                                  # sm90: the fp8 wgmma up to 16 tokens


@pytest.mark.slow
@pytest.mark.parametrize("capability", [80, 86, 89, 90], ids=["A100", "RTX-30", "RTX-40", "H100"])
def test_every_kernel_compiles_and_fits_shared_memory(capability):
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "portable_compile.py"), str(capability)],
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    shared = json.loads(run.stdout.splitlines()[-1])["shared"]
    expected = EVERYWHERE | (FP8_TENSOR_CORES if capability >= 89 else set()) | (HOPPER if capability == 90 else set())
    assert expected <= set(shared), f"not launched: {sorted(expected - set(shared))}"
    over = {name: nbytes for name, nbytes in shared.items() if nbytes > SHARED_LIMIT[capability]}
    assert not over, f"over sm{capability}'s {SHARED_LIMIT[capability]} bytes of shared memory: {over}"
