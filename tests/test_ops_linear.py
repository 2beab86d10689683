"""On the CPU an unquantized linear keeps its weight in oneDNN's blocked layout (ops.prepack_linear_weight). In bf16
oneDNN then does not reorder it on every call: the products stay F.linear's, bit for bit, and a bf16 model on the
CPU generates what it generates with plain weights. In fp32 the packed product replaces MKL's (faster at one and a
few rows): the sums differ in their last bits only. A tied lm_head keeps the plain table for the token embedding and
gets a packed copy for the logits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import SamplingParams, ops
from engine_helpers import make_llm

BF16 = torch.bfloat16


def packed_or_skip(w: torch.Tensor) -> torch.Tensor:
    packed = ops.prepack_linear_weight(w)
    if packed is None:
        pytest.skip("this torch has no oneDNN linear ops")
    return packed


@pytest.mark.parametrize("lead,k,n", [((1,), 576, 960), ((7,), 64, 48), ((3, 5), 128, 256), ((300,), 1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_prepacked_weight_gives_f_linears_bits(lead, k, n, bias, gen):
    x = torch.randn(*lead, k, generator=gen).to(BF16)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(BF16)
    b = torch.randn(n, generator=gen).to(BF16) if bias else None
    assert torch.equal(ops.linear(x, packed_or_skip(w), b), F.linear(x, w, b))


def test_a_strided_input_gives_the_same_bits(gen):
    x = torch.randn(4, 2 * 64, generator=gen).to(BF16)[:, ::2]
    w = torch.randn(32, 64, generator=gen).to(BF16)
    assert torch.equal(ops.linear(x, packed_or_skip(w)), F.linear(x, w))


def test_only_bf16_and_fp32_weights_in_host_memory_are_packed():
    assert ops.prepack_linear_weight(torch.randn(8, 16, dtype=torch.float16)) is None
    assert ops.prepack_linear_weight(torch.randn(8, 16, dtype=torch.float64)) is None


@pytest.mark.parametrize("lead,k,n", [((1,), 576, 960), ((5,), 576, 1728), ((300,), 1536, 576)])
def test_a_prepacked_fp32_weight_gives_f_linears_values(lead, k, n, gen):
    # One decode token, a verify step's five, a prefill chunk: oneDNN's sums against MKL's.
    x = torch.randn(*lead, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    got, want = ops.linear(x, packed_or_skip(w)), F.linear(x, w)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_bf16_model_on_the_cpu_runs_on_packed_weights_with_the_same_tokens(qwen3_vl_dir, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompt = {"prompt_token_ids": list(range(40, 80))}
    packed = make_llm(qwen3_vl_dir, device="cpu", dtype="bfloat16")
    model = packed.engine.model_executor.driver_worker.model_runner.model
    linears = [m for m in model.modules() if hasattr(m, "quant_method")]
    if not linears[0].weight.is_mkldnn:
        pytest.skip("this torch has no oneDNN linear ops")
    assert all(m.weight.is_mkldnn for m in linears)
    assert model.lm_head.weight.is_mkldnn                                       # untied: packed too
    import engine.model.vocab_parallel_embedding as vpe
    monkeypatch.setattr(ops, "prepack_linear_weight", lambda w: None)
    monkeypatch.setattr(vpe, "prepack_linear_weight", lambda w: None)
    plain = make_llm(qwen3_vl_dir, device="cpu", dtype="bfloat16")
    assert not plain.engine.model_executor.driver_worker.model_runner.model.lm_head.weight.is_mkldnn
    want = plain.generate(prompt, params)[0].outputs[0]
    got = packed.generate(prompt, params)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs   # the same bits all the way


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_tied_lm_head_keeps_the_plain_table_and_scores_with_a_packed_copy(qwen3_dir, dtype):
    llm = make_llm(qwen3_dir, device="cpu", dtype=dtype)
    model = llm.engine.model_executor.driver_worker.model_runner.model
    head = model.lm_head
    assert head.weight is model.decoder.embed_tokens.weight and not head.weight.is_mkldnn
    packed_or_skip(torch.zeros(8, 8, dtype=head.weight.dtype))
    assert head.packed_weight.is_mkldnn
    hidden = torch.randn(3, head.weight.shape[1], dtype=head.weight.dtype)
    assert torch.allclose(head.compute_logits(hidden), F.linear(hidden, head.weight).float(), rtol=1e-2, atol=1e-3)
