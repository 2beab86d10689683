"""Qwen3-VL image preprocessing with Pillow and torch, reproducing transformers' Qwen2VLImageProcessorPil.

An image is resized (bicubic, Pillow) so both sides are multiples of patch*merge = 32 and its area lies within
[min_pixels, max_pixels], scaled to [0, 1], normalized with mean/std, duplicated to temporal_patch_size = 2 frames
and cut into 16x16 patches (engine/ops/pixels.py, through a table of what each 8-bit value becomes). One row of
pixel_values is one patch as (C, T, 16, 16) = 1536 values, and rows come in merge-block order: every 2x2 block of
patches (the ones the merger fuses into one LLM token) is contiguous.
Each arithmetic step happens in the dtype the reference uses, so pixel_values match it bit for bit.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from engine import ops
from engine.errors import ImageError
from engine.inputs.image_io import to_rgb
from engine.inputs.processor_config import (DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, image_processor_config,
                                            pixel_bounds)

MAX_ASPECT_RATIO = 200  # the vision encoder's limit; smart_resize refuses more elongated images


@dataclass(frozen=True)
class ImageProcessor:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS    # servers cap it far lower (one token per 32x32 pixels)
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    def __post_init__(self):
        if self.max_pixels < self.factor ** 2 or self.min_pixels > self.max_pixels:
            raise ValueError(f"image pixel budget [{self.min_pixels}, {self.max_pixels}] is empty or below one "
                             f"{self.factor}x{self.factor} block; raise max_pixels")

    # ---- construction ---------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: dict[str, Any], min_pixels: int | None = None,
                    max_pixels: int | None = None) -> "ImageProcessor":
        """From a preprocessor_config.json dict; `min_pixels`/`max_pixels` as pixel_bounds reads them."""
        lo, hi = pixel_bounds(cfg, min_pixels, max_pixels)
        defaults = cls()
        return cls(
            patch_size=int(cfg.get("patch_size", defaults.patch_size)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", defaults.temporal_patch_size)),
            merge_size=int(cfg.get("merge_size", defaults.merge_size)),
            min_pixels=lo,
            max_pixels=hi,
            image_mean=tuple(float(x) for x in cfg.get("image_mean", defaults.image_mean)),
            image_std=tuple(float(x) for x in cfg.get("image_std", defaults.image_std)),
            rescale_factor=float(cfg.get("rescale_factor", defaults.rescale_factor)),
        )

    @classmethod
    def from_model_dir(cls, path: str | Path, min_pixels: int | None = None,
                       max_pixels: int | None = None) -> "ImageProcessor":
        """From the model's image-processor settings (processor_config.image_processor_config)."""
        return cls.from_config(image_processor_config(path), min_pixels=min_pixels, max_pixels=max_pixels)

    # ---- sizes ----------------------------------------------------------------------------------------------
    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def cache_key(self) -> str:
        """Everything that changes pixel_values for the same image: part of an image's content hash."""
        return (f"qwen2vl/p{self.patch_size}/t{self.temporal_patch_size}/m{self.merge_size}/"
                f"px{self.min_pixels}-{self.max_pixels}/mean{self.image_mean}/std{self.image_std}/"
                f"r{self.rescale_factor!r}")

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """smart_resize: sides rounded to multiples of `factor`, area brought into [min_pixels, max_pixels]
        with the aspect ratio kept as closely as possible."""
        if min(height, width) <= 0:
            raise ImageError(f"image is {width}x{height}: it has no pixels")
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise ImageError(f"image is {width}x{height}, an aspect ratio over {MAX_ASPECT_RATIO}:1; "
                             f"crop or pad it")
        f = self.factor
        h_bar, w_bar = round(height / f) * f, round(width / f) * f
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(f, math.floor(height / beta / f) * f)
            w_bar = max(f, math.floor(width / beta / f) * f)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / f) * f
            w_bar = math.ceil(width * beta / f) * f
        return h_bar, w_bar

    def grid_thw(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) in patches for an image of this size; a still image is one temporal patch."""
        h, w = self.resized_size(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    # ---- pixels ---------------------------------------------------------------------------------------------
    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """pixel_values [h*w, C*T*P*P] float32 in merge-block order, and grid_thw (1, h, w) in patches."""
        raw, grid = self.resize(image)
        return self.to_pixel_values(raw), grid

    def resize(self, image: Image.Image | np.ndarray) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """The image in RGB (or RGB pixels as uint8 [H, W, 3]), resized to the patch grid, as uint8 [H, W, 3],
        and grid_thw (1, h, w)."""
        grid_size = self.resized_size(*image_hw(image))
        height, width = grid_size
        if isinstance(image, np.ndarray) and image.shape[:2] == grid_size:
            return torch.from_numpy(image), (1, height // self.patch_size, width // self.patch_size)
        image = to_rgb(Image.fromarray(image) if isinstance(image, np.ndarray) else image)
        if (width, height) != image.size:
            image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
        return torch.from_numpy(np.array(image)), (1, height // self.patch_size, width // self.patch_size)

    def to_pixel_values(self, raw: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """uint8 [H, W, 3] -> rescaled, normalized patch rows in `dtype`; runs on the tensor's device (CPU, or
        one kernel on the GPU). A video's frame group, uint8 [T, H, W, 3], is normalized with the video
        processor's arithmetic (video_value_table; Qwen3-VL's two processors share mean, std and rescale)."""
        table = (video_value_table if raw.dim() == 4 else _value_table)(
            self.rescale_factor, self.image_mean, self.image_std, raw.device)
        return ops.patchify(raw, table, self.patch_size, self.merge_size, self.temporal_patch_size, dtype)


def image_hw(image: Image.Image | np.ndarray) -> tuple[int, int]:
    return image.shape[:2] if isinstance(image, np.ndarray) else (image.height, image.width)


@functools.lru_cache(maxsize=16)
def _value_table(rescale: float, mean: tuple[float, ...], std: tuple[float, ...], device: torch.device):
    """float32 [C, 256]: what each 8-bit value of each channel becomes, by the reference's arithmetic (rescale
    in float64, rounded to float32 once, then (x - mean) / std in float32). Made once per device."""
    x = (torch.arange(256, dtype=torch.float64) * rescale).to(torch.float32)
    mean_t = torch.tensor(mean, dtype=torch.float32).view(-1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(-1, 1)
    return ((x[None, :] - mean_t) / std_t).to(device)


@functools.lru_cache(maxsize=16)
def video_value_table(rescale: float, mean: tuple[float, ...], std: tuple[float, ...], device: torch.device):
    """float32 [C, 256]: each 8-bit value as the video processor's fused rescale + normalize makes it: mean and
    std divided by the rescale factor in float32, then (x - mean') / std' in float32."""
    mean_t = (torch.tensor(mean, dtype=torch.float32) * (1.0 / rescale)).view(-1, 1)
    std_t = (torch.tensor(std, dtype=torch.float32) * (1.0 / rescale)).view(-1, 1)
    x = torch.arange(256, dtype=torch.float32)
    return ((x[None, :] - mean_t) / std_t).to(device)
