"""Writing this step's keys and values into the paged KV cache (Triton version of store_kvcache_ref), and the
fp8 (e4m3fn) encoding and decoding the cache's readers and writers share.

An fp8 cache reaches the kernels as its uint8 view (`kernel_view`) and is encoded and decoded with integer
operations: Triton refuses float8_e4m3fn ("fp8e4nv") on GPUs older than sm_89, and the RTX 30 cards this cache
is for are sm_86. The codec is exact in both directions: encoding rounds to nearest-even with saturation to
+-448, the same values as store_kvcache_ref's clamp-and-cast; decoding yields the e4m3 value itself."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.ops.kv_cache import FP8_KV_DTYPE


def kernel_view(cache: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the tensor a kernel takes for `cache`, whether it holds fp8 bytes)."""
    if cache.dtype == FP8_KV_DTYPE:
        return cache.view(torch.uint8), True
    return cache, False


@triton.jit
def fp8e4m3_to_float(b, DTYPE: tl.constexpr, NATIVE: tl.constexpr, PACKED: tl.constexpr = False):
    """e4m3fn bytes (uint8, or already float8e4nv) -> their values in DTYPE (exact in fp16, bf16 and fp32). NATIVE
    (sm89+): the GPU's own conversion (two values per instruction). Else the byte's exponent and mantissa bits,
    moved into an fp16's (sign to bit 15, the rest shifted left by 7), are an fp16 whose value is the e4m3 value
    / 2^8 for normals and subnormals alike (the exponent biases are 15 and 7); scaling by 2^8 is exact. PACKED
    (CUDA without FP8 conversions: sm80/86) does that for four bytes at a time in PTX (e4m3_bits_ptx), about 2.5
    instructions per value instead of ~7 element by element; the interpreter runs the same bits in Triton's
    integer ops. The NaN bytes (0x7f/0xff), which no encoder here writes, decode as NaN natively and as 480 from
    the bits."""
    if NATIVE:
        f = b.to(tl.float8e4nv, bitcast=True).to(DTYPE)
    elif PACKED:
        f = e4m3_bits_ptx(b, DTYPE)
    else:
        h = b.to(tl.uint16)
        bits = ((h & 0x80) << 8) | ((h & 0x7F) << 7)
        f = (bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0).to(DTYPE)
    return f


# e4m3 bytes -> 16-bit floats, four per sequence (inline_asm_elementwise, pack=4: the bytes arrive in one 32-bit
# register, $2; the values leave in two, $0 and $1). prmt spreads bytes 0/1 (then 2/3) to the high bytes of two
# 16-bit lanes; each lane keeps its sign bit and shifts the 7 exponent-and-mantissa bits right into the float's low
# exponent bits ({shift}); one fma per pair then multiplies by the power of two that the shift leaves out ({scale}:
# exact, subnormals included).
_E4M3_PTX = """{{
.reg .b32 a<2>, m<2>, scale, negzero;
mov.b32 scale, {scale};
mov.b32 negzero, 0x80008000;
prmt.b32 a0, 0, $2, 0x5140;
prmt.b32 a1, 0, $2, 0x7362;
and.b32 m0, a0, 0x7f007f00;
and.b32 m1, a1, 0x7f007f00;
shr.b32 m0, m0, {shift};
shr.b32 m1, m1, {shift};
lop3.b32 m0, m0, 0x80008000, a0, 0xf8;
lop3.b32 m1, m1, 0x80008000, a1, 0xf8;
fma.rn.{type}x2 $0, m0, scale, negzero;
fma.rn.{type}x2 $1, m1, scale, negzero;
}}"""
# bf16: the bits shifted by 4 are the value times 2^-120 (bias 127 against 7); fp16: by 1, times 2^-8 (15 against 7).
E4M3_TO_BF16_PTX = tl.constexpr(_E4M3_PTX.format(shift=4, scale="0x7b807b80", type="bf16"))   # 2^120 twice
E4M3_TO_F16_PTX = tl.constexpr(_E4M3_PTX.format(shift=1, scale="0x5c005c00", type="f16"))     # 2^8 twice


@triton.jit
def e4m3_bits_ptx(b, DTYPE: tl.constexpr):
    """e4m3fn bytes -> exact values through _E4M3_PTX: bf16 for bf16, else fp16 (which holds every e4m3 value)
    converted to DTYPE."""
    if DTYPE == tl.bfloat16:
        f = tl.inline_asm_elementwise(E4M3_TO_BF16_PTX, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        f = tl.inline_asm_elementwise(E4M3_TO_F16_PTX, "=r,=r,r", [b], dtype=tl.float16, is_pure=True,
                                      pack=4).to(DTYPE)
    return f


@triton.jit
def float_to_fp8e4m3(x):
    """Values -> e4m3fn bytes (uint8), rounded to nearest-even, saturated to +-448."""
    x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(x)
    mag = bits & 0x7FFFFFFF
    # Normals (|x| >= 2^-6): round the fp32 mantissa to 3 bits (a carry moves into the exponent), then rebias
    # the exponent from 127 to 7 (120 << 3 in the 8-bit exponent + 3-bit mantissa code).
    rounded = (mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    normal = rounded - (120 << 3)
    # Subnormals: multiples of 2^-9; adding 2^23 rounds |x| * 2^9 to an integer, nearest-even (8 is 2^-6, the
    # smallest normal, whose code is also 8).
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def to_cache(x, cache_ptr, KV_FP8: tl.constexpr):
    """x as cache_ptr's elements hold it: fp8 bytes (KV_FP8) or a plain cast to the cache's dtype."""
    if KV_FP8:
        return float_to_fp8e4m3(x)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_cb, stride_cs, stride_ch,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr):
    # One program per token: all of its kv heads at once (Hk*D = 1024 elements for Qwen3-VL-8B), so each
    # head row is one contiguous 16-byte-vectorised copy. k/v may be strided views of the fused qkv output.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # slot -1 (padding, or KV already cached): every access is masked off, so nothing is read or written.
    valid = slot >= 0
    safe_slot = tl.where(valid, slot, 0)
    dst = (safe_slot // BLOCK_SIZE) * stride_cb + (safe_slot % BLOCK_SIZE) * stride_cs

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = valid & (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    src_k = k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst_off = dst + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(k_cache_ptr + dst_off, to_cache(k, k_cache_ptr, KV_FP8), mask=mask)
    tl.store(v_cache_ptr + dst_off, to_cache(v, v_cache_ptr, KV_FP8), mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hk, D]; caches: [num_blocks, block_size, Hk, D]; slot_mapping: [T] int (-1 = skip)."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, "caches must share one dense layout"
    assert slot_mapping.numel() == num_tokens
    (k_cache, kv_fp8), (v_cache, _) = kernel_view(k_cache), kernel_view(v_cache)
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim), KV_FP8=kv_fp8,
        num_warps=4,
    )
