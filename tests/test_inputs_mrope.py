"""get_mrope_positions gives the 3-axis positions and delta transformers' Qwen3VLModel.get_rope_index gives."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen3VLConfig, Qwen3VLModel

from engine.errors import InvalidInputError
from engine.inputs.mrope import get_mrope_positions

IMG, START, END = 1000, 998, 999   # stand-ins for <|image_pad|>, <|vision_start|>, <|vision_end|>
MERGE = 2


def text(n: int, seed: int = 0) -> list[int]:
    return [(7 * i + seed) % 500 + 1 for i in range(n)]


def image(grid: tuple[int, int, int], framed: bool = True) -> list[int]:
    pads = [IMG] * (grid[0] * grid[1] * grid[2] // MERGE ** 2)
    return [START, *pads, END] if framed else pads


PROMPTS = {  # name: (token ids, grids)
    "text only": (text(12), []),
    "one image": (text(5) + image((1, 4, 6)) + text(7, 1), [(1, 4, 6)]),
    "two images of different sizes": (text(3) + image((1, 8, 4)) + text(4, 1) + image((1, 6, 10)) + text(2, 2),
                                      [(1, 8, 4), (1, 6, 10)]),
    "tall then wide": (text(2) + image((1, 12, 2)) + image((1, 2, 12)) + text(3), [(1, 12, 2), (1, 2, 12)]),
    "image at the start": (image((1, 4, 4), framed=False) + text(6), [(1, 4, 4)]),
    "image at the end": (text(6) + image((1, 2, 6), framed=False), [(1, 2, 6)]),
    "only an image": (image((1, 6, 4), framed=False), [(1, 6, 4)]),
}


@pytest.fixture(scope="module")
def hf_model(qwen3_vl_dir):
    config = Qwen3VLConfig.from_pretrained(qwen3_vl_dir)
    assert config.vision_config.spatial_merge_size == MERGE
    return Qwen3VLModel(config).eval()


@pytest.mark.parametrize("name", list(PROMPTS))
def test_positions_and_delta_match_transformers(hf_model, name):
    ids, grids = PROMPTS[name]
    positions, delta = get_mrope_positions(ids, grids, IMG, MERGE)
    input_ids = torch.tensor([ids])
    ref_positions, ref_delta = hf_model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == IMG).int(),
        image_grid_thw=torch.tensor(grids) if grids else None)
    assert positions.dtype == torch.int64 and positions.shape == (3, len(ids))
    assert torch.equal(positions, ref_positions[:, 0])
    assert delta == int(ref_delta[0, 0])


def test_text_only_is_plain_1d_positions():
    positions, delta = get_mrope_positions(text(9), [], IMG, MERGE)
    assert torch.equal(positions, torch.arange(9).expand(3, 9)) and delta == 0


def test_an_image_advances_text_by_its_longest_merged_side():
    ids = text(2) + image((1, 4, 8), framed=False) + text(1)     # merged grid 2 x 4
    positions, delta = get_mrope_positions(ids, [(1, 4, 8)], IMG, MERGE)
    assert positions[:, 2].tolist() == [2, 2, 2]                 # first image token: (cur, cur+0, cur+0)
    assert positions[:, 2 + 7].tolist() == [2, 3, 5]             # last: row 1, col 3 of the merged grid
    assert positions[:, -1].tolist() == [6, 6, 6]                # text resumes at cur + max(2, 4)
    assert delta == 7 - len(ids)                                 # max position 6, plus one, minus 11 tokens


def test_adjacent_images_are_split_by_their_own_token_counts():
    ids = text(1) + image((1, 2, 2), framed=False) + image((1, 4, 4), framed=False)
    positions, _ = get_mrope_positions(ids, [(1, 2, 2), (1, 4, 4)], IMG, MERGE)
    assert positions[:, 2].tolist() == [2, 2, 2]                 # second image starts at 1 + max(1, 1)


@pytest.mark.parametrize("ids, grids, message", [
    (text(3) + image((1, 4, 4)), [(1, 4, 6)], "needs 6 consecutive image tokens"),
    (text(3) + image((1, 4, 4)) + image((1, 2, 2)), [(1, 4, 4)], "the prompt has 5 image tokens but"),
    (text(3) + [IMG, 5, IMG, IMG, IMG], [(1, 4, 4)], "consecutive"),
])
def test_image_tokens_that_do_not_match_the_grids_are_refused(ids, grids, message):
    with pytest.raises(InvalidInputError, match=message):
        get_mrope_positions(ids, grids, IMG, MERGE)
