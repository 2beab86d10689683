"""The processed form of a prompt, handed from the input processor to the engine core."""
from __future__ import annotations

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
    """One preprocessed image and where its placeholder tokens sit in the prompt: plain data, which a step may
    carry to other processes.

    The image is kept resized but still 8-bit (`raw`, a quarter of the float32 pixel values' bytes); the model
    runner turns it into pixel values (rescale, normalization, patch order) where they are needed, on the GPU
    for the engine (ImageProcessor.to_pixel_values)."""
    raw: torch.Tensor                   # [H, W, 3] uint8, already resized to the patch grid
    grid_thw: tuple[int, int, int]      # (t, h, w) in patches (before the 2x2 merge)
    content_hash: str                   # identifies the image's content + processing; prefix/encoder cache key
    offset: int = 0                     # index of its first <|image_pad|> token in prompt_token_ids
    length: int = 0                     # number of <|image_pad|> tokens = t*h*w / merge**2

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class ProcessedPrompt:
    prompt_token_ids: list[int]
    prompt: str | None = None                       # the text, when the prompt was given as text
    images: list[ImageItem] = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None     # [3, len(prompt_token_ids)] int64, Qwen3-VL only
    mrope_position_delta: int = 0                   # generated token at index n gets position n + delta
