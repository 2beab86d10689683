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

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes


@dataclass(frozen=True)
class ProcessedVideo:
    """A video as the input processor makes it: its sampled frames resized and cut into frame groups of
    temporal_patch_size frames. Each group is encoded and placed in the prompt as an image of its own: it has
    its own timestamp, its own <|vision_start|><|video_pad|>...<|vision_end|> run and its own M-RoPE grid."""
    groups: tuple[torch.Tensor, ...]    # [T, H, W, 3] uint8 each; shared: never modified
    grid_thw: tuple[int, int, int]      # (1, h, w) in patches: one group's grid
    timestamps: tuple[float, ...]       # seconds of each group, as the prompt writes them
    content_hashes: tuple[str, ...]     # one per group
    source_pixels: int = 0              # pixels decoded at the clip's size (sampled frames)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)


@dataclass
class ImageItem:
    """One preprocessed image (or one frame group of a video) and where its placeholder tokens sit in the
    prompt: plain data, which a step may carry to other processes.

    The image is kept resized but still 8-bit (`raw`, a quarter of the float32 pixel values' bytes); the model
    runner turns it into pixel values (rescale, normalization, patch order) where they are needed, on the GPU
    for the engine (ImageProcessor.to_pixel_values). A video frame group's `raw` holds its frames: [T, H, W, 3]."""
    raw: torch.Tensor                   # [H, W, 3] uint8 (a video frame group: [T, H, W, 3]), resized
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
