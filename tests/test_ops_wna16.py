"""The 4-/8-bit kernels (engine/ops/triton/quant/wna16_*.py) against the reference, on fresh random inputs: the
one-token GEMV, the GEMM that dequantizes in its K loop (plain and swap-AB tiles), dequantize-then-cuBLAS, split-K
summed by the tile's last program or by a second kernel, and the automatic dispatch end to end.

  CPU, Triton's interpreter, small shapes:  TRITON_INTERPRET=1 pytest -m triton_interpret tests/test_ops_wna16.py
  GPU, compiled, the 8B shapes too:         pytest -m gpu tests/test_ops_wna16.py
Each output starts as NaN, so an element no program writes fails the test. Tolerances are relative Frobenius
errors against the float32 reference (as in tests/test_ops_quant.py): bf16 1e-2, fp16 3e-3. The interpreter runs
no bf16 dot (it multiplies raw bits), so the GEMM runs in fp16 there. OPS_TEST_SEED=N repeats a run.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from engine.model.linear import ColumnParallelLinear  # noqa: E402
from engine.model.quantization.config import QuantizationConfig, WNA16Scheme  # noqa: E402
from engine.model.quantization.weights import WNA16Weights  # noqa: E402
from engine.ops.platform import DeviceCaps, device_caps  # noqa: E402
from gpu_cards import needs_card
from engine.ops.quant import pack_int32, wna16_linear_ref  # noqa: E402
from engine.ops.triton.quant import linear, splitk, table  # noqa: E402
from engine.ops.triton.quant.table import KernelChoice, Problem, choose_wna16  # noqa: E402
from engine.ops.triton.quant.wna16_dequant import wna16_dequant_linear  # noqa: E402
from engine.ops.triton.quant.wna16_gemm import wna16_gemm  # noqa: E402
from engine.ops.triton.quant.wna16_gemv import wna16_gemv  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"   # (conftest patches the interpreter)
HAS_CUDA = torch.cuda.is_available()
F16, BF16 = torch.float16, torch.bfloat16
TOL = {BF16: 1e-2, F16: 3e-3}
SHAPES_8B = [(4096, 4096), (4096, 1024), (4096, 6144), (4096, 24576), (12288, 4096)]
RUN = {"wna16_gemv": wna16_gemv, "wna16_gemm": wna16_gemm, "wna16_dequant": wna16_dequant_linear}

# Lists of marks: a mark called with another mark takes it as an argument instead of applying it.
INTERP_MARKS = [pytest.mark.triton_interpret,
                pytest.mark.skipif(not INTERPRET, reason="set TRITON_INTERPRET=1 to run in Triton's interpreter")]
GPU_MARKS = [pytest.mark.gpu,
             pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs CUDA, TRITON_INTERPRET unset")]
DEVICES = [pytest.param("cpu", marks=INTERP_MARKS, id="interp"), pytest.param("cuda", marks=GPU_MARKS, id="cuda")]


def gpu(fn):
    for mark in GPU_MARKS:
        fn = mark(fn)
    return fn


def random_weights(K, N, group, bits, dtype, device, symmetric=False):
    q = torch.randint(0, 2**bits, (K, N), dtype=torch.int32)
    scales = (torch.rand(K // group, N) * 0.02 + 0.002).to(dtype)
    zeros = torch.full((K // group, N), 2.0 ** (bits - 1)) if symmetric else \
        torch.randint(0, 2**bits, (K // group, N)).float()
    return pack_int32(q, bits).to(device), scales.to(device), zeros.to(dtype).to(device)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got.float().cpu()
    assert torch.isfinite(got).all(), "an output element is unwritten or not finite"
    return ((got - ref).norm() / ref.norm()).item()


def reference(x, qweight, scales, zeros, group, bits, bias=None):
    return wna16_linear_ref(x.float().cpu(), qweight.cpu(), scales.float().cpu(), zeros.float().cpu(), group, bits,
                            bias.float().cpu() if bias is not None else None)


def check(device, M, K, N, group, bits, dtype, tiles, bias=True, symmetric=False):
    """Runs `tiles` on fresh inputs into a NaN-filled output; returns the relative error against the reference."""
    qweight, scales, zeros = random_weights(K, N, group, bits, dtype, device, symmetric)
    x = torch.randn(M, K).to(dtype).to(device)
    b = torch.randn(N).to(dtype).to(device) if bias else None
    out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
    got = RUN[tiles.kernel](x, qweight, scales, zeros, group, bits, b, out, tiles)
    return rel_err(got, reference(x, qweight, scales, zeros, group, bits, b))


# ---------------------------------------------------------------- each kernel

@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, 64)])
@pytest.mark.parametrize("device", DEVICES)
def test_gemv_matches_reference(device, bits, group):
    # One token. N = 40 is not a multiple of the 32-column strip; split 1, 2 (one or several groups per range;
    # the last program sums) and 2 without counters (a second kernel sums); bias or not.
    K = 256 if device == "cpu" else 2048
    for split, bias, serial in ((1, True, True), (2, False, True), (2, True, False)):
        for dtype in ((F16,) if device == "cpu" else (F16, BF16)):
            tiles = KernelChoice("wna16_gemv", block_n=32, block_k=64 * (32 // bits) // 2, split_k=split,
                                 num_warps=4, serial=serial)
            err = check(device, 1, K, 40, group, bits, dtype, tiles, bias=bias, symmetric=split == 1)
            assert err < TOL[dtype], (split, bias, serial, dtype, err)


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, 64)])
@pytest.mark.parametrize("device", DEVICES)
def test_gemm_matches_reference(device, bits, group):
    # Plain and swap-AB tiles, split-K summed by the last program or a second kernel, row tiles that hold the
    # tokens or not, grouped tile order or not; N = 80 is not a multiple of 64-column tiles.
    K, N = 512, 80
    dtypes = (F16,) if device == "cpu" else (F16, BF16)
    cases = [(9, False, 1, True), (2, True, 2, False), (33, True, 1, True), (70, False, 2, True)]
    for i, (M, swap_ab, split, serial) in enumerate(cases):
        for dtype in dtypes:
            tiles = KernelChoice("wna16_gemm", block_n=32 if swap_ab else 64, block_k=128, split_k=split,
                                 block_m=16 if M <= 16 else 32 if M <= 33 else 64, swap_ab=swap_ab,
                                 group_m=(1, 8)[i % 2], num_stages=2, serial=serial)
            err = check(device, M, K, N, group, bits, dtype, tiles, bias=i % 2 == 0, symmetric=i == 2)
            assert err < TOL[dtype], (M, dtype, tiles, err)


@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_then_matmul_matches_reference(device):
    # Tiles that span several groups (per-row scales) and fewer than one; 4- and 8-bit; K not a power of two.
    for bits, group, block_k in ((4, 32, 64), (4, 128, 64), (8, 64, 32)):
        tiles = KernelChoice("wna16_dequant", block_n=32, block_k=block_k, num_warps=4)
        assert check(device, 5, 384, 40, group, bits, F16, tiles, bias=bits == 4) < TOL[F16], (bits, group)


@pytest.mark.parametrize("device", DEVICES)
def test_split_counters_are_reset_for_the_next_launch(device):
    tiles = KernelChoice("wna16_gemm", block_n=32, block_k=64, split_k=4, block_m=16, swap_ab=True, num_stages=2)
    for _ in range(2):
        assert check(device, 2, 512, 64, 64, 4, F16, tiles) < TOL[F16]
    assert int(splitk._LOCKS[torch.device(device) if device == "cpu" else torch.device("cuda", 0)].abs().sum()) == 0


# ---------------------------------------------------------------- the dispatch, end to end

@pytest.mark.parametrize("device", DEVICES)
def test_the_table_s_kernel_runs_for_each_token_count(device, monkeypatch):
    """linear.wna16_linear looks the kernel up in the table (the GEMV for one token, the GEMM to 64, dequantize
    past it; a tuned entry past 64 tokens sends its bucket to the GEMM) and flattens leading dims."""
    K, N, group = 256, 48, 128
    tuned = KernelChoice("wna16_gemm", block_n=32, block_k=64, block_m=128, num_stages=2, swap_ab=True)
    monkeypatch.setitem(table.TUNED_W4G128, (N, K, 128), tuned)       # Hopper's (and the interpreter's)
    qweight, scales, zeros = random_weights(K, N, group, 4, F16, device)
    ran = []
    monkeypatch.setattr(linear, "WNA16_KERNELS", {k: (lambda *a, f=f: ran.append(a[-1]) or f(*a))
                                                  for k, f in linear.WNA16_KERNELS.items()})
    caps = device_caps(torch.device(device))
    past_64 = "wna16_gemm" if caps.wgmma else "wna16_dequant"          # the tuned bucket (65-128 tokens)
    for M, kernel in ((1, "wna16_gemv"), (6, "wna16_gemm"), (64, "wna16_gemm"), (65, past_64), (128, past_64),
                      (129, "wna16_dequant")):
        ran.clear()
        x = torch.randn(M, 1, K).to(F16).to(device)                  # leading dims are flattened
        y = linear.wna16_linear(x, qweight, scales, zeros, group, 4)
        assert [t.kernel for t in ran] == [kernel], M
        assert y.shape == (M, 1, N) and rel_err(y, reference(x.reshape(M, K), qweight, scales, zeros, group, 4)
                                                .reshape(M, 1, N)) < TOL[F16], M
        assert kernel != "wna16_gemm" or M <= 64 or ran == [tuned], M
    assert ran[-1] == choose_wna16(Problem(129, N, K, F16, group_size=group), caps)


@pytest.mark.parametrize("device", DEVICES)
def test_act_order_layer(device, gen):
    # A GPTQ desc_act layer: the loader permutes the input channels so groups are contiguous; x gets `perm`.
    K, N, G, bits = 256, 40, 32, 4
    g_idx = torch.randperm(K, generator=gen) % (K // G)
    w = WNA16Weights(torch.randint(0, 16, (K, N), generator=gen, dtype=torch.uint8),
                     (torch.rand(K // G, N, generator=gen) * 0.02 + 0.002).to(F16),
                     torch.randint(0, 16, (K // G, N), generator=gen).float(), g_idx)
    quant = QuantizationConfig("gptq", [(["Linear"], WNA16Scheme(bits, G, symmetric=False, act_order=True))])
    layer = ColumnParallelLinear(K, N, False, quant, ["proj"])
    layer.quant_method.load_shard(layer, None, w, "proj")
    layer.to(device=device, dtype=F16)
    for M in (1, 5):
        x = torch.randn(M, K, generator=gen).to(F16)
        xd = x.to(device).index_select(-1, layer.perm)
        y = linear.wna16_linear(xd, layer.qweight, layer.scales, layer.zeros, G, bits)
        ref = x.float() @ w.dequantize(torch.float32).T
        assert rel_err(y, ref) < TOL[F16], M


# ---------------------------------------------------------------- GPU: the 8B shapes, graphs, every device class

@pytest.mark.parametrize("K,N", SHAPES_8B)
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@gpu
def test_8b_shapes_every_bucket(K, N, dtype):
    caps = device_caps(torch.device("cuda"))
    for M in (1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 256, 1000):
        tiles = choose_wna16(Problem(M, N, K, dtype), caps)
        assert check("cuda", M, K, N, 128, 4, dtype, tiles, bias=M % 2 == 1) < TOL[dtype], (M, tiles)


@pytest.mark.parametrize("arch", [80, 86, 89, 90])
@gpu
def test_every_device_class_s_tiles_run_here(arch):
    # The tiles the table gives sm80-90, compiled for and run on this GPU (tests/test_ops_portable.py checks that
    # they compile for the architectures themselves).
    needs_card(arch)
    for K, N in ((4096, 6144), (12288, 4096)):
        for M in (1, 8, 33, 64, 256):
            tiles = choose_wna16(Problem(M, N, K, BF16), DeviceCaps.for_arch(arch))
            assert check("cuda", M, K, N, 128, 4, BF16, tiles) < TOL[BF16], (arch, M, tiles)


@pytest.mark.parametrize("M", [1, 4, 16, 100])
@gpu
def test_cuda_graph_replays_with_split_k(M):
    K, N = 4096, 1024
    qweight, scales, zeros = random_weights(K, N, 128, 4, BF16, "cuda")
    x = torch.randn(M, K, device="cuda", dtype=BF16)
    default = choose_wna16(Problem(M, N, K, BF16), device_caps(x.device))
    tiles = replace(default, split_k=4) if default.kernel != "wna16_dequant" else default

    def fn():
        return linear.wna16_linear(x, qweight, scales, zeros, 128, 4, tiles=tiles)
    fn()                                                         # compile and allocate the counters outside
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fn()
    for _ in range(3):                                           # new inputs, same buffers, counters reused
        x.copy_(torch.randn(M, K, device="cuda", dtype=BF16))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(y, reference(x, qweight, scales, zeros, 128, 4)) < TOL[BF16]
