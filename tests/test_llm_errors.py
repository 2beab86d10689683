"""Bad input to the offline API is refused with an error that says what is wrong, never a crash or a hang, and
leaves the engine usable."""
from __future__ import annotations

import base64
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.errors import ImageError, InvalidInputError, ModelLoadError, PromptTooLongError
from engine_helpers import assert_pool_idle, make_llm


@pytest.fixture(scope="module")
def llm(qwen3_vl_dir):
    return make_llm(qwen3_vl_dir, max_model_len=256, num_gpu_blocks_override=64)


def test_unknown_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_unsupported_architecture(qwen3_dir, tmp_path):
    d = shutil.copytree(qwen3_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture .*GPT2LMHeadModel"):
        LLM(str(d))


def test_missing_tensor_is_named(qwen3_dir, tmp_path):
    d = shutil.copytree(qwen3_dir, tmp_path / "m")
    weights = load_file(d / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.down_proj.weight"):
        LLM(str(d))


def test_a_tensor_the_model_has_no_parameter_for_is_refused(qwen3_dir, tmp_path):
    """A bias the config does not announce (Llama's mlp_bias) would be dropped and change every answer."""
    d = shutil.copytree(qwen3_dir, tmp_path / "m")
    weights = load_file(d / "model.safetensors")
    rows = weights["model.layers.0.mlp.down_proj.weight"].shape[0]
    weights["model.layers.0.mlp.down_proj.bias"] = weights["model.layers.0.mlp.down_proj.weight"].new_ones(rows)
    save_file(weights, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.layers.0.mlp.down_proj.bias.*no parameter"):
        LLM(str(d))


def test_tensors_of_parts_the_model_does_not_build_are_ignored_with_a_word(qwen3_dir, tmp_path, caplog):
    d = shutil.copytree(qwen3_dir, tmp_path / "m")
    weights = load_file(d / "model.safetensors")
    weights["mtp.layers.0.proj.weight"] = weights["model.norm.weight"].clone()
    weights["model.rotary_emb.inv_freq"] = weights["model.norm.weight"].clone()
    save_file(weights, d / "model.safetensors")
    llm = make_llm(d, max_model_len=64, num_gpu_blocks_override=8)
    assert llm.generate(["Hello"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    ignored = [r.getMessage() for r in caplog.records if "Ignored" in r.getMessage()]
    assert ignored == ["Ignored 1 checkpoint tensors of parts this model does not use: mtp.layers.0.proj.weight"]


def test_empty_prompt(llm):
    with pytest.raises(InvalidInputError, match="empty"):
        llm.generate("")
    with pytest.raises(InvalidInputError, match="empty"):
        llm.generate({"prompt_token_ids": []})


def test_prompt_too_long_says_the_lengths(llm):
    with pytest.raises(PromptTooLongError, match="256 tokens.*300 tokens"):
        llm.generate({"prompt_token_ids": [5] * 300})
    with pytest.raises(PromptTooLongError, match="max_tokens"):
        llm.generate({"prompt_token_ids": [5] * 100}, SamplingParams(max_tokens=200))


def test_bytes_that_are_not_an_image(llm):
    url = "data:image/png;base64," + base64.b64encode(b"certainly not a png").decode()
    with pytest.raises(ImageError, match="decode"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])


def test_out_of_range_sampling_values():
    with pytest.raises(InvalidInputError) as e:
        SamplingParams(top_p=1.5)
    assert e.value.param == "top_p"


def test_engine_still_serves_after_refusals(llm):
    [out] = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4
    assert_pool_idle(llm)


def test_a_request_id_is_free_again_once_no_launched_step_holds_a_token_for_it(llm):
    engine = llm.engine
    engine.add_request("same", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=8))
    engine.step()                                   # launched: a token for "same" is in flight
    engine.abort_request("same")
    with pytest.raises(InvalidInputError, match="already running"):
        engine.add_request("same", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("same", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs[-1].outputs[0].token_ids) == 2
    assert_pool_idle(llm)
