"""ImageProcessor reproduces transformers' Qwen2VLImageProcessorPil (what Qwen3-VL uses) bit for bit."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from engine.errors import ImageError, ModelLoadError
from engine.inputs.image_processor import ImageProcessor
from tiny_models import REFERENCE_DIR

QWEN3_VL_CONFIG = json.loads((REFERENCE_DIR / "preprocessor_config.json").read_text())


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Random pixels, so that every resampling difference shows."""
    channels = len(Image.new(mode, (1, 1)).getbands())
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (height * width * channels,), generator=gen, dtype=torch.uint8)
    return Image.frombytes(mode, (width, height), bytes(data.tolist()))


def reference_processor(config: dict, **overrides) -> Qwen2VLImageProcessorPil:
    # A deep copy: Qwen2VLImageProcessorPil writes min_pixels/max_pixels into the `size` dict it is given.
    return Qwen2VLImageProcessorPil(**{**copy.deepcopy(config), **overrides})


def reference(config: dict, image: Image.Image, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    out = reference_processor(config, **overrides)(images=[image], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


SIZES = {  # (width, height): what smart_resize does with Qwen3-VL's own budget (65,536 to 16,777,216 pixels)
    "small, scaled up to min_pixels": (100, 70),
    "tiny, scaled up": (7, 5),
    "exact multiple of 32": (256, 320),
    "rounded to multiples of 32": (333, 250),
    "wide": (1000, 90),
    "tall": (60, 700),
    "aspect ratio just under 200": (3980, 20),
}


@pytest.mark.parametrize("name", list(SIZES))
def test_pixel_values_and_grid_match_transformers(name):
    image = noise(*SIZES[name])
    ours, grid = ImageProcessor.from_config(QWEN3_VL_CONFIG)(image)
    ref_pixels, ref_grid = reference(QWEN3_VL_CONFIG, image)
    assert grid == tuple(ref_grid[0].tolist())
    assert ours.dtype == torch.float32 and ours.shape == ref_pixels.shape
    assert torch.equal(ours, ref_pixels)


@pytest.mark.parametrize("name", ["exact multiple of 32", "rounded to multiples of 32"])
def test_rgb_pixels_as_an_array_give_what_their_pil_image_gives(name):
    """decode_image hands the processor an 8-bit RGB PNG as libspng's uint8 [H, W, 3] array; an array already on
    the patch grid is taken as it is, any other is resized through Pillow like the image."""
    import numpy as np
    image = noise(*SIZES[name])
    processor = ImageProcessor.from_config(QWEN3_VL_CONFIG)
    raw, grid = processor.resize(np.array(image))   # writable, as libspng's arrays are
    ref_raw, ref_grid = processor.resize(image)
    assert grid == ref_grid and torch.equal(raw, ref_raw)


@pytest.mark.parametrize("size", [(1200, 900), (640, 4000), (513, 511)])
def test_max_pixels_cap_scales_down_like_transformers(size):
    image = noise(*size, seed=1)
    cap = 256 * 256
    ours, grid = ImageProcessor.from_config(QWEN3_VL_CONFIG, max_pixels=cap)(image)
    ref_pixels, ref_grid = reference(QWEN3_VL_CONFIG, image, max_pixels=cap)
    assert grid == tuple(ref_grid[0].tolist()) and grid[1] * grid[2] * 16 * 16 <= cap
    assert torch.equal(ours, ref_pixels)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P", "CMYK"])
def test_other_modes_are_converted_like_transformers(mode):
    image = noise(90, 60, mode, seed=2)
    ours, _ = ImageProcessor.from_config(QWEN3_VL_CONFIG)(image)
    ref_pixels, _ = reference(QWEN3_VL_CONFIG, image)
    assert torch.equal(ours, ref_pixels)


def test_rows_are_channel_time_patch_in_merge_block_order():
    # A 64x64 image is 4x4 patches = 2x2 merge blocks; row 1 must be patch (row 0, col 1), row 2 patch (1, 0).
    image = noise(64, 64, seed=3)
    proc = ImageProcessor.from_config(QWEN3_VL_CONFIG, min_pixels=32 * 32)
    pixels, grid = proc(image)
    assert grid == (1, 4, 4) and pixels.shape == (16, 3 * 2 * 16 * 16)
    x = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(64, 64, 3).permute(2, 0, 1)
    x = ((x.double() / 255).float() - 0.5) / 0.5
    patch = pixels[2].view(3, 2, 16, 16)
    assert torch.equal(patch[:, 0], x[:, 16:32, 0:16]) and torch.equal(patch[:, 1], patch[:, 0])  # T duplicated


def test_tiny_model_config_matches_transformers(qwen3_vl_dir):
    config = json.loads((qwen3_vl_dir / "preprocessor_config.json").read_text())
    image = noise(700, 500, seed=4)
    ours, grid = ImageProcessor.from_model_dir(qwen3_vl_dir)(image)
    ref_pixels, ref_grid = reference(config, image)
    assert grid == tuple(ref_grid[0].tolist()) and torch.equal(ours, ref_pixels)


@pytest.mark.parametrize("width, height", [(100, 70), (1200, 900), (3980, 20), (7, 5)])
def test_patch_count_matches_transformers(width, height):
    proc = ImageProcessor.from_config(QWEN3_VL_CONFIG, max_pixels=512 * 512)
    ref = reference_processor(QWEN3_VL_CONFIG, max_pixels=512 * 512)
    t, h, w = proc.grid_thw(height, width)
    assert t * h * w == ref.get_number_of_image_patches(height, width)


def test_aspect_ratio_over_200_is_refused():
    with pytest.raises(ImageError, match="aspect ratio over 200"):
        ImageProcessor.from_config(QWEN3_VL_CONFIG)(noise(402, 2))


@pytest.mark.parametrize("config, expected", [
    ({"size": {"shortest_edge": 1000, "longest_edge": 9000}}, (1000, 9000)),
    ({"min_pixels": 2000, "max_pixels": 8000, "size": {"shortest_edge": 1000, "longest_edge": 9000}}, (2000, 8000)),
    ({}, (65_536, 16_777_216)),
])
def test_pixel_budget_is_read_like_transformers(config, expected):
    proc = ImageProcessor.from_config(config)
    ref = reference_processor({**QWEN3_VL_CONFIG, **config})
    assert (proc.min_pixels, proc.max_pixels) == expected
    if config:
        assert (ref.size["shortest_edge"], ref.size["longest_edge"]) == expected


def test_server_cap_overrides_the_config():
    proc = ImageProcessor.from_config(QWEN3_VL_CONFIG, max_pixels=1024 * 1024)
    assert proc.max_pixels == 1024 * 1024 and proc.min_pixels == 65_536


def test_an_empty_pixel_budget_is_refused():
    with pytest.raises(ValueError, match="raise max_pixels"):
        ImageProcessor.from_config(QWEN3_VL_CONFIG, max_pixels=50_000)  # below min_pixels 65,536


def test_cache_key_changes_with_processing_parameters():
    a = ImageProcessor.from_config(QWEN3_VL_CONFIG)
    b = ImageProcessor.from_config(QWEN3_VL_CONFIG, max_pixels=512 * 512)
    assert a.cache_key != b.cache_key and a.cache_key == ImageProcessor.from_config(QWEN3_VL_CONFIG).cache_key


def test_missing_preprocessor_config_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="preprocessor_config.json"):
        ImageProcessor.from_model_dir(tmp_path)
