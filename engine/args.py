"""Engine settings with vLLM's names and meanings, as a dataclass (offline `LLM(...)`) and as CLI flags.

Each field is declared once, with its default and its help: add_cli_args() turns the fields into the flags of
`python -m engine` (--max-num-seqs for max_num_seqs), taking the flag's type from the annotation. The server's
own settings (engine/server/cli.py) are declared the same way.
"""
from __future__ import annotations

import argparse
import json
import os
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")
DEVICES = ("auto", "cuda", "cpu")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
SCHEDULING_POLICIES = ("fcfs", "priority")
# vLLM's values for an fp8 cache with e4m3 elements; fp8_e5m2 (and fp8_inc, fp8_ds_mla) are not implemented.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


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


def flag(default: Any = MISSING, *, default_factory: Any = MISSING, help: str | None = None, **cli: Any) -> Any:
    """A field that is also a CLI flag: its help, any short aliases (`-q`), a flag name other than the field's
    (`option`) and argparse keywords (choices, action, type) travel in the field's metadata."""
    return field(default=default, default_factory=default_factory, metadata={"help": help, "cli": cli})


@dataclass
class EngineArgs:
    model: str = flag(help="Hugging Face model directory or .gguf file")
    served_model_name: str | None = flag(None, help="model name in the API (default: the path's name)")
    dtype: str = flag("auto", choices=DTYPES,
                      help="auto: the checkpoint's dtype on CUDA; on CPU float32 (a GGUF: bfloat16)")
    device: str = flag("auto", choices=DEVICES, help="auto: cuda when available, else cpu")
    max_model_len: int | None = flag(None, help="default: the model's context, capped by the KV pool")
    block_size: int = flag(16, help="tokens per KV cache block (a power of two)")
    gpu_memory_utilization: float = flag(0.9, help="share of the GPU's memory the engine may use, KV pool included")
    gpu_memory_limit: float | None = flag(
        None, type=gib, metavar="GiB",
        help="GPU memory the whole engine may take (weights, activations, KV cache, CUDA graphs), in GiB, "
             "e.g. 8 or 12GiB; replaces --gpu-memory-utilization; emulates a card of that size")
    cpu_kv_cache_space: float | None = flag(None, help="GiB of KV pool on CPU")
    swap_space: float | None = flag(None, help="GiB of CPU swap space for preempted KV")
    num_gpu_blocks_override: int | None = flag(None, help="KV pool size in blocks, instead of profiling")
    max_num_batched_tokens: int | None = flag(None, help="tokens per step (default: 8192, at least max_num_seqs)")
    max_num_seqs: int = flag(256, help="requests per step")
    kv_cache_dtype: str = flag(
        "auto", choices=KV_CACHE_DTYPES,
        help="auto: K and V in the model dtype; fp8 (= fp8_e4m3): stored as float8_e4m3fn with scale 1.0, half the "
             "bytes per token (twice the KV pool), at a small accuracy cost. Checkpoints with k_scale/v_scale are "
             "refused")
    enable_prefix_caching: bool = flag(False, action=argparse.BooleanOptionalAction,
                                       help="reuse the KV blocks of a prompt prefix seen before")
    enforce_eager: bool = flag(False, help="no CUDA graphs: every step runs op by op")
    cpu_embeddings: bool = flag(
        False, help="keep the token-embedding table in page-locked host memory instead of on the GPU (a step reads "
                    "only its tokens' rows, over PCIe): frees its GPU memory for the KV cache, 1.24 GB for "
                    "Qwen3-VL-8B in bf16. No effect on the CPU, nor for a model whose lm_head shares the table "
                    "(tie_word_embeddings: a warning says so)")
    quantize_lm_head: bool = flag(
        False, help="the lm_head's weights in 8 bits (groups of 128 along the hidden size, weight-only): half the bytes "
                    "a decode step reads for them (1.24 GB -> 0.66 GB for Qwen3-VL-8B). Logits move slightly; greedy "
                    "tokens can change where two candidates nearly tie (BENCHMARKS.md measures how often)")
    load_format: str = flag("auto", choices=LOAD_FORMATS,
                            help="auto: a .gguf file or a directory of safetensors, as the path says; safetensors and "
                                 "gguf state it (a path of the other kind is refused); dummy: random weights")
    quantization: str | None = flag(
        None, aliases=("-q",),
        help="fp8, awq, gptq or compressed-tensors: the checkpoint's method (read from its quantization_config; "
             "must agree) or, with --load-format dummy, the layout of the random weights")
    scheduling_policy: str = flag("fcfs", choices=SCHEDULING_POLICIES,
                                  help="priority: a request's `priority` field, lower runs sooner")
    limit_mm_per_prompt: dict = flag(default_factory=lambda: {"image": 8, "video": 2},
                                     help='JSON, images and videos counted apart, e.g. \'{"image": 4, "video": 1}\'')
    mm_processor_kwargs: dict = flag(
        default_factory=dict, help='JSON: image and video processor defaults, transformers\' names, e.g. '
                                   '\'{"max_pixels": 1003520, "fps": 1, "max_frames": 64}\' (a request\'s own '
                                   'mm_processor_kwargs may lower them)')
    encoder_cache_size: int = flag(16384, help="LLM tokens of vision-encoder output kept for reuse")
    max_image_bytes: int = flag(20 * 1024 * 1024, help="larger images are refused before decoding")
    max_image_pixels: int = flag(40_000_000, help="larger images are refused before decoding")
    max_video_mb: float = flag(64.0, help="larger videos are refused before decoding")
    max_video_seconds: float = flag(1200.0, help="longer videos (by their header) are refused before decoding")
    max_video_frames: int = flag(36_000, help="videos of more frames (by their header) are refused before decoding")
    video_decode_timeout_s: float = flag(30.0, help="a video whose decode takes longer is refused (413)")
    allow_remote_media: bool = flag(False, help="allow http(s) image and video URLs (off by default)")
    allowed_local_media_path: str | None = flag(None, help="allow file:// image and video URLs under this dir")
    allow_special_tokens_in_messages: bool = flag(
        False, help="tokenize special-token strings typed in chat messages (<|im_start|>...) as control tokens; "
                    "by default they are text, and only the chat template writes control tokens")
    max_pixels_per_request: int = flag(
        80_000_000, help="image pixels one request's images may decode to; past it 413 (default %(default)s: two "
                         "images at --max-image-pixels; at most --max-pixels-in-flight)")
    max_pixels_in_flight: int = flag(
        160_000_000, help="image pixels being decoded at once over all requests; an image past it gets 429 "
                          "(default %(default)s: four images at --max-image-pixels)")
    max_prompt_text_mb: float = flag(
        8.0, help="MB (UTF-8) of prompt text in one request, counted before it is rendered or tokenized; past it "
                  "413 (default %(default)s; at most --max-prompt-text-mb-in-flight)")
    max_prompt_text_mb_in_flight: float = flag(
        32.0, help="MB of prompt text being rendered and tokenized at once over all requests; a prompt past it "
                   "gets 429 (default %(default)s)")
    tensor_parallel_size: int = flag(
        1, aliases=("-tp",),
        help="number of tensor-parallel ranks: the engine process and N-1 worker processes, each holding 1/N of "
             "the weights and KV heads (one GPU per rank, cuda:0..N-1; on CPU any N, over gloo)")
    seed: int = flag(0, help="seed of the engine's random state (vLLM's --seed): the same requests in the same "
                             "order sample the same tokens after a restart; a request's own seed still wins")
    speculative_config: dict | None = flag(
        None, help='JSON, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4}\' (prompt_lookup_min/max) '
                   'or \'{"method": "eagle3", "num_speculative_tokens": 3, "model": "DIR"}\'; disable_by_batch_size')
    demo_model: bool = flag(False, help=argparse.SUPPRESS)   # the small text-only default model of run_app.sh

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not "
                             f"{self.kv_cache_dtype!r} (fp8 means fp8_e4m3; fp8_e5m2 is not supported)")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, not {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.gpu_memory_limit is not None and not 0 < self.gpu_memory_limit < float("inf"):
            raise ValueError(f"gpu_memory_limit is in GiB and must be positive, not {self.gpu_memory_limit}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {self.load_format!r}")
        # The path picks the reader; a stated format that disagrees with it is a mistake, not a hint to ignore.
        gguf_path = str(self.model).endswith(".gguf")
        if self.load_format in ("gguf", "safetensors") and (self.load_format == "gguf") != gguf_path:
            raise ValueError(f"load_format {self.load_format} does not match the model path {self.model!r}: "
                             f"gguf reads a .gguf file, safetensors a model directory (auto picks by the path)")
        if self.quantization is not None:
            from engine.errors import ModelLoadError
            from engine.model.quantization.config import canonical_method
            try:
                canonical_method(self.quantization)
            except ModelLoadError as e:
                raise ValueError(str(e)) from None
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        unknown = set(self.limit_mm_per_prompt) - {"image", "video"}
        if unknown or not all(isinstance(v, int) and v >= 0 for v in self.limit_mm_per_prompt.values()):
            raise ValueError(f"limit_mm_per_prompt takes counts for image and video, not {self.limit_mm_per_prompt}")
        # A request alone on the server must fit in the in-flight budgets, or it would get 429 for ever.
        if not 0 < self.max_pixels_per_request <= self.max_pixels_in_flight:
            raise ValueError(f"max_pixels_per_request must be in (0, max_pixels_in_flight = "
                             f"{self.max_pixels_in_flight}], not {self.max_pixels_per_request}")
        if not 0 < self.max_prompt_text_mb <= self.max_prompt_text_mb_in_flight:
            raise ValueError(f"max_prompt_text_mb must be in (0, max_prompt_text_mb_in_flight = "
                             f"{self.max_prompt_text_mb_in_flight:g}], not {self.max_prompt_text_mb:g}")
        from engine.spec_decode.config import SpeculativeConfig
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a whole number of ranks, at least 1, not "
                             f"{self.tensor_parallel_size!r}")

    @property
    def batched_tokens_budget(self) -> int:
        """max_num_batched_tokens, or its default: 8192 tokens (never fewer than max_num_seqs)."""
        return self.max_num_batched_tokens or max(8192, self.max_num_seqs)

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> "EngineArgs":
        return from_cli(cls, ns)


