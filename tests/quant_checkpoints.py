"""Quantized copies of the tiny checkpoints, packed as each format's public description says (written here
independently of the engine's unpackers), plus the dequantized float32 twin that transformers runs as the oracle.

    awq (AutoAWQ GEMM):  qweight int32 [K, N/8], qzeros int32 [K/G, N/8], packed along N; bits 4i..4i+3 of
                         word c hold column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; scales fp16 [K/G, N]
    gptq (v1):           qweight int32 [K/pack, N] packed along K; qzeros int32 [K/G, N/pack] packed along N,
                         storing zero - 1; scales fp16 [K/G, N]; g_idx int32 [K]
    compressed-tensors:  weight_packed int32 [N, K/pack] of (signed value + 2**(bits-1)), packed along K;
    (pack-quantized)     weight_scale [N, K/G]; weight_zero_point int32 [N/pack, K/G] packed along N (asymmetric);
                         weight_shape [N, K]; weight_g_idx [K] (actorder group)
    fp8 (block-wise):    weight float8_e4m3fn [N, K]; weight_scale_inv float32 [ceil(N/bn), ceil(K/bk)]
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

DECODER_LINEAR = re.compile(r".*layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$")
VISION_LINEAR = re.compile(r"model\.visual\.blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc[12])$")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@dataclass
class Spec:
    """One quantized variant: the format, its parameters, and which layers it leaves in float."""
    method: str                        # awq | gptq | compressed-tensors | fp8
    bits: int = 4
    group_size: int = 128              # -1: per channel
    symmetric: bool = True
    act_order: bool = False
    block_size: tuple[int, int] = (128, 128)
    skip: list[str] = field(default_factory=list)   # regexes of layer names kept in float (also the ignore list)
    quantize_vision: bool = False      # fp8: Qwen's checkpoints quantize the vision blocks too
    seed: int = 0

    def quantizes(self, layer: str) -> bool:
        if any(re.match(p, layer) for p in self.skip):
            return False
        return bool(DECODER_LINEAR.match(layer) or (self.quantize_vision and VISION_LINEAR.match(layer)))


# ---- integer group quantization (shared by awq, gptq, compressed-tensors) ------------------------------------
def group_quantize(w: torch.Tensor, spec: Spec, scale_dtype: torch.dtype, gen: torch.Generator):
    """w [N, K] -> (q [N, K] unsigned ints, scale [N, groups], zero [N, groups] unsigned, g_idx [K] or None)
    with dequantized = (q - zero[:, g_idx]) * scale[:, g_idx]. Under act-order, `gen` is re-seeded per input
    (see write_quantized), so layers reading the same input get the same channel order, as in GPTQ."""
    n, k = w.shape
    g = k if spec.group_size == -1 else spec.group_size
    top = 2 ** spec.bits - 1
    g_idx = torch.arange(k) // g
    if spec.act_order:   # channels quantized in a random order: group j holds the j-th run of g channels
        order = torch.randperm(k, generator=gen)
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[order] = torch.arange(k) // g
    groups = k // g
    scale = torch.empty(n, groups)
    zero = torch.empty(n, groups)
    for j in range(groups):
        cols = w[:, g_idx == j]
        if spec.symmetric:
            s = cols.abs().amax(dim=1) / (2 ** (spec.bits - 1) - 1)
            z = torch.full((n,), 2.0 ** (spec.bits - 1))
        else:
            lo, hi = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            s = (hi - lo) / top
            # gptq v1 stores zero - 1, so a zero point of 0 cannot be written: keep it at 1 or more.
            z = (-lo / s).round().clamp(1, top)
        scale[:, j], zero[:, j] = s, z
    scale = scale.to(scale_dtype)
    q = (w / scale.float()[:, g_idx]).round() + zero[:, g_idx]
    q = q.clamp(0, top).to(torch.int64)
    return q, scale, zero.to(torch.int64), (g_idx if spec.act_order or spec.method == "gptq" else None)


def dequantize(q, scale, zero, g_idx, group_size: int) -> torch.Tensor:
    k = q.shape[1]
    idx = g_idx if g_idx is not None else torch.arange(k) // (k if group_size == -1 else group_size)
    return (q.float() - zero.float()[:, idx]) * scale.float()[:, idx]


def pack_words(values: np.ndarray, bits: int, positions: list[int] | None = None) -> np.ndarray:
    """Pack the last axis, 32 // bits values a word: value i of a word (or value positions[i]) at bits*i."""
    per = 32 // bits
    v = values.astype(np.uint64).reshape(*values.shape[:-1], -1, per)
    if positions is not None:
        v = v[..., positions]
    words = np.zeros(v.shape[:-1], dtype=np.uint64)
    for i in range(per):
        words |= (v[..., i] & np.uint64(2 ** bits - 1)) << np.uint64(bits * i)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def awq_tensors(w, spec, gen) -> tuple[dict, torch.Tensor]:
    q, scale, zero, _ = group_quantize(w, spec, torch.float16, gen)
    t = {"qweight": pack_words(q.T.numpy(), 4, AWQ_ORDER), "qzeros": pack_words(zero.T.numpy(), 4, AWQ_ORDER),
         "scales": scale.T.contiguous()}
    return t, dequantize(q, scale, zero, None, spec.group_size)


