"""Quantized checkpoints compute what transformers computes on their dequantized weights: tiny Qwen3-VL, Qwen3 and
Llama checkpoints in each format (packed by tests/quant_checkpoints.py as the formats' public descriptions say),
greedy tokens identical and log-probabilities within 1e-4, for text, images and a multi-turn chat."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from engine import SamplingParams
from engine.model.quantization.layers import Fp8BlockLinearMethod, UnquantizedLinearMethod, WNA16LinearMethod
from engine.model.vocab_parallel_embedding import ParallelLMHead
from engine_helpers import assert_pool_idle, make_llm
from oracle import hf_greedy
from quant_checkpoints import Spec, build_qwen3_wide, write_quantized
from test_engine_parity import CONVERSATIONS, IMAGE_CONVERSATIONS

NEW_TOKENS = 10
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=20)

VL_SPECS = {
    "fp8 128x128 blocks, vision blocks in fp8": Spec("fp8", block_size=(128, 128), quantize_vision=True),
    "awq group 32": Spec("awq", group_size=32, symmetric=False),
    "gptq 4-bit group 64 asymmetric act-order": Spec("gptq", group_size=64, symmetric=False, act_order=True),
    "compressed-tensors 4-bit group 32 asymmetric, layer 1 mlp ignored":
        Spec("compressed-tensors", group_size=32, symmetric=False, skip=[r".*layers\.1\.mlp\."]),
}
TEXT_SPECS = {   # on a Qwen3 of hidden size 128 (groups of 128 fit)
    "fp8 16x32 blocks": Spec("fp8", block_size=(16, 32)),
    "awq group 128": Spec("awq", group_size=128, symmetric=False),
    "gptq 8-bit group 32 symmetric": Spec("gptq", bits=8, group_size=32),
    "gptq 4-bit group 32 symmetric act-order": Spec("gptq", group_size=32, act_order=True),
    "gptq 4-bit per-channel asymmetric": Spec("gptq", group_size=-1, symmetric=False),
    "compressed-tensors 8-bit per-channel": Spec("compressed-tensors", bits=8, group_size=-1),
    "compressed-tensors 4-bit group 128 actorder group": Spec("compressed-tensors", group_size=128, act_order=True),
}
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Once upon a time there was a small cat"}]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


class Variant:
    def __init__(self, src, root, spec: Spec):
        self.spec = spec
        self.quant_dir, self.float_dir = write_quantized(src, root, spec)
        log, handler = logging.getLogger("engine"), _Lines()
        log.addHandler(handler)
        try:
            self.llm = make_llm(self.quant_dir)
        finally:
            log.removeHandler(handler)
        self.log = handler.lines

    def assert_matches_transformers(self, prompt, image_token_id=None):
        [out] = self.llm.generate(prompt, PARAMS)
        tokens, ref_logprobs = hf_greedy(self.float_dir, prompt, NEW_TOKENS, image_token_id)
        assert out.outputs[0].token_ids == tokens
        for step, (ours, ref) in enumerate(zip(out.outputs[0].logprobs, ref_logprobs)):
            ids = torch.tensor(list(ours))
            got = torch.tensor(list(ours.values()))
            torch.testing.assert_close(got, ref[ids], atol=1e-4, rtol=0, msg=f"log-probs differ at step {step}")
        assert_pool_idle(self.llm)


@pytest.fixture(scope="module", params=list(VL_SPECS))
def vl(request, qwen3_vl_dir, tmp_path_factory):
    return Variant(qwen3_vl_dir, tmp_path_factory.mktemp("quant-vl"), VL_SPECS[request.param])


@pytest.fixture(scope="module")
def qwen3_wide_dir(tmp_path_factory):
    return build_qwen3_wide(tmp_path_factory.mktemp("models") / "tiny-qwen3-wide")


@pytest.mark.parametrize("name", ["text only", *IMAGE_CONVERSATIONS])
def test_qwen3_vl_quantized_matches_transformers_on_dequantized_weights(vl, name):
    conversation = CONVERSATIONS[name] if name in CONVERSATIONS else IMAGE_CONVERSATIONS[name]()
    prompt = vl.llm.engine.input_processor.process_chat(conversation)
    vl.assert_matches_transformers(prompt, vl.llm.engine.model_config.image_token_id)


def test_qwen3_vl_quantized_layers_are_the_checkpoints(vl):
    """The decoder projections hold the format's weights; ignored ones, the vision tower and lm_head stay float."""
    model = vl.llm.engine.model_executor.driver_worker.model
    expected = Fp8BlockLinearMethod if vl.spec.method == "fp8" else WNA16LinearMethod
    layers = model.decoder.layers
    assert isinstance(layers[0].self_attn.qkv_proj.quant_method, expected)
    assert isinstance(layers[0].mlp.down_proj.quant_method, expected)
    assert isinstance(layers[1].mlp.gate_up_proj.quant_method, UnquantizedLinearMethod if vl.spec.skip else expected)
    assert isinstance(model.lm_head, ParallelLMHead) and isinstance(model.visual.blocks[0].attn.qkv, nn.Linear)
    assert model.visual.blocks[0].attn.qkv.weight.dtype == model.lm_head.weight.dtype
    dequantized = [line for line in vl.log if line.startswith("Dequantized")]
    if vl.spec.quantize_vision:   # 4 blocks x (qkv, proj, fc1, fc2)
        assert dequantized and dequantized[0].startswith("Dequantized 16 quantized layers"), vl.log
    else:
        assert not dequantized
    [loaded] = [line for line in vl.log if line.startswith("Loading model weights took")]
    assert f"({vl.llm.engine.model_config.quantization.describe()}; " in loaded


@pytest.mark.parametrize("name", list(TEXT_SPECS))
def test_qwen3_quantized_matches_transformers_on_dequantized_weights(qwen3_wide_dir, tmp_path, name):
    variant = Variant(qwen3_wide_dir, tmp_path, TEXT_SPECS[name])
    variant.assert_matches_transformers(variant.llm.engine.input_processor.process_chat(CHAT))


def test_llama_quantized_matches_transformers_on_dequantized_weights(llama_dir, tmp_path):
    variant = Variant(llama_dir, tmp_path, Spec("compressed-tensors", group_size=16, symmetric=False))
    variant.assert_matches_transformers(variant.llm.engine.input_processor.process_chat(CHAT))
