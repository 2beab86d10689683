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

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.logger import init_logger

logger = init_logger(__name__)

# checkpoint projection -> (our fused parameter, shard). The loader copies each into its slice.
_STACKED = (("q_proj", "qkv_proj", "q"), ("k_proj", "qkv_proj", "k"), ("v_proj", "qkv_proj", "v"),
            ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def load_model_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist", code="model_not_found")
    if is_gguf(path):
        return _gguf_config(path)
    if not path.is_dir():
        raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file", code="model_not_found")
    return ModelConfig.from_model_dir(path)


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
        _load_named(model, _gguf_weights(Path(path), model.config))
    else:
        _load_named(model, _safetensors_weights(Path(path), next(model.parameters()).device))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info("Loading model weights took %.2f GB and %.2f seconds (%s)", nbytes / 1e9,
                time.perf_counter() - start, "random dummy weights" if load_format == "dummy" else path)


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
def _load_named(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    filled: dict[str, set] = defaultdict(set)
    vision: list[tuple[str, torch.Tensor]] = []
    for name, tensor in weights:
        if name.startswith("model.visual."):
            vision.append((name[len("model.visual."):], tensor))
            continue
        name = name.replace("model.language_model.", "language_model.", 1)
        if name.startswith("lm_head.") and model.config.tie_word_embeddings:
            continue
        target, shard = name, None
        for part, fused, shard_id in _STACKED:
            if f".{part}." in name:
                target, shard = name.replace(f".{part}.", f".{fused}."), shard_id
                break
        param = params.get(target)
        if param is None:
            continue   # e.g. rotary inv_freq buffers saved by old checkpoints
        _copy_shard(param, tensor, shard, model.config, target)
        filled[target].add(shard)
    if vision:
        loaded = model.visual.load_weights(vision)
        for name in loaded:
            filled["visual." + name].add(None)
    missing = [n for n, p in params.items() if not _complete(n, filled.get(n, set()))]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ModelLoadError(f"checkpoint is missing tensors: {shown}", code="missing_weights")


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
    for name, p in model.named_parameters():
        if p.dim() == 1 and "norm" in name:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)
