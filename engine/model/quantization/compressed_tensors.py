"""compressed-tensors checkpoints, `format: pack-quantized` (llm-compressor's W4A16 / W8A16): `weight_packed` int32
[N, K / pack] packed along the input dimension (value i of a word at bits [bits*i, bits*(i+1))), each value the
signed integer plus 2**(bits-1); `weight_scale` [N, K / G] ([N, 1] per channel); `weight_zero_point` (asymmetric
only) int32 [N / pack, K / G] packed the same way along the OUTPUT dimension; `weight_shape` [N, K]; and, for
actorder "group", `weight_g_idx` [K]. W = (q - zero_point) * scale in signed or offset form alike."""
from __future__ import annotations

import torch

from engine.errors import ModelLoadError
from engine.model.quantization.config import WNA16Scheme
from engine.model.quantization.weights import LeafLayout, WNA16Weights, unpack_int32_cols
from engine.ops.quant import unpack_int32

LEAVES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


def required(scheme: WNA16Scheme) -> set[str]:
    leaves = {"weight_packed", "weight_scale", "weight_shape"}
    if not scheme.symmetric:
        leaves.add("weight_zero_point")
    if scheme.act_order:
        leaves.add("weight_g_idx")
    return leaves


def layout(leaf: str, scheme: WNA16Scheme) -> LeafLayout:
    g, pack, k_dim = scheme.group_size, 32 // scheme.bits, 1 if scheme.group_size != -1 else None
    return {"weight_packed": LeafLayout(0, 1, 1, pack), "weight_scale": LeafLayout(0, 1, k_dim, g),
            "weight_zero_point": LeafLayout(0, pack, k_dim, g),
            "weight_shape": LeafLayout(None, 1, None, 1, shape_of_weight=True),
            "weight_g_idx": LeafLayout(None, 1, 0, 1, group_index=True)}[leaf]


def convert(t: dict[str, torch.Tensor], scheme: WNA16Scheme, name: str) -> WNA16Weights:
    bits, pack = scheme.bits, 32 // scheme.bits
    n, k = (int(v) for v in t["weight_shape"].tolist())
    if k % pack or n % pack:
        raise ModelLoadError(f"{name}: weight shape {[n, k]} is not a multiple of {pack} (padded packing is not "
                             f"supported)", code="unsupported_quantization")
    groups = 1 if scheme.group_size == -1 else k // scheme.group_size
    expected = {"weight_packed": (n, k // pack), "weight_scale": (n, groups)}
    if not scheme.symmetric:
        expected["weight_zero_point"] = (n // pack, groups)
    if scheme.act_order:
        expected["weight_g_idx"] = (k,)
    for leaf, shape in expected.items():
        if tuple(t[leaf].shape) != shape:
            raise ModelLoadError(f"{name}.{leaf} has shape {list(t[leaf].shape)}, expected {list(shape)} for "
                                 f"compressed-tensors {scheme.describe()}", code="shape_mismatch")
    q = unpack_int32_cols(t["weight_packed"], bits).T
    scales = t["weight_scale"].T
    if scheme.symmetric:
        zeros = torch.full_like(scales, float(1 << (bits - 1)), dtype=torch.float32)
    else:
        zeros = unpack_int32(t["weight_zero_point"], bits).T.float()
    return WNA16Weights(q.to(torch.uint8), scales, zeros, t.get("weight_g_idx"))
