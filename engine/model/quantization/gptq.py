"""GPTQ checkpoints, v1 format (AutoGPTQ / GPTQModel `checkpoint_format: gptq`): `qweight` int32 [K / pack, N] packed
along the input dimension in plain order; `qzeros` int32 [K / G, N / pack] packed along the output dimension and
stored minus one (the v1 convention); `scales` fp16 [K / G, N]; `g_idx` int32 [K], the group of each input channel
(not contiguous under act-order, desc_act)."""
from __future__ import annotations

import torch

from engine.errors import ModelLoadError
from engine.model.quantization.config import WNA16Scheme
from engine.model.quantization.weights import LeafLayout, WNA16Weights, unpack_int32_cols
from engine.ops.quant import unpack_int32

LEAVES = ("qweight", "qzeros", "scales", "g_idx")


def required(scheme: WNA16Scheme) -> set[str]:
    return set(LEAVES)


def layout(leaf: str, scheme: WNA16Scheme) -> LeafLayout:
    g, pack, k_dim = scheme.group_size, 32 // scheme.bits, 0 if scheme.group_size != -1 else None
    return {"qweight": LeafLayout(1, 1, 0, pack), "qzeros": LeafLayout(1, pack, k_dim, g),
            "scales": LeafLayout(1, 1, k_dim, g), "g_idx": LeafLayout(None, 1, 0, 1, group_index=True)}[leaf]


def convert(t: dict[str, torch.Tensor], scheme: WNA16Scheme, name: str) -> WNA16Weights:
    bits, pack = scheme.bits, 32 // scheme.bits
    qweight, qzeros, scales, g_idx = t["qweight"], t["qzeros"], t["scales"], t["g_idx"]
    k, n = qweight.shape[0] * pack, qweight.shape[1]
    groups = 1 if scheme.group_size == -1 else k // scheme.group_size
    expected = {"qweight": (k // pack, n), "qzeros": (groups, n // pack), "scales": (groups, n), "g_idx": (k,)}
    for leaf, shape in expected.items():
        if tuple(t[leaf].shape) != shape:
            raise ModelLoadError(f"{name}.{leaf} has shape {list(t[leaf].shape)}, expected {list(shape)} for gptq "
                                 f"{scheme.describe()}", code="shape_mismatch")
    # v1 stores zero - 1; a zero point of 0 wraps to all ones and reads back as 2**bits, masked back to 0.
    zeros = (unpack_int32_cols(qzeros, bits) + 1) & ((1 << bits) - 1)
    return WNA16Weights(unpack_int32(qweight, bits).to(torch.uint8), scales, zeros.float(), g_idx)
