"""A Qwen3-VL directory loads with either processor layout: Qwen's preprocessor_config.json, or transformers 5's
processor_config.json (the image processor nested inside, no preprocessor_config.json). The checkpoint saved by
transformers 5 processes images as transformers does and generates what transformers generates, token for token."""
from __future__ import annotations

import json

import pytest
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from engine.args import EngineArgs
from engine.errors import ModelLoadError
from engine.inputs.image_processor import ImageProcessor
from engine.inputs.setup import build_input_processor
from engine.model.loader import load_model_config
from engine_helpers import make_llm, noise_image
from test_engine_parity import IMAGE_CONVERSATIONS, assert_matches_transformers


def input_processor(model_dir):
    return build_input_processor(EngineArgs(model=str(model_dir)), load_model_config(model_dir))


def test_transformers5_saves_the_image_processor_inside_processor_config(qwen3_vl_transformers5_dir):
    assert not (qwen3_vl_transformers5_dir / "preprocessor_config.json").exists()
    saved = json.loads((qwen3_vl_transformers5_dir / "processor_config.json").read_text())
    assert saved["image_processor"]["size"] == {"longest_edge": 256 * 256, "shortest_edge": 32 * 32}


def test_both_layouts_give_the_same_image_processor(qwen3_vl_dir, qwen3_vl_transformers5_dir):
    assert ImageProcessor.from_model_dir(qwen3_vl_transformers5_dir) == ImageProcessor.from_model_dir(qwen3_vl_dir)


def test_transformers5_layout_pixels_match_transformers(qwen3_vl_transformers5_dir):
    image = noise_image(700, 500, 4)
    ours, grid = ImageProcessor.from_model_dir(qwen3_vl_transformers5_dir)(image)
    ref = Qwen2VLImageProcessorPil.from_pretrained(qwen3_vl_transformers5_dir)(images=[image], return_tensors="pt")
    assert grid == tuple(ref["image_grid_thw"][0].tolist()) and torch.equal(ours, ref["pixel_values"])


@pytest.mark.parametrize("name", sorted(IMAGE_CONVERSATIONS))
def test_both_layouts_give_the_same_prompt(qwen3_vl_dir, qwen3_vl_transformers5_dir, name):
    messages = IMAGE_CONVERSATIONS[name]()
    processors = [input_processor(d) for d in (qwen3_vl_dir, qwen3_vl_transformers5_dir)]
    old, new = (p.process_chat(messages) for p in processors)
    assert new.prompt_token_ids == old.prompt_token_ids
    pixels = [torch.cat([p.image_processor.to_pixel_values(image.raw) for image in prompt.images])
              for p, prompt in zip(processors, (old, new))]
    assert torch.equal(*pixels)


def test_a_transformers5_checkpoint_generates_what_transformers_generates(qwen3_vl_transformers5_dir):
    llm = make_llm(qwen3_vl_transformers5_dir)
    prompt = llm.engine.input_processor.process_chat(IMAGE_CONVERSATIONS["two images of different sizes"]())
    assert_matches_transformers(llm, qwen3_vl_transformers5_dir, prompt, llm.engine.model_config.image_token_id)


def test_a_processor_config_without_an_image_processor_is_a_model_load_error(tmp_path):
    (tmp_path / "processor_config.json").write_text('{"processor_class": "Qwen3VLProcessor"}')
    with pytest.raises(ModelLoadError, match="no image_processor entry"):
        ImageProcessor.from_model_dir(tmp_path)
