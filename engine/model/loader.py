"""Building a model and filling its weights: Hugging Face safetensors directories, GGUF files, or random
("dummy") weights for benchmarks. Weights go straight to the target device and dtype."""
from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from engine import load_progress
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.logger import init_logger
from engine.model.quantization.layers import Fp8BlockLinear, WNA16Linear
from engine.model.quantization.loading import QuantizedTensorCollector
from engine.model.quantization.parse import resolve_quantization

logger = init_logger(__name__)

# checkpoint projection -> (our fused parameter, shard). The loader copies each into its slice.
_STACKED = (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
            ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))
_SHARD_INDEX = {None: None, "q": 0, "k": 1, "v": 2, 0: 0, 1: 1}
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def load_model_config(path: str | Path, quantization: str | None = None, load_format: str = "auto") -> ModelConfig:
    """The model's config; `quantization` (--quantization) states or, for dummy weights, picks the method."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist", code="model_not_found")
    if is_gguf(path):
        if quantization is not None:
            raise ModelLoadError(f"--quantization {quantization} does not apply to a GGUF file (its own "
                                 f"quantization is dequantized at load)", code="quantization_mismatch")
        return _gguf_config(path)
    if not path.is_dir():
        raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file", code="model_not_found")
    config = ModelConfig.from_model_dir(path)
    config.quantization = resolve_quantization(config.quantization, quantization, load_format == "dummy")
    return config


def build_model(config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The model's modules on `device` in `dtype` (weights not yet meaningful)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            if config.architecture == "Qwen3VLForConditionalGeneration":
                from engine.model.qwen3_vl import Qwen3VLForConditionalGeneration
                model = Qwen3VLForConditionalGeneration(config, max_positions)
            else:
                from engine.model.decoder import CausalLM
                model = CausalLM(config, max_positions)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def load_weights(model: nn.Module, path: str | Path, load_format: str) -> None:
    start = time.perf_counter()
    if load_format == "dummy":
        _init_dummy(model)
    elif is_gguf(path):
        _load_named(model, _counted(_gguf_weights(Path(path), model.config), model))
    else:
        _load_named(model, _counted(_safetensors_weights(Path(path), next(model.parameters()).device), model))
    load_progress.report("weights loaded", load_progress.WEIGHTS_END)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    quant = model.config.quantization
    logger.info("Loading model weights took %.2f GB and %.2f seconds (%s%s)", nbytes / 1e9,
                time.perf_counter() - start, f"{quant.describe()}; " if quant else "",
                "random dummy weights" if load_format == "dummy" else path)


def _counted(weights: Iterator[tuple[str, torch.Tensor]], model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights as they are read, reported to load_progress against the model's own tensor count (a
    checkpoint may hold a few more or fewer: the fraction is capped, it only has to move)."""
    total = sum(1 for _ in model.state_dict())
    for i, item in enumerate(weights, 1):
        load_progress.weights(i, total)
        yield item


# ---- safetensors ---------------------------------------------------------------------------------------------
def _safetensors_weights(path: Path, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path}", code="missing_weights")
    for name in files:
        if not (path / name).is_file():
            raise ModelLoadError(f"weight shard {name} listed in the index is missing from {path}",
                                 code="missing_weights")
        with safe_open(path / name, framework="pt", device=str(device)) as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


# ---- GGUF (config and tokenizer from metadata, weights dequantized once) -------------------------------------
def _gguf_config(path: Path) -> ModelConfig:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        cfg = dict(load_gguf_checkpoint(str(path))["config"])
    except Exception as e:   # not a GGUF file, truncated, unknown architecture...
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}", code="invalid_gguf") from e
    arch = _GGUF_ARCHITECTURES.get(cfg.get("model_type", ""))
    if arch is None:
        raise ModelLoadError(f"unsupported GGUF architecture {cfg.get('model_type')!r} "
                             f"(supported: {', '.join(_GGUF_ARCHITECTURES)})", code="unsupported_architecture")
    cfg["architectures"] = [arch]
    config = ModelConfig.from_dict(cfg)
    config.source_format = "gguf"
    return config


def _gguf_weights(path: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    arch = {"LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA, "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3}[config.architecture]
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    hf_names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(config.num_hidden_layers):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "input_layernorm", "post_attention_layernorm"):
            hf_names.append(f"model.layers.{i}.{part}.weight")
    to_hf = {}
    for hf in hf_names:
        gguf_name = name_map.get_name(hf[: -len(".weight")])
        if gguf_name:
            to_hf[gguf_name + ".weight"] = hf
    for tensor in gguf.GGUFReader(str(path)).tensors:
        hf = to_hf.get(tensor.name)
        if hf is None:
            continue
        w = torch.from_numpy(gguf.dequantize(tensor.data, tensor.tensor_type).copy())
        if arch == gguf.MODEL_ARCH.LLAMA and (".q_proj." in hf or ".k_proj." in hf):
            heads = config.num_attention_heads if ".q_proj." in hf else config.num_key_value_heads
            w = _unpermute_llama_qk(w, heads)
        yield hf, w


