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
    # One token: the GEMV; 2-64: the GEMM that reads each weight tile once for all tokens; more: dequantize +
    # cuBLAS (compute-bound there).
    for K, N in SHAPES_8B:
        for M in TOKENS:
            want = "fp8_gemv" if M == 1 else "fp8_gemm" if M <= 64 else "fp8_dequant"
            assert fp8(M, K, N, caps).kernel == want, (caps.name, K, N, M)


def test_fp8_weight_only_gemm_tiles_fit_ampere_and_fill_the_sms():
    # Swap-AB up to 32 tokens (the tokens on the dot's narrow side), then 64x64x64; one scale per tile (64 columns
    # and 128 or 64 along K inside a 128x128 block); split-K where the column tiles alone leave SMs idle.
    for K, N in SHAPES_8B:
        for M in range(2, 65):
            tiles = fp8(M, K, N, SM86)
            assert tiles.swap_ab == (M <= 32) and tiles.block_m >= min(M, 64) and tiles.block_n == 64, (M, tiles)
            assert 128 % tiles.block_k == 0 and tiles.num_stages <= 3 and tiles.num_warps == 4
            # shared memory per stage: the e4m3 tile and x's rows in bf16, three stages well inside sm86's 99 KB
            stage = tiles.block_n * tiles.block_k + tiles.block_m * tiles.block_k * 2
            assert stage * tiles.num_stages <= SM86.shared_memory_per_block // 2, (M, tiles)
            assert -(-N // 64) * tiles.split_k >= 2 * splitk.SMS or tiles.split_k == 8, (K, N, tiles)
    assert fp8(8, 4096, 4096, SM80) == fp8(8, 4096, 4096, SM86)
    # A K that is not a multiple of the scale block runs the same weight-only GEMM on every GPU.
    assert fp8(8, 4000, 4096, SM90).kernel == fp8(8, 4000, 4096, SM89).kernel == "fp8_gemm"


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
    assert fp8(1, 1000, 4096, SM90).kernel == "fp8_gemv" and fp8(64, 1000, 4096, SM90).kernel == "fp8_gemm"
    assert fp8(65, 1000, 4096, SM90).kernel == "fp8_dequant"


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
    if kernel_config().emulate_arch is not None:
        pytest.skip("this process already emulates a card (ENGINE_EMULATE_ARCH)")
    cuda = torch.device("cuda", 0)
    real = device_caps(cuda)
    props = torch.cuda.get_device_properties(0)
    assert real.capability == (props.major, props.minor) and real.sm_count == props.multi_processor_count
    with override_kernel_config(emulate_arch=86):
        emulated = device_caps(cuda)
        assert emulated.capability == (8, 6) and not emulated.fp8_tensor_cores and not emulated.pdl
        assert emulated.sm_count == real.sm_count and emulated.shared_memory_per_block == 101376
    assert device_caps(cuda) == real


# ---------------------------------------------------------------- emulated cards (ENGINE_EMULATE_ARCH)

# What each card chooses at the 8B shapes (qkv: K 4096 -> N 6144): FP8 and 4-bit kernels by token count, the
# fp8 KV cache's e4m3 decode, PDL, wgmma (Hopper's tiles), cuDNN attention, the prefill attention tiles and the
# shared memory one program gets (CUDA's per-block opt-in: 163 KB on A100, 99 KB on RTX 30/40, 227 KB on H100).
EMULATED = {
    80: dict(fp8=("fp8_gemv", "fp8_gemm", "fp8_gemm", "fp8_dequant"), native_e4m3=False, pdl=False, wgmma=False,
             prefill_tiles=(128, 64, 8, 3), shared=163 * 1024),
    86: dict(fp8=("fp8_gemv", "fp8_gemm", "fp8_gemm", "fp8_dequant"), native_e4m3=False, pdl=False, wgmma=False,
             prefill_tiles=(128, 64, 8, 3), shared=99 * 1024),
    89: dict(fp8=("w8a8", "w8a8", "w8a8", "w8a8"), native_e4m3=True, pdl=False, wgmma=False,
             prefill_tiles=(128, 64, 8, 3), shared=99 * 1024),
    90: dict(fp8=("w8a8_one_launch", "w8a8_one_launch", "cublas_w8a8", "cublas_w8a8"), native_e4m3=True, pdl=True,
             wgmma=True, prefill_tiles=(128, 128, 8, 3), shared=227 * 1024),
}
EMULATED_TOKENS = (1, 8, 64, 256)


@pytest.mark.parametrize("arch", sorted(EMULATED), ids=lambda a: f"sm{a}")
def test_each_emulated_card_takes_that_card_s_paths_and_tiles(arch):
    from engine.ops.triton import attention
    want = EMULATED[arch]
    cuda = torch.device("cuda", 0)
    with override_caps(DeviceCaps.for_arch(arch)):
        caps = device_caps(cuda)
        assert [fp8(M, 4096, 6144, caps).kernel for M in EMULATED_TOKENS] == list(want["fp8"])
        assert [wna16(M, 4096, 6144, caps).kernel for M in EMULATED_TOKENS] == \
            ["wna16_gemv", "wna16_gemm", "wna16_gemm", "wna16_gemm" if arch == 90 else "wna16_dequant"]
        assert wna16(8, 4096, 6144, caps).swap_ab and (wna16(8, 4096, 6144, caps).block_n == 64) == want["wgmma"]
        assert attention.fp8_native(cuda) == want["native_e4m3"] and attention.fp8_packed(cuda) != want["native_e4m3"]
        assert (pdl.options(cuda, 1) == {"GDC": True, "launch_pdl": True}) == want["pdl"]
        assert caps.wgmma == want["wgmma"] and caps.shared_memory_per_block == want["shared"]
        assert attention.tile_config(128, BF16, cuda, num_query_tokens=8192) == want["prefill_tiles"]
        if not want["wgmma"]:
            assert not attention.cudnn_attention_usable(BF16, 128, cuda)


def test_emulating_a_card_makes_triton_compile_for_it_and_refuse_what_does_not_fit(tmp_path):
    import triton

    from engine.ops.emulation import SharedMemoryLimit
    knobs = triton.knobs.runtime
    before = knobs.override_arch
    try:
        with override_kernel_config(emulate_arch=86):
            dispatch._triton_ready.cache_clear()
            assert dispatch.triton_available()
            assert knobs.override_arch == "sm86"
            [limit] = [h for h in knobs.kernel_load_start_hook.calls if isinstance(h, SharedMemoryLimit)]
    finally:
        knobs.override_arch = before
        for h in [h for h in knobs.kernel_load_start_hook.calls if isinstance(h, SharedMemoryLimit)]:
            knobs.kernel_load_start_hook.remove(h)
        dispatch._triton_ready.cache_clear()
    meta = tmp_path / "_k.json"
    meta.write_text('{"shared": 120000}')           # an H100 tile: more than an RTX 30 card gives one program
    with pytest.raises(triton.runtime.errors.OutOfResources, match="emulated sm86"):
        limit(None, None, "_k", {"_k.json": str(meta)}, "hash")
    SharedMemoryLimit(80, 166912)(None, None, "_k", {"_k.json": str(meta)}, "hash")   # fits an A100
