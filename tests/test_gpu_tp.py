"""On two or more CUDA GPUs (the device machine: pytest -m gpu): tensor parallelism over NCCL gives the tokens of
one GPU, eagerly and with CUDA graphs (captured with their all-reduces on every rank), with swap preemption,
chunked prefill and prefix caching on; the ranks sit on cuda:0 and cuda:1. Skipped with fewer than two GPUs."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine_helpers import assert_pool_idle, make_llm
from test_gpu_engine import conversations

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
MODES = dict(num_gpu_blocks_override=24, max_num_batched_tokens=32, enable_prefix_caching=True)



def outputs(llm) -> list:
    prompts = [llm.engine.input_processor.process_chat(c) for c in conversations()]
    outs = llm.generate(prompts + [prompts[3]], [GREEDY] * len(prompts) + [SEEDED])
    outs += llm.generate(prompts, GREEDY)       # again: prefix-cache and encoder-cache hits
    assert_pool_idle(llm)
    return outs


@pytest.fixture(scope="module")
def one_gpu(qwen3_vl_dir):
    llm = make_llm(qwen3_vl_dir, device="cuda", dtype="float32", **MODES)
    return outputs(llm)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
def test_two_gpus_give_the_tokens_of_one(qwen3_vl_dir, one_gpu, eager):
    llm = make_llm(qwen3_vl_dir, device="cuda", dtype="float32", tensor_parallel_size=2, enforce_eager=eager,
                   **MODES)
    try:
        assert [r["device"] for r in llm.engine.get_stats()["ranks"]] == ["cuda:0", "cuda:1"]
        if not eager:
            assert llm.engine.model_executor.driver_worker.model_runner.graphs is not None, "graphs should be captured on rank 0"
        got = outputs(llm)
        swaps = llm.engine.get_stats()["num_swap_outs"]
    finally:
        llm.shutdown()
    assert swaps > 0, "the workload should preempt by swapping"
    for out, ref in zip(got, one_gpu):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    for out, ref in zip(got[:4], one_gpu[:4]):
        for a, b in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            for tok in set(a) & set(b):
                assert abs(a[tok] - b[tok]) < 1e-3
