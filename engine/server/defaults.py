"""Default sampling parameters for fields a request leaves out.

As vLLM's `--generation-config auto` (its default): the model creator's generation_config.json may set
temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens; those become the defaults, and every
other field keeps vLLM's default. `--generation-config vllm` ignores the file; a directory reads that
directory's generation_config.json instead.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from engine.logger import init_logger

logger = init_logger(__name__)

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0: off (vLLM spells it -1; both are accepted in requests)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None       # None: chat may use all the room left in max_model_len


# generation_config.json key -> (SamplingDefaults field, accepted JSON types)
_KEYS: dict[str, tuple[str, tuple[type, ...]]] = {
    "temperature": ("temperature", (int, float)),
    "top_p": ("top_p", (int, float)),
    "top_k": ("top_k", (int,)),
    "min_p": ("min_p", (int, float)),
    "repetition_penalty": ("repetition_penalty", (int, float)),
    "max_new_tokens": ("max_tokens", (int,)),
}


def load_sampling_defaults(model: str, mode: str) -> SamplingDefaults:
    """The defaults for `--generation-config mode` with `--model model`, logged once at start."""
    defaults = SamplingDefaults()
    if mode == "vllm":
        logger.info("Default sampling parameters: vLLM's (--generation-config vllm): %s", asdict(defaults))
        return defaults
    directory = Path(model) if mode == "auto" else Path(mode)
    path = directory / GENERATION_CONFIG
    if not path.is_file():       # a .gguf model, or a directory without the file
        if mode != "auto":
            logger.warning("--generation-config %s: no %s there; using vLLM's defaults", mode, GENERATION_CONFIG)
        logger.info("Default sampling parameters: vLLM's (no %s): %s", GENERATION_CONFIG, asdict(defaults))
        return defaults
    overrides = _read_overrides(path)
    defaults = replace(defaults, **overrides)
    if overrides:
        logger.info("Default sampling parameters have been overridden by the model's generation config (%s): "
                    "%s. Relaunch with `--generation-config vllm` if this is not intended.", path, overrides)
    logger.info("Default sampling parameters: %s", asdict(defaults))
    return defaults


def _read_overrides(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("cannot read %s (%s); using vLLM's default sampling parameters", path, e)
        return {}
    if not isinstance(config, dict):
        logger.warning("%s is not a JSON object; using vLLM's default sampling parameters", path)
        return {}
    overrides = {}
    for key, (name, types) in _KEYS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            logger.warning("ignoring %s=%r in %s: not a %s", key, value, path, types[-1].__name__)
            continue
        overrides[name] = 0 if name == "top_k" and value < 0 else value
    return overrides
