"""Engine settings with vLLM's names and meanings, as a dataclass (offline `LLM(...)`) and as CLI flags."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field, fields

DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")


@dataclass
class EngineArgs:
    model: str
    served_model_name: str | None = None
    dtype: str = "auto"                          # auto: checkpoint's dtype on CUDA; CPU: float32 (GGUF: bf16)
    device: str = "auto"                         # auto: cuda when available, else cpu
    max_model_len: int | None = None             # default: the model's context, capped by the KV pool
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    gpu_memory_limit: float | None = None        # GiB the whole engine may take on the GPU (replaces utilization)
    cpu_kv_cache_space: float | None = None      # GiB of KV pool when running on CPU (default: 2, capped by RAM)
    swap_space: float | None = None              # GiB of CPU swap pool (default: 4 on CUDA, 1 on CPU)
    num_gpu_blocks_override: int | None = None
    max_num_batched_tokens: int | None = None    # default: 8192 (at least max_model_len without chunking)
    max_num_seqs: int = 256
    enable_prefix_caching: bool = False
    enforce_eager: bool = False
    load_format: str = "auto"                    # auto | safetensors | gguf | dummy
    quantization: str | None = None              # fp8 | awq | gptq | compressed-tensors (default: the checkpoint's)
    scheduling_policy: str = "fcfs"              # fcfs | priority
    limit_mm_per_prompt: dict = field(default_factory=lambda: {"image": 8})
    mm_processor_kwargs: dict = field(default_factory=dict)   # e.g. {"max_pixels": 1003520}
    encoder_cache_size: int = 16384              # LLM tokens of vision-encoder output kept for reuse
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    allow_remote_media: bool = False             # fetch http(s) image URLs (off: only data: URLs)
    allowed_local_media_path: str | None = None  # serve file:// image URLs from inside this directory
    allow_special_tokens_in_messages: bool = False   # typed <|im_start|> in chat text: a token, not text
    max_pixels_in_flight: int = 160_000_000      # image pixels decoded at once, all requests (429 past it)
    seed: int = 0
    demo_model: bool = False                     # the small text-only default model of run_app.sh

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, not {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.gpu_memory_limit is not None and not 0 < self.gpu_memory_limit < float("inf"):
            raise ValueError(f"gpu_memory_limit is in GiB and must be positive, not {self.gpu_memory_limit}")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(f"unknown load_format {self.load_format!r}")
        if self.quantization is not None:
            from engine.errors import ModelLoadError
            from engine.model.quantization.config import canonical_method
            try:
                canonical_method(self.quantization)
            except ModelLoadError as e:
                raise ValueError(str(e)) from None
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")

    @property
    def batched_tokens_budget(self) -> int:
        """max_num_batched_tokens, or its default: 8192 tokens (never fewer than max_num_seqs)."""
        return self.max_num_batched_tokens or max(8192, self.max_num_seqs)

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})


def add_cli_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = EngineArgs
    p.add_argument("--model", required=True, help="Hugging Face model directory or .gguf file")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: the path's name)")
    p.add_argument("--dtype", default=d.dtype, choices=DTYPES)
    p.add_argument("--device", default=d.device, choices=("auto", "cuda", "cpu"))
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    p.add_argument("--gpu-memory-limit", type=gib, default=None, metavar="GiB",
                   help="GPU memory the whole engine may take (weights, activations, KV cache, CUDA graphs), in GiB, "
                        "e.g. 8 or 12GiB; replaces --gpu-memory-utilization; emulates a card of that size")
    p.add_argument("--cpu-kv-cache-space", type=float, default=None, help="GiB of KV pool on CPU")
    p.add_argument("--swap-space", type=float, default=None, help="GiB of CPU swap space for preempted KV")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--load-format", default=d.load_format, choices=("auto", "safetensors", "gguf", "dummy"))
    p.add_argument("--quantization", "-q", default=None,
                   help="fp8, awq, gptq or compressed-tensors: the checkpoint's method (read from its "
                        "quantization_config; must agree) or, with --load-format dummy, the layout of the random "
                        "weights")
    p.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=("fcfs", "priority"))
    p.add_argument("--limit-mm-per-prompt", type=json.loads, default={"image": 8},
                   help='JSON, e.g. \'{"image": 4}\'')
    p.add_argument("--mm-processor-kwargs", type=json.loads, default={},
                   help='JSON, e.g. \'{"max_pixels": 1003520}\'')
    p.add_argument("--encoder-cache-size", type=int, default=d.encoder_cache_size)
    p.add_argument("--max-image-bytes", type=int, default=d.max_image_bytes)
    p.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels)
    p.add_argument("--allow-remote-media", action="store_true", help="allow http(s) image URLs (off by default)")
    p.add_argument("--allowed-local-media-path", default=None, help="allow file:// image URLs under this dir")
    p.add_argument("--max-pixels-in-flight", type=int, default=d.max_pixels_in_flight,
                   help="image pixels being decoded at once over all requests; an image past it gets 429 "
                        "(default %(default)s: four images at --max-image-pixels)")
    p.add_argument("--allow-special-tokens-in-messages", action="store_true",
                   help="tokenize special-token strings typed in chat messages (<|im_start|>...) as control "
                        "tokens; by default they are text, and only the chat template writes control tokens")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--demo-model", action="store_true", help=argparse.SUPPRESS)
    return p


def gib(text: str) -> float:
    """A size in GiB, as `12`, `12.5` or `12GiB` (GB is refused: cards are sold in GiB, and 12 GB is not 12 GiB)."""
    value = text.strip()
    if value.lower().endswith("gib"):
        value = value[:-3]
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in GiB (e.g. 8, 11.5 or 12GiB)") from None
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be positive and finite")
    return number


def api_key_from_env(cli_value: str | None) -> str | None:
    return cli_value or os.environ.get("VLLM_API_KEY") or None
