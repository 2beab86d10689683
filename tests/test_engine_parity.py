"""The engine computes what transformers computes: on the same weights and inputs, greedy tokens are identical
and the log-probabilities of every step agree to 1e-4 (fp32), for Qwen3-VL (text, images, multi-turn),
Qwen3 and Llama."""
from __future__ import annotations

import base64
import io

import pytest
import torch

from engine import SamplingParams
from engine_helpers import assert_pool_idle, make_llm, noise_image
from oracle import hf_greedy

NEW_TOKENS = 12
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=20)


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_part(image) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


CONVERSATIONS = {
    "text only": [{"role": "user", "content": "Hello! How can I help you today?"}],
    "system and text": [{"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": "Once upon a time there was a small cat"}],
}
IMAGE_CONVERSATIONS = {
    "one image": lambda: [{"role": "user", "content": [image_part(noise_image(64, 64, 1)),
                                                       {"type": "text", "text": "Describe the image."}]}],
    "two images of different sizes": lambda: [{"role": "user", "content": [
        image_part(noise_image(96, 160, 2)), {"type": "text", "text": "and"},
        image_part(noise_image(128, 64, 3)), {"type": "text", "text": "What color is the square?"}]}],
    "image in an earlier turn": lambda: [
        {"role": "user", "content": [image_part(noise_image(64, 96, 4)), {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "It is red, green and blue."},
        {"role": "user", "content": "Describe the image."}],
}


@pytest.fixture(scope="module")
def vl_llm(qwen3_vl_dir):
    return make_llm(qwen3_vl_dir)


def assert_matches_transformers(llm, model_dir, prompt, image_token_id=None):
    [out] = llm.generate(prompt, PARAMS)
    tokens, ref_logprobs = hf_greedy(model_dir, prompt, NEW_TOKENS, image_token_id)
    assert out.outputs[0].token_ids == tokens
    for step, (ours, ref) in enumerate(zip(out.outputs[0].logprobs, ref_logprobs)):
        ids = torch.tensor(list(ours))
        got = torch.tensor(list(ours.values()))
        torch.testing.assert_close(got, ref[ids], atol=1e-4, rtol=0, msg=f"log-probs differ at step {step}")
    assert_pool_idle(llm)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_qwen3_vl_text_matches_transformers(vl_llm, qwen3_vl_dir, name):
    prompt = vl_llm.engine.input_processor.process_chat(CONVERSATIONS[name])
    assert_matches_transformers(vl_llm, qwen3_vl_dir, prompt)


@pytest.mark.parametrize("name", sorted(IMAGE_CONVERSATIONS))
def test_qwen3_vl_images_match_transformers(vl_llm, qwen3_vl_dir, name):
    prompt = vl_llm.engine.input_processor.process_chat(IMAGE_CONVERSATIONS[name]())
    assert prompt.images, "the conversation should carry images"
    assert_matches_transformers(vl_llm, qwen3_vl_dir, prompt, vl_llm.engine.model_config.image_token_id)


@pytest.mark.parametrize("fixture", ["qwen3_dir", "llama_dir"])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_text_models_match_transformers(request, fixture, name):
    model_dir = request.getfixturevalue(fixture)
    llm = make_llm(model_dir)
    prompt = llm.engine.input_processor.process_chat(CONVERSATIONS[name])
    assert_matches_transformers(llm, model_dir, prompt)


def test_plain_text_prompt_matches_transformers(qwen3_dir):
    llm = make_llm(qwen3_dir)
    prompt = llm.engine.process_prompt("The capital of France is")
    assert_matches_transformers(llm, qwen3_dir, prompt)
