"""Building a model and filling its weights: Hugging Face safetensors directories, GGUF files, or random
("dummy") weights for benchmarks. Weights go straight to the target device and dtype.

Under tensor parallelism each rank reads only its slice of each checkpoint tensor: the layer a tensor goes to
says which rows and columns (checkpoint_ranges), and the tensor's layout says where they are (LeafLayout: a
float weight's, or a quantized format's packed words, groups and blocks). Checkpoint entries are read lazily
(`CheckpointTensor.read(index)`), so safetensors reads only those bytes and GGUF dequantizes only those rows."""
from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine import load_progress
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.logger import init_logger
from engine.distributed.parallel_state import get_tp_size
from engine.model.linear import LinearBase
from engine.model.quantization.layers import UnquantizedLinearMethod
from engine.model.quantization.loading import QuantizedTensorCollector
from engine.model.quantization.parse import resolve_quantization
from engine.model.quantization.weights import FLOAT_BIAS, FLOAT_WEIGHT, LeafLayout

logger = init_logger(__name__)

# checkpoint projection -> (our fused parameter, output shard). The loader copies each into its slice.
_STACKED = (("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1), ("v_proj", "qkv_proj", 2),
            ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                       "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}
Index = tuple[slice, ...] | None   # the part of a checkpoint tensor to read; None: all of it
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
    """The model's modules on `device` in `dtype` (weights not yet meaningful); under tensor parallelism this
    rank's share of them (engine.distributed.parallel_state must be initialized first)."""
    config.verify_tensor_parallel(get_tp_size())
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


def _counted(weights: Iterator[tuple[str, CheckpointTensor]], model: nn.Module) -> Iterator[tuple[str, CheckpointTensor]]:
    """The weights as they are read, reported to load_progress against the model's own tensor count (a
    checkpoint may hold a few more or fewer: the fraction is capped, it only has to move)."""
    total = sum(1 for _ in model.state_dict())
    for i, item in enumerate(weights, 1):
        load_progress.weights(i, total)
        yield item


class CheckpointTensor:
    """One checkpoint entry, read on demand: all of it, or the part `index` selects."""
    dtype: torch.dtype | None

    def read(self, index: Index = None) -> torch.Tensor:
        raise NotImplementedError


class InMemoryTensor(CheckpointTensor):
    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.dtype = tensor, tensor.dtype

    def read(self, index: Index = None) -> torch.Tensor:
        return self.tensor if index is None else self.tensor[index]


class _SafetensorsTensor(CheckpointTensor):
    def __init__(self, f, key: str):
        self.f, self.key = f, key
        self.dtype = _SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype())

    def read(self, index: Index = None) -> torch.Tensor:
        return self.f.get_tensor(self.key) if index is None else self.f.get_slice(self.key)[index]


# ---- safetensors ---------------------------------------------------------------------------------------------
def _safetensors_weights(path: Path, device: torch.device) -> Iterator[tuple[str, CheckpointTensor]]:
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
                yield key, _SafetensorsTensor(f, key)


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


class _GGUFTensor(CheckpointTensor):
    """A GGUF tensor dequantized when read, only the part asked for: GGUF stores a 2-D weight row by row, each
    row in blocks of consecutive columns (32 for the Q4/Q8 types), so a slice of rows, or of columns on block
    bounds, is cut from the raw bytes before dequantizing. Llama's q/k rows come back in the checkpoint's
    rotate-half layout."""
    dtype = torch.float32

    def __init__(self, tensor, unpermute_head_dim: int | None):
        self.tensor, self.unpermute_head_dim = tensor, unpermute_head_dim

    def read(self, index: Index = None) -> torch.Tensor:
        import gguf

        data, kind = self.tensor.data, self.tensor.tensor_type
        rows, cols = (tuple(index) + (slice(None),) * 2)[:2] if index else (slice(None), slice(None))
        if data.ndim == 2:
            data, rows = data[rows], slice(None)
            block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
            if data.dtype != np.uint8:            # float types: one array element per value
                block, block_bytes = 1, 1
            if cols != slice(None) and cols.start % block == 0 and cols.stop % block == 0:
                data, cols = data[:, cols.start // block * block_bytes: cols.stop // block * block_bytes], slice(None)
        w = torch.from_numpy(gguf.dequantize(data, kind).copy())[rows]
        if self.unpermute_head_dim is not None:
            w = _unpermute_llama_qk(w, self.unpermute_head_dim)
        return w if cols == slice(None) else w[:, cols]


def _gguf_weights(path: Path, config: ModelConfig) -> Iterator[tuple[str, CheckpointTensor]]:
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
        qk = arch == gguf.MODEL_ARCH.LLAMA and (".q_proj." in hf or ".k_proj." in hf)
        yield hf, _GGUFTensor(tensor, config.head_dim if qk else None)


def _unpermute_llama_qk(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """llama.cpp stores Llama's q/k rows with each head's two rotary halves interleaved (GPT-J layout);
    undo that to get back the checkpoint's rotate-half layout (head by head: whole heads of rows suffice)."""
    return w.reshape(-1, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ---- mapping names into the model ----------------------------------------------------------------------------
def _target(name: str, config: ModelConfig) -> tuple[str, int | None] | None:
    """Checkpoint name -> (our parameter's name, output shard of a fused projection or None); None: not ours to
    load."""
    name = name.replace("model.language_model.", "language_model.", 1)
    if name.startswith("lm_head.") and config.tie_word_embeddings:
        return None
    for part, fused, shard in _STACKED:
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def _rank_index(module: nn.Module | None, shard: int | None, layout: LeafLayout) -> Index:
    """The part of a checkpoint tensor laid out as `layout` that this rank's `module` holds (None: all)."""
    if get_tp_size() == 1 or not hasattr(module, "checkpoint_ranges"):
        return None
    index = [slice(None)] * 2
    n_range, k_range = module.checkpoint_ranges(shard)
    for dim, unit, rng in ((layout.n_dim, layout.n_unit, n_range), (layout.k_dim, layout.k_unit, k_range)):
        if dim is None or rng is None:
            continue
        start, length = rng
        if start % unit or length % unit:
            raise module.tp_error(f"this rank's {'output' if dim == layout.n_dim else 'input'} channels "
                                  f"{start}..{start + length} do not fall on whole units of {unit} (packed words, "
                                  f"groups or blocks) of the checkpoint's layout")
        index[dim] = slice(start // unit, (start + length) // unit)
    while index and index[-1] == slice(None):
        index.pop()   # a 1-D tensor takes one index (g_idx); an untouched tensor is read whole
    return tuple(index) or None


def _read_quantized_leaf(entry: CheckpointTensor, leaf: str, module: nn.Module, shard: int | None,
                         collector: QuantizedTensorCollector, layer: str) -> torch.Tensor:
    """This rank's part of one tensor of a quantized layer (all of it when `module` is None), with group
    numbers and compressed-tensors' weight_shape made the rank's own."""
    scheme = collector.quant.scheme_for(layer)
    if scheme is None:
        return entry.read()   # collector.add refuses it by name
    layout = collector.format.layout(leaf, scheme)
    tensor = entry.read(_rank_index(module, shard, layout))
    if module is None or get_tp_size() == 1:
        return tensor
    n_range, k_range = module.checkpoint_ranges(shard)
    if layout.group_index and k_range is not None and scheme.group_size != -1:
        tensor = tensor - k_range[0] // scheme.group_size   # the rank's groups count from 0
    if layout.shape_of_weight:
        tensor = tensor.clone()
        for dim, rng in enumerate((n_range, k_range)):
            if rng is not None:
                tensor[dim] = rng[1]
    return tensor


def _is_quantized(module: nn.Module | None) -> bool:
    return isinstance(module, LinearBase) and not isinstance(module.quant_method, UnquantizedLinearMethod)


def _load_named(model: nn.Module, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
    config = model.config
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    collector = QuantizedTensorCollector(config.quantization) if config.quantization is not None else None
    dtype = model.decoder.embed_tokens.weight.dtype
    filled: dict[str, set] = defaultdict(set)
    vision: list[tuple[str, torch.Tensor]] = []
    dequantized: list[str] = []
    unused: list[tuple[str, nn.Module | None]] = []   # checkpoint tensors that match no parameter
    for name, entry in weights:
        target = _target(name, config)
        if target is None:
            continue   # tied lm_head
        module, shard = modules.get(target[0].rpartition(".")[0]), target[1]
        if collector is not None and collector.accepts(name, entry):
            layer, _, leaf = name.rpartition(".")
            quantized_module = _is_quantized(module)
            done = collector.add(name, _read_quantized_leaf(entry, leaf, module if quantized_module else None,
                                                            shard, collector, layer))
            if done is None:
                continue
            if quantized_module:
                module.quant_method.load_shard(module, shard, done[1], layer)
                prefix = target[0].rpartition(".")[0]
                for pname, _ in module.named_parameters():
                    if pname != "bias":   # biases are checkpoint tensors of their own
                        filled[f"{prefix}.{pname}"].add(shard)
                continue
            # A layer the model keeps in its dtype (the vision tower, lm_head): dequantized once, here (read
            # whole, then this rank's part taken like a float weight's).
            name, tensor = layer + ".weight", done[1].dequantize(dtype)
            target = _target(name, config)
            index = _rank_index(module, shard, FLOAT_WEIGHT)
            tensor = tensor if index is None else tensor[index]
            dequantized.append(layer)
        elif entry.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            # Cast to the model dtype without its scales, an fp8 weight would load and answer garbage.
            raise ModelLoadError(f"{name} is {str(entry.dtype).removeprefix('torch.')} but the checkpoint's "
                                 f"config.json has no fp8 quantization_config to say how it is scaled",
                                 code="unsupported_quantization")
        elif name.startswith("model.visual."):
            tensor = entry.read()
        elif target[0] not in params:
            if not name.endswith("rotary_emb.inv_freq"):    # buffers that old checkpoints saved
                unused.append((name, module))
            continue
        else:
            tensor = entry.read(_rank_index(module, shard, FLOAT_BIAS if name.endswith(".bias") else FLOAT_WEIGHT))
        if name.startswith("model.visual."):
            vision.append((name[len("model.visual."):], tensor))
            continue
        if target is None or target[0] not in params:
            continue
        _copy_shard(module, params[target[0]], tensor, shard, target[0])
        filled[target[0]].add(shard)
    if collector is not None:
        collector.check_complete()
    _check_unused(unused)
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


def _check_unused(unused: list[tuple[str, nn.Module | None]]) -> None:
    """A bias for a layer the model built without one (the config did not announce it, as Llama's mlp_bias)
    would be dropped and change every answer: refused. Other tensors that match no parameter (parts the model
    does not build, such as extra heads, or scales of options it does not use) are named in the log."""
    dropped = [name for name, module in unused if module is not None and name.endswith(".bias")]
    if dropped:
        shown = ", ".join(dropped[:4]) + (f" and {len(dropped) - 4} more" if len(dropped) > 4 else "")
        raise ModelLoadError(f"the checkpoint holds {shown}, which the model built from its config.json has no "
                             f"parameter for (an option this engine does not support, such as mlp_bias?)",
                             code="unexpected_weights")
    if unused:
        shown = ", ".join(name for name, _ in unused[:4])
        logger.warning("Ignored %d checkpoint tensors of parts this model does not use: %s%s", len(unused), shown,
                       " ..." if len(unused) > 4 else "")


def _copy_shard(module: nn.Module | None, param: torch.Tensor, tensor: torch.Tensor, shard: int | None,
                name: str) -> None:
    if hasattr(module, "weight_loader"):
        module.weight_loader(param, tensor, shard, name)
        return
    if param.shape != tensor.shape:
        raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}",
                             code="shape_mismatch")
    param.data.copy_(tensor)


def _complete(name: str, shards: set) -> bool:
    if ".qkv_proj." in name:
        return shards >= {0, 1, 2}
    if ".gate_up_proj." in name:
        return shards >= {0, 1}
    return bool(shards)


def _init_dummy(model: nn.Module) -> None:
    """Random weights of realistic scale: speed does not depend on the values, but NaNs and overflow would."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    quantized = set()
    for prefix, module in model.named_modules():
        if _is_quantized(module):
            module.quant_method.init_dummy(module, gen)
            quantized.update(f"{prefix}.{n}" for n, _ in module.named_parameters())
    for name, p in model.named_parameters():
        if name in quantized:
            continue
        if p.dim() == 1 and "norm" in name:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)
