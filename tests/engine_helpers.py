"""Shared helpers for engine tests: deterministic images, engine construction, pool accounting checks."""
from __future__ import annotations

import numpy as np
from PIL import Image

from engine import LLM


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    """A random RGB image: every pixel matters, so a wrong patch order or position shows in the logits."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def make_llm(model_dir, **kwargs) -> LLM:
    defaults = dict(num_gpu_blocks_override=256, max_model_len=2048, swap_space=0.01, enforce_eager=True)
    defaults.update(kwargs)
    return LLM(str(model_dir), **defaults)


def assert_pool_idle(llm: LLM) -> None:
    """Every GPU and CPU block is free again and no cached block still holds a reference."""
    engine = llm.engine
    kv = engine.kv
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == engine.kv_cache_config.num_gpu_blocks, "GPU blocks leaked"
    assert kv.num_free_cpu_blocks == engine.kv_cache_config.num_cpu_blocks, "CPU swap blocks leaked"
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks), "a block kept a reference"
    assert not kv.requests, "the KV cache manager kept a request's record"
    assert not engine.model_executor.driver_worker.model_runner.requests, "the runner kept a finished request's data"
    assert not engine.grammars, "a structured-output matcher outlived its request"
