"""The Triton kernels that write or read the paged KV cache, on an fp8 (e4m3fn) cache, against their torch
references (--kv-cache-dtype fp8). Run as test_ops_triton.py:
  GPU, compiled kernels:        pytest -m gpu tests/test_ops_triton_kv_fp8.py
  CPU, Triton's interpreter:    ./run_tests.sh --kernels tests/test_ops_triton_kv_fp8.py
Writes must be bit-exact (the kernels' integer e4m3 encoding against torch's clamp-and-cast); reads decode exact
values, so attention on an fp8 cache keeps the tolerances of attention on a model-dtype cache. The Qwen-shape and
CUDA-graph attention tests run on both caches in test_ops_triton.py.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from engine.ops.attention import paged_attention_ref  # noqa: E402
from engine.ops.kv_cache import FP8_KV_DTYPE, store_kvcache_ref, to_kv_cache_dtype  # noqa: E402
from engine.ops.triton.kv_cache import fp8e4m3_to_float  # noqa: E402
from paged_batches import make_batch, randn  # noqa: E402
from test_ops_triton import (ATTN_TOL, BF16, F16, F32, as_kv_cache, assert_close, device_cases,  # noqa: E402
                             fused_qkv, rope_cos_sin)

FP8 = FP8_KV_DTYPE


def as_fp8_cache(cache: torch.Tensor) -> torch.Tensor:
    return as_kv_cache(cache, "fp8")


def wide_values(gen, t, h, d, dtype, device):
    """Values over e4m3's whole range and past it: subnormals (< 2^-6), halfway cases, and beyond +-448
    (which must saturate), with both signs."""
    exponents = torch.randint(-12, 11, (t, h, d), generator=gen).float()
    x = torch.randn(t, h, d, generator=gen).sign() * torch.rand(t, h, d, generator=gen).add(1.0) * 2.0 ** exponents
    x.view(-1)[:6] = torch.tensor([448.0, 464.0, -1000.0, 2.0 ** -10, -(2.0 ** -9) * 1.5, 0.0])
    return x.to(device=device, dtype=dtype)


@pytest.mark.parametrize("device,dtype", device_cases([F32, BF16], [F32, BF16, F16]))
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("hk,d", [(1, 64), (8, 128)])
def test_store_kvcache_fp8_is_bit_exact(device, dtype, block_size, hk, d, gen):
    from engine.ops.triton.kv_cache import store_kvcache
    t, num_blocks = 37, 80 // block_size + 1
    k, v = wide_values(gen, t, hk, d, dtype, device), wide_values(gen, t, hk, d, dtype, device)
    k_cache = as_fp8_cache(randn(gen, num_blocks, block_size, hk, d, device=device))
    v_cache = as_fp8_cache(randn(gen, num_blocks, block_size, hk, d, device=device))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[::3] = -1                                       # skipped: already cached, or padding
    slots = slots.to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache_ref(k, v, k_ref, v_ref, slots)
    store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))


@pytest.mark.parametrize("device,dtype", device_cases([F32, BF16], [F32, BF16]))
@pytest.mark.parametrize("norm", [False, True])
def test_rope_and_store_kv_fp8_is_bit_exact(device, dtype, norm, gen):
    """The decoder's fused prologue on an fp8 cache writes exactly the e4m3 encoding of what it writes into a
    model-dtype cache (that one is checked against the reference in test_ops_triton.py), v saturating past 448,
    and returns the same rotated q; -1 slots write nothing."""
    from engine.ops.triton.rotary import rope_and_store_kv
    t, hq, hk, d, block_size = 19, 4, 2, 64, 16
    q, k, v = fused_qkv(gen, t, hq, hk, d, dtype, device)
    v = v * 300.0
    cos, sin = rope_cos_sin(gen, t, d, device)
    weights = [(torch.rand(d, generator=gen) + 0.5).to(device=device, dtype=dtype) for _ in range(2)] if norm \
        else [None, None]
    num_blocks = 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    slots[::3] = -1
    slots = slots.to(device)
    plain = [torch.full((num_blocks, block_size, hk, d), 7.0, dtype=dtype, device=device) for _ in range(2)]
    fp8 = [torch.full((num_blocks, block_size, hk, d), 7.0, device=device).to(FP8) for _ in range(2)]
    q_plain = rope_and_store_kv(q, k, v, cos, sin, *plain, slots, *weights, 1e-6)
    q_fp8 = rope_and_store_kv(q, k, v, cos, sin, *fp8, slots, *weights, 1e-6)
    assert torch.equal(q_fp8, q_plain)
    for got, want in zip(fp8, plain):
        assert torch.equal(got.view(torch.uint8), to_kv_cache_dtype(want, FP8).view(torch.uint8))


def fp8_batch(gen, decodes, prefills, hq, hk, d, block_size, dtype, device, **kw):
    q, k_cache, v_cache, md = make_batch(gen, decodes, prefills, hq, hk, d, block_size, dtype, device, **kw)
    return q, as_fp8_cache(k_cache), as_fp8_cache(v_cache), md


def check_paged_fp8(q, k_cache, v_cache, md, dtype):
    from engine.ops.triton.attention import paged_attention
    scale = q.shape[-1] ** -0.5
    out = paged_attention(q, k_cache, v_cache, md, scale)
    assert_close(out, paged_attention_ref(q, k_cache, v_cache, md, scale), ATTN_TOL[dtype], "fp8-cache attention")


@pytest.mark.parametrize("device,dtype,hq,hk,block_size",
                         device_cases([F32], [F32, BF16], [(8, 2), (8, 1)], [1, 16]))
def test_paged_attention_mixed_fp8(device, dtype, hq, hk, block_size, gen):
    """Decodes (one a padding entry) and prefill chunks after cached prefixes, reading an fp8 cache."""
    decodes = [1, 17, 0, 600, int(torch.randint(1, 600, (1,), generator=gen))]
    prefills = [(129, 129), (129, 600), (64, 127), (1, 17)]
    check_paged_fp8(*fp8_batch(gen, decodes, prefills, hq, hk, 128, block_size, dtype, device), dtype)


@pytest.mark.parametrize("device,dtype", device_cases([F16], [BF16, F16]))
@pytest.mark.parametrize("splits", [None, 1, 16])
def test_paged_decode_splits_fp8(device, dtype, splits, gen, monkeypatch):
    import engine.ops.triton.attention as attn
    if splits is not None:
        monkeypatch.setattr(attn, "decode_num_splits", lambda *args: splits)
    decodes = [0, 1, 65, 600, int(torch.randint(1, 600, (1,), generator=gen))]
    check_paged_fp8(*fp8_batch(gen, decodes, [], 8, 2, 128, 16, dtype, device), dtype)


@pytest.mark.parametrize("device,dtype", device_cases([], [BF16, F16, F32]))
def test_every_fp8_decode_gives_attention_the_same_bits(device, dtype, gen, monkeypatch):
    """sm89+ decodes e4m3 with the GPU's conversion, sm80/86 with integer operations four bytes at a time in PTX,
    the interpreter element by element: all yield the exact e4m3 values, so attention gives the same bits each
    way this GPU can run (decodes with splits, and prefill chunks)."""
    import engine.ops.triton.attention as attn
    decodes = [1, 65, 600, int(torch.randint(1, 600, (1,), generator=gen))]
    q, k_cache, v_cache, md = fp8_batch(gen, decodes, [(129, 600), (64, 127)], 8, 2, 128, 16, dtype, device)
    scale = q.shape[-1] ** -0.5
    first = attn.paged_attention(q, k_cache, v_cache, md, scale)
    if attn.fp8_native(torch.device(device)):
        monkeypatch.setattr(attn, "fp8_native", lambda device: False)
        monkeypatch.setattr(attn, "fp8_packed", lambda device: True)
        assert torch.equal(first, attn.paged_attention(q, k_cache, v_cache, md, scale)), "packed PTX decode"
    monkeypatch.setattr(attn, "fp8_native", lambda device: False)
    monkeypatch.setattr(attn, "fp8_packed", lambda device: False)
    assert torch.equal(first, attn.paged_attention(q, k_cache, v_cache, md, scale)), "element-wise decode"


@triton.jit
def _decode_all_kernel(b_ptr, out_ptr, NATIVE: tl.constexpr, PACKED: tl.constexpr):
    offs = tl.arange(0, 256)
    b = tl.load(b_ptr + offs)
    if NATIVE:
        b = b.to(tl.float8e4nv, bitcast=True).to(tl.uint8, bitcast=True)
    tl.store(out_ptr + offs, fp8e4m3_to_float(b, out_ptr.dtype.element_ty, NATIVE, PACKED))


@pytest.mark.parametrize("device,dtype", device_cases([F32, BF16, F16], [F32, BF16, F16]))
def test_every_e4m3_byte_decodes_to_its_exact_value(device, dtype):
    """All 256 bytes through each decode this device runs (integer ops; on a GPU also the PTX four bytes at a
    time, and the GPU's own conversion where it has one) give torch's e4m3 values exactly, signed zeros and
    subnormals included; the two NaN bytes, which no encoder writes, give +-480 from the bits."""
    from engine.ops.triton.attention import fp8_native
    b = torch.arange(256, dtype=torch.uint8, device=device)
    want = b.view(torch.float8_e4m3fn).float()
    want[[0x7F, 0xFF]] = torch.tensor([480.0, -480.0], device=device)
    modes = [(False, False)] + ([(False, True)] if device == "cuda" else []) + \
        ([(True, False)] if fp8_native(torch.device(device)) else [])
    for native, packed in modes:
        out = torch.empty(256, dtype=dtype, device=device)
        _decode_all_kernel[(1,)](b, out, NATIVE=native, PACKED=packed, num_warps=1)
        got, ref = out.float(), want.to(dtype).float()
        nan = [0x7F, 0xFF] if native else []
        keep = torch.ones(256, dtype=torch.bool, device=device)
        keep[nan] = False
        assert torch.equal(got[keep], ref[keep]), (native, packed, (got != ref).nonzero().flatten().tolist())
        assert torch.equal(torch.signbit(got[keep]), torch.signbit(ref[keep])), (native, packed)
