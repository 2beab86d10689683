"""On a CUDA GPU (run on the device machine: pytest -m gpu): the GPU engine — Triton kernels, CUDA graphs, pinned
swap — computes what the CPU engine computes. fp32: the same greedy tokens and log-probs within 1e-3; bf16:
log-probs close to fp32 and the same first tokens."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine_helpers import assert_pool_idle, make_llm, noise_image
from test_engine_parity import image_part

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)


def conversations():
    return [
        [{"role": "user", "content": "Hello! How can I help you today?"}],
        [{"role": "user", "content": [image_part(noise_image(64, 64, 1)), {"type": "text", "text": "Describe."}]}],
        [{"role": "user", "content": [image_part(noise_image(96, 160, 2)), {"type": "text", "text": "and"},
                                      image_part(noise_image(128, 64, 3)), {"type": "text", "text": "Compare."}]}],
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Once upon a time there was a small cat who liked to sleep in the sun."}],
    ]


def outputs(llm, batched: bool = True):
    prompts = [llm.engine.input_processor.process_chat(c) for c in conversations()]
    if batched:
        outs = llm.generate(prompts, PARAMS)
    else:
        outs = [llm.generate(p, PARAMS)[0] for p in prompts]
    assert_pool_idle(llm)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module")
def cpu_reference(qwen3_vl_dir):
    return outputs(make_llm(qwen3_vl_dir, device="cpu"), batched=False)


def assert_close_logprobs(got, ref, atol):
    for step, (a, b) in enumerate(zip(got, ref)):
        common = set(a) & set(b)
        assert common, f"step {step}: no token in common between the top log-probs"
        for tok in common:
            assert abs(a[tok] - b[tok]) <= atol, f"step {step} token {tok}: {a[tok]} vs {b[tok]}"


def assert_same_until_near_tie(got, ref, atol: float, steps: int | None = None) -> None:
    """Log-probs within atol, and the same greedy token at each step until the reference's two best tokens are
    closer than 2 * atol: there either side may rightly take the other, and what follows differs."""
    (tokens, lps), (ref_tokens, ref_lps) = got, ref
    for step, (a, b) in enumerate(list(zip(lps, ref_lps))[:steps]):
        assert_close_logprobs([a], [b], atol=atol)
        best = sorted(b.values(), reverse=True)
        if len(best) > 1 and best[0] - best[1] < 2 * atol:
            return
        assert tokens[step] == ref_tokens[step], f"step {step}: {tokens[step]} vs {ref_tokens[step]}; top {b}"


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
def test_gpu_fp32_matches_cpu(qwen3_vl_dir, cpu_reference, eager):
    llm = make_llm(qwen3_vl_dir, device="cuda", dtype="float32", enforce_eager=eager)
    if not eager:
        graphs = llm.engine.model_executor.driver_worker.model_runner.graphs
        assert graphs is not None and any(k[0] == "prefill" for k in graphs.graphs), "graphs should be captured"
    # One at a time: single-sequence prefills (text ones replay a prefill graph); then all together.
    for batched in (False, True):
        for (tokens, lps), (ref_tokens, ref_lps) in zip(outputs(llm, batched), cpu_reference):
            assert tokens == ref_tokens
            assert_close_logprobs(lps, ref_lps, atol=1e-3)


def test_a_pool_too_small_for_the_prefill_scratch_keeps_the_decode_graphs(qwen3_vl_dir, cpu_reference, monkeypatch):
    """Where the KV pool cannot spare the prefill graphs' scratch blocks (a small card), only the decode graphs are
    captured: prefill chunks run eagerly, decode steps replay, and the tokens are the CPU engine's."""
    from engine.worker import worker
    monkeypatch.setattr(worker, "prefill_scratch_blocks", lambda num_gpu_blocks, block_size: 0)
    monkeypatch.setattr(worker, "scratch_blocks_needed", lambda block_size: 0)   # make_llm's fixed pool size
    llm = make_llm(qwen3_vl_dir, device="cuda", dtype="float32", enforce_eager=False)
    graphs = llm.engine.model_executor.driver_worker.model_runner.graphs
    assert graphs is not None and not llm.engine.model_executor.driver_worker.scratch_blocks
    assert {k[0] for k in graphs.graphs} == {"decode"}
    for batched in (False, True):
        for (tokens, lps), (ref_tokens, ref_lps) in zip(outputs(llm, batched), cpu_reference):
            assert tokens == ref_tokens
            assert_close_logprobs(lps, ref_lps, atol=1e-3)


def test_gpu_bf16_is_close_to_fp32(qwen3_vl_dir, cpu_reference):
    llm = make_llm(qwen3_vl_dir, device="cuda", dtype="bfloat16")
    for (tokens, lps), (ref_tokens, ref_lps) in zip(outputs(llm), cpu_reference):
        assert tokens[:2] == ref_tokens[:2]
        assert_close_logprobs(lps[:1], ref_lps[:1], atol=0.15)


