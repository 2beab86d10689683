"""Every engine mode computes the same thing: the same requests give the same tokens alone, batched together,
arriving at staggered steps, with block sizes 1, 16 and 32, with chunked-prefill budgets as small as 8 tokens,
under recompute or swap preemption from a tiny pool, and with prefix caching on. Afterwards every block is free.
All of it with the KV cache in the model dtype and in fp8 (--kv-cache-dtype fp8): the fp8 rounding happens once,
when a token's K/V is written, so every mode reads the same cached values."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine_helpers import assert_pool_idle, make_llm, noise_image
from test_engine_parity import image_part

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)


def conversations():
    return [
        [{"role": "user", "content": "Hello! How can I help you today?"}],
        [{"role": "user", "content": [image_part(noise_image(64, 64, 10)),
                                      {"type": "text", "text": "Describe the image."}]}],
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Once upon a time there was a small cat who liked to sleep in the sun."}],
        [{"role": "user", "content": [image_part(noise_image(96, 160, 11)), {"type": "text", "text": "and"},
                                      image_part(noise_image(64, 128, 12)), {"type": "text", "text": "Compare."}]}],
        [{"role": "user", "content": "The capital of France is Paris. The capital of Italy is"}],
    ]


def run(llm, staggered: bool = False) -> list[list[int]]:
    """Greedy for every conversation plus one seeded random request; optionally one new request per step."""
    engine = llm.engine
    prompts = [engine.input_processor.process_chat(c) for c in conversations()]
    params = [GREEDY] * len(prompts) + [SEEDED]
    prompts.append(prompts[2])
    ids = [f"r{i}" for i in range(len(prompts))]
    pending = list(zip(ids, prompts, params))
    final = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(1 if staggered else len(pending)):
            if pending:
                rid, prompt, sp = pending.pop(0)
                engine.add_request(rid, prompt, sp)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
    assert_pool_idle(llm)
    return [final[rid] for rid in ids]


@pytest.fixture(scope="module", params=["auto", "fp8"])
def kv_cache_dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def expected(qwen3_vl_dir, kv_cache_dtype):
    """Each request alone, in an ample pool, one at a time."""
    llm = make_llm(qwen3_vl_dir, kv_cache_dtype=kv_cache_dtype)
    outs = []
    prompts = [llm.engine.input_processor.process_chat(c) for c in conversations()]
    for prompt, sp in zip(prompts + [prompts[2]], [GREEDY] * len(prompts) + [SEEDED]):
        [out] = llm.generate(prompt, sp)
        outs.append(out.outputs[0].token_ids)
    return outs


MODES = {
    "batched together": dict(),
    "block size 1": dict(block_size=1, num_gpu_blocks_override=4096),
    "block size 32": dict(block_size=32, num_gpu_blocks_override=128),
    "chunked prefill, 8-token budget": dict(max_num_batched_tokens=8),
    "chunked prefill, 13-token budget, 2 seqs": dict(max_num_batched_tokens=13, max_num_seqs=2),
    "recompute preemption in a tiny pool": dict(num_gpu_blocks_override=10, swap_space=0),
    "swap preemption in a tiny pool": dict(num_gpu_blocks_override=10, swap_space=0.01),
    "prefix caching": dict(enable_prefix_caching=True),
    "prefix caching, tiny pool, swap": dict(enable_prefix_caching=True, num_gpu_blocks_override=10),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_gives_same_tokens(qwen3_vl_dir, kv_cache_dtype, expected, mode):
    llm = make_llm(qwen3_vl_dir, kv_cache_dtype=kv_cache_dtype, **MODES[mode])
    assert run(llm) == expected


@pytest.mark.parametrize("mode", ["batched together", "chunked prefill, 8-token budget",
                                  "recompute preemption in a tiny pool", "swap preemption in a tiny pool"])
def test_staggered_arrivals_give_same_tokens(qwen3_vl_dir, kv_cache_dtype, expected, mode):
    llm = make_llm(qwen3_vl_dir, kv_cache_dtype=kv_cache_dtype, **MODES[mode])
    assert run(llm, staggered=True) == expected


def test_tiny_pool_really_preempts(qwen3_vl_dir, kv_cache_dtype):
    recompute = make_llm(qwen3_vl_dir, kv_cache_dtype=kv_cache_dtype, **MODES["recompute preemption in a tiny pool"])
    run(recompute)
    c = recompute.engine.scheduler.counters
    assert c.num_recompute_preemptions > 0 and c.num_swap_outs == 0
    swap = make_llm(qwen3_vl_dir, kv_cache_dtype=kv_cache_dtype, **MODES["swap preemption in a tiny pool"])
    run(swap)
    c = swap.engine.scheduler.counters
    assert c.num_swap_outs > 0 and c.num_swap_ins == c.num_swap_outs and c.num_blocks_swapped_in > 0
