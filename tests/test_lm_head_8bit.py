"""--quantize-lm-head (EngineArgs.quantize_lm_head): the logits come from 8-bit lm_head weights (groups along the
hidden size, engine/ops/quant.py's wna16 layout, ops.wna16_linear). Here, on the CPU: the quantizer's error bound,
the lm_head's weights and what stays of the bf16 table (tied or not), and engines with the flag against engines
without it (logprobs close, the flag off by default). The speed on a GPU: BENCHMARKS.md; the logit error on real
weights: bench/lm_head_8bit_error.py."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.args import EngineArgs
from engine.errors import ModelLoadError
from engine.model.vocab_parallel_embedding import ParallelLMHead
from engine.ops.quant import dequantize_wna16, quantize_wna16
from engine.server.cli import parse_args
from engine_helpers import make_llm

PROMPT = {"prompt_token_ids": [5, 17, 3, 29, 11, 40, 8, 2, 23, 14, 31, 7]}


def test_the_flag_is_an_engine_switch_and_off_by_default():
    assert parse_args(["--model", "m", "--quantize-lm-head"])[0] == EngineArgs(model="m", quantize_lm_head=True)
    assert EngineArgs(model="m").quantize_lm_head is False


@pytest.mark.parametrize("bits,group", [(8, 128), (8, 16), (4, 32)])
def test_each_weight_is_within_half_a_step_of_its_group_s_grid(bits, group):
    torch.manual_seed(0)
    w = torch.randn(96, 256) * 0.05
    w[3] = 0.0                                   # a row of zeros
    w[5, :group] = torch.linspace(0.01, 0.2, group)   # a group of one sign: the range is widened to hold 0
    qweight, scales, zeros = quantize_wna16(w, bits, group)
    assert qweight.dtype == torch.int32 and qweight.shape == (256 * bits // 32, 96)
    assert scales.shape == zeros.shape == (256 // group, 96) and scales.dtype == torch.float32
    back = dequantize_wna16(qweight, scales, zeros, group, bits).t()
    step = scales.repeat_interleave(group, dim=0).t()
    assert ((back - w).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(back[3], torch.zeros(256))            # zero stays exactly zero
    assert zeros.eq(zeros.round()).all() and zeros.min() >= 0 and zeros.max() <= (1 << bits) - 1


def lm_head_of(llm) -> ParallelLMHead:
    return llm.engine.model_executor.driver_worker.model_runner.model.lm_head


def prompt_logprobs(llm) -> torch.Tensor:
    """The logprob of each prompt token after the first (the lm_head scores every prompt position)."""
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    ids = PROMPT["prompt_token_ids"]
    return torch.tensor([pl[t] for pl, t in zip(out.prompt_logprobs[1:], ids[1:])])


@pytest.mark.parametrize("model", ["llama_dir", "qwen3_dir"])
def test_logits_from_8_bit_weights_stay_close_to_the_table_s(model, request, engine_log):
    # llama: an untied lm_head (hidden 48: groups of 16), whose bf16 table is freed; qwen3: tied to the token
    # embedding (hidden 64: groups of 64), whose table stays for the lookup.
    model_dir = request.getfixturevalue(model)
    plain, quantized = make_llm(model_dir), make_llm(model_dir, quantize_lm_head=True)
    head = lm_head_of(quantized)
    assert head.quantized and head.qweight.dtype == torch.int32
    assert head.quant_group == (16 if model == "llama_dir" else 64)
    tied = quantized.engine.model_config.tie_word_embeddings
    assert hasattr(head, "weight") == tied
    assert not lm_head_of(plain).quantized
    want, got = prompt_logprobs(plain), prompt_logprobs(quantized)
    assert torch.isfinite(got).all()
    # 8-bit steps of 1/255 of each group's range: the logprobs move by a small fraction of a nat.
    assert (got - want).abs().max() < 0.05, (got - want)
    assert not torch.equal(got, want)                       # the 8-bit weights are what scored them
    assert any("--quantize-lm-head on the CPU" in r.getMessage() for r in engine_log.records)


def test_a_hidden_size_no_group_divides_is_refused_with_the_flag_named():
    head = ParallelLMHead(64, 30)
    head.weight.data.normal_()
    with pytest.raises(ModelLoadError, match="--quantize-lm-head needs a hidden size divisible by 4"):
        head.quantize_weights(tied=False)                  # 30: no power-of-two group of 4 or more divides it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 8, 100])
def test_the_gpu_kernels_compute_the_references_logits(tokens):
    # Qwen3-VL-8B's hidden size at a smaller vocabulary: the 8-bit GEMV (1 token), GEMM (8) and dequantize +
    # cuBLAS (100) with float32 scales and zero points, against the torch reference on the same 8-bit weights.
    torch.manual_seed(0)
    head = ParallelLMHead(5000, 4096).to("cuda", torch.bfloat16)
    head.weight.data.normal_(std=0.02)
    head.quantize_weights(tied=False)
    hidden = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
    got = head.compute_logits(hidden)
    from engine.ops import wna16_linear_ref
    want = wna16_linear_ref(hidden.float().cpu(), head.qweight.cpu(), head.scales.cpu(), head.zeros.cpu(),
                            head.quant_group, 8).float()
    err = ((got.cpu() - want).norm() / want.norm()).item()
    assert err < 1e-2, err


def test_the_table_is_quantized_in_chunks_of_rows_as_if_whole(monkeypatch):
    from engine.model import vocab_parallel_embedding
    torch.manual_seed(1)
    head = ParallelLMHead(100, 256)
    head.weight.data.normal_(std=0.02)
    whole = quantize_wna16(head.weight.data, 8, 128)
    monkeypatch.setattr(vocab_parallel_embedding, "QUANT_ROWS", 32)     # 32 + 32 + 32 + 4 rows
    head.quantize_weights(tied=False)
    assert all(torch.equal(got, want) for got, want in zip((head.qweight, head.scales, head.zeros), whole))
    assert not hasattr(head, "weight")
