"""Megatron-style tensor-parallel linear layers (vLLM's names). Each rank holds a slice of every projection:

  ColumnParallelLinear        weight split along the output dimension: each rank computes its columns of y.
  MergedColumnParallelLinear  several column-parallel projections of one input fused (gate/up): each rank holds
                              its slice of every one, side by side.
  QKVParallelLinear           q, k, v fused, split by heads. With more ranks than KV heads, a KV head is
                              replicated on every rank whose q heads read it.
  RowParallelLinear           weight split along the input dimension (its input is a column-parallel layer's
                              per-rank output): the partial sums are all-reduced, the bias added once after.

The rank and size come from engine.distributed.parallel_state when the layer is built. At TP=1 every layer is
the plain projection: the parameter shapes of an unsharded model and no collective. How the weights are stored
and multiplied (float, WNA16, fp8 blocks) is the layer's `quant_method` (engine.model.quantization.layers);
`checkpoint_ranges` says which rows and columns of each checkpoint tensor this rank loads.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import kv_heads_per_rank
from engine.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from engine.errors import ModelLoadError
from engine.model.quantization.config import QuantizationConfig
from engine.model.quantization.layers import linear_method

Range = tuple[int, int] | None   # (start, length) in a checkpoint tensor's dimension; None: all of it


class LinearBase(nn.Module):
    """`input_size` and `output_sizes` are this rank's; `names` are the checkpoint layers of the output shards
    (they choose the quantization scheme and name the layer in errors)."""
    input_is_parallel = False

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, quant: QuantizationConfig | None,
                 names: list[str]):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.in_features, self.output_sizes = input_size, list(output_sizes)
        self.out_features = sum(self.output_sizes)
        self.names = names
        self.quant_method = linear_method(quant.scheme_for_shards(names) if quant is not None else None)
        self.quant_method.create_weights(self)
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def shard_slice(self, index: int | None) -> slice:
        """This rank's rows (of the output dimension) that output shard `index` fills; None: all of them."""
        if index is None:
            return slice(0, self.out_features)
        start = sum(self.output_sizes[:index])
        return slice(start, start + self.output_sizes[index])

    def checkpoint_ranges(self, index: int | None) -> tuple[Range, Range]:
        """(output range, input range) of checkpoint layer `index` that this rank holds."""
        raise NotImplementedError

    def tp_error(self, what: str) -> ModelLoadError:
        """A layout this layer cannot take at this tensor_parallel_size."""
        return ModelLoadError(f"{self.names[0]}: {what} at tensor_parallel_size {self.tp_size}",
                              code="tensor_parallel")

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, index: int | None, name: str) -> None:
        """Copy this rank's slice of a float checkpoint tensor (already cut by checkpoint_ranges) into `param`."""
        dst = param.data if param is self.bias and self.input_is_parallel else param.data[self.shard_slice(index)]
        if dst.shape != tensor.shape:
            raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                                 + (f" (this rank's share at tensor_parallel_size {self.tp_size})"
                                    if self.tp_size > 1 else ""), code="shape_mismatch")
        dst.copy_(tensor)


def _split(size: int, tp_size: int, what: str, names: list[str]) -> int:
    if size % tp_size:
        raise ModelLoadError(f"{names[0]}: {what} {size} does not split over tensor_parallel_size {tp_size}",
                             code="tensor_parallel")
    return size // tp_size


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool, quant: QuantizationConfig | None,
                 names: list[str]):
        tp = get_tp_size()
        super().__init__(input_size, [_split(output_size, tp, "output size", names)], bias, quant, names)

    def checkpoint_ranges(self, index: int | None) -> tuple[Range, Range]:
        size = self.output_sizes[index or 0]
        return (self.tp_rank * size, size), None


class MergedColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, quant: QuantizationConfig | None,
                 names: list[str]):
        tp = get_tp_size()
        LinearBase.__init__(self, input_size, [_split(s, tp, "output size", names) for s in output_sizes], bias,
                            quant, names)


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool, quant: QuantizationConfig | None, names: list[str]):
        tp = get_tp_size()
        self.head_size = head_size
        self.num_heads = _split(total_num_heads, tp, "attention heads", names)
        self.num_kv_heads = kv_heads_per_rank(total_num_kv_heads, tp)
        # Ranks per KV head: 1 when the KV heads split, tp / total_num_kv_heads when they are replicated.
        self.num_kv_head_replicas = max(1, tp // total_num_kv_heads)
        q, kv = self.num_heads * head_size, self.num_kv_heads * head_size
        LinearBase.__init__(self, hidden_size, [q, kv, kv], bias, quant, names)

    def checkpoint_ranges(self, index: int | None) -> tuple[Range, Range]:
        if index == 0:
            return (self.tp_rank * self.output_sizes[0], self.output_sizes[0]), None
        kv_start = self.tp_rank // self.num_kv_head_replicas * self.num_kv_heads * self.head_size
        return (kv_start, self.output_sizes[index]), None


class RowParallelLinear(LinearBase):
    input_is_parallel = True

    def __init__(self, input_size: int, output_size: int, bias: bool, quant: QuantizationConfig | None,
                 names: list[str]):
        tp = get_tp_size()
        super().__init__(_split(input_size, tp, "input size", names), [output_size], bias, quant, names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        out = tensor_model_parallel_all_reduce(self.quant_method.apply(self, x, None))
        return out if self.bias is None else out + self.bias

    def checkpoint_ranges(self, index: int | None) -> tuple[Range, Range]:
        return None, (self.tp_rank * self.in_features, self.in_features)
