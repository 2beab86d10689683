"""--kv-cache-dtype fp8 (vLLM's flag): K and V stored as float8_e4m3fn with scale 1.0, on the CPU reference
path. The only thing it changes is the rounding of what the cache stores: attention on an fp8 cache is attention
on the values rounded through e4m3; the pool holds twice the tokens of a bf16 one in the same bytes; engine
log-probs stay close to a model-dtype cache's. Engine modes under fp8: test_engine_equivalence.py. Triton
kernels: test_ops_triton_kv_fp8.py."""
from __future__ import annotations

import argparse
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.args import EngineArgs, add_cli_args
from engine.worker.cache_engine import CacheEngine
from engine.errors import ModelLoadError
from engine.ops.attention import paged_attention_ref
from engine.ops.kv_cache import FP8_KV_DTYPE, store_kvcache_ref
from engine_helpers import make_llm
from paged_batches import make_batch
from test_engine_parity import CONVERSATIONS, IMAGE_CONVERSATIONS

FP8 = FP8_KV_DTYPE


# ---- the cache write -------------------------------------------------------------------------------------------
def test_store_rounds_to_nearest_e4m3_and_saturates_at_448():
    k = torch.tensor([[[1.0, 1.0625, 1.1875, 1000.0]], [[-1000.0, 449.0, 2.0 ** -10, -3.0 * 2.0 ** -10]]])
    v = -k
    k_cache = torch.zeros(2, 2, 1, 4).to(FP8)
    v_cache = torch.zeros(2, 2, 1, 4).to(FP8)
    store_kvcache_ref(k, v, k_cache, v_cache, torch.tensor([3, -1]))      # -1: not written
    # 1.0625 is halfway between 1 and 1.125 (even: 1); 1.1875 between 1.125 and 1.25 (even: 1.25).
    assert k_cache.float()[1, 1, 0].tolist() == [1.0, 1.0, 1.25, 448.0]
    assert v_cache.float()[1, 1, 0].tolist() == [-1.0, -1.0, -1.25, -448.0]
    assert k_cache.float().abs().sum() == 1.0 + 1.0 + 1.25 + 448.0        # nothing else written


# ---- attention reads the rounded values, and nothing else changes ------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_attention_on_fp8_cache_is_attention_on_the_rounded_values(dtype, block_size):
    gen = torch.Generator().manual_seed(7)
    q, k, v, md = make_batch(gen, [1, 17, 0, 100], [(40, 40), (9, 70), (1, 5)], 8, 2, 64, block_size, dtype, "cpu")
    k8, v8 = k.clamp(-448, 448).to(FP8), v.clamp(-448, 448).to(FP8)
    rounded = (k8.float().to(dtype), v8.float().to(dtype))
    out = paged_attention_ref(q, k8, v8, md, 0.125)
    assert torch.equal(out, paged_attention_ref(q, *rounded, md, 0.125))
    # ...and the rounding is visible: the fp8 cache is not the original one.
    assert not torch.equal(out, paged_attention_ref(q, k.to(dtype), v.to(dtype), md, 0.125))


# ---- sizing -----------------------------------------------------------------------------------------------------
def test_fp8_halves_bytes_per_block_and_doubles_the_pool(qwen3_vl_dir):
    config = None
    counts = {}
    for kv_dtype in ("auto", "fp8"):
        llm = LLM(str(qwen3_vl_dir), dtype="bfloat16", kv_cache_dtype=kv_dtype, cpu_kv_cache_space=0.01,
                  max_model_len=512, swap_space=0.001, enforce_eager=True)
        engine, config = llm.engine, llm.engine.model_config
        stats = engine.stats.snapshot()
        counts[kv_dtype] = (engine.kv_cache_config.num_gpu_blocks, engine.kv_cache_config.num_cpu_blocks, stats["bytes_per_block"])
        assert engine.model_executor.driver_worker.cache.gpu_cache.dtype == (torch.bfloat16 if kv_dtype == "auto" else FP8)
        assert engine.model_executor.driver_worker.cache.cpu_cache.dtype == engine.model_executor.driver_worker.cache.gpu_cache.dtype
        assert stats["kv_cache_dtype"] == ("bfloat16" if kv_dtype == "auto" else "float8_e4m3fn")
        assert stats["kv_bytes_per_token"] == stats["bytes_per_block"] // 16
    per_token_bf16 = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    (gpu_auto, cpu_auto, bytes_auto), (gpu_fp8, cpu_fp8, bytes_fp8) = counts["auto"], counts["fp8"]
    assert bytes_auto == per_token_bf16 * 16 and bytes_fp8 * 2 == bytes_auto
    assert gpu_fp8 in (2 * gpu_auto, 2 * gpu_auto + 1)       # the same budget, floor-divided by half the bytes
    assert cpu_fp8 in (2 * cpu_auto, 2 * cpu_auto + 1)
    assert CacheEngine.bytes_per_block(config, 16, FP8) * 2 == CacheEngine.bytes_per_block(config, 16, torch.bfloat16)


