"""Qwen3-VL video preprocessing, reproducing transformers' Qwen3VLVideoProcessor and the video half of
Qwen3VLProcessor (the oracle: transformers 5.x).

1. Frames to sample (`sample_indices`): `fps` frames per second of the clip, at least min_frames, at most
   max_frames and the clip's own count, spread evenly over [0, total - 1] and rounded; or exactly `num_frames`.
2. One size for every frame (`resized_size`): smart resize over the whole clip -- sides multiples of 32, and
   frames * height * width brought within [min_pixels, max_pixels] (the processor's `size` shortest/longest
   edge, which for video bound the pixels of all frames together).
3. The resize itself (`resize`): bicubic with antialiasing on uint8, torch's kernel, as torchvision's uint8
   path on the CPU calls it.
4. Frames go in pairs (temporal patch 2; an odd count repeats the last frame): each pair is one frame group
   of (h/32) * (w/32) LLM tokens. The prompt gets, per group, `<{t:.1f} seconds>` (the mean time of its two
   frames) before <|vision_start|><|video_pad|>...<|vision_end|> (`placeholder_text`).
5. Pixel values (`to_pixel_values`): rescale and normalize fused, as the video processor does
   ((x - mean/r) / (std/r) in float32), then patches in merge-block order with the two frames as T.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from engine import ops
from engine.config import read_model_json
from engine.errors import ImageError, InvalidInputError
from engine.inputs.image_processor import video_value_table

MAX_ASPECT_RATIO = 200
# What mm_processor_kwargs may set for videos, server-wide or per request (transformers' names).
VIDEO_KWARGS = ("fps", "num_frames", "max_frames", "min_frames", "size")


@dataclass(frozen=True)
class VideoProcessor:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32         # size.shortest_edge: of all frames together
    max_pixels: int = 768 * 32 * 32         # size.longest_edge
    fps: float = 2.0                        # frames sampled per second of the clip
    num_frames: int | None = None           # exactly this many frames instead (excludes fps)
    min_frames: int = 4
    max_frames: int = 768
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    # ---- construction ---------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "VideoProcessor":
        """From a video_preprocessor_config.json dict (Qwen3VLVideoProcessor's class defaults where it is silent)."""
        d = cls()
        size = cfg.get("size") or {}
        return cls(patch_size=int(cfg.get("patch_size", d.patch_size)),
                   temporal_patch_size=int(cfg.get("temporal_patch_size", d.temporal_patch_size)),
                   merge_size=int(cfg.get("merge_size", d.merge_size)),
                   min_pixels=int(size.get("shortest_edge", d.min_pixels)),
                   max_pixels=int(size.get("longest_edge", d.max_pixels)),
                   fps=float(cfg.get("fps") or d.fps),
                   num_frames=cfg.get("num_frames"),
                   min_frames=int(cfg.get("min_frames", d.min_frames)),
                   max_frames=int(cfg.get("max_frames", d.max_frames)),
                   image_mean=tuple(float(x) for x in cfg.get("image_mean", d.image_mean)),
                   image_std=tuple(float(x) for x in cfg.get("image_std", d.image_std)),
                   rescale_factor=float(cfg.get("rescale_factor", d.rescale_factor)))

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "VideoProcessor":
        """Where transformers looks, in its order: processor_config.json's video_processor entry,
        video_preprocessor_config.json, then preprocessor_config.json (the image processor's file)."""
        directory = Path(path)
        if (directory / "processor_config.json").is_file():
            nested = read_model_json(path, "processor_config.json", "").get("video_processor")
            if isinstance(nested, dict):
                return cls.from_config(nested)
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            if (directory / name).is_file():
                return cls.from_config(read_model_json(path, name, ""))
        return cls()

    def sampling_defaults(self) -> dict[str, float]:
        """What a client needs to predict a clip's frames and tokens (the page's estimate before it sends)."""
        return {"fps": self.fps, "min_frames": self.min_frames, "max_frames": self.max_frames,
                "min_pixels": self.min_pixels, "max_pixels": self.max_pixels}

    def with_kwargs(self, kwargs: dict[str, Any], param: str, cap: "VideoProcessor | None" = None
                    ) -> "VideoProcessor":
        """This processor with mm_processor_kwargs' video settings applied (the others ignored). `cap`: the
        server's processor, whose max_pixels and max_frames a request may lower, not raise."""
        if not kwargs:
            return self
        changes: dict[str, Any] = {}
        if "fps" in kwargs or "num_frames" in kwargs:       # fps and num_frames exclude each other
            changes["fps"] = _number(kwargs.get("fps", self.fps), f"{param}.fps", float, 1e-3, 1e3)
            changes["num_frames"] = None if kwargs.get("num_frames") is None else _number(
                kwargs["num_frames"], f"{param}.num_frames", int, 1, 1 << 20)
        for key in ("max_frames", "min_frames"):
            if key in kwargs:
                changes[key] = _number(kwargs[key], f"{param}.{key}", int, 1, 1 << 20)
        if "size" in kwargs:
            size = kwargs["size"]
            if not isinstance(size, dict) or not set(size) <= {"shortest_edge", "longest_edge"}:
                raise InvalidInputError(f"{param}.size must be {{\"shortest_edge\": pixels, \"longest_edge\": "
                                        f"pixels}}", param=f"{param}.size")
            for key, field in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
                if key in size:
                    changes[field] = _number(size[key], f"{param}.size.{key}", int, 1, 1 << 40)
        out = replace(self, **changes)
        if cap is not None:
            for field, flag in (("max_pixels", "size.longest_edge"), ("max_frames", "max_frames"),
                                ("num_frames", "num_frames")):
                mine, limit = getattr(out, field), getattr(cap, "max_frames" if field == "num_frames" else field)
                if mine is not None and mine > limit:
                    raise InvalidInputError(f"{param}.{flag} is {mine}, over this server's {limit}",
                                            param=f"{param}.{flag}")
        if out.min_pixels > out.max_pixels:
            raise InvalidInputError(f"{param}.size: shortest_edge {out.min_pixels} is over longest_edge "
                                    f"{out.max_pixels}", param=f"{param}.size")
        return out

    # ---- sizes ----------------------------------------------------------------------------------------------
    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def cache_key(self) -> str:
        """What changes a frame group's pixel values beside its pixels: part of its content hash."""
        return (f"qwen3vl-video/p{self.patch_size}/t{self.temporal_patch_size}/m{self.merge_size}/"
                f"mean{self.image_mean}/std{self.image_std}/r{self.rescale_factor!r}")

    def sample_indices(self, total_frames: int, video_fps: float) -> np.ndarray:
        """Which frames of a clip of `total_frames` at `video_fps` go to the model (Qwen3VLVideoProcessor's
        sample_frames)."""
        if self.num_frames is not None:
            count = self.num_frames
        else:
            count = int(total_frames / video_fps * self.fps)
            count = min(max(count, self.min_frames), self.max_frames, total_frames)
        return np.linspace(0, total_frames - 1, count).round().astype(np.int64)

    def resized_size(self, num_frames: int, height: int, width: int) -> tuple[int, int]:
        """The video smart resize: (height, width), multiples of `factor`, with num_frames * h * w within
        [min_pixels, max_pixels]."""
        f, t = self.factor, self.temporal_patch_size
        if num_frames < t:
            raise ImageError(f"a video needs at least {t} frames, got {num_frames}")
        if height < f or width < f:                  # tiny frames are scaled up to one block first
            scale = max(f / height, f / width)
            height, width = int(height * scale), int(width * scale)
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise ImageError(f"video frames are {width}x{height}, an aspect ratio over {MAX_ASPECT_RATIO}:1")
        h_bar, w_bar = round(height / f) * f, round(width / f) * f
        t_bar = round(num_frames / t) * t
        if t_bar * h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(num_frames * height * width / self.max_pixels)
            h_bar = max(f, math.floor(height / beta / f) * f)
            w_bar = max(f, math.floor(width / beta / f) * f)
        elif t_bar * h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (num_frames * height * width))
            h_bar = math.ceil(height * beta / f) * f
            w_bar = math.ceil(width * beta / f) * f
        return h_bar, w_bar

    def group_grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) in patches of one frame group of frames resized to height x width."""
        return 1, height // self.patch_size, width // self.patch_size

    def timestamps(self, indices: list[int] | np.ndarray, video_fps: float) -> list[float]:
        """Seconds of each frame group: the mean time of its first and last frame (Qwen3VLProcessor's
        _calculate_timestamps)."""
        t = self.temporal_patch_size
        idx = [int(i) for i in indices]
        idx += [idx[-1]] * (-len(idx) % t)
        seconds = [i / video_fps for i in idx]
        return [(seconds[i] + seconds[i + t - 1]) / 2 for i in range(0, len(seconds), t)]

    # ---- pixels ---------------------------------------------------------------------------------------------
    def resize(self, frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """uint8 [n, H, W, 3] -> uint8 [n, height, width, 3], antialiased bicubic (torch's uint8 kernel)."""
        if frames.shape[1:3] == (height, width):
            return frames
        x = frames.permute(0, 3, 1, 2)
        x = F.interpolate(x, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
        return x.permute(0, 2, 3, 1).contiguous()

    def groups(self, frames: torch.Tensor) -> list[torch.Tensor]:
        """Resized frames [n, h, w, 3] -> one uint8 [T, h, w, 3] per frame group (the last frame repeated to
        fill the last group)."""
        t = self.temporal_patch_size
        if pad := -frames.shape[0] % t:
            frames = torch.cat([frames, frames[-1:].expand(pad, *frames.shape[1:])])
        return [frames[i:i + t] for i in range(0, frames.shape[0], t)]

    def to_pixel_values(self, raw: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One frame group, uint8 [T, h, w, 3] -> patch rows [h*w/P^2, C*T*P*P] in `dtype`, on raw's device."""
        table = video_value_table(self.rescale_factor, self.image_mean, self.image_std, raw.device)
        return ops.patchify(raw, table, self.patch_size, self.merge_size, self.temporal_patch_size, dtype)


def placeholder_text(timestamps: list[float], vision_start: str, video_pad: str, vision_end: str) -> str:
    """What stands for one video in the prompt before each group's <|video_pad|> is expanded to its tokens."""
    return "".join(f"<{t:.1f} seconds>{vision_start}{video_pad}{vision_end}" for t in timestamps)


def _number(value: Any, param: str, kind: type, lo: float, hi: float):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or value == int(value))
    if not ok or not lo <= value <= hi:
        raise InvalidInputError(f"{param} must be a{'n integer' if kind is int else ' number'} in [{lo}, {hi}], "
                                f"got {value!r}", param=param)
    return kind(value)
