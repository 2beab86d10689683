"""On a CUDA GPU (the device machine: pytest -m gpu): speculative decoding with the GPU's kernels and CUDA graphs
(a verify step of up to GRAPH_SEQ_SLOTS requests replays a prefill graph) gives the greedy tokens of the GPU engine
without it, for n-gram and EAGLE-3 drafts, in fp32 (where a verify step's attention and the one-token decode
kernel agree to rounding)."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine_helpers import assert_pool_idle, make_llm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
PROMPTS = [[{"role": "user", "content": "Hello! How can I help you today? Hello! How can I help you today?"}],
           [{"role": "user", "content": "The capital of France is Paris. The capital of Italy is"}]]


def tokens(llm):
    outs = [llm.chat(p, GREEDY)[0] for p in PROMPTS]
    assert_pool_idle(llm)
    return [o.outputs[0].token_ids for o in outs]


COMMON = dict(device="cuda", dtype="float32", enforce_eager=False, max_num_seqs=4)


@pytest.fixture(scope="module")
def expected(qwen3_dir):
    return tokens(make_llm(qwen3_dir, **COMMON))


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_gpu_speculation_keeps_the_greedy_tokens(qwen3_dir, eagle3_dir, expected, method):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1} if method == "ngram" else \
        {"method": "eagle3", "num_speculative_tokens": 3, "model": str(eagle3_dir)}
    llm = make_llm(qwen3_dir, speculative_config=spec, **COMMON)
    assert tokens(llm) == expected
    assert llm.engine.get_stats()["spec_decode"]["num_draft_tokens"] > 0


def test_gpu_verify_steps_of_several_requests_replay_a_graph_and_keep_the_tokens(qwen3_dir, expected, monkeypatch):
    """Both prompts at once: their verify steps (two sequences of up to k + 1 tokens) replay a small prefill
    bucket's graph instead of running ~400 launches eagerly, and the tokens are those without drafts."""
    llm = make_llm(qwen3_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                  "prompt_lookup_min": 1}, **COMMON)
    graphs = llm.engine.model_executor.driver_worker.model_runner.graphs
    replayed, run = [], graphs.run

    def counted(inp):
        replayed.append((inp.md.num_seqs, inp.md.max_query_len, inp.input_ids.shape[0]))
        return run(inp)

    monkeypatch.setattr(graphs, "run", counted)
    outs = llm.chat(PROMPTS, GREEDY)
    assert_pool_idle(llm)
    assert [o.outputs[0].token_ids for o in outs] == expected
    verify_steps = [r for r in replayed if r[0] == 2 and r[1] > 1 and r[2] <= 10]
    assert verify_steps, f"no two-request verify step replayed a graph: {replayed}"
