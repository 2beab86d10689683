"""One linear layer's (or fused shard's) quantized weights in the in-memory layout, as the format converters
produce them from checkpoint tensors, and the packing helpers they share."""
from __future__ import annotations

from dataclasses import dataclass

import torch



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
        (n, k), (bn, bk) = self.weight.shape, self.block_size
        scale = self.scale_inv.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
        return (self.weight.float() * scale).to(dtype)


def unpack_int32_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[K // pack, N] int32 packed along K, value k % pack of column n at bits [bits*(k % pack), ...)
    -> [K, N] int32 of unsigned values."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=packed.device, dtype=torch.int32) * bits
    q = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return q.reshape(packed.shape[0] * pack, packed.shape[1])


def unpack_int32_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C // pack] int32 packed along the last dimension, value i of a word at bits [bits*i, bits*(i+1))
    -> [R, C] int32 of unsigned values."""
    return unpack_int32_rows(packed.T, bits).T


def pack_int32_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] unsigned values -> [K // pack, N] int32, value k % pack of column n at bits [bits*(k % pack), ...)."""
    pack = 32 // bits
    k, n = q.shape
    shifts = torch.arange(pack, device=q.device, dtype=torch.int64) * bits
    words = (q.to(torch.int64).view(k // pack, pack, n) << shifts[None, :, None]).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
