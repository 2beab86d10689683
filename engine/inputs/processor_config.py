"""Where a vision model's image-processor settings live and what they say about image sizes. No torch: the
launcher's memory sum (app/memory_estimate.py) reads the same bounds the engine's ImageProcessor resizes to."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import read_model_json
from engine.errors import ModelLoadError

DEFAULT_MIN_PIXELS = 65_536          # preprocessor_config.json size.shortest_edge (an area, despite the name)
DEFAULT_MAX_PIXELS = 16_777_216      # size.longest_edge (4096x4096); servers cap it far lower


def image_processor_config(path: str | Path) -> dict[str, Any]:
    """preprocessor_config.json, or the image_processor entry of processor_config.json, where transformers 5 saves
    a processor's parts together."""
    directory = Path(path)
    if (directory / "processor_config.json").is_file() and not (directory / "preprocessor_config.json").is_file():
        cfg = read_model_json(path, "processor_config.json", "a vision model needs it")
        cfg = cfg.get("image_processor") if isinstance(cfg, dict) else None
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{directory / 'processor_config.json'} has no image_processor entry, and "
                                 f"there is no preprocessor_config.json: a vision model needs one of them")
        return cfg
    return read_model_json(path, "preprocessor_config.json", "a vision model needs it (or transformers 5's "
                           "processor_config.json with an image_processor entry)")


def pixel_bounds(cfg: dict[str, Any], min_pixels: int | None = None,
                 max_pixels: int | None = None) -> tuple[int, int]:
    """(min, max) pixels of a resized image. Top-level min_pixels/max_pixels keys win over `size` (as in
    transformers); the arguments win over both (the server's cap)."""
    size = cfg.get("size") or {}
    lo = min_pixels or cfg.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
    hi = max_pixels or cfg.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
    return int(lo or DEFAULT_MIN_PIXELS), int(hi or DEFAULT_MAX_PIXELS)
