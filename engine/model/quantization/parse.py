"""Reading `quantization_config` (config.json) for each method, refusing by name what we cannot run exactly, and
reconciling it with `--quantization`."""
from __future__ import annotations

from engine.errors import ModelLoadError
from engine.model.quantization.config import (Fp8BlockScheme, QuantizationConfig, WNA16Scheme, canonical_method,
                                              unsupported)


def parse_quantization_config(qc: dict | None) -> QuantizationConfig | None:
    if not qc:
        return None
    method = canonical_method(str(qc.get("quant_method", "")))
    if qc.get("kv_cache_scheme"):
        # Its K/V scales are calibrated for the cache; an fp8 cache with scale 1.0 (--kv-cache-dtype fp8) or a
        # model-dtype cache would both run the model otherwise than it was quantized.
        raise unsupported(f"{method} with a quantized KV cache (kv_cache_scheme): KV cache scales are not "
                          f"supported")
    return {"fp8": _fp8, "awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors}[method](qc)


def resolve_quantization(parsed: QuantizationConfig | None, flag: str | None,
                         dummy: bool) -> QuantizationConfig | None:
    """The checkpoint's config, checked against `--quantization`; for random (dummy) weights the flag alone
    picks the method's usual layout."""
    if flag is None:
        return parsed
    method = canonical_method(flag)
    if parsed is not None:
        if parsed.method != method:
            raise ModelLoadError(f"--quantization {flag} contradicts the checkpoint, whose quantization_config "
                                 f"says {parsed.method}", code="quantization_mismatch")
        return parsed
    if not dummy:
        raise ModelLoadError(f"--quantization {flag} needs a checkpoint quantized with {method}; this one has no "
                             f"quantization_config (quantizing at load is not supported)",
                             code="quantization_mismatch")
    return default_config(method)


def default_config(method: str) -> QuantizationConfig:
    """The layout most published checkpoints of `method` use (random weights for benchmarks)."""
    return parse_quantization_config({
        "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False},
        "compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                           "strategy": "group", "group_size": 128}}}},
    }[method])


def _fp8(qc: dict) -> QuantizationConfig:
    block = qc.get("weight_block_size")
    if not block:
        raise unsupported("fp8 with per-tensor scales (no weight_block_size); only block-wise fp8 is supported")
    if len(block) != 2 or min(block) < 1:
        raise unsupported(f"fp8 weight_block_size {block}")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise unsupported(f"fp8 activation_scheme {qc.get('activation_scheme')!r} (supported: dynamic)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise unsupported(f"fp8 fmt {qc.get('fmt')!r} (supported: e4m3)")
    return QuantizationConfig("fp8", [(["Linear"], Fp8BlockScheme((int(block[0]), int(block[1]))))],
                              *_not_convert(qc))


def _not_convert(qc: dict) -> tuple[list[str], bool]:
    return list(qc.get("modules_to_not_convert") or []), True


def _bits(method: str, bits, allowed: tuple[int, ...]) -> int:
    if bits not in allowed:
        raise unsupported(f"{method} with {bits}-bit weights (supported: "
                          f"{', '.join(f'{b}-bit' for b in allowed)})")
    return int(bits)


def _group(method: str, group) -> int:
    group = int(group if group is not None else -1)
    if group != -1 and (group < 1 or group & (group - 1)):
        raise unsupported(f"{method} group_size {group}")
    return group


def _awq(qc: dict) -> QuantizationConfig:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise unsupported(f"awq version {version!r} (supported: gemm)")
    if not qc.get("zero_point", True):
        raise unsupported("awq without zero points (zero_point: false)")
    bits = _bits("awq", qc.get("bits", qc.get("w_bit", 4)), (4,))
    group = _group("awq", qc.get("group_size", qc.get("q_group_size", 128)))
    return QuantizationConfig("awq", [(["Linear"], WNA16Scheme(bits, group, symmetric=False))],
                              *_not_convert(qc))


def _gptq(qc: dict) -> QuantizationConfig:
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt != "gptq":
        raise unsupported(f"gptq checkpoint_format {fmt!r} (supported: gptq, the v1 format)")
    if qc.get("dynamic"):
        raise unsupported("gptq with per-module `dynamic` overrides")
    bits = _bits("gptq", qc.get("bits", 4), (4, 8))
    group = _group("gptq", qc.get("group_size", 128))
    scheme = WNA16Scheme(bits, group, symmetric=bool(qc.get("sym", True)), act_order=bool(qc.get("desc_act")))
    return QuantizationConfig("gptq", [(["Linear"], scheme)], *_not_convert(qc))


def _compressed_tensors(qc: dict) -> QuantizationConfig:
    if qc.get("sparsity_config") and qc["sparsity_config"].get("format", "dense") != "dense":
        raise unsupported(f"compressed-tensors sparsity format {qc['sparsity_config'].get('format')!r}")
    if qc.get("transform_config"):
        raise unsupported("compressed-tensors with transforms (transform_config)")
    groups = []
    for name, group in (qc.get("config_groups") or {}).items():
        fmt = group.get("format") or qc.get("format")
        if fmt != "pack-quantized":
            raise unsupported(f"compressed-tensors format {fmt!r} in {name} (supported: pack-quantized)")
        groups.append((list(group.get("targets") or []), _ct_scheme(name, group)))
    if not groups:
        raise unsupported("compressed-tensors without config_groups")
    return QuantizationConfig("compressed-tensors", groups, list(qc.get("ignore") or []))


def _ct_scheme(name: str, group: dict) -> WNA16Scheme:
    for act in ("input_activations", "output_activations"):
        a = group.get(act)
        if a:
            raise unsupported(f"compressed-tensors {name}: {act} quantized "
                              f"(W{group.get('weights', {}).get('num_bits')}A{a.get('num_bits')}, "
                              f"{a.get('type', 'int')}); only weight-only schemes are supported")
    w = group.get("weights") or {}
    if w.get("type", "int") != "int":
        raise unsupported(f"compressed-tensors {name}: {w.get('type')} weights (supported: int)")
    if w.get("dynamic"):
        raise unsupported(f"compressed-tensors {name}: dynamic weight quantization")
    bits = _bits(f"compressed-tensors {name}", w.get("num_bits"), (4, 8))
    strategy = w.get("strategy")
    if strategy == "channel":
        group_size = -1
    elif strategy == "group":
        group_size = _group("compressed-tensors", w.get("group_size"))
    else:
        raise unsupported(f"compressed-tensors {name}: weight strategy {strategy!r} (supported: group, channel)")
    actorder = w.get("actorder")
    if actorder not in (None, "group", "weight", "static"):
        raise unsupported(f"compressed-tensors {name}: actorder {actorder!r}")
    # actorder "group" ships weight_g_idx (groups in activation order); "weight" reorders only during
    # calibration and stores plain contiguous groups.
    return WNA16Scheme(bits, group_size, symmetric=bool(w.get("symmetric", True)), act_order=actorder == "group")
