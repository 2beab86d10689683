"""Building a model and filling its weights: Hugging Face safetensors directories, GGUF files, or random
("dummy") weights for benchmarks. Weights go straight to the target device and dtype (with --cpu-embeddings the
token-embedding table straight to host memory).

Under tensor parallelism each rank reads only its slice of each checkpoint tensor: the layer a tensor goes to
says which rows and columns (checkpoint_ranges), and the tensor's layout says where they are (LeafLayout: a
float weight's, or a quantized format's packed words, groups and blocks); the files themselves are read by
engine/model/weight_files.py."""
from __future__ import annotations

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
from engine.distributed.parallel_state import get_tp_size
from engine.model.linear import LinearBase
from engine.model.quantization.layers import UnquantizedLinearMethod
from engine.model.quantization.loading import QuantizedTensorCollector
from engine.model.quantization.parse import resolve_quantization
from engine.model.quantization.weights import FLOAT_BIAS, FLOAT_WEIGHT, LeafLayout
from engine.model.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from engine.model.weight_files import CheckpointTensor, Index, gguf_config, gguf_weights, safetensors_weights

logger = init_logger(__name__)

# checkpoint projection -> (our fused parameter, output shard). The loader copies each into its slice.
_STACKED = (("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1), ("v_proj", "qkv_proj", 2),
            ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))
_DUMMY_TABLE_ROWS = 4096   # rows of a vocabulary table drawn at once by dummy loading (32 MB at hidden 4096)


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
        return gguf_config(path)
    if not path.is_dir():
        raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file", code="model_not_found")
    config = ModelConfig.from_model_dir(path)
    config.quantization = resolve_quantization(config.quantization, quantization, load_format == "dummy")
    return config


