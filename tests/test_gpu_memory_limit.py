"""On a CUDA GPU (pytest -m gpu): --gpu-memory-limit keeps the whole process under the limit, as on a card that
size, and refuses at start a model whose weights do not fit."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.errors import ModelLoadError
from engine.worker.memory import GiB, non_torch_bytes
from engine_helpers import make_llm, noise_image
from test_engine_parity import image_part

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture
def uncapped():
    """The cap is per process: give the next test the whole device back."""
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


def test_process_stays_under_the_limit_and_cannot_exceed_it(qwen3_vl_dir, uncapped):
    limit = 2 * GiB
    llm = make_llm(qwen3_vl_dir, device="cuda", dtype="bfloat16", enforce_eager=False, num_gpu_blocks_override=None,
                   gpu_memory_limit=limit / GiB)
    engine = llm.engine
    assert engine.kv_cache_config.gpu_memory_limit == limit and engine.kv_cache_config.num_gpu_blocks > 0
    chat = [{"role": "user", "content": [image_part(noise_image(256, 256, 1)), {"type": "text", "text": "Hi"}]}]
    out = llm.generate(engine.input_processor.process_chat(chat), SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
    dev = engine.device
    assert torch.cuda.memory_reserved(dev) + non_torch_bytes(dev) <= limit
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch.empty(limit, dtype=torch.uint8, device=dev)


def test_weights_over_the_limit_are_refused_at_start(tmp_path, uncapped):
    from bench.synthetic_model import build

    model = build(tmp_path / "qwen3-vl-8b")      # bf16 weights of 17.5 GB
    with pytest.raises(ModelLoadError, match=r"weights do not fit under --gpu-memory-limit 8\.00 GiB"):
        make_llm(model, device="cuda", load_format="dummy", num_gpu_blocks_override=None, gpu_memory_limit=8)