def gptq_tensors(w, spec, gen) -> tuple[dict, torch.Tensor]:
    q, scale, zero, g_idx = group_quantize(w, spec, torch.float16, gen)
    t = {"qweight": pack_words(q.numpy(), spec.bits).T.contiguous(),        # along K: pack rows of q.T
         "qzeros": pack_words((zero - 1).T.numpy(), spec.bits), "scales": scale.T.contiguous(),
         "g_idx": g_idx.to(torch.int32)}
    return t, dequantize(q, scale, zero, g_idx, spec.group_size)


def compressed_tensors_tensors(w, spec, gen) -> tuple[dict, torch.Tensor]:
    q, scale, zero, g_idx = group_quantize(w, spec, torch.bfloat16, gen)
    t = {"weight_packed": pack_words(q.numpy(), spec.bits), "weight_scale": scale,
         "weight_shape": torch.tensor(list(w.shape))}
    if not spec.symmetric:
        t["weight_zero_point"] = pack_words(zero.T.numpy(), spec.bits).T.contiguous()
    if spec.act_order:
        t["weight_g_idx"] = g_idx.to(torch.int32)
    return t, dequantize(q, scale, zero, g_idx, spec.group_size)


def fp8_tensors(w, spec, gen) -> tuple[dict, torch.Tensor]:
    n, k = w.shape
    bn, bk = spec.block_size
    scale = torch.empty(-(-n // bn), -(-k // bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max() / 448.0
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    w8 = (w / full).to(torch.float8_e4m3fn)
    return {"weight": w8, "weight_scale_inv": scale}, w8.float() * full


PACKERS = {"awq": awq_tensors, "gptq": gptq_tensors, "compressed-tensors": compressed_tensors_tensors,
           "fp8": fp8_tensors}


# ---- config.json's quantization_config, as each tool writes it -----------------------------------------------
def quantization_config(spec: Spec, kept: list[str], multimodal: bool) -> dict:
    """`kept`: the decoder layers `spec.skip` leaves in float. AutoAWQ, GPTQ and Qwen's fp8 name unquantized
    modules in `modules_to_not_convert` (substrings of module names: "visual" covers the vision tower);
    compressed-tensors in `ignore` (exact names or `re:` patterns)."""
    if spec.quantize_vision:   # Qwen's FP8 checkpoints: vision blocks quantized, the mergers not
        vision = ["model.visual.merger", "model.visual.deepstack_merger_list"]
    else:
        vision = ["visual"] if multimodal else []
    not_convert = ["lm_head", *vision, *kept]
    if spec.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": spec.group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": not_convert}
    if spec.method == "gptq":
        return {"quant_method": "gptq", "bits": spec.bits, "group_size": spec.group_size, "sym": spec.symmetric,
                "desc_act": spec.act_order, "checkpoint_format": "gptq", "true_sequential": True,
                "modules_to_not_convert": not_convert}
    if spec.method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(spec.block_size), "modules_to_not_convert": not_convert}
    weights = {"num_bits": spec.bits, "type": "int", "symmetric": spec.symmetric, "dynamic": False,
               "strategy": "channel" if spec.group_size == -1 else "group",
               "group_size": None if spec.group_size == -1 else spec.group_size,
               "actorder": "group" if spec.act_order else None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head", *(["re:.*visual.*"] if multimodal else []), *("re:" + p for p in spec.skip)],
            "kv_cache_scheme": None}


def write_quantized(src: Path, out_root: Path, spec: Spec) -> tuple[Path, Path]:
    """(quantized checkpoint dir, dequantized float32 dir) for `spec`, from the float checkpoint `src`."""
    quant_dir, float_dir = out_root / "quantized", out_root / "dequantized"
    for d in (quant_dir, float_dir):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors*"))
    state = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(spec.seed)
    quantized, dequantized, kept = {}, {}, []
    for name, tensor in state.items():
        layer = name.removesuffix(".weight")
        if name.endswith(".weight") and spec.quantizes(layer):
            # q/k/v (and gate/up) share their input, hence their act-order: one seed per input.
            shared_input = re.sub(r"\.([qkv]_proj|gate_proj|up_proj)$", ".in", layer)
            gen.manual_seed(spec.seed + sum(map(ord, shared_input)))
            tensors, w = PACKERS[spec.method](tensor.float(), spec, gen)
            quantized.update({f"{layer}.{leaf}": t.contiguous() for leaf, t in tensors.items()})
            dequantized[name] = w.to(tensor.dtype)
        else:
            quantized[name] = dequantized[name] = tensor
            if name.endswith(".weight") and DECODER_LINEAR.match(layer):
                kept.append(layer)
    save_file(quantized, quant_dir / "model.safetensors")
    save_file(dequantized, float_dir / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(spec, kept, "vision_config" in config)
    (quant_dir / "config.json").write_text(json.dumps(config, indent=2))
    return quant_dir, float_dir


def build_qwen3_wide(out_dir: Path, seed: int = 3) -> Path:
    """A tiny Qwen3 with hidden 128 and intermediate 256, so that 128-wide groups fit every projection."""
    import tiny_models

    return tiny_models.build_qwen3(out_dir, seed, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   head_dim=32, tie_word_embeddings=False)