def build_model(config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device,
                cpu_embeddings: bool = False) -> nn.Module:
    """The model's modules on `device` in `dtype` (weights not yet meaningful); under tensor parallelism this
    rank's share of them (engine.distributed.parallel_state must be initialized first). `cpu_embeddings`: the
    token-embedding table in host memory where that saves GPU memory (embeddings_in_host_memory)."""
    config.verify_tensor_parallel(get_tp_size())
    host_embeddings = embeddings_in_host_memory(cpu_embeddings, config, device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            if config.architecture == "Qwen3VLForConditionalGeneration":
                from engine.model.qwen3_vl import Qwen3VLForConditionalGeneration
                model = Qwen3VLForConditionalGeneration(config, max_positions, host_embeddings)
            else:
                from engine.model.decoder import CausalLM
                model = CausalLM(config, max_positions, host_embeddings)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def embeddings_in_host_memory(cpu_embeddings: bool, config: ModelConfig, device: torch.device) -> bool:
    """Whether --cpu-embeddings puts the token-embedding table in host memory: only on a GPU (on the CPU it is
    in host memory already), and only when lm_head does not share it (tied embeddings: lm_head reads the whole
    table every step, so it stays on the GPU). A launcher may pass the flag for any model: neither case fails."""
    if not cpu_embeddings:
        return False
    if config.tie_word_embeddings:
        logger.warning("--cpu-embeddings saves nothing for this model: its lm_head shares the token-embedding "
                       "table (tie_word_embeddings) and reads all of it every step, so the table stays with the "
                       "other weights")
        return False
    if device.type != "cuda":
        logger.info("--cpu-embeddings changes nothing on the CPU: the token embeddings are in host memory already")
        return False
    return True


def load_weights(model: nn.Module, path: str | Path, load_format: str, device: torch.device,
                 fp8_kv_cache: bool = False, quantize_lm_head: bool = False) -> None:
    """Fill the model built by build_model on `device` (the device is never taken from a parameter: the first
    one may be a token-embedding table kept in host memory). `fp8_kv_cache` (--kv-cache-dtype fp8): a checkpoint
    that carries KV cache scales is refused instead of run with scale 1.0. `quantize_lm_head`
    (--quantize-lm-head): the lm_head's weights become 8-bit once loaded."""
    start = time.perf_counter()
    if load_format == "dummy":
        _init_dummy(model, device)
    elif is_gguf(path):
        _load_named(model, _counted(gguf_weights(Path(path), model.config), model), fp8_kv_cache)
    else:
        _load_named(model, _counted(safetensors_weights(Path(path), device), model), fp8_kv_cache)
    load_progress.report("weights loaded", load_progress.WEIGHTS_END)
    _process_weights_after_loading(model, quantize_lm_head)
    on_device = [p for p in model.parameters() if p.device.type == device.type]
    in_host = [p for p in model.parameters() if p.device.type != device.type]
    quant = model.config.quantization
    logger.info("Loading model weights took %.2f GB and %.2f seconds (%s%s)", _nbytes(on_device) / 1e9,
                time.perf_counter() - start, f"{quant.describe()}; " if quant else "",
                "random dummy weights" if load_format == "dummy" else path)
    if in_host:
        logger.info("Token embeddings in host memory (%.2f GB, --cpu-embeddings; not in the weights above): the GPU "
                    "reads the rows of each step's tokens over PCIe", _nbytes(in_host) / 1e9)


def _process_weights_after_loading(model: nn.Module, quantize_lm_head: bool = False) -> None:
    """The layers' last conversions, once every weight is in place (CPU bf16: oneDNN's blocked layout; the
    lm_head's 8-bit weights)."""
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.quant_method.process_weights_after_loading(module)
    lm_head = getattr(model, "lm_head", None)
    if isinstance(lm_head, ParallelLMHead):
        lm_head.process_weights_after_loading(tied=model.config.tie_word_embeddings, quantize=quantize_lm_head)


def _nbytes(params: list[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _counted(weights: Iterator[tuple[str, CheckpointTensor]], model: nn.Module) -> Iterator[tuple[str, CheckpointTensor]]:
    """The weights as they are read, reported to load_progress against the model's own tensor count (a
    checkpoint may hold a few more or fewer: the fraction is capped, it only has to move)."""
    total = sum(1 for _ in model.state_dict())
    for i, item in enumerate(weights, 1):
        load_progress.weights(i, total)
        yield item


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


KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")   # vLLM's names for per-layer KV cache scales


def _load_named(model: nn.Module, weights: Iterable[tuple[str, CheckpointTensor]],
                fp8_kv_cache: bool = False) -> None:
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
        if fp8_kv_cache and name.endswith(KV_SCALE_SUFFIXES):
            # The fp8 cache stores K and V with scale 1.0; values calibrated against these scales would be
            # stored unscaled, so the checkpoint is refused rather than run differently from its intent.
            raise ModelLoadError(f"the checkpoint carries KV cache scales ({name}); --kv-cache-dtype fp8 "
                                 f"supports only checkpoints without them (scale 1.0). Use --kv-cache-dtype auto",
                                 code="unsupported_quantization")
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
            # A table kept in host memory (--cpu-embeddings) is read there, never through the GPU.
            tensor = entry.read(_rank_index(module, shard, FLOAT_BIAS if name.endswith(".bias") else FLOAT_WEIGHT),
                                host=getattr(module, "in_host_memory", False))
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


def _init_dummy(model: nn.Module, device: torch.device) -> None:
    """Random weights of realistic scale: speed does not depend on the values, but NaNs and overflow would.
    Drawn on `device`; the vocabulary tables (embedding, lm_head) in slices of rows copied into place, so that a
    table in host memory (--cpu-embeddings) never has a whole copy on the GPU and gets the same values."""
    gen = torch.Generator(device=device).manual_seed(0)
    quantized, tables = set(), set()
    for prefix, module in model.named_modules():
        if _is_quantized(module):
            module.quant_method.init_dummy(module, gen)
            quantized.update(f"{prefix}.{n}" for n, _ in module.named_parameters())
        elif isinstance(module, VocabParallelEmbedding):
            tables.add(f"{prefix}.weight")
    for name, p in model.named_parameters():
        if name in quantized:
            continue
        if p.dim() == 1 and "norm" in name:
            p.data.fill_(1.0)
        elif name in tables:
            for rows in p.data.split(_DUMMY_TABLE_ROWS):
                rows.copy_(torch.empty(rows.shape, dtype=rows.dtype, device=device).normal_(0.0, 0.02, generator=gen))
        else:
            p.data.normal_(0.0, 0.02, generator=gen)
