"""mm_processor_kwargs: the processor settings a request (or the server, --mm-processor-kwargs) gives, with
transformers' names and meanings for Qwen3-VL.

- Images: `min_pixels`, `max_pixels` (one image's pixel budget after resizing), or `size` {shortest_edge,
  longest_edge} for both.
- Videos: `fps` (frames sampled per second of the clip; for a list of frames, their rate, which sets their
  timestamps), `num_frames` (exactly this many instead), `min_frames`, `max_frames`, and `size` (the pixel
  budget of all sampled frames together).

A request may lower the server's pixel and frame bounds, not raise them: they size its memory.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine.errors import InvalidInputError
from engine.inputs.image_processor import ImageProcessor
from engine.inputs.video_processor import VIDEO_KWARGS

IMAGE_KWARGS = ("min_pixels", "max_pixels", "size")
ACCEPTED = tuple(dict.fromkeys(IMAGE_KWARGS + VIDEO_KWARGS))


def check_mm_processor_kwargs(kwargs: Any, param: str = "mm_processor_kwargs") -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidInputError(f"{param} must be an object", param=param)
    unknown = sorted(set(kwargs) - set(ACCEPTED))
    if unknown:
        raise InvalidInputError(f"{param} does not take {unknown}; it takes {', '.join(ACCEPTED)}", param=param)
    return kwargs


def image_bounds(kwargs: dict[str, Any]) -> tuple[int | None, int | None]:
    """(min_pixels, max_pixels) the kwargs set for images, None where they say nothing."""
    size = kwargs.get("size") if isinstance(kwargs.get("size"), dict) else {}
    return kwargs.get("min_pixels", size.get("shortest_edge")), kwargs.get("max_pixels", size.get("longest_edge"))


def image_processor_for(base: ImageProcessor, kwargs: dict[str, Any], param: str) -> ImageProcessor:
    """The server's image processor with a request's pixel bounds."""
    lo, hi = image_bounds(kwargs)
    if lo is None and hi is None:
        return base
    for name, value in (("min_pixels", lo), ("max_pixels", hi)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InvalidInputError(f"{param}.{name} must be a positive integer, got {value!r}",
                                    param=f"{param}.{name}")
    if hi is not None and hi > base.max_pixels:
        raise InvalidInputError(f"{param}.max_pixels is {hi}, over this server's {base.max_pixels}",
                                param=f"{param}.max_pixels")
    try:
        return replace(base, min_pixels=lo if lo is not None else min(base.min_pixels, hi),
                       max_pixels=hi if hi is not None else base.max_pixels)
    except ValueError as e:
        raise InvalidInputError(f"{param}: {e}", param=param) from None
