"""The processed form of a prompt, handed from the input processor to the engine core."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ProcessedImage:
    """An image as the input processor makes it from an upload, before its place in a prompt is known."""
    raw: torch.Tensor                   # [H, W, 3] uint8, resized to the patch grid; shared: never modified
    grid_thw: tuple[int, int, int]      # (t, h, w) in patches (before the 2x2 merge)
    content_hash: str                   # identifies the image's content + processing; prefix/encoder cache key
    source_pixels: int = 0              # width x height as uploaded: what decoding it again would take


@dataclass
class ImageItem:
    """One preprocessed image and where its placeholder tokens sit in the prompt.

    The image is kept resized but still 8-bit (`raw`, a quarter of the float32 pixel values' bytes); the
    rescale, normalization and patch ordering run where the pixels are needed, on the GPU for the engine."""
    raw: torch.Tensor                   # [H, W, 3] uint8, already resized to the patch grid
    grid_thw: tuple[int, int, int]      # (t, h, w) in patches (before the 2x2 merge)
    content_hash: str                   # identifies the image's content + processing; prefix/encoder cache key
    to_pixels: Callable[..., torch.Tensor]  # (raw on any device[, dtype]) -> pixel values, same device (f32)
    offset: int = 0                     # index of its first <|image_pad|> token in prompt_token_ids
    length: int = 0                     # number of <|image_pad|> tokens = t*h*w / merge**2
    _cpu_pixels: torch.Tensor | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def pixel_values(self) -> torch.Tensor:
        """[num_patches, C*T*P*P] float32, rows in merge-block order (computed on the CPU once)."""
        if self._cpu_pixels is None:
            self._cpu_pixels = self.to_pixels(self.raw)
        return self._cpu_pixels

    def pixels_on(self, device: torch.device) -> torch.Tensor:
        if self._cpu_pixels is not None or device.type == "cpu":
            return self.pixel_values.to(device)
        from engine.transfer import to_device
        return self.to_pixels(to_device(self.raw, torch.uint8, device))


@dataclass
class ProcessedPrompt:
    prompt_token_ids: list[int]
    prompt: str | None = None                       # the text, when the prompt was given as text
    images: list[ImageItem] = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None     # [3, len(prompt_token_ids)] int64, Qwen3-VL only
    mrope_position_delta: int = 0                   # generated token at index n gets position n + delta
