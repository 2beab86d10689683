"""Linear layers over quantized weights (the layouts are in QUANT_CONTRACT.md):

- wna16_linear: N-bit integer weights (4 or 8) in groups along K with a scale and a zero point per group, times
  16-bit activations. One in-memory layout for AWQ, GPTQ and compressed-tensors checkpoints (the loader repacks).
- fp8_block_linear: float8_e4m3fn weights with one inverse scale per (bn, bk) block (Qwen's FP8 checkpoints).

The references dequantize the whole weight and matmul: they are the specification and the CPU path."""
from __future__ import annotations

import torch


def unpack_int32_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[K // pack, N] int32 packed along K in plain order -> [K, N] int32 of unsigned values."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=packed.device, dtype=torch.int32) * bits
    q = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return q.reshape(packed.shape[0] * pack, packed.shape[1])


def wna16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                     bits: int, dtype: torch.dtype) -> torch.Tensor:
    """W [K, N] in `dtype`: (q - zero) * scale of each element's group."""
    q = unpack_int32_rows(qweight, bits).to(dtype)
    z = zeros.to(dtype).repeat_interleave(group_size, dim=0)
    s = scales.to(dtype).repeat_interleave(group_size, dim=0)
    return (q - z) * s


def wna16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, bits: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    dtype = torch.float32 if x.device.type == "cpu" else x.dtype
    w = wna16_dequantize(qweight, scales, zeros, group_size, bits, dtype)
    y = x.to(dtype) @ w
    if bias is not None:
        y = y + bias.to(dtype)
    return y.to(x.dtype)


def fp8_block_dequantize(weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                         block_size: tuple[int, int]) -> torch.Tensor:
    """W [N, K] float32: each e4m3 value times its (bn, bk) block's scale."""
    n, k = weight.shape
    bn, bk = block_size
    s = weight_scale_inv.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return weight.float() * s


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                         block_size: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ fp8_block_dequantize(weight, weight_scale_inv, block_size).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bits: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    return wna16_linear_ref(x, qweight, scales, zeros, group_size, bits, bias)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     block_size: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    return fp8_block_linear_ref(x, weight, weight_scale_inv, block_size, bias)
