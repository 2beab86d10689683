"""Linear layers over quantized weights: the torch references (the specification, and the CPU path) and the
public ops, which run the Triton kernels (engine/ops/triton/quant/) on CUDA. docs/QUANT_LAYOUTS.md specifies the
layouts byte by byte.

wna16_linear: 4- or 8-bit integer weights in groups along K, bf16/fp16 activations. qweight int32 [K // pack, N]
packs `pack = 32 // bits` consecutive k of one column, lowest bits first; W[k, n] = (q[k, n] - zeros[g, n]) *
scales[g, n] with g = k // group_size. AWQ, GPTQ and compressed-tensors checkpoints are repacked to this at load.

fp8_block_linear: float8_e4m3fn weight [N, K] with one float32 `weight_scale_inv` per (bn, bk) block;
W[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]. The reference is weight-only (no activation
quantization); on GPUs with FP8 tensor cores the kernel path quantizes activations per token and group of bk
(the checkpoints' dynamic activation scheme), which is why its results differ from the reference by FP8 rounding.
"""
from __future__ import annotations

import torch

from engine.ops.dispatch import use_triton

FP8_E4M3_MAX = 448.0


def _check_wna16(x, qweight, scales, zeros, group_size: int, bits: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"wna16_linear supports 4- and 8-bit weights, got bits={bits}")
    pack = 32 // bits
    K = x.shape[-1]
    if qweight.dtype != torch.int32 or qweight.shape[0] * pack != K:
        raise ValueError(f"qweight must be int32 [K // {pack}, N] for K={K}, got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    if K % group_size or group_size % pack:
        raise ValueError(f"group_size {group_size} must divide K={K} and be a multiple of {pack}")
    want = (K // group_size, qweight.shape[1])
    if tuple(scales.shape) != want or tuple(zeros.shape) != want:
        raise ValueError(f"scales and zeros must be {want}, got {tuple(scales.shape)} and {tuple(zeros.shape)}")


def unpack_int32(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [K // pack, N] -> int32 [K, N] of unsigned values 0 .. 2**bits - 1 (k = row * pack + i)."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=qweight.device, dtype=torch.int32) * bits
    q = (qweight.unsqueeze(1) >> shifts.view(1, pack, 1)) & ((1 << bits) - 1)
    return q.reshape(qweight.shape[0] * pack, qweight.shape[1])


def pack_int32(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int [K, N] of values 0 .. 2**bits - 1 -> int32 [K // pack, N]; the inverse of unpack_int32."""
    pack = 32 // bits
    q = q.to(torch.int64).reshape(q.shape[0] // pack, pack, q.shape[1])
    shifts = torch.arange(pack, device=q.device, dtype=torch.int64) * bits
    packed = (q << shifts.view(1, pack, 1)).sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # two's complement into int32


def dequantize_wna16(qweight, scales, zeros, group_size: int, bits: int, dtype=torch.float32) -> torch.Tensor:
    """The [K, N] weight in `dtype` (computed in float32)."""
    q = unpack_int32(qweight, bits).to(torch.float32)
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=0)
    z = zeros.to(torch.float32).repeat_interleave(group_size, dim=0)
    return ((q - z) * s).to(dtype)


def quantize_wna16(weight: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
    """An [N, K] weight -> (qweight int32 [K // pack, N], float32 scales and zeros [K // group_size, N]) in this
    module's layout: per group of K and column, the range [min, max] (widened to hold 0) in 2**bits - 1 steps,
    with an integer zero point. Round to nearest: each weight is off by at most half a step."""
    N, K = weight.shape
    if K % group_size:
        raise ValueError(f"group_size {group_size} must divide K={K}")
    levels = (1 << bits) - 1
    g = weight.to(torch.float32).t().reshape(K // group_size, group_size, N)
    lo, hi = g.amin(dim=1).clamp(max=0.0), g.amax(dim=1).clamp(min=0.0)
    scales = ((hi - lo) / levels).clamp(min=1e-12)
    zeros = (-lo / scales).round().clamp(0, levels)
    q = (g / scales.unsqueeze(1) + zeros.unsqueeze(1)).round().clamp(0, levels).to(torch.int32)
    return pack_int32(q.reshape(K, N), bits), scales, zeros


def wna16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, bits: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W + bias, W dequantized as the module docstring says. x: [..., K] -> [..., N] in x.dtype."""
    _check_wna16(x, qweight, scales, zeros, group_size, bits)
    compute = torch.float32 if x.device.type == "cpu" else x.dtype
    w = dequantize_wna16(qweight, scales, zeros, group_size, bits, compute)
    y = x.to(compute) @ w
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(x.dtype)


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bits: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    if use_triton(x):
        _check_wna16(x, qweight, scales, zeros, group_size, bits)
        from engine.ops.triton.quant import linear
        return linear.wna16_linear(x, qweight, scales, zeros, group_size, bits, bias)
    return wna16_linear_ref(x, qweight, scales, zeros, group_size, bits, bias)


def _check_fp8(x, weight, weight_scale_inv, block_size) -> None:
    bn, bk = block_size
    N, K = weight.shape
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_block_linear needs a float8_e4m3fn weight, got {weight.dtype}")
    if x.shape[-1] != K:
        raise ValueError(f"x has K={x.shape[-1]} but the weight is [N={N}, K={K}]")
    want = (-(-N // bn), -(-K // bk))
    if tuple(weight_scale_inv.shape) != want or weight_scale_inv.dtype != torch.float32:
        raise ValueError(f"weight_scale_inv must be float32 {want} for blocks {tuple(block_size)}, got "
                         f"{weight_scale_inv.dtype} {tuple(weight_scale_inv.shape)}")


def dequantize_fp8_block(weight, weight_scale_inv, block_size, dtype=torch.float32) -> torch.Tensor:
    """The [N, K] weight in `dtype` (computed in float32)."""
    bn, bk = block_size
    N, K = weight.shape
    s = weight_scale_inv.repeat_interleave(bn, dim=0)[:N].repeat_interleave(bk, dim=1)[:, :K]
    return (weight.to(torch.float32) * s).to(dtype)


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                         block_size: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = (x.float() @ W.T + bias).to(x.dtype): weight-only, activations stay in x's precision."""
    _check_fp8(x, weight, weight_scale_inv, block_size)
    y = x.to(torch.float32) @ dequantize_fp8_block(weight, weight_scale_inv, block_size).T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def quantize_fp8_per_token_group_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, K // group]) with x ~= q * scale per group: the
    dynamic activation quantization of the W8A8 path (scale = amax / 448, at least 1e-10 / 448)."""
    M, K = x.shape
    g = x.to(torch.float32).reshape(M, K // group, group)
    scale = g.abs().amax(dim=-1).clamp(min=1e-10) / FP8_E4M3_MAX
    q = (g / scale.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(M, K), scale


def fp8_block_linear_w8a8_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                              block_size: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the W8A8 kernels compute: activations quantized per token and group of bk, then the exact product of
    the two dequantized operands in float32. Used by the tests to check those kernels tightly."""
    _check_fp8(x, weight, weight_scale_inv, block_size)
    bk = block_size[1]
    x2 = x.reshape(-1, x.shape[-1])
    q, s = quantize_fp8_per_token_group_ref(x2, bk)
    xd = (q.to(torch.float32).reshape(q.shape[0], -1, bk) * s.unsqueeze(-1)).reshape(q.shape)
    y = xd @ dequantize_fp8_block(weight, weight_scale_inv, block_size).T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     block_size: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    if use_triton(x):
        _check_fp8(x, weight, weight_scale_inv, block_size)
        from engine.ops.triton.quant import linear
        return linear.fp8_block_linear(x, weight, weight_scale_inv, tuple(block_size), bias)
    return fp8_block_linear_ref(x, weight, weight_scale_inv, block_size, bias)
