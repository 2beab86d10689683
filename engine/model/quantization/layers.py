"""How a linear layer stores and multiplies its weights: a `quant_method` per layer (vLLM's pattern), chosen by
the checkpoint's quantization scheme. The parallel layer (engine.model.linear) owns the sizes (this rank's),
the bias and the collectives; the method creates the weight parameters on it (the layouts of
docs/QUANT_LAYOUTS.md), multiplies, and loads one output shard's converted weights.

A fused projection (q/k/v, gate/up) holds its shards side by side along the output dimension: rows of a float
or fp8 weight and of its scale blocks, columns of qweight/scales/zeros. Under tensor parallelism a layer holds
this rank's slice: column-parallel layers a slice of the output dimension, row-parallel ones a slice of the input
dimension in whole groups (WNA16) or blocks (fp8), which the loader reads from the checkpoint. The forward passes
are device work only (no host syncs, fixed shapes), so they run inside CUDA graphs."""
from __future__ import annotations

import math

import torch
from torch import nn

from engine import ops
from engine.errors import ModelLoadError
from engine.model.quantization.config import Fp8BlockScheme, Scheme, WNA16Scheme
from engine.model.quantization.weights import Fp8Weights, WNA16Weights
from engine.ops.quant import pack_int32


def linear_method(scheme: Scheme | None):
    if isinstance(scheme, WNA16Scheme):
        return WNA16LinearMethod(scheme)
    if isinstance(scheme, Fp8BlockScheme):
        return Fp8BlockLinearMethod(scheme)
    return UnquantizedLinearMethod()


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class UnquantizedLinearMethod:
    """weight [out, in] in the model dtype, as nn.Linear holds it; on the CPU a bf16 weight is repacked after
    loading into oneDNN's blocked layout (ops.prepack_linear_weight: the same products, without a reorder per
    call)."""

    def create_weights(self, layer: nn.Module) -> None:
        layer.weight = _frozen(torch.empty(layer.out_features, layer.in_features))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        packed = ops.prepack_linear_weight(layer.weight.data)
        if packed is not None:
            layer.weight = _frozen(packed)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return ops.linear(x, layer.weight, bias)


