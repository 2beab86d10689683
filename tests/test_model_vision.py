"""The Qwen3-VL vision encoder reproduces transformers' Qwen3VLVisionModel on the tiny random checkpoint:
the merged image embeddings and every deepstack feature, for square, non-square, multi-image and multi-frame
batches; batching images never mixes them; a checkpoint missing a tensor is rejected by name."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.model.qwen3_vl_vision import Qwen3VLVisionModel

PREFIX = "model.visual."


def visual_weights(model_dir) -> dict[str, torch.Tensor]:
    tensors = load_file(str(model_dir / "model.safetensors"))
    return {k[len(PREFIX):]: v for k, v in tensors.items() if k.startswith(PREFIX)}


def build_encoder(model_dir, dtype=torch.float32) -> Qwen3VLVisionModel:
    model = Qwen3VLVisionModel(ModelConfig.from_model_dir(model_dir).vision, dtype=dtype)
    model.load_weights(visual_weights(model_dir).items(), strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def ours(qwen3_vl_dir):
    return build_encoder(qwen3_vl_dir)


@pytest.fixture(scope="module")
def oracle(qwen3_vl_dir):
    from transformers import Qwen3VLForConditionalGeneration
    model = Qwen3VLForConditionalGeneration.from_pretrained(qwen3_vl_dir, dtype=torch.float32)
    return model.model.visual.eval()


def random_pixels(grids: list[list[int]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    grid_thw = torch.tensor(grids, dtype=torch.long)
    rows = int(grid_thw.prod(-1).sum())
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 3 * 2 * 16 * 16, generator=gen), grid_thw


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    assert actual.shape == expected.shape
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= rel * max(1.0, expected.abs().max().item()), f"max abs diff {err}"


GRIDS = {
    "one square image": [[1, 4, 4]],
    "one non-square image": [[1, 6, 10]],
    "two images of different sizes": [[1, 4, 4], [1, 6, 10]],
    "a two-frame clip (attention per frame)": [[2, 4, 6]],
}


@pytest.mark.parametrize("grids", GRIDS.values(), ids=GRIDS.keys())
def test_matches_transformers(ours, oracle, grids):
    pixels, grid_thw = random_pixels(grids)
    with torch.no_grad():
        embeds, deepstack = ours(pixels, grid_thw)
        ref = oracle(pixels, grid_thw=grid_thw, return_dict=True)
    merged_rows = int(grid_thw.prod(-1).sum()) // 4
    assert embeds.shape == (merged_rows, 64)
    assert deepstack.shape == (3, merged_rows, 64)
    assert_close(embeds, ref.pooler_output)
    assert len(ref.deepstack_features) == 3
    for k, feature in enumerate(ref.deepstack_features):
        assert_close(deepstack[k], feature)


def test_batched_images_equal_images_encoded_alone(ours):
    pixels, grid_thw = random_pixels([[1, 4, 4], [1, 6, 10], [1, 4, 4]], seed=1)
    with torch.no_grad():
        embeds, deepstack = ours(pixels, grid_thw)
        start, out = 0, 0
        for grid in grid_thw:
            n = int(grid.prod())
            alone, alone_ds = ours(pixels[start:start + n], grid[None])
            assert_close(embeds[out:out + n // 4], alone)
            assert_close(deepstack[:, out:out + n // 4], alone_ds)
            start, out = start + n, out + n // 4
        assert out == embeds.shape[0]


def test_repeated_grid_reuses_cached_tensors(ours):
    pixels, grid_thw = random_pixels([[1, 4, 4], [1, 4, 4]], seed=2)
    with torch.no_grad():
        first = ours(pixels, grid_thw)
        cached = ours._grid_cache[(1, 4, 4)]
        second = ours(pixels, grid_thw)
    assert ours._grid_cache[(1, 4, 4)] is cached
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tracks_fp32(qwen3_vl_dir, ours, dtype):
    pixels, grid_thw = random_pixels([[1, 6, 10]], seed=3)
    with torch.no_grad():
        ref, ref_ds = ours(pixels, grid_thw)
        embeds, deepstack = build_encoder(qwen3_vl_dir, dtype)(pixels, grid_thw)
    assert embeds.dtype == dtype and deepstack.dtype == dtype
    assert_close(embeds, ref, rel=5e-2)
    assert_close(deepstack, ref_ds, rel=5e-2)


def test_missing_tensor_is_named(qwen3_vl_dir):
    weights = visual_weights(qwen3_vl_dir)
    del weights["blocks.2.attn.qkv.bias"]
    model = Qwen3VLVisionModel(ModelConfig.from_model_dir(qwen3_vl_dir).vision)
    loaded = model.load_weights(weights.items())
    assert "blocks.2.attn.qkv.bias" not in loaded and "patch_embed.proj.weight" in loaded
    with pytest.raises(ModelLoadError, match=r"model\.visual\.blocks\.2\.attn\.qkv\.bias"):
        model.check_all_loaded(loaded)
    with pytest.raises(ModelLoadError, match=r"blocks\.2\.attn\.qkv\.bias"):
        model.load_weights(weights.items(), strict=True)


def test_unexpected_or_misshapen_tensor_is_rejected(qwen3_vl_dir):
    model = Qwen3VLVisionModel(ModelConfig.from_model_dir(qwen3_vl_dir).vision)
    with pytest.raises(ModelLoadError, match="blocks.9.norm1.weight"):
        model.load_weights([("blocks.9.norm1.weight", torch.ones(32))])
    with pytest.raises(ModelLoadError, match="pos_embed.weight"):
        model.load_weights([("pos_embed.weight", torch.ones(63, 32))])
