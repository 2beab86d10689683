"""Block-wise FP8 checkpoints (`quant_method: fp8`, Qwen's and DeepSeek's): `weight` in float8_e4m3fn [N, K] and
`weight_scale_inv` [ceil(N / bn), ceil(K / bk)], W = weight * weight_scale_inv of its block."""
from __future__ import annotations

import torch

from engine.errors import ModelLoadError
from engine.model.quantization.config import Fp8BlockScheme
from engine.model.quantization.weights import FLOAT_WEIGHT, Fp8Weights, LeafLayout

LEAVES = ("weight", "weight_scale_inv")


def required(scheme: Fp8BlockScheme) -> set[str]:
    return set(LEAVES)


def layout(leaf: str, scheme: Fp8BlockScheme) -> LeafLayout:
    # The scales are read whole along N: a rank's rows may start inside a block (Fp8BlockLinearMethod.load_shard).
    return FLOAT_WEIGHT if leaf == "weight" else LeafLayout(None, 1, 1, scheme.block_size[1])


def convert(t: dict[str, torch.Tensor], scheme: Fp8BlockScheme, name: str) -> Fp8Weights:
    weight, scale = t["weight"], t["weight_scale_inv"]
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ModelLoadError(f"{name}.weight is {weight.dtype} {list(weight.shape)}; a block-wise fp8 "
                             f"checkpoint stores a 2-D float8_e4m3fn weight", code="shape_mismatch")
    (n, k), (bn, bk) = weight.shape, scheme.block_size
    # A tensor-parallel rank reads its rows of the weight but every row block of the scales: at least n rows.
    if scale.dim() != 2 or scale.shape[0] < -(-n // bn) or scale.shape[1] != -(-k // bk):
        raise ModelLoadError(f"{name}.weight_scale_inv has shape {list(scale.shape)}, expected "
                             f"{[-(-n // bn), -(-k // bk)]} for {bn}x{bk} blocks of a {n}x{k} weight",
                             code="shape_mismatch")
    return Fp8Weights(weight, scale.float(), scheme.block_size)
