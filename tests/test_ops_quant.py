"""Quantized linear ops (engine/ops/quant.py, docs/QUANT_LAYOUTS.md): the references against the layouts' formulas
written out here (CPU); every FP8 kernel path, and the 4-bit op at the 8B shapes, against its reference on fresh
random inputs (GPU: pytest -m gpu); each checkpoint format's layer through the kernels (Triton's interpreter).
The 4-bit kernels one by one: tests/test_ops_wna16.py; the dispatch table: tests/test_ops_quant_dispatch.py.

Tolerances are relative Frobenius errors ||out - ref|| / ||ref|| against a float32 reference:
- bf16 activations: 1e-2 (the dequantized weight and the output are rounded to bf16, 2**-9 relative each);
- fp16: 3e-3 (2**-12 each);
- FP8 W8A8 against a reference that quantizes the activations the same way: 1e-2 (bf16 output rounding); against
  the weight-only reference: 6e-2 (e4m3 keeps 3 mantissa bits, so each activation moves by up to
  2**-4 of its binade: about 3% rms, which the tests measure and bound).
Every FP8 kernel also runs at small shapes in Triton's interpreter (CPU):
TRITON_INTERPRET=1 pytest -m triton_interpret tests/test_ops_quant.py.
The seed of each test is printed; OPS_TEST_SEED=N reproduces a failure.
"""
from __future__ import annotations

import os

import pytest
import torch

from engine.ops.platform import DeviceCaps, device_caps, override_caps
from gpu_cards import needs_card
from engine.ops.quant import (dequantize_fp8_block, dequantize_wna16, fp8_block_linear, fp8_block_linear_ref,
                              fp8_block_linear_w8a8_ref, pack_int32, quantize_fp8_per_token_group_ref,
                              unpack_int32, wna16_linear, wna16_linear_ref)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def gpu_test(fn):
    skip = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs CUDA and TRITON_INTERPRET unset")
    return pytest.mark.gpu(skip(fn))


