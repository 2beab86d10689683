"""The quantized linears' Triton entry points, with the references' signatures (engine/ops/quant.py): flatten x to
[M, K], look the kernel and tiles up in the dispatch table (table.py) for the device's capabilities
(engine/ops/platform.py), launch. `tiles` runs a given KernelChoice instead (benchmarks and tests). Every path
captures in CUDA graphs: launch parameters follow from shapes only, no host syncs.
"""
from __future__ import annotations

import torch

from engine.ops.platform import device_caps
from engine.ops.triton.quant import fp8_w8a8, fp8_weight_only
from engine.ops.triton.quant.table import KernelChoice, Problem, choose_fp8, choose_wna16
from engine.ops.triton.quant.wna16_dequant import wna16_dequant_linear
from engine.ops.triton.quant.wna16_gemm import wna16_gemm
from engine.ops.triton.quant.wna16_gemv import wna16_gemv

WNA16_KERNELS = {"wna16_gemv": wna16_gemv, "wna16_gemm": wna16_gemm, "wna16_dequant": wna16_dequant_linear}


def _flatten(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bits: int, bias: torch.Tensor | None = None,
                 tiles: KernelChoice | None = None) -> torch.Tensor:
    lead, N = x.shape[:-1], qweight.shape[1]
    x2 = _flatten(x)
    M, K = x2.shape
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*lead, N)
    tiles = tiles or choose_wna16(Problem(M, N, K, x.dtype, bits=bits, group_size=group_size),
                                  device_caps(x.device))
    run = WNA16_KERNELS[tiles.kernel]
    out = run(x2, qweight.contiguous(), scales.contiguous(), zeros.contiguous(), group_size, bits, bias, out, tiles)
    return out.reshape(*lead, N)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                     block_size: tuple[int, int], bias: torch.Tensor | None = None,
                     tiles: KernelChoice | None = None) -> torch.Tensor:
    lead, N = x.shape[:-1], weight.shape[0]
    x2 = _flatten(x)
    M, K = x2.shape
    if M == 0:
        return torch.empty((*lead, N), dtype=x.dtype, device=x.device)
    block_size = tuple(block_size)
    caps = device_caps(x.device)
    problem = Problem(M, N, K, x.dtype, block_size=block_size)
    tiles = tiles or choose_fp8(problem, caps)
    if tiles.kernel == "cublas_w8a8":
        y = fp8_w8a8.cublas_w8a8(x2, weight, weight_scale_inv, block_size[1], bias)
        if y is not None:
            return y.reshape(*lead, N)
        tiles = choose_fp8(problem, caps)   # refused: table.CUBLAS_REFUSED now holds this dtype
    if tiles.kernel == "fp8_dequant":
        y = fp8_weight_only.fp8_dequant_linear(x2, weight, weight_scale_inv, block_size, bias, tiles, caps)
        return y.reshape(*lead, N)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if tiles.kernel == "w8a8_one_launch":
        fp8_w8a8.w8a8_one_launch(x2, weight, weight_scale_inv, block_size, bias, out, tiles)
    elif tiles.kernel == "w8a8":
        fp8_w8a8.w8a8_gemm(x2, weight, weight_scale_inv, block_size, bias, out, tiles)
    elif tiles.kernel == "fp8_gemv":
        fp8_weight_only.fp8_gemv(x2, weight, weight_scale_inv, block_size, bias, out, tiles, caps)
    elif tiles.kernel == "fp8_gemm":
        fp8_weight_only.fp8_gemm(x2, weight, weight_scale_inv, block_size, bias, out, tiles, caps)
    else:
        raise ValueError(f"{tiles.kernel} is not an FP8 block kernel")
    return out.reshape(*lead, N)
