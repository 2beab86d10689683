"""wna16_linear's fused kernels (engine/ops/triton/wna16_fused.py) against the reference, on fresh random inputs.

  CPU, Triton's interpreter, small shapes:  TRITON_INTERPRET=1 pytest -m triton_interpret tests/test_ops_wna16_fused.py
  GPU, compiled, the 8B shapes too:         pytest -m gpu tests/test_ops_wna16_fused.py
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
from engine.ops.quant import pack_int32, wna16_linear_ref  # noqa: E402
from engine.ops.triton import splitk  # noqa: E402
from engine.ops.triton import wna16 as tw  # noqa: E402
from engine.ops.triton import wna16_fused as tf  # noqa: E402
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"   # (conftest patches the interpreter)
HAS_CUDA = torch.cuda.is_available()
F16, BF16 = torch.float16, torch.bfloat16
TOL = {BF16: 1e-2, F16: 3e-3}
SHAPES_8B = [(4096, 4096), (4096, 1024), (4096, 6144), (4096, 24576), (12288, 4096)]

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


def check(device, M, K, N, group, bits, dtype, cfg, bias=True, symmetric=False):
    """Runs `cfg` on fresh inputs into a NaN-filled output; returns the relative error against the reference."""
    qweight, scales, zeros = random_weights(K, N, group, bits, dtype, device, symmetric)
    x = torch.randn(M, K).to(dtype).to(device)
    b = torch.randn(N).to(dtype).to(device) if bias else None
    out = torch.full((M, N), float("nan"), dtype=dtype, device=device)
    tf.fused_linear(x, qweight, scales, zeros, group, bits, b, out, cfg)
    ref = wna16_linear_ref(x.float().cpu(), qweight.cpu(), scales.float().cpu(), zeros.float().cpu(), group, bits,
                           b.float().cpu() if bias else None)
    got = out.float().cpu()
    assert torch.isfinite(got).all(), "an output element is unwritten or not finite"
    return ((got - ref).norm() / ref.norm()).item()


# ---------------------------------------------------------------- the GEMV (1-8 tokens)

@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (4, 128), (8, 32), (8, 128)])
@pytest.mark.parametrize("device", DEVICES)
def test_gemv_matches_reference(device, bits, group):
    # N = 96 is not a multiple of the 64-column strip; splits of 1, 2 and 4 cover one and several groups each;
    # both reductions (last program, second kernel) run.
    K, N = (256 if device == "cpu" else 512), 96                 # the interpreter runs every program in turn
    for i, M in enumerate((1, 2, 3, 5, 8, 1)):
        for dtype in (F16, BF16):
            cfg = tf.FusedConfig("gemv", block_n=64, block_k=128 if i % 2 else 64, split_k=(1, 2, 4)[i % 3],
                                 num_warps=2, serial=i != 3)
            err = check(device, M, K, N, group, bits, dtype, cfg, bias=i % 2 == 0, symmetric=i == 4)
            assert err < TOL[dtype], (M, dtype, cfg, err)


@pytest.mark.parametrize("device", DEVICES)
def test_gemv_8bit_and_even_columns(device):
    # N a multiple of the strip (no column masks) with one program per strip and K not a power of two.
    for M in (1, 4):
        cfg = tf.FusedConfig("gemv", block_n=32, block_k=128, split_k=3, num_warps=1)   # 3 splits of one step
        assert check(device, M, 384, 64, 128, 8, F16, cfg) < TOL[F16]


# ---------------------------------------------------------------- the GEMM (more tokens)

@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, 64)])
@pytest.mark.parametrize("device", DEVICES)
def test_gemm_matches_reference(device, bits, group):
    K, N = 512, 80
    dtypes = (F16,) if device == "cpu" else (F16, BF16)
    for i, M in enumerate((9, 1, 16, 33, 70)):
        for dtype in dtypes:
            cfg = tf.FusedConfig("gemm", block_n=32 if i % 2 else 64, block_k=128, split_k=(1, 2)[i % 2],
                                 block_m=16 if M <= 16 else 32 if M <= 33 else 64, swap_ab=i % 2 == 1,
                                 group_m=(1, 8)[i % 2],
                                 serial=i != 1)
            err = check(device, M, K, N, group, bits, dtype, cfg, bias=i % 2 == 0, symmetric=i == 2)
            assert err < TOL[dtype], (M, dtype, cfg, err)


# ---------------------------------------------------------------- dispatch, act-order, counters

@pytest.mark.parametrize("device", DEVICES)
def test_automatic_dispatch_runs_the_fused_kernels(device, monkeypatch):
    monkeypatch.setenv("ENGINE_WNA16_KERNELS", "fused")
    K, N, group = 256, 48, 64
    qweight, scales, zeros = random_weights(K, N, group, 4, F16, device)
    for M in (1, 6, 8, 9, 40):
        cfg = tf.choose_config(M, N, K, 4, group)
        assert cfg is not None and cfg.path == ("gemv" if M == 1 else "gemm")
        x = torch.randn(2, M, K).to(F16).to(device)                 # leading dims are flattened
        y = tw.wna16_linear(x, qweight, scales, zeros, group, 4)
        ref = wna16_linear_ref(x.float().cpu(), qweight.cpu(), scales.float().cpu(), zeros.float().cpu(), group, 4)
        assert y.shape == (2, M, N) and ((y.float().cpu() - ref).norm() / ref.norm()).item() < TOL[F16]


@pytest.mark.parametrize("device", DEVICES)
def test_by_default_one_token_runs_the_gemv_and_2_to_64_tokens_the_fused_gemm(device, monkeypatch):
    # The measured mix (BENCHMARKS.md): wna16's GEMV for one token, wna16_fused's GEMM from 2 to 64 tokens,
    # dequantize-then-cuBLAS above.
    monkeypatch.delenv("ENGINE_WNA16_KERNELS", raising=False)
    K, N, group = 256, 48, 64
    qweight, scales, zeros = random_weights(K, N, group, 4, F16, device)
    fused_paths = []
    real = tf.fused_linear
    monkeypatch.setattr(tf, "fused_linear", lambda *a: fused_paths.append(a[-1].path) or real(*a))
    for M, expected in ((1, []), (2, ["gemm"]), (64, ["gemm"]), (65, [])):
        fused_paths.clear()
        x = torch.randn(M, K).to(F16).to(device)
        y = tw.wna16_linear(x, qweight, scales, zeros, group, 4)
        ref = wna16_linear_ref(x.float().cpu(), qweight.cpu(), scales.float().cpu(), zeros.float().cpu(), group, 4)
        assert fused_paths == expected, M
        assert ((y.float().cpu() - ref).norm() / ref.norm()).item() < TOL[F16], M
    assert tw.choose_config(1, N, K, 4, group).path == "gemv"


@pytest.mark.parametrize("device", DEVICES)
def test_past_64_tokens_the_gemm_runs_only_where_the_table_holds_a_config(device, monkeypatch):
    """Beyond wna16.DEQUANT_MIN_M tokens dequantize + cuBLAS is the default; a TUNED_W4G128 entry for the shape
    and bucket (measured faster there, Hopper) sends those tokens to the fused GEMM with its config."""
    monkeypatch.delenv("ENGINE_WNA16_KERNELS", raising=False)
    monkeypatch.setattr(tf, "is_hopper", lambda device: True)
    K, N = 256, 64
    tuned = tf.FusedConfig("gemm", block_n=32, block_k=128, block_m=64, num_warps=4, num_stages=2, swap_ab=True)
    monkeypatch.setitem(tf.TUNED_W4G128, (N, K, 128), tuned)
    qweight, scales, zeros = random_weights(K, N, 128, 4, F16, device)
    configs = []
    real = tf.fused_linear
    monkeypatch.setattr(tf, "fused_linear", lambda *a: configs.append(a[-1]) or real(*a))
    for M, expected in ((65, [tuned]), (128, [tuned]), (129, []), (300, [])):
        configs.clear()
        x = torch.randn(M, K).to(F16).to(device)
        y = tw.wna16_linear(x, qweight, scales, zeros, 128, 4)
        ref = wna16_linear_ref(x.float().cpu(), qweight.cpu(), scales.float().cpu(), zeros.float().cpu(), 128, 4)
        assert configs == expected, M
        assert ((y.float().cpu() - ref).norm() / ref.norm()).item() < TOL[F16], M
    monkeypatch.setattr(tf, "is_hopper", lambda device: False)      # the table is Hopper's
    assert tf.tuned_config(100, N, K, 4, 128, hopper=False) is None


def test_prefill_sized_batches_and_small_groups_keep_the_older_paths():
    assert tf.choose_config(tf.DEQUANT_MIN_M, 4096, 4096, 4, 128) is None
    assert tf.choose_config(tf.DEQUANT_MIN_M - 1, 4096, 4096, 4, 128).path == "gemm"
    assert tf.choose_config(64, 256, 1000, 4, 1000) is None          # group 1000: K steps of 8, too short for a dot
    assert tf.choose_config(4, 256, 1000, 4, 1000).path == "gemv"    # ... where the gemv takes the tokens
    assert tf.choose_config(1, 256, 1000, 4, 1000).path == "gemv"


def test_tuned_table_overrides_the_default(monkeypatch):
    tuned = tf.FusedConfig("gemv", block_n=128, split_k=8, num_warps=1)
    monkeypatch.setitem(tf.TUNED_W4G128, (4096, 4096, 2), tuned)
    assert tf.choose_config(2, 4096, 4096, 4, 128) is tuned
    assert tf.choose_config(3, 4096, 4096, 4, 128) is not tuned     # bucket 4
    assert tf.choose_config(2, 4096, 4096, 4, 64) is not tuned      # the table is for group 128
    assert tf.choose_config(2, 4096, 4096, 4, 128, hopper=False) is not tuned    # and for the H200


def test_default_one_token_gemv_fills_the_gpu_at_the_8b_shapes():
    for K, N in SHAPES_8B:
        cfg = tf.default_config(1, N, K, 4, 128)
        programs = -(-N // cfg.block_n) * cfg.split_k
        assert cfg.path == "gemv" and (programs >= 2 * splitk.SMS or cfg.split_k == 32), (K, N, cfg)
        assert cfg.block_n % (128 * cfg.num_warps) == 0            # a packed tile's rows stay in one thread


def test_default_gemm_on_hopper_feeds_the_dequantized_weights_from_registers():
    # 2-64 tokens: swap-AB (the weight tile is the wgmma's A operand, which Hopper reads from registers), 64
    # columns per program, a row tile that holds the tokens, split-K where the tiles alone leave SMs idle.
    for K, N in SHAPES_8B:
        for M in (2, 8, 16, 17, 32, 33, 64):
            cfg = tf.default_config(M, N, K, 4, 128)
            assert cfg.path == "gemm" and cfg.swap_ab and cfg.block_n == 64, (M, K, N, cfg)
            assert cfg.block_m >= min(M, 64) and cfg.block_m <= max(16, 2 * M), (M, cfg)
            assert -(-N // 64) * cfg.split_k >= 2 * splitk.SMS or cfg.split_k >= 4, (M, K, N, cfg)
    assert not tf.default_config(128, 4096, 4096, 4, 128).swap_ab


def test_default_tiles_fit_ampere_and_ada():
    # sm80-89: at most 128-row tiles with 8 warps and 2 stages from 64 tokens (shared memory, registers).
    for M in (2, 16, 32, 64, 128, 256, 1000):
        cfg = tf.choose_config(M, 4096, 4096, 4, 128, hopper=False)
        assert cfg.block_m <= 128 and cfg.num_stages <= 4
        if M > 32:
            assert cfg.num_warps == 8 and cfg.num_stages == 2


@pytest.mark.parametrize("device", DEVICES)
def test_act_order_layer_with_fused_kernels(device, gen):
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
    for M in (1, 5, 20):
        x = torch.randn(M, K, generator=gen).to(F16)
        xd = x.to(device).index_select(-1, layer.perm)
        y = tw.wna16_linear(xd, layer.qweight, layer.scales, layer.zeros, G, bits)
        ref = x.float() @ w.dequantize(torch.float32).T
        assert ((y.float().cpu() - ref).norm() / ref.norm()).item() < TOL[F16], M


@pytest.mark.parametrize("device", DEVICES)
def test_split_counters_are_reset_for_the_next_launch(device):
    cfg = tf.FusedConfig("gemv", block_n=32, block_k=64, split_k=4, num_warps=1)
    for _ in range(2):
        assert check(device, 2, 512, 64, 64, 4, F16, cfg) < TOL[F16]
    assert int(splitk._LOCKS[torch.device(device) if device == "cpu" else torch.device("cuda", 0)].abs().sum()) == 0


# ---------------------------------------------------------------- GPU: the 8B shapes, graphs, the A/B switch

@pytest.mark.parametrize("K,N", SHAPES_8B)
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@gpu
def test_8b_shapes_every_bucket(K, N, dtype):
    for M in (1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 256, 1000):
        cfg = tf.choose_config(M, N, K, 4, 128)
        if cfg is None:
            continue
        assert check("cuda", M, K, N, 128, 4, dtype, cfg, bias=M % 2 == 1) < TOL[dtype], (M, cfg)


@pytest.mark.parametrize("M", [1, 4, 16, 100])
@gpu
def test_cuda_graph_replays_with_split_k(M):
    K, N = 4096, 1024
    qweight, scales, zeros = random_weights(K, N, 128, 4, BF16, "cuda")
    x = torch.randn(M, K, device="cuda", dtype=BF16)
    cfg = replace(tf.default_config(M, N, K, 4, 128), split_k=4)

    def fn():
        return tw.wna16_linear(x, qweight, scales, zeros, 128, 4, config=cfg)
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
        ref = wna16_linear_ref(x.float(), qweight, scales.float(), zeros.float(), 128, 4)
        assert ((y.float() - ref).norm() / ref.norm()).item() < TOL[BF16]


@gpu
def test_older_kernels_stay_selectable(monkeypatch):
    K, N = 4096, 1024
    qweight, scales, zeros = random_weights(K, N, 128, 4, BF16, "cuda")
    for M in (1, 16, 200):
        x = torch.randn(M, K, device="cuda", dtype=BF16)
        ref = wna16_linear_ref(x.float(), qweight, scales.float(), zeros.float(), 128, 4)
        for which in ("old", "fused"):
            monkeypatch.setenv("ENGINE_WNA16_KERNELS", which)
            y = tw.wna16_linear(x, qweight, scales, zeros, 128, 4)
            assert ((y.float() - ref).norm() / ref.norm()).item() < TOL[BF16], (M, which)
