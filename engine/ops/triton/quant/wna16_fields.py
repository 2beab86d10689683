"""Unpacking the 4-/8-bit fields of a packed int32 tile (docs/QUANT_LAYOUTS.md: the int32 at packed row r of column
n holds k = r * PACK + j in bits [BITS * j, BITS * (j + 1))) without int-to-float conversions, for the 4-bit
kernels: wna16_gemv.py, wna16_gemm.py, wna16_dequant.py.

Fields as floats: a BITS-wide field q moved to mantissa bits [P, P + BITS) of 1.0f (0x3F800000, one LOP3 with the
mask) reads as v = 1 + q * 2**(P - 23).
- GEMM (`plane`): w = v * s' + c with s' = s * 2**(23 - P), c = -(2**(23 - P) + z) * s is (q - z) * s in one FMA
  (v * s' is exact inside the FMA; c is exact in float32 for P >= 11 with fp16 scales and integer z), then
  x.dtype for the dot. 4-bit fields: nibbles 0-2 from q << 11 at P = 11, 15, 19; 3-4 in place at P = 12, 16; 5-7
  from q >> 9 at P = 11, 15, 19 (two shifts per 8 weights). 8-bit: each byte shifted to P = 15.
- GEMV (`gemv_field`, `field_scaled`): v_j times x_j * c_j gives c_j x_j + q_j x_j; the GEMV subtracts the
  c_j x_j and zero-point terms once per step.
- Dequantize (`dequant_plane`): an integer q < 2**23 ORed into the bits of 2**23 is the float 2**23 + q.
(Instruction counts per weight, from the sm90 SASS of the compiled kernels, are in docs/perf-log.md.)
"""
from __future__ import annotations

import triton
import triton.language as tl

ONE_BITS = 0x3F800000   # float32 bits of 1.0
MAGIC = tl.constexpr(0x4B000000)   # float32 bits of 2**23: OR in an integer < 2**23 and it is 2**23 + q
MAGIC_F = tl.constexpr(8388608.0)


@triton.jit
def _raw(src, P: tl.constexpr, BITS: tl.constexpr, one):
    """1 + q * 2**(P - 23) for the BITS-bit field q at bits [P, P + BITS) of src. `one` holds the bits of 1.0 in a
    register (a kernel argument): with the mask as the immediate, AND and OR are one LOP3 (two immediates would
    take two)."""
    return ((src & (((1 << BITS) - 1) << P)) | one).to(tl.float32, bitcast=True)


@triton.jit
def _field(src, P: tl.constexpr, BITS: tl.constexpr, s, zs, one):
    """(q - z) * s for the field at bits [P, P + BITS) of src; s and zs = z * s in float32."""
    v = _raw(src, P, BITS, one)
    sp = s * (1 << (23 - P))
    return tl.fma(v, sp, -(sp + zs))


@triton.jit
def plane(q, j: tl.constexpr, BITS: tl.constexpr, s, zs, one):
    """Dequantized plane j of packed tile q: the weights at k = row * PACK + j."""
    if BITS == 4:
        if j < 3:
            w = _field(q << 11, 11 + 4 * j, 4, s, zs, one)
        elif j < 5:
            w = _field(q, 4 * j, 4, s, zs, one)
        else:
            w = _field(q >> 9, 4 * j - 9, 4, s, zs, one)
    else:
        if j < 2:
            w = _field(q << (15 - 8 * j), 15, 8, s, zs, one)
        else:
            w = _field(q >> (8 * j - 15), 15, 8, s, zs, one)
    return w


@triton.jit
def gemv_field(q, j: tl.constexpr, BITS: tl.constexpr, one):
    """Plane j of packed tile q as v = 1 + q_j / c_j, one LOP3 (_raw, c_j = 2**(23 - P)): 4-bit nibbles 2i and
    2i + 1 share one shift and land at P = 15 and 19 (c = 256 and 16); 8-bit fields at P = 15 (c = 256)."""
    if BITS == 4:
        if j < 4:
            src = q << (15 - 4 * (j - j % 2))
        else:
            src = q >> (4 * (j - j % 2) - 15)
        if j % 2 == 0:
            v = _raw(src, 15, 4, one)
        else:
            v = _raw(src, 19, 4, one)
    else:
        if j < 2:
            src = q << (15 - 8 * j)
        else:
            src = q >> (8 * j - 15)
        v = _raw(src, 15, 8, one)
    return v


@triton.jit
def field_scaled(xj, j: tl.constexpr, BITS: tl.constexpr):
    """c_j x_j for plane j, gemv_field's c_j (16 for odd 4-bit planes, else 256): v_j c_j x_j = c_j x_j + q_j x_j."""
    if BITS == 4 and j % 2 == 1:
        return xj * 16.0
    return xj * 256.0


@triton.jit
def dequant_plane(q, j: tl.constexpr, BITS: tl.constexpr):
    """Bit-plane j of packed int32 tile q, as float32 values 0 .. 2**BITS - 1 (the dequantize kernel)."""
    v = ((q >> (BITS * j)) & ((1 << BITS) - 1)) | MAGIC
    return v.to(tl.float32, bitcast=True) - MAGIC_F


@triton.jit
def group_params(s_ptr, z_ptr, kp0, kp, offs_n, n_mask, stride_sg, PACK: tl.constexpr, GROUP: tl.constexpr,
                 PER_ROW: tl.constexpr):
    """Scales and zeros for packed rows kp (kp0 the first): [BKP, BN] when a tile spans several groups, else
    [1, BN] (G % PACK == 0, so the PACK values of a packed row share one group)."""
    if PER_ROW:
        off = ((kp * PACK) // GROUP)[:, None].to(tl.int64) * stride_sg + offs_n[None, :]
    else:
        off = (((kp0 * PACK) // GROUP).to(tl.int64) * stride_sg + offs_n)[None, :]
    s = tl.load(s_ptr + off, mask=n_mask[None, :], other=0.0).to(tl.float32)
    z = tl.load(z_ptr + off, mask=n_mask[None, :], other=0.0).to(tl.float32)
    return s, z
