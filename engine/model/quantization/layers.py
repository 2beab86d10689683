"""Linear layers over quantized weights, and `make_linear`, which the decoder uses for each projection.

A fused projection (q/k/v, gate/up) holds its shards side by side along the output dimension: columns of
qweight/scales/zeros, rows of the fp8 weight and of its scale blocks. The forward passes are device work only
(no host syncs, fixed shapes), so they run inside CUDA graphs."""
from __future__ import annotations

import math

import torch
from torch import nn

from engine import ops
from engine.errors import ModelLoadError
from engine.model.quantization.config import Fp8BlockScheme, QuantizationConfig, WNA16Scheme
from engine.model.quantization.weights import Fp8Weights, WNA16Weights
from engine.ops.quant import pack_int32


def make_linear(in_features: int, output_sizes: list[int], bias: bool, quant: QuantizationConfig | None,
                names: list[str]) -> nn.Module:
    """The projection whose output shards are the checkpoint layers `names` (sizes `output_sizes`)."""
    scheme = quant.scheme_for_shards(names) if quant is not None else None
    if isinstance(scheme, WNA16Scheme):
        return WNA16Linear(in_features, output_sizes, bias, scheme, names)
    if isinstance(scheme, Fp8BlockScheme):
        return Fp8BlockLinear(in_features, output_sizes, bias, scheme)
    return nn.Linear(in_features, sum(output_sizes), bias=bias)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class _ShardedLinear(nn.Module):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool):
        super().__init__()
        self.in_features, self.output_sizes = in_features, list(output_sizes)
        self.out_features = sum(output_sizes)
        self.bias = _frozen(torch.empty(self.out_features)) if bias else None

    def shard_slice(self, index: int | None) -> slice:
        if index is None:
            return slice(0, self.out_features)
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])


class WNA16Linear(_ShardedLinear):
    """N-bit integer weights, packed along K as ops.wna16_linear takes them. Under act-order the input channels
    are permuted once at load so that groups are contiguous, and `perm` applies the same order to x."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, scheme: WNA16Scheme,
                 names: list[str]):
        super().__init__(in_features, output_sizes, bias)
        self.bits, pack = scheme.bits, 32 // scheme.bits
        self.group_size = in_features if scheme.group_size == -1 else scheme.group_size
        if in_features % self.group_size or self.group_size % pack:
            raise ModelLoadError(f"{names[0]}: input size {in_features} is not a multiple of group size "
                                 f"{self.group_size} (or the group of {pack} packed values)",
                                 code="unsupported_quantization")
        groups, n = in_features // self.group_size, self.out_features
        self.qweight = _frozen(torch.empty(in_features // pack, n, dtype=torch.int32))
        self.scales = _frozen(torch.empty(groups, n))
        self.zeros = _frozen(torch.empty(groups, n))
        self.perm = _frozen(torch.empty(in_features, dtype=torch.int64)) if scheme.act_order else None
        self._perm_loaded = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return ops.wna16_linear(x, self.qweight, self.scales, self.zeros, self.group_size, self.bits, self.bias)

    @torch.no_grad()
    def load_shard(self, index: int | None, w: WNA16Weights, name: str) -> None:
        cols = self.shard_slice(index)
        expected = (self.in_features, cols.stop - cols.start)
        if tuple(w.q.shape) != expected:
            raise ModelLoadError(f"{name} holds a {list(w.q.shape)} (input x output) weight, expected "
                                 f"{list(expected)}", code="shape_mismatch")
        q = w.q
        if w.g_idx is not None:
            q = q[self._input_order(w.g_idx, name)]
        self.qweight[:, cols] = pack_int32(q, self.bits).to(self.qweight.device)
        self.scales[:, cols] = w.scales.to(self.scales)
        self.zeros[:, cols] = w.zeros.to(self.zeros)

    def _input_order(self, g_idx: torch.Tensor, name: str) -> torch.Tensor:
        """The permutation that makes `g_idx`'s groups contiguous (the identity for plain checkpoints, whose
        g_idx is k // G); every shard of a fused layer shares one, as they share their input."""
        g_idx = g_idx.to(device=self.qweight.device, dtype=torch.int64)
        contiguous = torch.arange(self.in_features, device=g_idx.device) // self.group_size
        if torch.equal(g_idx, contiguous):
            order = contiguous.new_tensor(range(self.in_features))
        else:
            order = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[order], contiguous):
                raise ModelLoadError(f"{name}.g_idx does not give every group {self.group_size} input channels",
                                     code="shape_mismatch")
        if self.perm is None:
            if not torch.equal(order, contiguous.new_tensor(range(self.in_features))):
                raise ModelLoadError(f"{name} is stored in activation order (g_idx) but the config says "
                                     f"desc_act/actorder is off", code="unsupported_quantization")
            return order
        if self._perm_loaded and not torch.equal(self.perm, order):
            raise ModelLoadError(f"{name}: the shards of one fused layer have different act-order permutations",
                                 code="unsupported_quantization")
        self.perm.copy_(order)
        self._perm_loaded = True
        return order

    @torch.no_grad()
    def init_dummy(self, gen: torch.Generator) -> None:
        """Random weights of realistic scale (std about 0.02), zero points mid-range."""
        info = torch.iinfo(torch.int32)
        self.qweight.random_(info.min, info.max, generator=gen)
        self.scales.fill_(0.04 / (1 << (self.bits - 1)))
        self.zeros.fill_(float(1 << (self.bits - 1)))
        if self.perm is not None:
            self.perm.copy_(torch.randperm(self.in_features, generator=gen, device=self.perm.device))
        if self.bias is not None:
            self.bias.zero_()


class Fp8BlockLinear(_ShardedLinear):
    """e4m3 weights [N, K] with one scale per (bn, bk) block. Shards whose sizes are not multiples of the
    checkpoint's bn keep their exact scales with a finer row block (gcd of bn and the shard sizes), each scale
    row repeated."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, scheme: Fp8BlockScheme):
        super().__init__(in_features, output_sizes, bias)
        bn, bk = scheme.block_size
        self.checkpoint_bn = bn
        self.block_size = (math.gcd(bn, *output_sizes), bk)
        self.weight = _frozen(torch.empty(self.out_features, in_features, dtype=torch.float8_e4m3fn))
        self.weight_scale_inv = _frozen(torch.empty(-(-self.out_features // self.block_size[0]),
                                                    -(-in_features // bk), dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.fp8_block_linear(x, self.weight, self.weight_scale_inv, self.block_size, self.bias)

    @torch.no_grad()
    def load_shard(self, index: int | None, w: Fp8Weights, name: str) -> None:
        rows = self.shard_slice(index)
        expected = (rows.stop - rows.start, self.in_features)
        if tuple(w.weight.shape) != expected:
            raise ModelLoadError(f"{name}.weight has shape {list(w.weight.shape)}, expected {list(expected)}",
                                 code="shape_mismatch")
        bn = self.block_size[0]
        scale = w.scale_inv.repeat_interleave(self.checkpoint_bn // bn, dim=0)[: expected[0] // bn]
        self.weight[rows] = w.weight.to(self.weight.device)
        self.weight_scale_inv[rows.start // bn: rows.stop // bn] = scale.to(self.weight_scale_inv)

    @torch.no_grad()
    def init_dummy(self, gen: torch.Generator) -> None:
        self.weight.copy_(torch.randn(self.weight.shape, generator=gen, device=self.weight.device))
        self.weight_scale_inv.fill_(0.02)
        if self.bias is not None:
            self.bias.zero_()
