"""The quantized linears' dispatch (engine/ops/triton/quant/table.py), the device capabilities it reads
(engine/ops/platform.py) and the kernel configuration (engine/ops/kernel_config.py), on the CPU: which kernel and
tiles each device class gets, and how tests and benchmarks override what the dispatch sees. The kernels themselves:
tests/test_ops_wna16.py and tests/test_ops_quant.py."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.ops import dispatch  # noqa: E402
from engine.ops.kernel_config import KernelConfig, kernel_config, override_kernel_config  # noqa: E402
from engine.ops.platform import INTERPRETER, DeviceCaps, device_caps, override_caps  # noqa: E402
from engine.ops.triton import pdl  # noqa: E402
from engine.ops.triton.quant import splitk  # noqa: E402
from engine.ops.triton.quant.table import (TUNED_W4G128, Problem, choose_fp8, choose_wna16,  # noqa: E402
                                           device_class)

BF16 = torch.bfloat16
SM80, SM86, SM89, SM90, SM100, SM120 = (DeviceCaps.for_arch(a) for a in (80, 86, 89, 90, 100, 120))
SHAPES_8B = [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)]     # (K, N): qkv, o, gate_up, down
TOKENS = (1, 2, 8, 16, 17, 32, 33, 64, 65, 128, 129, 256, 1000, 1024, 8192)


def wna16(M, K, N, caps, group=128, bits=4):
    return choose_wna16(Problem(M, N, K, BF16, bits=bits, group_size=group), caps)


def fp8(M, K, N, caps, block=(128, 128), dtype=BF16):
    return choose_fp8(Problem(M, N, K, dtype, block_size=block), caps)


# ---------------------------------------------------------------- DeviceCaps

def test_each_architecture_s_capabilities():
    assert [device_class(c) for c in (SM80, SM86, SM89, SM90, SM100, SM120)] == \
        ["sm80", "sm80", "sm89", "sm90", "sm89", "sm89"]
    assert [c.pdl for c in (SM80, SM86, SM89, SM90, SM100, SM120)] == [False, False, False, True, True, True]
    assert SM90.wgmma and not any(c.wgmma for c in (SM80, SM86, SM89, SM100, SM120))   # Hopper's instruction only
    assert SM86.shared_memory_per_block == SM120.shared_memory_per_block == 101376
    with pytest.raises(ValueError, match="sm75"):
        DeviceCaps.for_arch(75)


def test_cpu_tensors_see_the_interpreter_and_an_override_replaces_every_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert device_caps(cpu) is INTERPRETER and not INTERPRETER.pdl and not INTERPRETER.fp8_tensor_cores
    with override_caps(SM86) as caps:
        assert device_caps(cpu) is caps and device_caps(cuda) is caps
        with override_caps(fp8_tensor_cores=True) as inner:      # changes on top of the caps seen now
            assert inner.capability == (8, 6) and inner.fp8_tensor_cores
        assert device_caps(cuda) is caps
    assert device_caps(cpu) is INTERPRETER


# ---------------------------------------------------------------- KernelConfig

def test_the_configuration_reads_the_environment_once_and_refuses_removed_switches():
    assert KernelConfig.from_env({}) == KernelConfig(triton=True, pdl=True, emulate_arch=None)
    assert KernelConfig.from_env({"ENGINE_DISABLE_TRITON": "1", "ENGINE_PDL": "0", "ENGINE_EMULATE_ARCH": "sm86"}) \
        == KernelConfig(triton=False, pdl=False, emulate_arch=86)
    for name in ("ENGINE_WNA16_KERNELS", "ENGINE_FP8_KERNELS", "ENGINE_FP8_WEIGHT_ONLY"):
        with pytest.raises(ValueError, match=name):
            KernelConfig.from_env({name: "1"})
    with pytest.raises(ValueError, match="ENGINE_EMULATE_ARCH"):
        KernelConfig.from_env({"ENGINE_EMULATE_ARCH": "hopper"})


def test_overriding_the_configuration_turns_triton_and_pdl_off_for_a_block():
    before = kernel_config()
    with override_kernel_config(triton=False):
        assert not dispatch.triton_available() and not dispatch.use_triton(torch.empty(1, device="meta"))
    assert kernel_config() is before
    cuda = torch.device("cuda", 0)
    with override_caps(SM90):
        assert pdl.options(cuda, 1) == {"GDC": True, "launch_pdl": True}
        assert pdl.options(cuda, 8) == {"GDC": False}       # batches run GEMMs, which neither trigger nor wait
        with override_kernel_config(pdl=False):
            assert pdl.options(cuda, 1) == {"GDC": False}
    with override_caps(SM89):                                 # no griddepcontrol instructions before sm90
        assert pdl.options(cuda, 1) == {"GDC": False}
    assert pdl.options(torch.device("cpu"), 1) == {"GDC": False}    # the interpreter


# ---------------------------------------------------------------- the 4-bit table

@pytest.mark.parametrize("caps", [SM80, SM86, SM89, SM90, SM100, SM120], ids=lambda c: c.name)
def test_4bit_kernels_by_token_count(caps):
    # One token: the GEMV; 2-64: the GEMM; more: dequantize + cuBLAS, except TUNED_W4G128's Hopper buckets.
    for K, N in SHAPES_8B:
        for M in TOKENS:
            kernel = wna16(M, K, N, caps).kernel
            tuned = caps.wgmma and 64 < M < 1024 and (N, K, 1 << (M - 1).bit_length()) in TUNED_W4G128
            want = "wna16_gemv" if M == 1 else "wna16_gemm" if M <= 64 or tuned else "wna16_dequant"
            assert kernel == want, (caps.name, K, N, M, kernel)


def test_4bit_one_token_gemv_splits_k_for_the_narrow_projections():
    for K, N in SHAPES_8B:
        tiles = wna16(1, K, N, SM90)
        assert (tiles.block_n, tiles.block_k, tiles.num_warps) == (32, 512, 8)
        assert tiles.split_k == (4 if N <= 4096 else 2 if N <= 8192 else 1), (K, N)
    assert wna16(1, 4096, 4096, SM86) == wna16(1, 4096, 4096, SM90)      # the same on every GPU


def test_4bit_gemm_on_hopper_feeds_the_dequantized_weights_from_registers():
    # 2-64 tokens: swap-AB (the weight tile is the wgmma's A operand, which Hopper reads from registers), 64
    # columns per program, a row tile that holds the tokens, split-K where the tiles alone leave SMs idle.
    for K, N in SHAPES_8B + [(4096, 1024), (12288, 4096)]:
        for M in (2, 8, 16, 17, 32, 33, 64):
            tiles = wna16(M, K, N, SM90)
            assert tiles.swap_ab and tiles.block_n == 64 and tiles.block_k == 128, (M, K, N, tiles)
            assert tiles.block_m >= min(M, 64) and tiles.block_m <= max(16, 2 * M), (M, tiles)
            assert -(-N // 64) * tiles.split_k >= 2 * splitk.SMS or tiles.split_k >= 4, (M, K, N, tiles)


def test_4bit_tiles_fit_ampere_ada_and_blackwell():
    # No wgmma: swap-AB 128-column tiles up to 32 tokens, then 64-row tiles with 8 warps and 2 stages (shared
    # memory, registers); Blackwell takes sm89's tiles until measured.
    for caps in (SM80, SM86, SM89, SM100, SM120):
        for M in range(2, 65):
            tiles = wna16(M, 4096, 4096, caps)
            assert tiles.block_m <= 64 and tiles.num_stages <= 4 and tiles.swap_ab == (M <= 32), (caps.name, M)
            if M > 32:
                assert (tiles.num_warps, tiles.num_stages, tiles.block_k) == (8, 2, 64)
            assert tiles == wna16(M, 4096, 4096, SM89)


def test_4bit_small_groups_and_other_formats_fall_back_to_dequantize():
    # A group of 8 (or 1000: K steps of 8) is too short for a 16-deep dot: dequantize + cuBLAS from 2 tokens.
    assert wna16(4, 1000, 256, SM90, group=1000).kernel == "wna16_dequant"
    assert wna16(4, 4096, 256, SM90, group=8).kernel == "wna16_dequant"
    assert wna16(1, 1000, 256, SM90, group=1000).kernel == "wna16_gemv"
    # TUNED_W4G128 is for 4-bit group 128 on Hopper only.
    assert wna16(200, 4096, 6144, SM90) == TUNED_W4G128[(6144, 4096, 256)]
    assert wna16(200, 4096, 6144, SM90, group=64).kernel == "wna16_dequant"
    assert wna16(200, 4096, 6144, SM90, bits=8).kernel == "wna16_dequant"
    assert wna16(16, 4096, 4096, SM90) == TUNED_W4G128[(4096, 4096, 16)]
    assert wna16(16, 4096, 4096, SM89) != TUNED_W4G128[(4096, 4096, 16)]


# ---------------------------------------------------------------- the FP8 table

@pytest.mark.parametrize("caps", [SM80, SM86], ids=lambda c: c.name)
def test_fp8_without_fp8_tensor_cores_runs_weight_only(caps):
    for K, N in SHAPES_8B:
        for M in TOKENS:
            assert fp8(M, K, N, caps).kernel == ("fp8_gemv" if M == 1 else "fp8_dequant")


def test_fp8_on_hopper_one_launch_up_to_16_tokens_then_cublas():
    for K, N in SHAPES_8B:
        for M in TOKENS:
            tiles = fp8(M, K, N, SM90)
            if M <= 16:
                assert tiles.kernel == "w8a8_one_launch" and tiles.swap_ab and tiles.block_n == 64
                assert tiles.split_k == (2 if N >= 16384 else 8)
            else:
                assert tiles.kernel == "cublas_w8a8", (K, N, M)
    # Where cuBLAS takes no block scales (K-block counts not a multiple of 4, other blocks): Triton's GEMM.
    assert fp8(64, 1152, 4096, SM90).kernel == fp8(300, 4096, 4096, SM90, block=(64, 128)).kernel == "w8a8"
    # A K that is not a multiple of the scale block runs weight-only.
    assert fp8(1, 1000, 4096, SM90).kernel == "fp8_gemv" and fp8(64, 1000, 4096, SM90).kernel == "fp8_dequant"


@pytest.mark.parametrize("caps", [SM89, SM100, SM120], ids=lambda c: c.name)
def test_fp8_without_wgmma_runs_triton_w8a8_and_one_token_down_proj_weight_only(caps):
    for K, N in SHAPES_8B:
        for M in TOKENS:
            tiles = fp8(M, K, N, caps)
            if M == 1 and K > 4096:
                assert tiles.kernel == "fp8_gemv"
            else:
                assert tiles.kernel == "w8a8" and tiles.block_m == (16 if M <= 16 else 64), (K, N, M)


def test_fp8_cublas_refusals_fall_back_to_triton(monkeypatch):
    from engine.ops.triton.quant import table
    monkeypatch.setattr(table, "CUBLAS_REFUSED", {torch.float16})
    assert fp8(64, 4096, 4096, SM90, dtype=torch.float16).kernel == "w8a8"
    assert fp8(64, 4096, 4096, SM90).kernel == "cublas_w8a8"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_emulating_an_architecture_keeps_the_card_s_sms():
    cuda = torch.device("cuda", 0)
    real = device_caps(cuda)
    props = torch.cuda.get_device_properties(0)
    assert real.capability == (props.major, props.minor) and real.sm_count == props.multi_processor_count
    with override_kernel_config(emulate_arch=86):
        emulated = device_caps(cuda)
        assert emulated.capability == (8, 6) and not emulated.fp8_tensor_cores and not emulated.pdl
        assert emulated.sm_count == real.sm_count and emulated.shared_memory_per_block == 101376
    assert device_caps(cuda) == real
