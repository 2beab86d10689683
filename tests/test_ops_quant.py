"""Quantized linear ops (engine/ops/quant.py, QUANT_CONTRACT.md): the references against the contract's formulas
written out here (CPU), and every kernel path against its reference on fresh random inputs (GPU: pytest -m gpu).

Tolerances are relative Frobenius errors ||out - ref|| / ||ref|| against a float32 reference:
- bf16 activations: 1e-2 (the dequantized weight and the output are rounded to bf16, 2**-9 relative each);
- fp16: 3e-3 (2**-12 each);
- FP8 W8A8 against a reference that quantizes the activations the same way: 1e-2 (bf16 output rounding); against
  the contract's weight-only reference: 6e-2 (e4m3 keeps 3 mantissa bits, so each activation moves by up to
  2**-4 of its binade: about 3% rms, which the tests measure and bound).
The weight-only kernel paths also run at small shapes in Triton's interpreter (CPU, fp16/fp32, no FP8 tensor
cores): TRITON_INTERPRET=1 pytest -m triton_interpret tests/test_ops_quant.py.
The seed of each test is printed; OPS_TEST_SEED=N reproduces a failure.
"""
from __future__ import annotations

import os

import pytest
import torch

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
    """(qweight, scales, zeros, q) of random weights with the contract's layout; group -1 means per-channel."""
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


# ---------------------------------------------------------------- CPU: the references are the contract

@pytest.mark.parametrize("bits", [4, 8])
def test_packing_matches_contract_formula(gen, bits):
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

def _wna16_case(gen, M, K, N, group, bits, dtype, bias=True, config=None, device="cuda"):
    from engine.ops.triton import wna16 as tw
    G = K if group == -1 else group
    qweight, scales, zeros, _ = random_wna16(K, N, group, bits, dtype, device=device)
    x = torch.randn(M, K, device=device).to(dtype)
    b = torch.randn(N, device=device).to(dtype) if bias else None
    out = tw.wna16_linear(x, qweight, scales, zeros, G, bits, b, config=config) if config else \
        wna16_linear(x, qweight, scales, zeros, G, bits, b)
    ref = wna16_linear_ref(x.float(), qweight, scales.float(), zeros.float(), G, bits,
                           b.float() if bias else None)
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


