"""The model's shape, read from a Hugging Face config.json (or a GGUF's metadata) into one flat dataclass.

Both transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) spellings are read; where a
key is missing the default is the one transformers uses for that model type.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import ModelLoadError
from engine.model.quantization.config import QuantizationConfig
from engine.model.quantization.parse import parse_quantization_config

SUPPORTED_ARCHITECTURES = ("Qwen3VLForConditionalGeneration", "Qwen3ForCausalLM", "LlamaForCausalLM")

# transformers' defaults when a config omits the rope base.
_DEFAULT_ROPE_THETA = {"qwen3_vl_text": 500_000.0, "qwen3": 10_000.0, "llama": 10_000.0}


@dataclass
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: list[int]
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)   # rope_type and its parameters (llama3), minus theta
    mrope_section: list[int] | None = None              # Qwen3-VL: frequencies per (T, H, W) axis
    mrope_interleaved: bool = False
    qk_norm: bool = False                               # Qwen3 family: RMSNorm on q and k per head
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    torch_dtype: str = "float32"
    source_format: str = "safetensors"                  # or "gguf"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    vision: VisionConfig | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    quantization: QuantizationConfig | None = None      # the checkpoint's quantization_config (or --quantization)

    @property
    def is_multimodal(self) -> bool:
        return self.vision is not None

    def kv_heads_per_rank(self, tp_size: int) -> int:
        """The KV heads each tensor-parallel rank holds (and caches)."""
        return kv_heads_per_rank(self.num_key_value_heads, tp_size)

    def kv_bytes_per_token(self, tp_size: int = 1) -> int:
        """Bytes of K and V per token over all layers on one rank, per byte of element size (multiply by the
        dtype's size)."""
        return 2 * self.num_hidden_layers * self.kv_heads_per_rank(tp_size) * self.head_dim

    def verify_tensor_parallel(self, tp_size: int) -> None:
        """Refuse a tensor_parallel_size the model's shape cannot split, naming the sizes that can."""
        problems = self._tensor_parallel_problems(tp_size)
        if problems:
            valid = [n for n in range(1, self.num_attention_heads + 1) if not self._tensor_parallel_problems(n)]
            raise ModelLoadError(f"tensor_parallel_size {tp_size} does not fit this model: {'; '.join(problems)} "
                                 f"(sizes that fit: {', '.join(map(str, valid))})", code="tensor_parallel")

    def _tensor_parallel_problems(self, n: int) -> list[str]:
        if n < 1:
            return ["it must be at least 1"]
        problems = []
        if self.num_attention_heads % n:
            problems.append(f"it does not divide the {self.num_attention_heads} attention heads")
        kv = self.num_key_value_heads
        if kv % n and n % kv:
            problems.append(f"it neither divides the {kv} key-value heads nor is a multiple of them")
        if self.intermediate_size % n:
            problems.append(f"it does not divide intermediate_size {self.intermediate_size}")
        return problems

    # ---- readers -------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}", code="unsupported_architecture")
        text = cfg.get("text_config") or cfg if arch == "Qwen3VLForConditionalGeneration" else cfg
        model_type = text.get("model_type") or cfg.get("model_type", "")
        heads = text["num_attention_heads"]
        theta, scaling = _rope_params(text, model_type)
        mc = cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"],
            num_hidden_layers=text["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=text.get("num_key_value_heads") or heads,
            head_dim=text.get("head_dim") or text["hidden_size"] // heads,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            qk_norm=arch in ("Qwen3VLForConditionalGeneration", "Qwen3ForCausalLM"),
            attention_bias=bool(text.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            torch_dtype=str(text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype")
                            or cfg.get("torch_dtype") or "float32"),
            eos_token_ids=_as_list(text.get("eos_token_id", cfg.get("eos_token_id"))),
            bos_token_id=text.get("bos_token_id", cfg.get("bos_token_id")),
            quantization=parse_quantization_config(cfg.get("quantization_config")
                                                   or text.get("quantization_config")),
        )
        if arch == "Qwen3VLForConditionalGeneration":
            mc.mrope_section = list(scaling.pop("mrope_section", None) or [24, 20, 20])
            mc.mrope_interleaved = bool(scaling.pop("mrope_interleaved", True))
            if sum(mc.mrope_section) != mc.head_dim // 2:
                raise ModelLoadError(f"mrope_section {mc.mrope_section} must sum to head_dim/2 = {mc.head_dim // 2}")
            v = cfg["vision_config"]
            mc.vision = VisionConfig(
                depth=v["depth"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                num_heads=v["num_heads"], patch_size=v["patch_size"], temporal_patch_size=v["temporal_patch_size"],
                spatial_merge_size=v["spatial_merge_size"], out_hidden_size=v["out_hidden_size"],
                num_position_embeddings=v["num_position_embeddings"],
                deepstack_visual_indexes=list(v.get("deepstack_visual_indexes", [])),
                hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"), in_channels=v.get("in_channels", 3))
            mc.image_token_id = cfg.get("image_token_id", 151655)
            mc.video_token_id = cfg.get("video_token_id", 151656)
            mc.vision_start_token_id = cfg.get("vision_start_token_id", 151652)
            mc.vision_end_token_id = cfg.get("vision_end_token_id", 151653)
        rope_type = mc.rope_scaling.get("rope_type", "default")
        if rope_type not in ("default", "llama3"):
            raise ModelLoadError(f"unsupported rope_type {rope_type!r} (supported: default, llama3)")
        return mc

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "ModelConfig":
        mc = cls.from_dict(read_model_json(path, "config.json", "not a Hugging Face model directory"))
        gen_path = Path(path) / "generation_config.json"
        if gen_path.is_file():
            # generation_config.json's eos list (Qwen: <|im_end|> and <|endoftext|>) is what generation stops on.
            gen_eos = _as_list(json.loads(gen_path.read_text()).get("eos_token_id"))
            mc.eos_token_ids = list(dict.fromkeys(mc.eos_token_ids + gen_eos))
        return mc


def kv_heads_per_rank(total_num_kv_heads: int, tp_size: int) -> int:
    """Each rank's share of the KV heads, or one (replicated) when there are more ranks than KV heads."""
    return max(1, total_num_kv_heads // tp_size)


def read_model_json(model_dir: str | Path, name: str, why: str) -> dict:
    """A JSON file of a model directory; a clear ModelLoadError (saying `why` it is needed) if missing or bad."""
    path = Path(model_dir) / name
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no {name}: {why}", code="model_not_found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(i) for i in x] if isinstance(x, (list, tuple)) else [int(x)]


def _rope_params(text: dict, model_type: str) -> tuple[float, dict]:
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or text.get("rope_theta") or _DEFAULT_ROPE_THETA.get(model_type, 10_000.0)
    params.setdefault("rope_type", params.pop("type", "default"))
    return float(theta), params