@pytest.mark.parametrize("mode", [dict(enable_prefix_caching=True), dict(num_gpu_blocks_override=10),
                                  dict(num_gpu_blocks_override=10, swap_space=0), dict(max_num_batched_tokens=8),
                                  dict(block_size=32, num_gpu_blocks_override=128)],
                         ids=["prefix-cache", "swap", "recompute", "chunked-8", "block-32"])
def test_gpu_engine_modes_match_cpu(qwen3_vl_dir, cpu_reference, mode):
    llm = make_llm(qwen3_vl_dir, device="cuda", dtype="float32", **mode)
    outs = outputs(llm)
    outs2 = outputs(llm)     # second pass: prefix-cache and encoder-cache hits
    for (tokens, _), (tokens2, _), (ref_tokens, _) in zip(outs, outs2, cpu_reference):
        assert tokens == tokens2 == ref_tokens


def test_gpu_memory_does_not_grow_over_chat_rounds(qwen3_vl_dir):
    llm = make_llm(qwen3_vl_dir, device="cuda", dtype="bfloat16", enable_prefix_caching=True,
                   limit_mm_per_prompt={"image": 16})
    history, readings = [], []
    for i in range(10):
        history.append({"role": "user", "content": [image_part(noise_image(64, 64, i % 3)),
                                                    {"type": "text", "text": f"Round {i}."}]})
        [out] = llm.chat(history, SamplingParams(temperature=0.0, max_tokens=8))
        history.append({"role": "assistant", "content": out.outputs[0].text})
        torch.cuda.synchronize()
        readings.append(torch.cuda.memory_allocated())
    # From round 3 on the three images are in the (bounded) encoder cache: nothing may grow after that.
    assert max(readings[3:]) <= readings[3], readings


def test_vision_graphs_match_the_eager_encoder(qwen3_vl_dir, monkeypatch):
    """The vision encoder's CUDA graphs (padded to a bucket of patches, one graph per bucket, segment count and
    padding) give what the eager encoder gives, also when a replay's padding rows hold an earlier image's
    pixels, and for one image that fills its bucket (no padding segment)."""
    from engine.worker import vision_graphs
    monkeypatch.setattr(vision_graphs, "BUCKET_PATCHES", 256)   # the tiny model takes at most 256 patches
    llm = make_llm(qwen3_vl_dir, device="cuda", dtype="float32", enforce_eager=False)
    graphs, visual = llm.engine.model_executor.driver_worker.model_runner.vision_graphs, llm.engine.model_executor.driver_worker.model.visual
    assert graphs is not None, "a multimodal model gets vision graphs with CUDA graphs on"
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    # The third replays the first's graph; 256 x 256 pixels are 256 patches, a bucket without padding rows.
    for sizes in ([(64, 64)], [(96, 160), (128, 64)], [(64, 96)], [(256, 256)]):
        images = [noise_image(w, h, seed) for seed, (w, h) in enumerate(sizes)]
        items = llm.engine.input_processor.process(
            {"prompt": placeholder * len(images), "multi_modal_data": {"image": images}}).images
        to_pixels = llm.engine.input_processor.image_processor.to_pixel_values
        pixels = torch.cat([to_pixels(it.raw.to(llm.engine.device)) for it in items])
        grid = torch.tensor([it.grid_thw for it in items])
        with torch.inference_mode():
            eager = visual(pixels, grid)
            graph = graphs.encode(pixels, grid)
        for got, ref in zip(graph, eager):
            assert got.shape == ref.shape
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert sorted(graphs.graphs) == [(256, 1, False), (256, 1, True), (256, 2, True)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_long_new_prompt_runs_its_attention_dense_and_matches_the_kernel(qwen3_vl_dir, monkeypatch,
                                                                           kv_cache_dtype):
    """A new prompt of DENSE_PREFILL_MIN_TOKENS or more (eager: past the prefill graphs' sizes; the threshold
    lowered to 1024 here for a short prompt) takes torch's fused attention on Hopper in bf16, on a bf16 or an fp8
    cache: the greedy tokens and log-probs of the Triton prefill kernel's run."""
    import random

    from engine.ops.triton import attention as attn
    monkeypatch.setattr(attn, "DENSE_PREFILL_MIN_TOKENS", 1024)
    llm = make_llm(qwen3_vl_dir, device="cuda", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(vocab // 10, vocab) for _ in range(1500)]}
    taken = []
    dense = attn.dense_causal_attention
    monkeypatch.setattr(attn, "dense_causal_attention", lambda *a: taken.append(a[4]) or dense(*a))

    def run():
        out = llm.generate(prompt, PARAMS)[0].outputs[0]
        assert_pool_idle(llm)
        return out.token_ids, out.logprobs

    on = run()
    hopper = attn.cudnn_attention_usable(torch.bfloat16, llm.engine.model_config.head_dim, torch.device("cuda"))
    assert taken == ([1500] * llm.engine.model_config.num_hidden_layers if hopper else [])
    monkeypatch.setattr(attn, "DENSE_PREFILL_MIN_TOKENS", 1 << 30)
    assert_same_until_near_tie(on, run(), atol=0.05)
