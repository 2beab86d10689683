"""AWQ checkpoints, GEMM version (AutoAWQ): `qweight` int32 [K, N / 8] and `qzeros` int32 [K / G, N / 8], both packed
along the output dimension with the 8 values of a word in AWQ's interleaved order (bits 4i..4i+3 hold output column
8c + ORDER[i]); `scales` fp16 [K / G, N]. W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]."""
from __future__ import annotations

import torch

from engine.errors import ModelLoadError
from engine.model.quantization.config import WNA16Scheme
from engine.model.quantization.weights import LeafLayout, WNA16Weights, unpack_int32_cols

LEAVES = ("qweight", "qzeros", "scales")
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_COLUMN_OF_NIBBLE = torch.tensor(ORDER).argsort()     # nibble index holding output column j of a word


def required(scheme: WNA16Scheme) -> set[str]:
    return set(LEAVES)


def layout(leaf: str, scheme: WNA16Scheme) -> LeafLayout:
    g = scheme.group_size
    return {"qweight": LeafLayout(1, 8, 0, 1), "qzeros": LeafLayout(1, 8, 0 if g != -1 else None, g),
            "scales": LeafLayout(1, 1, 0 if g != -1 else None, g)}[leaf]


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    nibbles = unpack_int32_cols(packed, 4).view(packed.shape[0], packed.shape[1], 8)
    return nibbles[:, :, _COLUMN_OF_NIBBLE.to(packed.device)].reshape(packed.shape[0], -1)


def convert(t: dict[str, torch.Tensor], scheme: WNA16Scheme, name: str) -> WNA16Weights:
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"]
    k, n = qweight.shape[0], qweight.shape[1] * 8
    groups = 1 if scheme.group_size == -1 else k // scheme.group_size
    expected = {"qweight": (k, n // 8), "qzeros": (groups, n // 8), "scales": (groups, n)}
    for leaf, shape in expected.items():
        if tuple(t[leaf].shape) != shape or (leaf != "scales" and t[leaf].dtype != torch.int32):
            raise ModelLoadError(f"{name}.{leaf} is {t[leaf].dtype} {list(t[leaf].shape)}, expected {list(shape)} "
                                 f"for awq gemm {scheme.describe()}", code="shape_mismatch")
    return WNA16Weights(_unpack_awq(qweight).to(torch.uint8), scales, _unpack_awq(qzeros).float())
