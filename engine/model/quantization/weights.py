"""One linear layer's (or fused shard's) quantized weights as the format converters produce them from checkpoint
tensors (unpacked; the layer packs them into the in-memory layouts of docs/QUANT_LAYOUTS.md), and the column
unpacking the converters share."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.ops.quant import dequantize_fp8_block, unpack_int32


@dataclass(frozen=True)
class LeafLayout:
    """Where a checkpoint tensor of a quantized layer keeps the layer's output (N) and input (K) dimensions, and
    how many N or K values one of its entries stands for (a packed word, a group, a block), so that a rank
    reads only its rows of N or columns of K. None: the tensor does not run along that dimension (or is read
    whole along it)."""
    n_dim: int | None
    n_unit: int
    k_dim: int | None
    k_unit: int
    group_index: bool = False      # values are group numbers (g_idx): rebased to the rank's first group
    shape_of_weight: bool = False  # values are the weight's [N, K] (compressed-tensors' weight_shape)


FLOAT_WEIGHT = LeafLayout(0, 1, 1, 1)
FLOAT_BIAS = LeafLayout(0, 1, None, 1)


@dataclass
class WNA16Weights:
    """W[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n], input channels in checkpoint order; `g_idx`
    (act-order checkpoints) gives each input channel's group when groups are not contiguous."""
    q: torch.Tensor                  # [K, N] uint8, unsigned values
    scales: torch.Tensor             # [K // G, N]
    zeros: torch.Tensor              # [K // G, N] float (the zero point as a number)
    g_idx: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype`, the orientation of a float checkpoint's weight."""
        k = self.q.shape[0]
        group = self.g_idx.long() if self.g_idx is not None else \
            torch.arange(k, device=self.q.device) // (k // self.scales.shape[0])
        w = (self.q.float() - self.zeros.float()[group]) * self.scales.float()[group]
        return w.T.to(dtype).contiguous()


@dataclass
class Fp8Weights:
    weight: torch.Tensor             # [N, K] float8_e4m3fn
    scale_inv: torch.Tensor          # [ceil(N / bn), ceil(K / bk)] float32
    block_size: tuple[int, int]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8_block(self.weight, self.scale_inv, self.block_size, dtype)


def unpack_int32_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C // pack] int32 packed along the last dimension, value i of a word at bits [bits*i, bits*(i+1))
    -> [R, C] int32 of unsigned values."""
    return unpack_int32(packed.T, bits).T