# ---- accuracy ---------------------------------------------------------------------------------------------------
# Tolerance on the log-probs of each prompt position's 5 likeliest tokens. e4m3 keeps 3 mantissa bits: each stored
# K/V element moves by up to 2^-4 of itself. On these tiny random models (weights of std 0.15, top-20 log-probs
# spread over ~7 nats) that moves log-probs by at most 0.41 (measured over these prompts); rounding the same K/V
# through bf16 instead (7 bits, 16x finer) moves them by 0.03. A misread byte, a lost scale or values written
# without saturation would move them by whole nats.
FP8_LOGPROB_TOL = 0.6
PROMPT_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=20)


def max_logprob_change(model_dir, conversations) -> float:
    auto, fp8 = make_llm(model_dir), make_llm(model_dir, kv_cache_dtype="fp8")
    worst = 0.0
    for conversation in conversations:
        prompt = auto.engine.input_processor.process_chat(conversation)
        [want], [got] = auto.generate(prompt, PROMPT_LOGPROBS), fp8.generate(prompt, PROMPT_LOGPROBS)
        for a, b in zip(want.prompt_logprobs[1:], got.prompt_logprobs[1:]):
            top = sorted(a, key=a.get, reverse=True)[:5]
            assert top[0] in b, "the model-dtype cache's likeliest token left the fp8 cache's top 20"
            worst = max(worst, max(abs(a[t] - b[t]) for t in top if t in b))
    return worst


def test_fp8_logprobs_close_to_model_dtype_cache_qwen3_vl(qwen3_vl_dir):
    conversations = list(CONVERSATIONS.values()) + [make() for make in IMAGE_CONVERSATIONS.values()]
    assert 0.0 < max_logprob_change(qwen3_vl_dir, conversations) <= FP8_LOGPROB_TOL


def test_fp8_logprobs_close_to_model_dtype_cache_llama(llama_dir):
    assert 0.0 < max_logprob_change(llama_dir, list(CONVERSATIONS.values())) <= FP8_LOGPROB_TOL


# ---- what is refused ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["fp8_e5m2", "int8", "bfloat16"])
def test_other_kv_cache_dtypes_are_refused(value):
    with pytest.raises(ValueError, match=f"kv_cache_dtype must be one of auto, fp8, fp8_e4m3, not '{value}'"):
        EngineArgs(model="m", kv_cache_dtype=value)
    parser = add_cli_args(argparse.ArgumentParser(exit_on_error=False))
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        parser.parse_args(["--model", "m", "--kv-cache-dtype", value])


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3"])
def test_fp8_values_parse(value):
    ns = add_cli_args(argparse.ArgumentParser()).parse_args(["--model", "m", "--kv-cache-dtype", value])
    assert EngineArgs.from_cli(ns).kv_cache_dtype == value


@pytest.fixture(scope="module")
def scaled_kv_dir(llama_dir, tmp_path_factory):
    """The tiny Llama with per-layer k_scale/v_scale tensors, as checkpoints calibrated for an fp8 KV cache ship."""
    out = tmp_path_factory.mktemp("models") / "llama-kv-scales"
    shutil.copytree(llama_dir, out)
    tensors = load_file(out / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.05)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.02)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_checkpoint_kv_scales_are_refused_under_fp8(scaled_kv_dir):
    with pytest.raises(ModelLoadError, match=r"KV cache scales \(model\.layers\.0\.self_attn\.k_scale\).*"
                                             r"--kv-cache-dtype auto"):
        make_llm(scaled_kv_dir, kv_cache_dtype="fp8")


def test_checkpoint_kv_scales_are_unused_by_a_model_dtype_cache(scaled_kv_dir, llama_dir):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    [got] = make_llm(scaled_kv_dir).generate("Hello", params)
    [want] = make_llm(llama_dir).generate("Hello", params)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
