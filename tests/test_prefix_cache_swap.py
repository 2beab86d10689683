"""The KV pool as managed memory: prefix caching reuses exactly the KV that is still valid (never across two
different images), swap space parks preempted requests without changing their output, the priority policy lets
an important late request overtake, and a repeated image skips the vision encoder."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine_helpers import assert_pool_idle, make_llm, noise_image
from test_engine_parity import image_part

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SYSTEM = ("You are a helpful assistant. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? "
          "The capital of France is Paris. The capital of Italy is Rome.")


@pytest.fixture(scope="module")
def cached(qwen3_vl_dir):
    return make_llm(qwen3_vl_dir, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def uncached(qwen3_vl_dir):
    return make_llm(qwen3_vl_dir)


def chat(llm, messages, params=GREEDY):
    prompt = llm.engine.input_processor.process_chat(messages)
    [out] = llm.generate(prompt, params)
    assert_pool_idle(llm)
    return prompt, out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_shared_system_prompt_is_served_from_the_cache(cached, uncached):
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
    second = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Describe the image."}]
    p1, _ = chat(cached, first)
    p2, out = chat(cached, second)
    shared = common_prefix(p1.prompt_token_ids, p2.prompt_token_ids)
    assert shared >= 2 * BS
    assert out.metrics.num_cached_tokens == (shared // BS) * BS
    assert out.outputs[0].token_ids == chat(uncached, second)[1].outputs[0].token_ids


def test_multi_turn_history_skips_the_old_turns(cached, uncached):
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Once upon a time there was a cat."}]
    p1, out1 = chat(cached, turn1)
    turn2 = turn1 + [{"role": "assistant", "content": out1.outputs[0].text},
                     {"role": "user", "content": "What happened next?"}]
    _, out2 = chat(cached, turn2)
    assert out2.metrics.num_cached_tokens >= (len(p1.prompt_token_ids) // BS) * BS
    assert out2.outputs[0].token_ids == chat(uncached, turn2)[1].outputs[0].token_ids


def test_same_text_with_two_different_images_never_shares_image_kv(cached, uncached):
    def ask(seed):
        return [{"role": "user", "content": [{"type": "text", "text": SYSTEM},
                                             image_part(noise_image(128, 128, seed)),
                                             {"type": "text", "text": "What is it?"}]}]
    chat(cached, ask(1))
    p2, out = chat(cached, ask(2))
    image = p2.images[0]
    # The token ids are identical (same number of <|image_pad|>), but no block holding image 2 may be reused.
    assert out.metrics.num_cached_tokens == (image.offset // BS) * BS
    assert out.outputs[0].token_ids == chat(uncached, ask(2))[1].outputs[0].token_ids


def test_same_image_twice_is_a_hit(cached, uncached):
    messages = [{"role": "user", "content": [image_part(noise_image(96, 96, 7)),
                                             {"type": "text", "text": SYSTEM + " Describe the image."}]}]
    chat(cached, messages)
    p2, out = chat(cached, messages)
    assert out.metrics.num_cached_tokens == ((len(p2.prompt_token_ids) - 1) // BS) * BS
    assert out.outputs[0].token_ids == chat(uncached, messages)[1].outputs[0].token_ids


@pytest.mark.parametrize("extra", [0, 1, -1])
def test_prompts_on_block_borders(cached, uncached, extra):
    """A prompt of exactly k blocks must still compute its last token (a hit never covers it)."""
    ids = cached.engine.process_prompt(SYSTEM * 3).prompt_token_ids
    length = (len(ids) // BS) * BS + extra
    prompt = {"prompt_token_ids": ids[:length]}
    [first] = cached.generate(prompt, GREEDY)
    [again] = cached.generate(prompt, GREEDY)
    [plain] = uncached.generate(prompt, GREEDY)
    assert again.metrics.num_cached_tokens == ((length - 1) // BS) * BS
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == plain.outputs[0].token_ids
    assert_pool_idle(cached)


def test_hit_rate_is_counted(cached):
    stats = cached.engine.get_stats()
    assert stats["prefix_cache_queries"] > 0 and 0 < stats["prefix_cache_hit_rate"] < 1
    assert stats["num_cached_blocks"] > 0


def test_each_request_counts_once_in_the_prefix_stats_however_long_it_waits(qwen3_vl_dir):
    """A pool of 8 blocks and 40 requests: most wait through many steps for room, looked up at each one, yet
    the stats count each prompt once."""
    llm = make_llm(qwen3_vl_dir, enable_prefix_caching=True, num_gpu_blocks_override=8, max_model_len=128)
    prompts = [llm.engine.input_processor.process(f"{i} " * 20) for i in range(40)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert llm.engine.get_stats()["prefix_cache_queries"] == sum(len(p.prompt_token_ids) for p in prompts)
    assert_pool_idle(llm)


def test_freed_cached_blocks_are_reclaimed_oldest_first(qwen3_vl_dir):
    llm = make_llm(qwen3_vl_dir, enable_prefix_caching=True, num_gpu_blocks_override=12)
    old = [{"role": "user", "content": SYSTEM}]
    chat(llm, old)
    for i in range(4):   # other prompts push the pool round; the oldest cached blocks go first
        chat(llm, [{"role": "user", "content": f"{i} " * 40}])
    _, out = chat(llm, old)
    assert out.metrics.num_cached_tokens == 0
    assert llm.engine.kv.num_free_blocks == 12


def test_swap_keeps_outputs_and_returns_every_cpu_block(qwen3_vl_dir):
    prompts = [{"prompt_token_ids": list(range(3 + i, 60 + i))} for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ample = [o.outputs[0].token_ids for o in make_llm(qwen3_vl_dir).generate(prompts, params)]
    swapping = make_llm(qwen3_vl_dir, num_gpu_blocks_override=9, swap_space=0.01)
    outs = [o.outputs[0].token_ids for o in swapping.generate(prompts, params)]
    assert outs == ample
    stats = swapping.engine.get_stats()
    assert stats["num_swap_outs"] > 0 and stats["num_swap_ins"] == stats["num_swap_outs"]
    assert stats["num_free_cpu_blocks"] == stats["num_total_cpu_blocks"]
    assert_pool_idle(swapping)


def test_without_swap_space_preemption_recomputes(qwen3_vl_dir):
    prompts = [{"prompt_token_ids": list(range(3 + i, 60 + i))} for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ample = [o.outputs[0].token_ids for o in make_llm(qwen3_vl_dir).generate(prompts, params)]
    llm = make_llm(qwen3_vl_dir, num_gpu_blocks_override=9, swap_space=0)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ample
    stats = llm.engine.get_stats()
    assert stats["num_recompute_preemptions"] > 0 and stats["num_swap_outs"] == 0
    assert_pool_idle(llm)


def finishing_order(model_dir, policy: str) -> list[str]:
    """Four long low-priority requests (one fits in the pool at a time), then a shorter urgent one."""
    llm = make_llm(model_dir, num_gpu_blocks_override=12, swap_space=0.01, scheduling_policy=policy)
    engine = llm.engine
    low = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"low-{i}", {"prompt_token_ids": list(range(5, 50))}, low, priority=1)
    for _ in range(3):
        engine.step()
    urgent = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request("urgent", {"prompt_token_ids": list(range(7, 52))}, urgent, priority=0)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert_pool_idle(llm)
    return finished


def test_high_priority_request_submitted_last_finishes_first(qwen3_vl_dir):
    assert finishing_order(qwen3_vl_dir, "priority")[0] == "urgent"


def test_fcfs_serves_the_late_request_last(qwen3_vl_dir):
    assert finishing_order(qwen3_vl_dir, "fcfs")[-1] == "urgent"


def test_repeated_image_skips_the_vision_encoder(qwen3_vl_dir):
    llm = make_llm(qwen3_vl_dir)
    image = noise_image(96, 64, 21)
    ask = [{"role": "user", "content": [image_part(image), {"type": "text", "text": "Describe the image."}]}]
    _, first = chat(llm, ask)
    _, second = chat(llm, ask)
    stats = llm.engine.get_stats()
    assert (stats["encoder_cache_misses"], stats["encoder_cache_hits"]) == (1, 1)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    chat(llm, [{"role": "user", "content": [image_part(noise_image(96, 64, 22)), {"type": "text", "text": "?"}]}])
    assert llm.engine.get_stats()["encoder_cache_misses"] == 2


def test_encoder_cache_is_bounded(qwen3_vl_dir):
    llm = make_llm(qwen3_vl_dir, encoder_cache_size=20)
    for seed in range(5):   # 96x96 -> 9 tokens each: at most two fit in 20
        chat(llm, [{"role": "user", "content": [image_part(noise_image(96, 96, 30 + seed)),
                                                {"type": "text", "text": "?"}]}])
    cache = llm.engine.model_executor.driver_worker.model_runner.encoder_cache
    assert cache.num_tokens <= 20 and len(cache.entries) == 2