def from_cli(cls: type, ns: argparse.Namespace) -> Any:
    """The dataclass `cls` from the parsed flags (its own fields only: one parser holds several dataclasses')."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in vars(ns).items() if k in names})


def add_cli_args(p: Any, cls: type = EngineArgs) -> Any:
    """One flag per field of the dataclass `cls`, added to `p` (a parser or an argument group, returned); a bool
    is a switch, a dict is JSON, int and float parse as such."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        cli = dict(f.metadata.get("cli", {}))
        aliases = cli.pop("aliases", ())
        option = cli.pop("option", "--" + f.name.replace("_", "-"))
        kwargs = {"help": f.metadata.get("help"), "dest": f.name, **cli}
        if f.default is not MISSING:
            kwargs["default"] = f.default
        elif f.default_factory is not MISSING:
            kwargs["default"] = f.default_factory()
        else:
            kwargs["required"] = True
        kind = _flag_type(hints[f.name])
        if kind is bool:
            kwargs.setdefault("action", "store_true")
        elif kind is dict:
            kwargs.setdefault("type", json.loads)
        elif kind in (int, float):
            kwargs.setdefault("type", kind)
        p.add_argument(option, *aliases, **kwargs)
    return p


def _flag_type(annotation: Any) -> type:
    """int for `int | None`, and so on."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def api_key_from_env(cli_value: str | None) -> str | None:
    return cli_value or os.environ.get("VLLM_API_KEY") or None
