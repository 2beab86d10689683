"""Weight files, read lazily: each checkpoint entry is a CheckpointTensor whose read(index) returns all of it or
only the part `index` selects, so that under tensor parallelism safetensors reads only a rank's bytes and GGUF
dequantizes only its rows. Also the model config a GGUF file carries in its metadata."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                       "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}
Index = tuple[slice, ...] | None   # the part of a checkpoint tensor to read; None: all of it
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class CheckpointTensor:
    """One checkpoint entry, read on demand: all of it, or the part `index` selects."""
    dtype: torch.dtype | None

    def read(self, index: Index = None, host: bool = False) -> torch.Tensor:
        """On the load device, or in host memory with `host` (for a parameter that lives there)."""
        raise NotImplementedError


class _SafetensorsTensor(CheckpointTensor):
    def __init__(self, f, key: str, path: Path, device: torch.device):
        self.f, self.key, self.path, self.device = f, key, path, device
        self.dtype = _SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype())

    def read(self, index: Index = None, host: bool = False) -> torch.Tensor:
        if host and self.device.type != "cpu":
            from safetensors import safe_open

            # The file again, opened for the host: reading through the GPU handle would put the tensor, whole,
            # on the GPU first.
            with safe_open(self.path, framework="pt", device="cpu") as f:
                return _read_safetensors(f, self.key, index)
        return _read_safetensors(self.f, self.key, index)


def _read_safetensors(f, key: str, index: Index) -> torch.Tensor:
    return f.get_tensor(key) if index is None else f.get_slice(key)[index]


# ---- safetensors ---------------------------------------------------------------------------------------------
def safetensors_weights(path: Path, device: torch.device) -> Iterator[tuple[str, CheckpointTensor]]:
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
                yield key, _SafetensorsTensor(f, key, path / name, device)


# ---- GGUF (config and tokenizer from metadata, weights dequantized once) -------------------------------------
def gguf_config(path: Path) -> ModelConfig:
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

    def read(self, index: Index = None, host: bool = False) -> torch.Tensor:
        import gguf   # (always read into host memory: dequantized there)

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


def gguf_weights(path: Path, config: ModelConfig) -> Iterator[tuple[str, CheckpointTensor]]:
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
