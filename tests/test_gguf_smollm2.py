"""Real weights: the SmolLM2-135M-Instruct GGUF (the app's embedded default) loads from its own metadata, gives
the same greedy tokens as transformers' GGUF loader, and answers a simple question correctly."""
from __future__ import annotations

import functools

import pytest
import torch

from engine import LLM, SamplingParams
from engine_helpers import assert_pool_idle

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hello in one sentence."}],
]


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    """fp32, to compare with transformers' fp32 token for token (the CPU default for GGUF may be bf16)."""
    return LLM(str(smollm2_gguf), dtype="float32", max_model_len=1024, num_gpu_blocks_override=256,
               swap_space=0.01)


@functools.lru_cache(maxsize=1)
def _hf(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = path.rsplit("/", 1)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return tok, model


def test_config_and_tokenizer_come_from_the_gguf_metadata(smol):
    cfg = smol.engine.model_config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads) == \
        ("LlamaForCausalLM", 30, 576, 3)
    assert cfg.tie_word_embeddings
    assert smol.get_tokenizer().decode(smol.get_tokenizer().encode("Paris")) == "Paris"


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_greedy_tokens_match_transformers_gguf_loading(smol, smollm2_gguf, index):
    tok, model = _hf(str(smollm2_gguf))
    prompt = smol.engine.input_processor.process_chat(PROMPTS[index])
    ids = tok.apply_chat_template(PROMPTS[index], add_generation_prompt=True, return_dict=True,
                                  return_tensors="pt")["input_ids"]
    assert prompt.prompt_token_ids == ids[0].tolist(), "chat template + tokenizer must agree with transformers"
    with torch.inference_mode():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    ref_tokens = ref[0, ids.shape[1]:].tolist()
    [out] = smol.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24))
    n = len(ref_tokens)
    assert out.outputs[0].token_ids[:n] == ref_tokens
    assert_pool_idle(smol)


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_answers_the_capital_of_france(smol, smollm2_gguf, dtype):
    llm = smol if dtype == "float32" else LLM(str(smollm2_gguf), max_model_len=1024, num_gpu_blocks_override=64)
    [out] = llm.chat(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=32))
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