def interpreter_test(fn):
    return pytest.mark.triton_interpret(pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1")(fn))


TOL = {BF16: 1e-2, F16: 3e-3, F32: 1e-5}
# Qwen3-VL-8B's decoder projections (K -> N): o, k/v, fused qkv, fused gate_up, down, and up alone.
SHAPES_8B = [(4096, 4096), (4096, 1024), (4096, 6144), (4096, 24576), (12288, 4096), (4096, 12288)]
BATCHES = [1, 2, 7, 16, 64, 256, 1000]



def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def random_wna16(K, N, group, bits, dtype, device="cpu", symmetric=False):
    """(qweight, scales, zeros, q) of random weights in docs/QUANT_LAYOUTS.md's layout; group -1 means per-channel."""
    group = K if group == -1 else group
    q = torch.randint(0, 2**bits, (K, N), dtype=torch.int32, device=device)
    scales = (torch.rand(K // group, N, device=device) * 0.02 + 0.002).to(dtype)
    if symmetric:
        zeros = torch.full((K // group, N), 2.0 ** (bits - 1), device=device, dtype=dtype)
    else:
        zeros = torch.randint(0, 2**bits, (K // group, N), device=device).to(dtype)
    return pack_int32(q, bits), scales, zeros, q


def random_fp8(N, K, block, device="cpu"):
    """(weight e4m3 [N, K], weight_scale_inv [ceil(N/bn), ceil(K/bk)]) spanning e4m3's range."""
    w = (torch.randn(N, K, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(-(-N // block[0]), -(-K // block[1]), device=device) * 1e-3 + 1e-4
    return w, s


# ---------------------------------------------------------------- CPU: the references are the layouts' formulas

@pytest.mark.parametrize("bits", [4, 8])
def test_packing_matches_the_layout_formula(gen, bits):
    K, N = 64, 5
    pack = 32 // bits
    q = torch.randint(0, 2**bits, (K, N), generator=gen, dtype=torch.int32)
    qweight = pack_int32(q, bits)
    assert qweight.dtype == torch.int32 and qweight.shape == (K // pack, N)
    for k in range(K):
        for n in range(N):
            assert (int(qweight[k // pack, n]) >> (bits * (k % pack))) & (2**bits - 1) == int(q[k, n])
    assert torch.equal(unpack_int32(qweight, bits), q)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_round_trip_covers_the_sign_bit(bits):
    # The top value in the top slot sets bit 31: the int32 is negative and must still unpack to 2**bits - 1.
    pack = 32 // bits
    q = torch.full((pack, 3), 2**bits - 1, dtype=torch.int32)
    q[:, 1] = 0
    qweight = pack_int32(q, bits)
    assert int(qweight[0, 0]) == -1 and int(qweight[0, 1]) == 0
    assert torch.equal(unpack_int32(qweight, bits), q)


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (4, -1), (8, 64), (8, -1)])
def test_wna16_ref_is_dequantize_then_matmul(gen, bits, group):
    K, N, M = 256, 48, 3
    qweight, scales, zeros, q = random_wna16(K, N, group, bits, F32)
    G = K if group == -1 else group
    W = torch.empty(K, N, dtype=torch.float64)
    for k in range(K):
        W[k] = (q[k].double() - zeros[k // G].double()) * scales[k // G].double()
    x = torch.randn(M, K, generator=gen)
    bias = torch.randn(N, generator=gen)
    want = x.double() @ W + bias.double()
    got = wna16_linear_ref(x, qweight, scales, zeros, G, bits, bias)
    assert got.dtype == F32 and rel_err(got, want) < 1e-6
    assert torch.equal(wna16_linear(x, qweight, scales, zeros, G, bits, bias), got)  # CPU runs the reference
    assert torch.allclose(dequantize_wna16(qweight, scales, zeros, G, bits).double(), W, atol=1e-6)


def test_wna16_ref_keeps_activation_dtype(gen):
    qweight, scales, zeros, _ = random_wna16(128, 16, 32, 4, BF16)
    x = torch.randn(2, 128, generator=gen).to(BF16)
    y = wna16_linear_ref(x, qweight, scales, zeros, 32, 4)
    assert y.dtype == BF16 and y.shape == (2, 16)


@pytest.mark.parametrize("N,K,block", [(256, 384, (128, 128)), (200, 300, (128, 128)), (96, 80, (32, 64))])
def test_fp8_ref_is_blockwise_dequantize_then_matmul(gen, N, K, block):
    w, s = random_fp8(N, K, block)
    W = torch.empty(N, K, dtype=torch.float64)
    for n in range(N):
        for kb in range(s.shape[1]):
            ks = slice(kb * block[1], (kb + 1) * block[1])
            W[n, ks] = w[n, ks].double() * float(s[n // block[0], kb])
    x = torch.randn(4, K, generator=gen)
    bias = torch.randn(N, generator=gen)
    want = x.double() @ W.T + bias.double()
    got = fp8_block_linear_ref(x, w, s, block, bias)
    assert rel_err(got, want) < 1e-6
    assert torch.equal(fp8_block_linear(x, w, s, block, bias), got)
    assert torch.allclose(dequantize_fp8_block(w, s, block).double(), W, rtol=1e-6)


def test_per_token_group_quant_ref(gen):
    x = torch.randn(5, 256, generator=gen) * torch.logspace(-3, 3, 5).unsqueeze(1)
    x[1, :128] = 0.0                                             # an all-zero group quantizes to zeros
    q, s = quantize_fp8_per_token_group_ref(x, 128)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 2)
    amax = x.reshape(5, 2, 128).abs().amax(-1)
    assert torch.allclose(s, amax.clamp(min=1e-10) / 448.0)
    assert q.float().abs().amax() == 448.0                       # each group's largest value maps to e4m3's max
    back = (q.float().reshape(5, 2, 128) * s.unsqueeze(-1)).reshape(5, 256)
    # Round to nearest: within half a step, 2**-4 of the value for normal e4m3 values, and half the subnormal
    # step (2**-10 of the group's scale) for the small values of a group with a large one.
    scale = s.repeat_interleave(128, dim=1)
    assert ((back - x).abs() <= torch.maximum(x.abs() * 2**-4, scale * 2**-10) + 1e-12).all()
    assert (back[1, :128] == 0).all()


def test_w8a8_ref_is_close_to_weight_only_ref(gen):
    w, s = random_fp8(128, 512, (128, 128))
    x = torch.randn(16, 512, generator=gen)
    err = rel_err(fp8_block_linear_w8a8_ref(x, w, s, (128, 128)), fp8_block_linear_ref(x, w, s, (128, 128)))
    assert 1e-3 < err < 4e-2


def test_bad_layouts_are_refused(gen):
    qweight, scales, zeros, _ = random_wna16(128, 16, 32, 4, F32)
    x = torch.randn(2, 128, generator=gen)
    with pytest.raises(ValueError, match="4- and 8-bit"):
        wna16_linear(x, qweight, scales, zeros, 32, 3)
    with pytest.raises(ValueError, match="group_size"):
        wna16_linear(x, qweight, scales, zeros, 48, 4)
    with pytest.raises(ValueError, match="qweight"):
        wna16_linear(x[:, :64], qweight, scales, zeros, 32, 4)
    with pytest.raises(ValueError, match="scales and zeros"):
        wna16_linear(x, qweight, scales[:2], zeros, 32, 4)
    w, s = random_fp8(128, 128, (128, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_block_linear(x, w.float(), s, (128, 128))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        fp8_block_linear(x, w, s, (64, 128))


# ---------------------------------------------------------------- GPU: every kernel path against its reference

def _wna16_case(gen, M, K, N, group, bits, dtype, bias=True):
    G = K if group == -1 else group
    qweight, scales, zeros, _ = random_wna16(K, N, group, bits, dtype, device="cuda")
    x = torch.randn(M, K, device="cuda").to(dtype)
    b = torch.randn(N, device="cuda").to(dtype) if bias else None
    out = wna16_linear(x, qweight, scales, zeros, G, bits, b)
    ref = wna16_linear_ref(x.float(), qweight, scales.float(), zeros.float(), G, bits, b.float() if bias else None)
    assert out.dtype == dtype
    return rel_err(out, ref)


@pytest.mark.parametrize("M", BATCHES)
@pytest.mark.parametrize("K,N", SHAPES_8B)
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@gpu_test
def test_wna16_8b_shapes(gen, K, N, M, dtype):
    assert _wna16_case(gen, M, K, N, 128, 4, dtype) < TOL[dtype]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@gpu_test
def test_wna16_groups_and_bits(gen, bits, group, dtype):
    for M in (1, 7, 64, 300):
        for K, N in ((4096, 1024), (1024, 384)):
            assert _wna16_case(gen, M, K, N, group, bits, dtype, bias=M % 2 == 1) < TOL[dtype], (M, K, N)


def _fp8_case(gen, M, K, N, dtype, block=(128, 128), bias=True, tiles=None, device="cuda"):
    from engine.ops.triton.quant import linear
    w, s = random_fp8(N, K, block, device=device)
    x = torch.randn(M, K, device=device).to(dtype)
    b = torch.randn(N, device=device).to(dtype) if bias else None
    out = linear.fp8_block_linear(x, w, s, block, b, tiles=tiles) if tiles else fp8_block_linear(x, w, s, block, b)
    assert out.dtype == dtype
    wo = rel_err(out, fp8_block_linear_ref(x.float(), w, s, block, b.float() if bias else None))
    w8a8 = rel_err(out, fp8_block_linear_w8a8_ref(x.float(), w, s, block, b.float() if bias else None)) \
        if K % block[1] == 0 else None
    return wo, w8a8


def _check_fp8(wo, w8a8, dtype, weight_only: bool):
    if weight_only:
        assert wo < TOL[dtype], wo
    else:
        assert w8a8 < TOL[dtype] and wo < 6e-2, (w8a8, wo)


def _runs_w8a8(M: int, N: int, K: int, block=(128, 128)) -> bool:
    from engine.ops.triton.quant.table import Problem, choose_fp8
    kernel = choose_fp8(Problem(M, N, K, BF16, block_size=block), device_caps(torch.device("cuda"))).kernel
    return kernel in ("cublas_w8a8", "w8a8", "w8a8_one_launch")


# The device classes an FP8 test runs as: this GPU's own, sm89 (W8A8 without wgmma), sm86 (weight-only).
ARCHS = [pytest.param(None, id="this-gpu"), pytest.param(89, id="as-sm89"), pytest.param(86, id="as-sm86")]


def _as(arch):
    if arch:
        needs_card(arch)
    return override_caps(DeviceCaps.for_arch(arch)) if arch else override_caps(device_caps(torch.device("cuda")))


@pytest.mark.parametrize("M", BATCHES)
@pytest.mark.parametrize("K,N", SHAPES_8B)
@pytest.mark.parametrize("arch", ARCHS)
@gpu_test
def test_fp8_8b_shapes(gen, K, N, M, arch):
    with _as(arch):
        runs_w8a8 = _runs_w8a8(M, N, K)
        major, minor = device_caps(torch.device("cuda")).capability   # this GPU's, or the card it emulates
        card = arch or 10 * major + minor
        # No FP8 tensor cores (sm80/86): weight-only. sm89 has no cuBLAS block-scaled FP8, and its W8A8 kernel's
        # grid is too small for one token at down_proj's K: that token takes the weight-only GEMV.
        assert runs_w8a8 == (card >= 89 and not (card == 89 and M == 1 and K > 4096))
        wo, w8a8 = _fp8_case(gen, M, K, N, BF16)
    _check_fp8(wo, w8a8, BF16, not runs_w8a8)


@pytest.mark.parametrize("M", [1, 7, 64, 300])
@pytest.mark.parametrize("arch", ARCHS)
@gpu_test
def test_fp8_fp16_and_odd_shapes(gen, M, arch):
    with _as(arch):
        for K, N, block in ((4096, 1024, (128, 128)), (1000, 200, (128, 128)), (512, 96, (64, 128))):
            wo, w8a8 = _fp8_case(gen, M, K, N, F16, block)
            _check_fp8(wo, w8a8, F16, not _runs_w8a8(M, N, K, block))


@pytest.mark.parametrize("M", [1, 2, 16, 64, 256, 1000])
@gpu_test
def test_fp8_triton_w8a8_kernel(gen, M):
    # The block-scaled GEMM of GPUs where cuBLAS has no block scales (sm89), with every tile the table gives.
    from engine.ops.triton.quant.table import KernelChoice
    needs_card(89)
    for bm, bn, warps, stages in ((16, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (128, 128, 8, 4)):
        for K, N in ((4096, 6144), (12288, 4096), (384, 200)):
            tiles = KernelChoice("w8a8", block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
            wo, w8a8 = _fp8_case(gen, M, K, N, BF16, tiles=tiles)
            _check_fp8(wo, w8a8, BF16, weight_only=False)


@pytest.mark.parametrize("M", [1, 2, 7, 16])
@gpu_test
def test_fp8_one_launch_kernel_at_the_8b_shapes(gen, M):
    """Hopper's path up to 16 tokens: one launch that quantizes x in its K loop and splits K; the same W8A8
    product as the two-launch path, bias or not, at the 8B shapes and an odd one."""
    from engine.ops.triton.quant import splitk
    from engine.ops.triton.quant.table import Problem, choose_fp8
    needs_card(90)
    with override_caps(DeviceCaps.for_arch(90)):
        for K, N in ((4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (384, 200)):
            tiles = choose_fp8(Problem(M, N, K, BF16), DeviceCaps.for_arch(90))
            assert tiles.kernel == "w8a8_one_launch" and tiles.swap_ab and tiles.split_k > 1, (K, N, tiles)
            for bias in (False, True):
                wo, w8a8 = _fp8_case(gen, M, K, N, BF16, bias=bias)
                _check_fp8(wo, w8a8, BF16, weight_only=False)
    assert int(splitk._LOCKS[torch.device("cuda", 0)].abs().sum()) == 0     # every tile's counter reset


@pytest.mark.parametrize("split", [1, 2, 4, 8])
@gpu_test
def test_fp8_one_launch_kernel_splits_k_in_one_launch_or_two(gen, split):
    from engine.ops.triton.quant import splitk
    from engine.ops.triton.quant.table import KernelChoice
    needs_card(90)
    for serial in (True, False):                  # False: the partials are summed by a second kernel
        for M in (1, 5, 16):
            for block_n in (64, 128, 256):
                tiles = KernelChoice("w8a8_one_launch", block_m=16, block_n=block_n, split_k=split, swap_ab=True,
                                     num_warps=8 if block_n == 256 else 4, serial=serial)
                wo, w8a8 = _fp8_case(gen, M, 4096, 1024, BF16, tiles=tiles)
                _check_fp8(wo, w8a8, BF16, weight_only=False)
    locks = splitk._LOCKS.get(torch.device("cuda", 0))     # none at split 1 when this test runs alone
    assert locks is None or int(locks.abs().sum()) == 0


@pytest.mark.parametrize("kernel", ["fp8_gemv", "fp8_dequant"])
@gpu_test
def test_fp8_weight_only_without_fp8_tensor_cores(gen, kernel):
    # sm80/86: e4m3 bytes decoded with integer ops (emulated on this GPU).
    from engine.ops.triton.quant.table import KernelChoice
    with override_caps(DeviceCaps.for_arch(86)):
        for M in ((1,) if kernel == "fp8_gemv" else (5, 300)):
            for K, N, block in ((4096, 1024, (128, 128)), (1000, 200, (128, 128)), (512, 96, (64, 128))):
                tiles = KernelChoice(kernel, block_n=32, split_k=2)
                wo, _ = _fp8_case(gen, M, K, N, BF16, block, tiles=tiles)
                assert wo < TOL[BF16], (M, K, N, block)


@pytest.mark.parametrize("M", [2, 5, 8, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("arch", [80, 86, 89])
@gpu_test
def test_fp8_weight_only_gemm_at_the_8b_shapes(gen, M, arch):
    """2-64 tokens without FP8 tensor cores: each weight tile converted once for the row tile, tl.dot, split-K in
    one launch; the table's tiles for each architecture (sm89 runs it for a K that is not a multiple of the
    block, and natively converts e4m3), fp16 and bf16, bias or not."""
    from engine.ops.triton.quant import splitk
    from engine.ops.triton.quant.table import Problem, choose_fp8
    needs_card(arch)
    caps = DeviceCaps.for_arch(arch)
    with override_caps(caps):
        for K, N, block in SHAPES_FP8_GEMM if arch != 89 else ((1000, 200, (128, 128)), (4000, 4096, (128, 128))):
            tiles = choose_fp8(Problem(M, N, K, BF16, block_size=block), caps)
            assert tiles.kernel == "fp8_gemm" and tiles.swap_ab == (M <= 32), (K, N, tiles)
            for dtype, bias in ((BF16, True), (F16, False)):
                wo, _ = _fp8_case(gen, M, K, N, dtype, block, bias=bias)
                assert wo < TOL[dtype], (M, K, N, block, dtype)
    assert int(splitk._LOCKS[torch.device("cuda", 0)].abs().sum()) == 0     # every tile's counter reset


SHAPES_FP8_GEMM = [(K, N, (128, 128)) for K, N in SHAPES_8B] + [(1000, 200, (128, 128)), (512, 96, (64, 128))]


@gpu_test
def test_fp8_activation_quant_kernel(gen):
    from engine.ops.triton.quant.fp8_w8a8 import per_token_group_quant
    needs_card(89)
    x = torch.randn(37, 1024, device="cuda", dtype=BF16) * 10
    q, s = per_token_group_quant(x, 128, rows=40)
    qr, sr = quantize_fp8_per_token_group_ref(x.float(), 128)
    assert s.shape == (40, 8) and s.stride() == (1, 40)          # column-major scales (cuBLAS 1x128)
    assert torch.allclose(s[:37], sr, rtol=1e-6)
    assert (q[:37].float() != qr.float()).float().mean() < 1e-3  # division may differ by an ulp before rounding
    assert (q[37:].float() == 0).all() and torch.isfinite(s[37:]).all()   # padding rows: zeros


@pytest.mark.parametrize("op,arch", [("wna16", None), ("fp8", None), ("fp8", 89), ("fp8", 86)])
@pytest.mark.parametrize("M", [1, 16, 300])
@gpu_test
def test_cuda_graph_capture(gen, op, arch, M):
    K, N = 4096, 1024
    if op == "wna16":
        qweight, scales, zeros, _ = random_wna16(K, N, 128, 4, BF16, device="cuda")
        args = (qweight, scales, zeros, 128, 4)
        fn, ref_fn = wna16_linear, lambda x: wna16_linear_ref(x.float(), qweight, scales.float(), zeros.float(),
                                                              128, 4)
    else:
        w, s = random_fp8(N, K, (128, 128), device="cuda")
        args = (w, s, (128, 128))
        fn, ref_fn = fp8_block_linear, lambda x: fp8_block_linear_ref(x.float(), w, s, (128, 128))
    with _as(arch):
        x = torch.randn(M, K, device="cuda", dtype=BF16)
        fn(x, *args)                                             # compile outside the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(x, *args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = fn(x, *args)
    x.copy_(torch.randn(M, K, device="cuda", dtype=BF16))       # new input, same buffers
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(y, ref_fn(x)) < (6e-2 if op == "fp8" and arch != 86 else TOL[BF16])


@gpu_test
@pytest.mark.parametrize("weights", ["4-bit", "fp8-weight-only", "fp8"])
def test_programmatic_dependent_launch_changes_no_bit(gen, weights):
    # sm90+: along a decode step each kernel launches while the one before still runs (engine/ops/triton/pdl.py):
    # a one-token GEMV (4-bit, or FP8 weight-only) loads weights before it waits for the RMSNorm or SwiGLU before
    # it, and those wait for the GEMV before them; the FP8 one-launch W8A8 kernel waits before its K loop. A chain
    # of MLP blocks, eager and replayed from a CUDA graph, gives the same bits as without PDL (a kernel reading its
    # input early would not).
    from engine.ops import rms_norm, silu_and_mul
    from engine.ops.kernel_config import override_kernel_config
    from engine.ops.triton import pdl
    if not pdl.enabled(torch.device("cuda"), 1):
        pytest.skip("programmatic dependent launch needs sm90+")
    K, inter = 4096, 2048
    if weights.startswith("fp8"):
        layers = [(random_fp8(2 * inter, K, (128, 128), device="cuda"), random_fp8(K, inter, (128, 128), "cuda"))
                  for _ in range(4)]
        linear = lambda x, w: fp8_block_linear(x, *w, (128, 128))  # noqa: E731
    else:
        layers = [(random_wna16(K, 2 * inter, 128, 4, BF16, device="cuda")[:3],
                   random_wna16(inter, K, 128, 4, BF16, device="cuda")[:3]) for _ in range(4)]
        linear = lambda x, w: wna16_linear(x, *w, 128, 4)  # noqa: E731
    norm_w = (torch.rand(K, device="cuda") + 0.5).to(BF16)
    inputs = [torch.randn(1, K, device="cuda", dtype=BF16) for _ in range(2)]

    def chain(x):
        for gate_up, down in layers:
            x = linear(silu_and_mul(linear(rms_norm(x, norm_w, 1e-6), gate_up)), down)
        return x

    results = {}
    # Weight-only: this GPU without its FP8 tensor cores (PDL stays on), the GEMV's e4m3 decoded with integer ops.
    with override_caps(fp8_tensor_cores=weights != "fp8-weight-only"):
        for pdl_on in (False, True):
            with override_kernel_config(pdl=pdl_on):
                x = inputs[0].clone()
                eager = chain(x)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    y = chain(x)
                x.copy_(inputs[1])
                graph.replay()
                torch.cuda.synchronize()
                results[pdl_on] = (eager, y.clone())
        assert torch.equal(results[False][0], results[True][0])
        assert torch.equal(results[False][1], results[True][1])
        assert torch.equal(results[True][1], chain(inputs[1]))


# ---------------------------------------------------------------- CPU: the kernels in Triton's interpreter

@pytest.mark.parametrize("kernel", ["fp8_gemv", "fp8_dequant"])
@interpreter_test
def test_fp8_weight_only_paths_in_the_interpreter(gen, kernel):
    # e4m3 bytes decoded with integer ops (the interpreter has no FP8 conversions: DeviceCaps.fp8_tensor_cores is
    # off there). Scale blocks: one per tile, two along K per tile (the GEMV scales its activations per column),
    # and smaller than the tile along N too (per weight). The GEMV's split-K ranges are summed by the tile's last
    # program (serial) or, without counters, a second kernel.
    from engine.ops.triton.quant import splitk
    from engine.ops.triton.quant.table import KernelChoice
    M = 1 if kernel == "fp8_gemv" else 5
    cases = ((1, True, True), (2, False, True), (4, True, False)) if kernel == "fp8_gemv" else ((1, True, True),)
    for split, bias, serial in cases:
        for K, N, block in ((256, 40, (32, 64)), (256, 40, (16, 16)), (200, 24, (8, 16))):
            tiles = KernelChoice(kernel, block_n=16, block_k=32, split_k=split, serial=serial)
            wo, _ = _fp8_case(gen, M, K, N, F16, block, bias=bias, tiles=tiles, device="cpu")
            assert wo < TOL[F16], (split, bias, serial, K, N, block)
    locks = splitk._LOCKS.get(torch.device("cpu"))
    assert locks is None or int(locks.abs().sum()) == 0


@pytest.mark.parametrize("swap_ab", [True, False])
@interpreter_test
def test_fp8_weight_only_gemm_in_the_interpreter(gen, swap_ab):
    # A few tokens: weight tiles converted once per row tile (integer e4m3 decode), tl.dot either way round,
    # partial row and column tiles, K ranges summed by the tile's last program or a second kernel, one scale per
    # tile or per weight (blocks smaller than the tile), a K that ends mid-block.
    from engine.ops.triton.quant import splitk
    from engine.ops.triton.quant.table import KernelChoice
    for M, split, bias, serial in ((5, 1, True, True), (20, 2, False, True), (3, 4, True, False)):
        for K, N, block in ((256, 40, (32, 64)), (256, 40, (16, 16)), (200, 24, (8, 16))):
            tiles = KernelChoice("fp8_gemm", block_m=16, block_n=16, block_k=32, split_k=split, serial=serial,
                                 swap_ab=swap_ab)
            wo, _ = _fp8_case(gen, M, K, N, F16, block, bias=bias, tiles=tiles, device="cpu")
            assert wo < TOL[F16], (M, split, bias, serial, K, N, block)
    locks = splitk._LOCKS.get(torch.device("cpu"))
    assert locks is None or int(locks.abs().sum()) == 0


def _w8a8_interpreter_ref(x, w, s, b):
    """The W8A8 product with x quantized by the interpreter's own activation-quantization kernel: the interpreter
    rounds to e4m3 its own way (not always to nearest), so the tests compare the kernels' indexing, scales and
    split-K sums at the same rounding."""
    from engine.ops.triton.quant.fp8_w8a8 import per_token_group_quant
    M, K = x.shape
    xq, xs = per_token_group_quant(x, 128)
    xd = (xq.float().reshape(M, -1, 128) * xs.reshape(M, -1, 1)).reshape(M, K)
    return xd @ dequantize_fp8_block(w, s, (128, 128)).T + b.float()


@pytest.mark.parametrize("split,serial", [(1, True), (2, True), (4, False)])
@interpreter_test
def test_fp8_one_launch_kernel_in_the_interpreter(gen, split, serial):
    """The one-launch W8A8 kernel: x quantized per token and 128-group inside the K loop, K split in ranges summed
    by the tile's last program (serial) or by a second kernel, the weight tile on the dot's M side."""
    from engine.ops.triton.quant import linear, splitk
    from engine.ops.triton.quant.table import KernelChoice
    for M, K, N in ((1, 512, 256), (5, 512, 200), (16, 1024, 128)):
        w, s = random_fp8(N, K, (128, 128), device="cpu")
        x = torch.randn(M, K, generator=gen).to(BF16)
        b = torch.randn(N, generator=gen).to(BF16)
        tiles = KernelChoice("w8a8_one_launch", block_m=16, block_n=128, split_k=split, swap_ab=True,
                             serial=serial)
        y = linear.fp8_block_linear(x, w, s, (128, 128), b, tiles=tiles)
        assert rel_err(y, _w8a8_interpreter_ref(x, w, s, b)) < TOL[BF16], (M, K, N)
    locks = splitk._LOCKS.get(torch.device("cpu"))
    assert locks is None or int(locks.abs().sum()) == 0


@interpreter_test
def test_fp8_two_launch_w8a8_in_the_interpreter(gen):
    """sm89's path: the activation-quantization kernel, then the block-scaled GEMM (rows and columns past the
    tiles masked, grouped tile order)."""
    from engine.ops.triton.quant import linear
    from engine.ops.triton.quant.table import KernelChoice
    for M, K, N, bm, bn in ((1, 256, 64, 16, 64), (20, 384, 200, 16, 64), (40, 256, 96, 64, 128)):
        w, s = random_fp8(N, K, (128, 128), device="cpu")
        x = torch.randn(M, K, generator=gen).to(BF16)
        b = torch.randn(N, generator=gen).to(BF16)
        y = linear.fp8_block_linear(x, w, s, (128, 128), b, tiles=KernelChoice("w8a8", block_m=bm, block_n=bn))
        assert rel_err(y, _w8a8_interpreter_ref(x, w, s, b)) < TOL[BF16], (M, K, N)


@pytest.mark.parametrize("method", ["awq", "gptq", "compressed-tensors", "fp8"])
@interpreter_test
def test_each_checkpoint_format_through_the_kernels(gen, method, monkeypatch):
    """A checkpoint layer of each format, packed as the format's public description says
    (tests/quant_checkpoints.py), converted by the engine's loader and multiplied by the Triton kernels the table
    chooses, at 1 and 5 tokens, against x times the checkpoint's dequantized weight."""
    import engine.ops.quant as quant_ops
    from engine.model.linear import ColumnParallelLinear
    from engine.model.quantization.config import Fp8BlockScheme, QuantizationConfig, WNA16Scheme
    from engine.model.quantization.loading import FORMATS
    from quant_checkpoints import PACKERS, Spec
    K, N = 256, 64
    spec = Spec(method, group_size=64, symmetric=method != "gptq", act_order=method == "gptq",
                block_size=(32, 128))
    scheme = Fp8BlockScheme(spec.block_size) if method == "fp8" else \
        WNA16Scheme(spec.bits, spec.group_size, spec.symmetric, spec.act_order)
    tensors, dequantized = PACKERS[method](torch.randn(N, K, generator=gen) * 0.05, spec, gen)
    layer = ColumnParallelLinear(K, N, False, QuantizationConfig(method, [(["Linear"], scheme)]), ["proj"])
    layer.quant_method.load_shard(layer, None, FORMATS[method].convert(tensors, scheme, "proj"), "proj")
    if method != "fp8":
        layer.to(dtype=F16)        # scales and zeros in the model dtype (fp8 keeps its float32 block scales)
    monkeypatch.setattr(quant_ops, "use_triton", lambda t: True)        # the kernels, on CPU tensors
    for M in (1, 5):
        x = torch.randn(M, K, generator=gen).to(F16)
        y = layer(x)
        assert rel_err(y, x.float() @ dequantized.T) < TOL[F16], M