class WNA16LinearMethod:
    """N-bit integer weights, packed along K as ops.wna16_linear takes them (qweight, scales, zeros on the
    layer). Under act-order the input channels are permuted once at load so that groups are contiguous, and
    `perm` applies the same order to x."""

    def __init__(self, scheme: WNA16Scheme):
        self.scheme = scheme
        self.bits = scheme.bits

    def create_weights(self, layer: nn.Module) -> None:
        in_features, scheme, pack = layer.in_features, self.scheme, 32 // self.bits
        sharded_k = layer.input_is_parallel and layer.tp_size > 1
        # Per channel: one group over the input this rank holds (the scale is the same along all of K).
        self.group_size = in_features if scheme.group_size == -1 else scheme.group_size
        if in_features % self.group_size or self.group_size % pack:
            what = (f"input size {in_features} is not a multiple of group size {self.group_size} (or the group of "
                    f"{pack} packed values)")
            if sharded_k:
                raise layer.tp_error(f"this rank's {what}")
            raise ModelLoadError(f"{layer.names[0]}: {what}", code="unsupported_quantization")
        if scheme.act_order and sharded_k:
            raise layer.tp_error("act-order weights (desc_act / actorder group) put each group's input channels "
                                 "anywhere along the input dimension, so the layer cannot split along it")
        for size in layer.output_sizes:
            if size % pack and layer.tp_size > 1:
                raise layer.tp_error(f"an output shard of {size} per rank is not a multiple of the {pack} values "
                                     f"packed in a word")
        groups, n = in_features // self.group_size, layer.out_features
        layer.qweight = _frozen(torch.empty(in_features // pack, n, dtype=torch.int32))
        layer.scales = _frozen(torch.empty(groups, n))
        layer.zeros = _frozen(torch.empty(groups, n))
        layer.perm = _frozen(torch.empty(in_features, dtype=torch.int64)) if scheme.act_order else None
        layer.perm_loaded = False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing: load_shard repacks each shard as it arrives."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.perm is not None:
            x = x.index_select(-1, layer.perm)
        return ops.wna16_linear(x, layer.qweight, layer.scales, layer.zeros, self.group_size, self.bits, bias)

    @torch.no_grad()
    def load_shard(self, layer: nn.Module, index: int | None, w: WNA16Weights, name: str) -> None:
        """This rank's part of checkpoint layer `name` (output shard `index`), as the loader read it."""
        cols = layer.shard_slice(index)
        expected = (layer.in_features, cols.stop - cols.start)
        if tuple(w.q.shape) != expected:
            raise ModelLoadError(f"{name} holds a {list(w.q.shape)} (input x output) weight, expected "
                                 f"{list(expected)}", code="shape_mismatch")
        q = w.q
        if w.g_idx is not None:
            q = q[self._input_order(layer, w.g_idx, name)]
        layer.qweight[:, cols] = pack_int32(q, self.bits).to(layer.qweight.device)
        layer.scales[:, cols] = w.scales.to(layer.scales)
        layer.zeros[:, cols] = w.zeros.to(layer.zeros)

    def _input_order(self, layer: nn.Module, g_idx: torch.Tensor, name: str) -> torch.Tensor:
        """The permutation that makes `g_idx`'s groups contiguous (the identity for plain checkpoints, whose
        g_idx is k // G); every shard of a fused layer shares one, as they share their input."""
        g_idx = g_idx.to(device=layer.qweight.device, dtype=torch.int64)
        contiguous = torch.arange(layer.in_features, device=g_idx.device) // self.group_size
        if torch.equal(g_idx, contiguous):
            order = contiguous.new_tensor(range(layer.in_features))
        else:
            order = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[order], contiguous):
                raise ModelLoadError(f"{name}.g_idx does not give every group {self.group_size} input channels",
                                     code="shape_mismatch")
        if layer.perm is None:
            if not torch.equal(order, contiguous.new_tensor(range(layer.in_features))):
                raise ModelLoadError(f"{name} is stored in activation order (g_idx) but the config says "
                                     f"desc_act/actorder is off", code="unsupported_quantization")
            return order
        if layer.perm_loaded and not torch.equal(layer.perm, order):
            raise ModelLoadError(f"{name}: the shards of one fused layer have different act-order permutations",
                                 code="unsupported_quantization")
        layer.perm.copy_(order)
        layer.perm_loaded = True
        return order

    @torch.no_grad()
    def init_dummy(self, layer: nn.Module, gen: torch.Generator) -> None:
        """Random weights of realistic scale (std about 0.02), zero points mid-range."""
        info = torch.iinfo(torch.int32)
        layer.qweight.random_(info.min, info.max, generator=gen)
        layer.scales.fill_(0.04 / (1 << (self.bits - 1)))
        layer.zeros.fill_(float(1 << (self.bits - 1)))
        if layer.perm is not None:
            layer.perm.copy_(torch.randperm(layer.in_features, generator=gen, device=layer.perm.device))
        if layer.bias is not None:
            layer.bias.zero_()


class Fp8BlockLinearMethod:
    """e4m3 weights [N, K] with one scale per (bn, bk) block. Shards whose sizes are not multiples of the
    checkpoint's bn keep their exact scales with a finer row block (gcd of bn and the shard sizes), each scale
    row repeated; a rank's slice of a shard may start inside a checkpoint block for the same reason. Split
    along the input dimension, a rank holds whole bk blocks."""

    def __init__(self, scheme: Fp8BlockScheme):
        self.checkpoint_block = scheme.block_size

    def create_weights(self, layer: nn.Module) -> None:
        bn, bk = self.checkpoint_block
        if layer.input_is_parallel and layer.tp_size > 1 and layer.in_features % bk:
            raise layer.tp_error(f"this rank's input size {layer.in_features} is not a multiple of the fp8 "
                                 f"block width {bk}")
        self.block_size = (math.gcd(bn, *layer.output_sizes), bk)
        layer.weight = _frozen(torch.empty(layer.out_features, layer.in_features, dtype=torch.float8_e4m3fn))
        layer.weight_scale_inv = _frozen(torch.empty(-(-layer.out_features // self.block_size[0]),
                                                     -(-layer.in_features // bk), dtype=torch.float32))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing: the kernels take the checkpoint's layout."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return ops.fp8_block_linear(x, layer.weight, layer.weight_scale_inv, self.block_size, bias)

    @torch.no_grad()
    def load_shard(self, layer: nn.Module, index: int | None, w: Fp8Weights, name: str) -> None:
        """`w.scale_inv` holds every row block of the checkpoint layer (the loader cuts only its columns);
        this rank's rows start at checkpoint row `start`."""
        rows = layer.shard_slice(index)
        expected = (rows.stop - rows.start, layer.in_features)
        if tuple(w.weight.shape) != expected:
            raise ModelLoadError(f"{name}.weight has shape {list(w.weight.shape)}, expected {list(expected)}",
                                 code="shape_mismatch")
        n_range = layer.checkpoint_ranges(index)[0]
        start = n_range[0] if n_range is not None else 0
        bn, ckpt_bn = self.block_size[0], self.checkpoint_block[0]
        if w.scale_inv.shape[0] * ckpt_bn < start + expected[0]:
            raise ModelLoadError(f"{name}.weight_scale_inv has {w.scale_inv.shape[0]} row blocks of {ckpt_bn}, "
                                 f"too few for rows up to {start + expected[0]}", code="shape_mismatch")
        # One scale row per local block of bn rows; every local block lies inside one checkpoint block.
        block_rows = torch.arange(start, start + expected[0], bn, device=w.scale_inv.device) // ckpt_bn
        layer.weight[rows] = w.weight.to(layer.weight.device)
        layer.weight_scale_inv[rows.start // bn: rows.stop // bn] = w.scale_inv[block_rows].to(layer.weight_scale_inv)

    @torch.no_grad()
    def init_dummy(self, layer: nn.Module, gen: torch.Generator) -> None:
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen, device=layer.weight.device))
        layer.weight_scale_inv.fill_(0.02)
        if layer.bias is not None:
            layer.bias.zero_()