@pytest.mark.parametrize("path", ["gemv", "dequant"])
@gpu_test
def test_wna16_each_path_and_split(gen, path):
    from engine.ops.triton.wna16 import Wna16Config
    for split in (1, 2, 4):
        for M in ((1,) if path == "gemv" else (3, 40)):
            for bits, group in ((4, 128), (8, 32)):
                cfg = Wna16Config(path, block_n=64, block_kp=128 // (32 // bits), split_k=split)
                err = _wna16_case(gen, M, 2048, 640, group, bits, BF16, config=cfg)
                assert err < TOL[BF16], (split, M, bits)


def _fp8_case(gen, M, K, N, dtype, block=(128, 128), bias=True, config=None, device="cuda"):
    from engine.ops.triton import fp8_block as tf
    w, s = random_fp8(N, K, block, device=device)
    x = torch.randn(M, K, device=device).to(dtype)
    b = torch.randn(N, device=device).to(dtype) if bias else None
    out = tf.fp8_block_linear(x, w, s, block, b, config=config) if config else fp8_block_linear(x, w, s, block, b)
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
    from engine.ops.triton import fp8_block as tf
    x = torch.empty(M, K, device="cuda", dtype=BF16)
    return tf.choose_config(x, N, K, block).path in ("cublas", "w8a8", "fused")


@pytest.mark.parametrize("M", BATCHES)
@pytest.mark.parametrize("K,N", SHAPES_8B)
@pytest.mark.parametrize("weight_only", [False, True], ids=["auto", "weight-only"])
@gpu_test
def test_fp8_8b_shapes(gen, K, N, M, weight_only, monkeypatch):
    monkeypatch.setenv("ENGINE_FP8_WEIGHT_ONLY", "1" if weight_only else "0")
    runs_w8a8 = _runs_w8a8(M, N, K)
    assert not (weight_only and runs_w8a8)                       # ENGINE_FP8_WEIGHT_ONLY=1 is obeyed
    wo, w8a8 = _fp8_case(gen, M, K, N, BF16)
    _check_fp8(wo, w8a8, BF16, not runs_w8a8)


@pytest.mark.parametrize("M", [1, 7, 64, 300])
@gpu_test
def test_fp8_fp16_and_odd_shapes(gen, M, monkeypatch):
    for K, N, block in ((4096, 1024, (128, 128)), (1000, 200, (128, 128)), (512, 96, (64, 128))):
        for weight_only in (False, True):
            monkeypatch.setenv("ENGINE_FP8_WEIGHT_ONLY", "1" if weight_only else "0")
            wo, w8a8 = _fp8_case(gen, M, K, N, F16, block)
            _check_fp8(wo, w8a8, F16, not _runs_w8a8(M, N, K, block))


@pytest.mark.parametrize("M", [1, 2, 16, 64, 256, 1000])
@gpu_test
def test_fp8_triton_w8a8_kernel(gen, M):
    # The block-scaled GEMM of GPUs where cuBLAS has no block scales (sm89), forced here.
    from engine.ops.triton.fp8_block import Fp8Config
    for bm, bn, warps in ((16, 64, 4), (64, 128, 4), (128, 128, 8)):
        for K, N in ((4096, 6144), (12288, 4096), (384, 200)):
            wo, w8a8 = _fp8_case(gen, M, K, N, BF16, config=Fp8Config("w8a8", block_m=bm, block_n=bn,
                                                                        num_warps=warps))
            _check_fp8(wo, w8a8, BF16, weight_only=False)


@pytest.mark.parametrize("M", [1, 2, 7, 16])
@gpu_test
def test_fp8_fused_kernel_under_its_switch(gen, M, monkeypatch):
    """ENGINE_FP8_KERNELS=fused: up to 16 tokens in one launch that quantizes x in its K loop and splits K; the
    same W8A8 product as the two-launch path, bias or not, at the 8B shapes and an odd one."""
    from engine.ops.triton import fp8_block as tf
    from engine.ops.triton import splitk
    monkeypatch.setenv("ENGINE_FP8_KERNELS", "fused")
    for K, N in ((4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (384, 200)):
        x = torch.empty(M, K, device="cuda", dtype=BF16)
        cfg = tf.choose_config(x, N, K, (128, 128))
        assert cfg.path == "fused" and (cfg.split_k > 1 or N >= 24576 or K < 1024), (K, N, cfg)
        for bias in (False, True):
            wo, w8a8 = _fp8_case(gen, M, K, N, BF16, bias=bias)
            _check_fp8(wo, w8a8, BF16, weight_only=False)
    assert int(splitk._LOCKS[torch.device("cuda", 0)].abs().sum()) == 0     # every tile's counter reset


@pytest.mark.parametrize("split", [1, 2, 4, 8])
@gpu_test
def test_fp8_fused_kernel_splits_k_in_one_launch_or_two(gen, split, monkeypatch):
    from engine.ops.triton import fp8_block as tf
    from engine.ops.triton import splitk
    for serial in (True, False):
        if not serial:       # no counters: the partials are summed by a second kernel
            monkeypatch.setattr(splitk, "split_locks", lambda *args: None)
        for M in (1, 5, 16):
            for swap_ab, block_n in ((False, 128), (True, 64), (True, 128), (True, 256)):
                cfg = tf.Fp8Config("fused", block_m=16, block_n=block_n, split_k=split, swap_ab=swap_ab,
                                   num_warps=8 if block_n == 256 else 4)
                wo, w8a8 = _fp8_case(gen, M, 4096, 1024, BF16, config=cfg)
                _check_fp8(wo, w8a8, BF16, weight_only=False)
    monkeypatch.undo()
    locks = splitk._LOCKS.get(torch.device("cuda", 0))     # none at split 1 when this test runs alone
    assert locks is None or int(locks.abs().sum()) == 0


@pytest.mark.parametrize("path", ["gemv", "dequant"])
@gpu_test
def test_fp8_weight_only_without_fp8_tensor_cores(gen, path, monkeypatch):
    # sm80/86: e4m3 bytes decoded with integer ops (forced on this GPU).
    from engine.ops.triton import fp8_block as tf
    monkeypatch.setattr(tf, "has_fp8_tensor_cores", lambda device: False)
    for M in ((1,) if path == "gemv" else (5, 300)):
        for K, N, block in ((4096, 1024, (128, 128)), (1000, 200, (128, 128)), (512, 96, (64, 128))):
            cfg = tf.Fp8Config(path, block_m=16, block_n=32, split_k=2)
            wo, _ = _fp8_case(gen, M, K, N, BF16, block, config=cfg)
            assert wo < TOL[BF16], (M, K, N, block)


@gpu_test
def test_fp8_activation_quant_kernel(gen):
    from engine.ops.triton.fp8_block import per_token_group_quant
    x = torch.randn(37, 1024, device="cuda", dtype=BF16) * 10
    q, s = per_token_group_quant(x, 128, rows=40)
    qr, sr = quantize_fp8_per_token_group_ref(x.float(), 128)
    assert s.shape == (40, 8) and s.stride() == (1, 40)          # column-major scales (cuBLAS 1x128)
    assert torch.allclose(s[:37], sr, rtol=1e-6)
    assert (q[:37].float() != qr.float()).float().mean() < 1e-3  # division may differ by an ulp before rounding
    assert (q[37:].float() == 0).all() and torch.isfinite(s[37:]).all()   # padding rows: zeros


@pytest.mark.parametrize("op", ["wna16", "fp8", "fp8-weight-only", "fp8-fused"])
@pytest.mark.parametrize("M", [1, 16, 300])
@gpu_test
def test_cuda_graph_capture(gen, op, M, monkeypatch):
    monkeypatch.setenv("ENGINE_FP8_WEIGHT_ONLY", "1" if op == "fp8-weight-only" else "0")
    monkeypatch.setenv("ENGINE_FP8_KERNELS", "fused" if op == "fp8-fused" else "old")
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
    x = torch.randn(M, K, device="cuda", dtype=BF16)
    fn(x, *args)                                                 # compile outside the capture
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
    assert rel_err(y, ref_fn(x)) < (6e-2 if op in ("fp8", "fp8-fused") else TOL[BF16])


def test_programmatic_dependent_launch_is_for_one_token_launches_on_hopper(monkeypatch):
    pytest.importorskip("triton")
    from engine.ops.triton import pdl
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "_sm90", lambda index: True)
    assert pdl.options(cuda, 1) == {"GDC": True, "launch_pdl": True}
    assert pdl.options(cuda, 8) == {"GDC": False}         # batches run GEMMs, which neither trigger nor wait
    assert not pdl.enabled(torch.device("cpu"), 1)
    monkeypatch.setenv("ENGINE_PDL", "0")
    assert not pdl.enabled(cuda, 1)
    monkeypatch.delenv("ENGINE_PDL")
    monkeypatch.setattr(pdl, "_sm90", lambda index: False)  # sm80-89: no griddepcontrol instructions
    assert pdl.options(cuda, 1) == {"GDC": False}


@gpu_test
@pytest.mark.parametrize("weights", ["4-bit", "fp8", "fp8-fused"])
def test_programmatic_dependent_launch_changes_no_bit(gen, weights, monkeypatch):
    # sm90+: along a decode step each kernel launches while the one before still runs (engine/ops/triton/pdl.py):
    # a one-token GEMV (4-bit, or FP8 weight-only) loads weights before it waits for the RMSNorm or SwiGLU before
    # it, and those wait for the GEMV before them; the FP8 one-launch W8A8 kernel waits before its K loop. A chain
    # of MLP blocks, eager and replayed from a CUDA graph, gives the same bits as without PDL (a kernel reading its
    # input early would not).
    from engine.ops import rms_norm, silu_and_mul
    from engine.ops.triton import fp8_block as tfp8
    from engine.ops.triton import pdl
    from engine.ops.triton.fp8_block import Fp8Config
    if not pdl.enabled(torch.device("cuda"), 1):
        pytest.skip("programmatic dependent launch needs sm90+")
    K, inter = 4096, 2048
    if weights.startswith("fp8"):
        monkeypatch.setenv("ENGINE_FP8_WEIGHT_ONLY", "1" if weights == "fp8" else "0")
        layers = [(random_fp8(2 * inter, K, (128, 128), device="cuda"), random_fp8(K, inter, (128, 128), "cuda"))
                  for _ in range(4)]
        cfg = Fp8Config("fused", block_m=16, block_n=128, split_k=4, num_stages=4, swap_ab=True) \
            if weights == "fp8-fused" else None
        linear = lambda x, w: tfp8.fp8_block_linear(x, *w, (128, 128), config=cfg)  # noqa: E731
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
    for flag in ("0", "1"):
        monkeypatch.setenv("ENGINE_PDL", flag)
        x = inputs[0].clone()
        eager = chain(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = chain(x)
        x.copy_(inputs[1])
        graph.replay()
        torch.cuda.synchronize()
        results[flag] = (eager, y.clone())
    assert torch.equal(results["0"][0], results["1"][0])
    assert torch.equal(results["0"][1], results["1"][1])
    assert torch.equal(results["1"][1], chain(inputs[1]))


# ---------------------------------------------------------------- CPU: the kernels in Triton's interpreter

@pytest.mark.parametrize("path", ["gemv", "dequant"])
@pytest.mark.parametrize("dtype", [F16, F32], ids=["fp16", "fp32"])
@interpreter_test
def test_wna16_paths_in_the_interpreter(gen, path, dtype, monkeypatch):
    # Small shapes with N not a multiple of the tile; the GEMV's split 2 sums its partials in the tile's last
    # program (serial) or, without split-K counters (a graph captured before any eager launch), in a second kernel.
    from engine.ops.triton import splitk, wna16 as tw
    M = 1 if path == "gemv" else 5
    for split, bias, serial in ((1, True, True), (2, True, True), (2, False, True), (2, True, False)):
        if not serial:
            monkeypatch.setattr(splitk, "split_locks", lambda *args: None)
        for bits, group in ((4, 32), (8, 64)):
            cfg = tw.Wna16Config(path, block_n=32, block_kp=64 // (32 // bits), split_k=split)
            err = _wna16_case(gen, M, 256, 40, group, bits, dtype, bias=bias, config=cfg, device="cpu")
            assert err < TOL[dtype], (split, bias, serial, bits)


@pytest.mark.parametrize("path", ["gemv", "dequant"])
@interpreter_test
def test_fp8_weight_only_paths_in_the_interpreter(gen, path, monkeypatch):
    # e4m3 bytes decoded with integer ops (no FP8 tensor cores). Scale blocks: one per tile, two along K per tile
    # (the GEMV scales its activations per column), and smaller than the tile along N too (per weight). The
    # GEMV's split-K ranges are summed by the tile's last program (serial) or, without counters, a second kernel.
    from engine.ops.triton import fp8_block as tf
    from engine.ops.triton import splitk
    monkeypatch.setattr(tf, "has_fp8_tensor_cores", lambda device: False)
    M = 1 if path == "gemv" else 5
    for split, bias, serial in ((1, True, True), (2, True, True), (2, False, True), (4, True, False)):
        if not serial:
            monkeypatch.setattr(splitk, "split_locks", lambda *args: None)
        for K, N, block in ((256, 40, (32, 64)), (256, 40, (16, 16)), (200, 24, (8, 16))):
            cfg = tf.Fp8Config(path, block_m=16, block_n=16, block_k=32, split_k=split)
            wo, _ = _fp8_case(gen, M, K, N, F16, block, bias=bias, config=cfg, device="cpu")
            assert wo < TOL[F16], (split, bias, serial, K, N, block)
    locks = splitk._LOCKS.get(torch.device("cpu"))
    assert locks is None or int(locks.abs().sum()) == 0


@pytest.mark.parametrize("split,serial,swap_ab", [(1, True, False), (2, True, True), (4, True, False),
                                                   (4, False, True), (1, True, True)])
@interpreter_test
def test_fp8_fused_kernel_in_the_interpreter(gen, split, serial, swap_ab, monkeypatch):
    """The one-launch W8A8 kernel: x quantized per token and 128-group inside the K loop, K split in ranges summed
    by the tile's last program (serial) or by a second kernel, the weight tile on either side of the dot. The
    interpreter rounds to e4m3 its own way (not
    always to nearest), so the reference takes x quantized by the interpreter's per_token_group_quant kernel: the
    same rounding; what is checked is the kernel's indexing, scales and split-K sums."""
    from engine.ops.triton import fp8_block as tf
    from engine.ops.triton import splitk
    if not serial:
        monkeypatch.setattr(splitk, "split_locks", lambda *args: None)
    for M, K, N in ((1, 512, 256), (5, 512, 200), (16, 1024, 128)):
        w, s = random_fp8(N, K, (128, 128), device="cpu")
        x = torch.randn(M, K, generator=gen).to(BF16)
        b = torch.randn(N, generator=gen).to(BF16)
        cfg = tf.Fp8Config("fused", block_m=16, block_n=128, split_k=split, swap_ab=swap_ab)
        y = tf.fp8_block_linear(x, w, s, (128, 128), b, config=cfg)
        xq, xs = tf.per_token_group_quant(x, 128)
        xd = (xq.float().reshape(M, -1, 128) * xs.reshape(M, -1, 1)).reshape(M, K)
        ref = xd @ dequantize_fp8_block(w, s, (128, 128)).T + b.float()
        assert rel_err(y, ref) < TOL[BF16], (M, K, N)
    locks = splitk._LOCKS.get(torch.device("cpu"))
    assert locks is None or int(locks.abs().sum()) == 0
