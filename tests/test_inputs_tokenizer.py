"""load_tokenizer: a Hugging Face directory or a GGUF file in, the same tokenizer transformers builds out."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.errors import ModelLoadError
from engine.inputs.tokenizer import load_tokenizer

TEXT = "Hello! Unicode: café, 日本語, emoji 🙂 <|im_start|>user\nhi<|im_end|>"


@pytest.mark.parametrize("fixture", ["qwen3_vl_dir", "qwen3_dir", "llama_dir"])
def test_loads_a_model_directory_like_autotokenizer(request, fixture):
    model_dir = request.getfixturevalue(fixture)
    ours, reference = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert ours.encode(TEXT) == reference.encode(TEXT)
    assert len(ours) == len(reference)


def test_loads_a_gguf_file_from_its_metadata(smollm2_gguf):
    tok = load_tokenizer(smollm2_gguf)
    assert tok.eos_token == "<|im_end|>"
    assert tok.decode(tok.encode("The capital of France is Paris.")) == "The capital of France is Paris."
    assert tok.convert_tokens_to_ids("<|im_start|>") == tok.encode("<|im_start|>", add_special_tokens=False)[0]


def test_accepts_a_string_path(qwen3_dir):
    assert load_tokenizer(str(qwen3_dir)).encode("Paris") == load_tokenizer(qwen3_dir).encode("Paris")


def test_missing_path_is_a_model_load_error_not_a_hub_lookup(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "no-such-model")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer("Qwen/Qwen3-VL-8B-Instruct")


def test_directory_without_tokenizer_files_is_a_model_load_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        load_tokenizer(tmp_path)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_tokenizer(path)


def test_a_corrupt_gguf_is_a_model_load_error(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 32)
    with pytest.raises(ModelLoadError, match="cannot"):
        load_tokenizer(path)
