"""On a CUDA GPU (pytest -m gpu): the engine with --kv-cache-dtype fp8 — the Triton cache writes and attention
reads, CUDA graphs, pinned swap — computes what the CPU engine with an fp8 cache computes. In fp32 a K/V value is
encoded to the same e4m3 byte on both (it would differ only within an fp32 ulp of a rounding boundary), so the
greedy tokens are the same and log-probs agree within 1e-3, eager and under CUDA graphs alike."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import make_llm
from test_gpu_engine import assert_close_logprobs, outputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def cpu_fp8_reference(qwen3_vl_dir):
    return outputs(make_llm(qwen3_vl_dir, device="cpu", kv_cache_dtype="fp8"), batched=False)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
def test_gpu_fp8_kv_matches_cpu_fp8_kv(qwen3_vl_dir, cpu_fp8_reference, eager):
    llm = make_llm(qwen3_vl_dir, device="cuda", dtype="float32", kv_cache_dtype="fp8", enforce_eager=eager)
    assert llm.engine.cache.gpu_cache.dtype == torch.float8_e4m3fn
    if not eager:
        graphs = llm.engine.runner.graphs
        assert graphs is not None and any(k[0] == "prefill" for k in graphs.graphs), "graphs should be captured"
    for batched in (False, True):
        for (tokens, lps), (ref_tokens, ref_lps) in zip(outputs(llm, batched), cpu_fp8_reference):
            assert tokens == ref_tokens
            assert_close_logprobs(lps, ref_lps, atol=1e-3)


def test_gpu_bf16_fp8_kv_graphs_match_eager(qwen3_vl_dir):
    """The production setting (bf16 model, fp8 cache): CUDA graph replays give the eager run's greedy tokens."""
    eager = outputs(make_llm(qwen3_vl_dir, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8",
                             enforce_eager=True))
    graphs_llm = make_llm(qwen3_vl_dir, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", enforce_eager=False)
    assert graphs_llm.engine.runner.graphs is not None
    for (tokens, lps), (ref_tokens, ref_lps) in zip(outputs(graphs_llm), eager):
        assert tokens == ref_tokens
        assert_close_logprobs(lps[:1], ref_lps[:1], atol=0.02)


@pytest.mark.parametrize("mode", [dict(enable_prefix_caching=True), dict(num_gpu_blocks_override=10),
                                  dict(num_gpu_blocks_override=10, swap_space=0), dict(max_num_batched_tokens=8)],
                         ids=["prefix-cache", "swap", "recompute", "chunked-8"])
def test_gpu_fp8_kv_modes_match_cpu(qwen3_vl_dir, cpu_fp8_reference, mode):
    llm = make_llm(qwen3_vl_dir, device="cuda", dtype="float32", kv_cache_dtype="fp8", **mode)
    outs, outs2 = outputs(llm), outputs(llm)      # second pass: prefix-cache hits
    for (tokens, _), (tokens2, _), (ref_tokens, _) in zip(outs, outs2, cpu_fp8_reference):
        assert tokens == tokens2 == ref_tokens
