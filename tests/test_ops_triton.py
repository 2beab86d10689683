"""Every Triton kernel (engine/ops/triton/) against its torch reference (`*_ref`), on fresh random inputs.

Two ways to run the same tests:
  GPU, compiled kernels:        pytest -m gpu tests/test_ops_triton.py
  CPU, Triton's interpreter:    ./run_tests.sh --kernels tests/test_ops_triton.py   (TRITON_INTERPRET=1 pytest ...)
TRITON_INTERPRET must be set before triton decorates the kernels (at import), so it is an environment variable of
the whole run; a session with it runs only the interpreter cases, one without it the others (tests/conftest.py).
The interpreter is slow and runs no bf16 matmul (it multiplies bf16's raw bits), so CPU attention runs in
fp32/fp16 on small shapes, and where the GPU runs a grid of shapes the interpreter runs each value once.
The seed of each test is printed; OPS_TEST_SEED=N reproduces a failure.
"""
from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from engine.ops.activation import silu_and_mul_ref  # noqa: E402
from engine.ops.attention import paged_attention_ref, varlen_attention_ref  # noqa: E402
from engine.ops.kv_cache import FP8_E4M3_MAX, FP8_KV_DTYPE, store_kvcache_ref  # noqa: E402
from engine.ops.norm import layer_norm_ref, rms_norm_ref  # noqa: E402
from engine.ops.rotary import (apply_rotary_ref, qk_norm_rope_ref, rope_and_store_kv_ref,  # noqa: E402
                               vision_qkv_rope_ref)
from paged_batches import make_batch, randn  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Max error relative to the reference's largest magnitude. Elementwise kernels reproduce torch's rounding
# points, so on the GPU they are within an ulp; the interpreter truncates to bf16 instead of rounding (~2 ulp).
TOL = {F32: 1e-5, F16: 2e-3, BF16: 1e-2}
INTERP_BF16_TOL = 3e-2
ATTN_TOL = {F32: 2e-5, F16: 5e-3, BF16: 2e-2}


def elementwise_tol(dtype, device):
    return INTERP_BF16_TOL if device == "cpu" and dtype == BF16 else TOL[dtype]


def device_cases(cpu_dtypes, gpu_dtypes, *axes):
    """(device, dtype, *values) params: CUDA ones marked gpu, interpreter ones marked triton_interpret (the
    interpreter runs in its own pytest session: tests/conftest.py). On the GPU every combination of the dtypes and
    the axes' values; the interpreter runs each program in turn on the CPU, so it takes the fewest cases that
    give each axis (the dtypes too) each of its values once. A tuple value fills several names ("hq,hk")."""
    gpu_marks = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
    cases = [case("cuda", d, values, gpu_marks) for d in gpu_dtypes for values in itertools.product(*axes)]
    cpu_axes = [cpu_dtypes, *axes]
    for i in range(max(map(len, cpu_axes)) if cpu_dtypes else 0):
        d, *values = (axis[i % len(axis)] for axis in cpu_axes)
        cases.append(case("cpu", d, values, [pytest.mark.triton_interpret]))
    return cases


def case(device, dtype, values, marks):
    flat = [v for value in values for v in (value if isinstance(value, tuple) else (value,))]
    name = "-".join(["cuda" if device == "cuda" else "interp", str(dtype)[6:], *map(str, flat)])
    return pytest.param(device, dtype, *flat, marks=marks, id=name)


def assert_close(out, ref, tol, what=""):
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    out, ref = out.float().cpu(), ref.float().cpu()
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err, scale = (out - ref).abs().max().item(), max(ref.abs().max().item(), 1e-6)
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} vs max |ref| {scale:.3g} (tolerance {tol} relative)"


def fused_qkv(gen, t, hq, hk, d, dtype, device):
    """q, k, v as the strided views of one fused qkv projection output, as the model produces them."""
    qkv = randn(gen, t, (hq + 2 * hk) * d, dtype=dtype, device=device)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    return q, k, v