def _unpermute_llama_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores Llama's q/k rows with each head's two rotary halves interleaved (GPT-J layout);
    undo that to get back the checkpoint's rotate-half layout."""
    out = w.shape[0]
    return w.reshape(num_heads, out // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ---- mapping names into the model ----------------------------------------------------------------------------
def _target(name: str, config: ModelConfig) -> tuple[str, object] | None:
    """Checkpoint name -> (our parameter's name, shard of a fused projection or None); None: not ours to load."""
    name = name.replace("model.language_model.", "language_model.", 1)
    if name.startswith("lm_head.") and config.tie_word_embeddings:
        return None
    for part, fused, shard_id in _STACKED:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard_id
    return name, None


def _load_named(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    config = model.config
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    collector = QuantizedTensorCollector(config.quantization) if config.quantization is not None else None
    dtype = model.decoder.embed_tokens.weight.dtype
    filled: dict[str, set] = defaultdict(set)
    vision: list[tuple[str, torch.Tensor]] = []
    dequantized: list[str] = []
    for name, tensor in weights:
        if collector is not None and collector.accepts(name, tensor):
            done = collector.add(name, tensor)
            if done is None or _load_quantized(modules, filled, config, *done):
                continue
            # A layer the model keeps in its dtype (the vision tower, lm_head): dequantized once, here.
            layer, quantized = done
            name, tensor = layer + ".weight", quantized.dequantize(dtype)
            dequantized.append(layer)
        elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            # Cast to the model dtype without its scales, an fp8 weight would load and answer garbage.
            raise ModelLoadError(f"{name} is {str(tensor.dtype).removeprefix('torch.')} but the checkpoint's "
                                 f"config.json has no fp8 quantization_config to say how it is scaled",
                                 code="unsupported_quantization")
        if name.startswith("model.visual."):
            vision.append((name[len("model.visual."):], tensor))
            continue
        target = _target(name, config)
        if target is None or target[0] not in params:
            continue   # tied lm_head; rotary inv_freq buffers saved by old checkpoints
        _copy_shard(params[target[0]], tensor, target[1], config, target[0])
        filled[target[0]].add(target[1])
    if collector is not None:
        collector.check_complete()
    if dequantized:
        logger.info("Dequantized %d quantized layers the model runs in %s (%s%s) at load", len(dequantized),
                    str(dtype).removeprefix("torch."), ", ".join(dequantized[:3]),
                    f" and {len(dequantized) - 3} more" if len(dequantized) > 3 else "")
    if vision:
        loaded = model.visual.load_weights(vision)
        for name in loaded:
            filled["visual." + name].add(None)
    missing = [n for n, p in params.items() if not _complete(n, filled.get(n, set()))]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ModelLoadError(f"checkpoint is missing tensors: {shown}", code="missing_weights")


def _load_quantized(modules: dict[str, nn.Module], filled: dict[str, set], config: ModelConfig, layer: str,
                    weights) -> bool:
    """Put checkpoint layer `layer`'s converted weights into its (shard of a) quantized module, if the model
    holds one there."""
    target = _target(layer + ".weight", config)
    prefix = target[0].rpartition(".")[0] if target else ""
    module = modules.get(prefix)
    if not isinstance(module, (WNA16Linear, Fp8BlockLinear)):
        return False
    module.load_shard(_SHARD_INDEX[target[1]], weights, layer)
    for pname, _ in module.named_parameters():
        if pname != "bias":   # biases are checkpoint tensors of their own
            filled[f"{prefix}.{pname}"].add(target[1])
    return True


def _copy_shard(param: torch.Tensor, tensor: torch.Tensor, shard, config: ModelConfig, name: str) -> None:
    if shard is None:
        rows = slice(None)
    elif shard in ("q", "k", "v"):
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        rows = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}[shard]
    else:
        half = param.shape[0] // 2
        rows = slice(shard * half, (shard + 1) * half)
    dst = param.data[rows]
    if dst.shape != tensor.shape:
        raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}",
                             code="shape_mismatch")
    dst.copy_(tensor)


def _complete(name: str, shards: set) -> bool:
    if ".qkv_proj." in name:
        return shards >= {"q", "k", "v"}
    if ".gate_up_proj." in name:
        return shards >= {0, 1}
    return bool(shards)


def _init_dummy(model: nn.Module) -> None:
    """Random weights of realistic scale: speed does not depend on the values, but NaNs and overflow would."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    quantized = set()
    for prefix, module in model.named_modules():
        if isinstance(module, (WNA16Linear, Fp8BlockLinear)):
            module.init_dummy(gen)
            quantized.update(f"{prefix}.{n}" for n, _ in module.named_parameters())
    for name, p in model.named_parameters():
        if name in quantized:
            continue
        if p.dim() == 1 and "norm" in name:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)