# ---------------------------------------------------------------------------------------------- kv cache
@pytest.mark.parametrize("device,dtype", device_cases([F32, BF16], [F32, BF16]))
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("hk,d", [(1, 64), (8, 128), (3, 72)])
def test_store_kvcache(device, dtype, block_size, hk, d, gen):
    from engine.ops.triton.kv_cache import store_kvcache
    t = 37
    num_blocks = 80 // block_size + 1  # room for t distinct slots
    _, k, v = fused_qkv(gen, t, 2 * hk, hk, d, dtype, device)
    k_cache = randn(gen, num_blocks, block_size, hk, d, dtype=dtype, device=device)
    v_cache = randn(gen, num_blocks, block_size, hk, d, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots = torch.cat([slots, torch.full((t,), -1)])[torch.randperm(2 * t, generator=gen)[:t]]  # ~half skipped
    slots = slots.to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(k, v, k_ref, v_ref, slots)
    store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


# ---------------------------------------------------------------------------------------------- rms norm
@pytest.mark.parametrize("device,dtype", device_cases([F32, BF16], [F32, BF16, F16]))
@pytest.mark.parametrize("t,h", [(1, 4096), (7, 1000), (33, 128)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_2d(device, dtype, t, h, with_residual, gen):
    from engine.ops.triton.norm import rms_norm
    x = randn(gen, t, h, dtype=dtype, device=device, std=3.0)
    w = (torch.rand(h, generator=gen) + 0.5).to(device=device, dtype=dtype)
    res = randn(gen, t, h, dtype=dtype, device=device) if with_residual else None
    x_before = x.clone()
    out, ref = rms_norm(x, w, 1e-6, res), rms_norm_ref(x, w, 1e-6, res)
    assert torch.equal(x, x_before), "inputs must not be modified"
    if with_residual:
        assert_close(out[1], ref[1], elementwise_tol(dtype, device), "residual stream")
        out, ref = out[0], ref[0]
    assert_close(out, ref, elementwise_tol(dtype, device), "normed")


@pytest.mark.parametrize("device,dtype", device_cases([F32, BF16], [F32, BF16]))
@pytest.mark.parametrize("weight_dtype", [None, F32])
def test_rms_norm_per_head_strided(device, dtype, weight_dtype, gen):
    """A 3-D [T, heads, D] strided view (q of the fused qkv), weight possibly fp32 (type promotion)."""
    from engine.ops.triton.norm import rms_norm
    q, _, _ = fused_qkv(gen, 11, 8, 2, 128, dtype, device)
    w = (torch.rand(128, generator=gen) + 0.5).to(device=device, dtype=weight_dtype or dtype)
    assert_close(rms_norm(q, w, 1e-6), rms_norm_ref(q, w, 1e-6), elementwise_tol(dtype, device), "per-head norm")


@pytest.mark.parametrize("device,dtype", device_cases([F32, BF16], [F32, BF16]))
@pytest.mark.parametrize("t,h", [(1, 32), (7, 1152), (300, 96)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm(device, dtype, t, h, with_residual, gen):
    """The vision encoder's LayerNorm, fused with the residual add before it; rows of a width that is no
    power of two (1152) and off-centre inputs (mean 2), where a one-pass variance would lose digits."""
    from engine.ops.triton.norm import layer_norm
    x = randn(gen, t, h, dtype=dtype, device=device, std=3.0) + 2
    w = (torch.rand(h, generator=gen) + 0.5).to(device=device, dtype=dtype)
    b = randn(gen, h, dtype=dtype, device=device)
    res = randn(gen, t, h, dtype=dtype, device=device) if with_residual else None
    x_before = x.clone()
    out, ref = layer_norm(x, w, b, 1e-6, res), layer_norm_ref(x, w, b, 1e-6, res)
    assert torch.equal(x, x_before), "inputs must not be modified"
    if with_residual:
        assert_close(out[1], ref[1], elementwise_tol(dtype, device), "residual stream")
        out, ref = out[0], ref[0]
    assert_close(out, ref, elementwise_tol(dtype, device), "normed")


# ---------------------------------------------------------------------------------------------- rotary
def rope_cos_sin(gen, t, d, device):
    pos = torch.randint(0, 5000, (t,), generator=gen).float()
    inv_freq = 5e6 ** (-torch.arange(0, d, 2).float() / d)
    angles = pos[:, None] * inv_freq[None, :]
    return angles.cos().to(device), angles.sin().to(device)


@pytest.mark.parametrize("device,dtype", device_cases([F32, BF16], [F32, BF16]))
@pytest.mark.parametrize("t,hq,hk,d", [(1, 32, 8, 128), (17, 4, 1, 64), (5, 16, 16, 72)])
def test_apply_rotary(device, dtype, t, hq, hk, d, gen):
    from engine.ops.triton.rotary import apply_rotary
    q, k, _ = fused_qkv(gen, t, hq, hk, d, dtype, device)
    cos, sin = rope_cos_sin(gen, t, d, device)
    for out, ref, name in zip(apply_rotary(q, k, cos, sin), apply_rotary_ref(q, k, cos, sin), "qk"):
        assert_close(out, ref, elementwise_tol(dtype, device), name)


@pytest.mark.parametrize("device,dtype", device_cases([F32, BF16], [F32, BF16]))
@pytest.mark.parametrize("t,hq,hk,d", [(1, 32, 8, 128), (19, 4, 2, 64), (3, 8, 1, 128)])
def test_qk_norm_rope(device, dtype, t, hq, hk, d, gen):
    from engine.ops.triton.rotary import qk_norm_rope
    q, k, _ = fused_qkv(gen, t, hq, hk, d, dtype, device)
    qw = (torch.rand(d, generator=gen) + 0.5).to(device=device, dtype=dtype)
    kw = (torch.rand(d, generator=gen) + 0.5).to(device=device, dtype=dtype)
    cos, sin = rope_cos_sin(gen, t, d, device)
    outs = qk_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    refs = qk_norm_rope_ref(q, k, qw, kw, 1e-6, cos, sin)
    for out, ref, name in zip(outs, refs, "qk"):
        assert_close(out, ref, elementwise_tol(dtype, device), name)


@pytest.mark.parametrize("device,dtype", device_cases([F32, BF16], [F32, BF16]))
@pytest.mark.parametrize("t,hq,hk,d,block_size,norm", [(1, 32, 8, 128, 16, True), (19, 4, 2, 64, 16, True),
                                                        (7, 8, 1, 128, 1, False), (5, 16, 16, 72, 32, False)])
def test_rope_and_store_kv(device, dtype, t, hq, hk, d, block_size, norm, gen):
    """The decoder's fused prologue: same rotated q as the reference, and the same cache contents (rotated k,
    v) at the slots, with -1 slots writing nothing."""
    from engine.ops.triton.rotary import rope_and_store_kv
    q, k, v = fused_qkv(gen, t, hq, hk, d, dtype, device)
    weights = [(torch.rand(d, generator=gen) + 0.5).to(device=device, dtype=dtype) for _ in range(2)] if norm \
        else [None, None]
    cos, sin = rope_cos_sin(gen, t, d, device)
    num_blocks = t // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[::3] = -1
    slots = slots.to(device)
    caches = [torch.full((num_blocks, block_size, hk, d), 7.0, dtype=dtype, device=device) for _ in range(4)]
    out = rope_and_store_kv(q, k, v, cos, sin, caches[0], caches[1], slots, *weights, 1e-6)
    ref = rope_and_store_kv_ref(q, k, v, cos, sin, caches[2], caches[3], slots, *weights, 1e-6)
    tol = elementwise_tol(dtype, device)
    assert_close(out, ref, tol, "q")
    assert_close(caches[0], caches[2], tol, "k cache")
    assert torch.equal(caches[1], caches[3]), "v cache"


@pytest.mark.parametrize("device,dtype", device_cases([F32, BF16], [F32, BF16]))
@pytest.mark.parametrize("n,h,d", [(1, 16, 72), (37, 16, 72), (9, 4, 64)])
def test_vision_qkv_rope(device, dtype, n, h, d, gen):
    from engine.ops.triton.rotary import vision_qkv_rope
    qkv = randn(gen, n, 3 * h * d, dtype=dtype, device=device).view(n, 3, h, d)
    cos, sin = rope_cos_sin(gen, n, d, device)
    ref_qkv = qkv.clone()
    outs, refs = vision_qkv_rope(qkv, cos, sin), vision_qkv_rope_ref(ref_qkv, cos, sin)
    for out, ref, view, name in zip(outs, refs, qkv.unbind(1), "qkv"):
        assert out.data_ptr() == view.data_ptr() and out.stride() == view.stride(), f"{name}: a view of qkv"
        assert_close(out, ref, elementwise_tol(dtype, device), name)


# (not bf16 in the interpreter, which truncates to bf16 instead of rounding)
@pytest.mark.parametrize("device,dtype", device_cases([F32], [F32, BF16]))
@pytest.mark.parametrize("height,width", [(32, 32), (64, 96), (160, 32)])
def test_patchify_is_the_reference_bit_for_bit(device, dtype, height, width, gen):
    from engine.ops.pixels import patchify_ref
    from engine.ops.triton.pixels import patchify
    raw = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8).to(device)
    table = randn(gen, 3, 256, device=device)
    out = patchify(raw, table, 16, 2, 2, dtype)
    assert out.shape == (height * width // 256, 3 * 2 * 16 * 16) and out.dtype == dtype
    assert torch.equal(out, patchify_ref(raw, table, 16, 2, 2, dtype))


@pytest.mark.parametrize("device,dtype", device_cases([F32], [F32, BF16]))
def test_patchify_of_a_video_frame_group_is_the_reference_bit_for_bit(device, dtype, gen):
    from engine.ops.pixels import patchify_ref
    from engine.ops.triton.pixels import patchify
    raw = torch.randint(0, 256, (2, 64, 96, 3), generator=gen, dtype=torch.uint8).to(device)
    table = randn(gen, 3, 256, device=device)
    out = patchify(raw, table, 16, 2, 2, dtype)
    assert out.shape == (64 * 96 // 256, 3 * 2 * 16 * 16) and out.dtype == dtype
    assert torch.equal(out, patchify_ref(raw, table, 16, 2, 2, dtype))


# ---------------------------------------------------------------------------------------------- activation
@pytest.mark.parametrize("device,dtype", device_cases([F32, BF16], [F32, BF16, F16]))
@pytest.mark.parametrize("shape", [(1, 2 * 64), (7, 2 * 1000), (2, 3, 2 * 12288)])
def test_silu_and_mul(device, dtype, shape, gen):
    from engine.ops.triton.activation import silu_and_mul
    x = randn(gen, *shape, dtype=dtype, device=device, std=3.0)
    assert_close(silu_and_mul(x), silu_and_mul_ref(x), elementwise_tol(dtype, device), "silu_and_mul")


# ---------------------------------------------------------------------------------------------- attention
BORDER_CONTEXTS = [1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 600]


def check_paged(q, k_cache, v_cache, md, dtype):
    from engine.ops.triton.attention import paged_attention
    scale = q.shape[-1] ** -0.5
    out = paged_attention(q, k_cache, v_cache, md, scale)
    assert_close(out, paged_attention_ref(q, k_cache, v_cache, md, scale), ATTN_TOL[dtype], "paged attention")


@pytest.mark.parametrize("device,dtype,hq,hk,d,block_size",   # GQA groups 1, 4, 8
                         device_cases([F32], [F32, BF16], [(2, 2), (8, 2), (8, 1)], [64, 128], [1, 16, 32]))
def test_paged_attention_mixed(device, dtype, hq, hk, d, block_size, gen):
    """Decodes (with padding entries) then prefill chunks: a fresh prompt, chunks after cached prefixes,
    a one-token chunk, lengths on and around block and tile borders."""
    ctx = BORDER_CONTEXTS
    pick = torch.randint(0, len(ctx), (5,), generator=gen).tolist()
    decodes = [ctx[i] for i in pick[:3]] + [0, 600]
    prefills = [(ctx[pick[3]], ctx[pick[3]]),                      # whole prompt, no prefix
                (129, 600), (64, 64 + ctx[pick[4]]), (1, 17),      # chunks after cached prefixes
                (int(torch.randint(1, 200, (1,), generator=gen)), 333)]
    check_paged(*make_batch(gen, decodes, prefills, hq, hk, d, block_size, dtype, device), dtype)


@pytest.mark.parametrize("device,dtype", device_cases([F32], [BF16]))
def test_paged_attention_head_dim_below_16(device, dtype, gen):
    """Head size 8 (the tiny test Llamas): tl.dot needs K >= 16, so the kernels pad the head and mask it."""
    check_paged(*make_batch(gen, [5, 40], [(30, 30), (7, 50)], 6, 2, 8, 16, dtype, device), dtype)


@pytest.mark.parametrize("device,dtype,splits,block_size",
                         device_cases([F32, F16], [BF16, F16], [None, 1, 2, 16], [16, 32]))
def test_paged_decode_splits(device, dtype, splits, block_size, gen, monkeypatch):
    """Decode only, with forced split counts: empty splits, padding sequences (seq_len 0), long contexts."""
    import engine.ops.triton.attention as attn
    if splits is not None:
        monkeypatch.setattr(attn, "decode_num_splits", lambda *args: splits)
    decodes = [0, 1, 65, 600, 0, int(torch.randint(1, 600, (1,), generator=gen))]
    check_paged(*make_batch(gen, decodes, [], 8, 2, 128, block_size, dtype, device), dtype)


@pytest.mark.parametrize("device,dtype,block_size", device_cases([F32, F16], [BF16, F16], [1, 16, 64]))
def test_paged_prefill_only(device, dtype, block_size, gen):
    """Prefill chunks alone (num_decodes 0), several per batch, plus trailing tokens outside any sequence."""
    prefills = [(300, 300), (1, 1), (200, 457), (129, 129)]
    check_paged(*make_batch(gen, [], prefills, 4, 1, 64, block_size, dtype, device, extra_tokens=3), dtype)


def test_fresh_prefill_len_names_one_prompt_with_nothing_cached():
    """The dense path's precondition: one prefill sequence whose keys are exactly its queries."""
    from engine.ops.attention import fresh_prefill_len
    gen = torch.Generator().manual_seed(0)
    def md(decodes, prefills, extra=0):
        return make_batch(gen, decodes, prefills, 2, 1, 8, 16, F32, "cpu", extra_tokens=extra)[3]
    assert fresh_prefill_len(md([], [(300, 300)])) == 300
    assert fresh_prefill_len(md([], [(300, 300)], extra=5)) == 300       # padded rows: not a sequence
    assert fresh_prefill_len(md([], [(300, 320)])) == 0                  # a cached prefix (or an earlier chunk)
    assert fresh_prefill_len(md([40], [(300, 300)])) == 0                # a decode in the batch
    assert fresh_prefill_len(md([], [(300, 300), (20, 20)])) == 0        # two prompts (the prefill graphs' form)


@pytest.mark.parametrize("hq,hk,block_size", [(8, 2, 16), (4, 4, 1), (6, 2, 32)])
@pytest.mark.parametrize("extra", [0, 3])
def test_dense_causal_attention_is_the_paged_reference(hq, hk, block_size, extra):
    """One fresh prompt through torch's fused attention on K/V copied out of shuffled blocks: the paged
    reference's result, padded rows zero (CPU, fp32; on Hopper the same function runs on cuDNN)."""
    from engine.ops.attention import dense_causal_attention
    gen = torch.Generator().manual_seed(1)
    n = 157
    q, k_cache, v_cache, md = make_batch(gen, [], [(n, n)], hq, hk, 64, block_size, F32, "cpu", extra_tokens=extra)
    out = dense_causal_attention(q, k_cache, v_cache, md.block_tables[0], n, 0.125)
    assert_close(out, paged_attention_ref(q, k_cache, v_cache, md, 0.125), ATTN_TOL[F32], "dense attention")
    assert out.is_contiguous() and (out[n:] == 0).all()


@pytest.mark.parametrize("device,dtype", device_cases([], [BF16, F16]))
@pytest.mark.parametrize("n", [3072, 4097])    # DENSE_PREFILL_MIN_TOKENS and past it
@pytest.mark.parametrize("kv", ["model", "fp8"])
def test_long_fresh_prefill(device, dtype, n, kv, gen, monkeypatch):
    """A long new prompt at the 8B's heads (32 / 8 x 128): on Hopper cuDNN's attention (DENSE_PREFILL_MIN_TOKENS),
    elsewhere the prefill kernel; both the reference's result, and both with the threshold moved out of reach.
    An fp8 cache takes the same paths (its K/V decoded)."""
    import engine.ops.triton.attention as attn
    q, k_cache, v_cache, md = make_batch(gen, [], [(n, n)], 32, 8, 128, 16, dtype, device, extra_tokens=2)
    batch = (q, as_kv_cache(k_cache, kv), as_kv_cache(v_cache, kv), md)
    check_paged(*batch, dtype)
    monkeypatch.setattr(attn, "DENSE_PREFILL_MIN_TOKENS", 1 << 30)
    check_paged(*batch, dtype)


@pytest.mark.parametrize("device,dtype", device_cases([F32, F16], [F32, BF16, F16]))
@pytest.mark.parametrize("h,d", [(2, 72), (3, 64), (1, 128), (2, 96), (1, 48)])   # 72, 96, 48: head split in two
def test_varlen_attention(device, dtype, h, d, gen):
    from engine.ops.triton.varlen_attention import varlen_attention
    lens = [1, 17, 64, 65, 200, int(torch.randint(1, 300, (1,), generator=gen))]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    n = int(sum(lens))
    qkv = randn(gen, n, 3, h, d, dtype=dtype, device=device)  # strided views, as the ViT's fused qkv gives
    q, k, v = qkv.unbind(1)
    scale = d ** -0.5
    out = varlen_attention(q, k, v, cu, max(lens), scale)
    assert_close(out, varlen_attention_ref(q, k, v, cu, max(lens), scale), ATTN_TOL[dtype], "varlen attention")


@pytest.mark.parametrize("device,dtype", device_cases([F32], [F32, BF16, F16]))
@pytest.mark.parametrize("n", [1, 300, 4096])
def test_varlen_attention_one_segment(device, dtype, n, gen):
    """One segment over all rows (one image; cuDNN's kernel on Hopper in bf16/fp16) at the vision's 16 x 72."""
    from engine.ops.triton.varlen_attention import varlen_attention
    if device == "cpu" and n > 300:
        pytest.skip("too slow in the interpreter")
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    q, k, v = randn(gen, n, 3, 16, 72, dtype=dtype, device=device).unbind(1)
    out = varlen_attention(q, k, v, cu, n, 72 ** -0.5)
    assert out.shape == q.shape
    assert_close(out, varlen_attention_ref(q, k, v, cu, n, 72 ** -0.5), ATTN_TOL[dtype], "one-segment attention")


@pytest.mark.parametrize("device,dtype", device_cases([], [BF16]))
def test_varlen_attention_one_segment_in_a_cuda_graph(device, dtype, gen):
    """The vision graphs capture it: a replay on new q/k/v gives what an eager call gives."""
    from engine.ops.triton.varlen_attention import varlen_attention
    n = 4096
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    qkv = randn(gen, n, 3, 16, 72, dtype=dtype, device=device)
    varlen_attention(*qkv.unbind(1), cu, n, 0.1)          # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = varlen_attention(*qkv.unbind(1), cu, n, 0.1)
    qkv.copy_(randn(gen, n, 3, 16, 72, dtype=dtype, device=device))
    graph.replay()
    torch.testing.assert_close(out, varlen_attention(*qkv.unbind(1), cu, n, 0.1), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------- GPU only
def as_kv_cache(cache: torch.Tensor, kv: str) -> torch.Tensor:
    """The random cache in the model's dtype ("model") or as an fp8 one (--kv-cache-dtype fp8: the values clamped
    to e4m3's range and rounded; the poison block's 100.0 is an e4m3 value and stays)."""
    if kv == "model":
        return cache
    return cache.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


@pytest.mark.parametrize("device,dtype", device_cases([], [BF16]))
@pytest.mark.parametrize("kv", ["model", "fp8"])
def test_paged_attention_qwen_shapes(device, dtype, kv, gen):
    """Qwen3-VL-8B's heads (32 q / 8 kv, D 128), block 16, long contexts, a busy mixed batch."""
    decodes = torch.randint(1, 4000, (40,), generator=gen).tolist() + [0, 0, 8192]
    prefills = [(512, 512), (2048, 6000), (777, 1500), (1, 4097)]
    q, k_cache, v_cache, md = make_batch(gen, decodes, prefills, 32, 8, 128, 16, dtype, device)
    check_paged(q, as_kv_cache(k_cache, kv), as_kv_cache(v_cache, kv), md, dtype)


@pytest.mark.parametrize("device,dtype", device_cases([], [BF16]))
@pytest.mark.parametrize("kv", ["model", "fp8"])
def test_decode_cuda_graph_replay(device, dtype, kv, gen):
    """Capture the decode attention once, replay it with new seq_lens (incl. padding) and new q values."""
    from engine.ops.triton.attention import paged_attention
    batch, width, block_size = 8, 64, 16
    q, k_cache, v_cache, md = make_batch(gen, [width * block_size] * batch, [], 32, 8, 128, block_size, dtype,
                                         device)
    k_cache, v_cache = as_kv_cache(k_cache, kv), as_kv_cache(v_cache, kv)
    scale = 128 ** -0.5
    paged_attention(q, k_cache, v_cache, md, scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(q, k_cache, v_cache, md, scale)
    for _ in range(4):
        lens = torch.randint(0, width * block_size + 1, (batch,), generator=gen)
        lens[0], lens[1] = 0, width * block_size  # a padding entry and a full block table every time
        md.seq_lens.copy_(lens)
        md.seq_lens_cpu = lens.tolist()
        q.copy_(randn(gen, *q.shape, dtype=dtype, device=device, std=2.0))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, paged_attention_ref(q, k_cache, v_cache, md, scale), ATTN_TOL[dtype], f"replay {lens}")
