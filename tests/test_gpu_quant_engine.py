"""On a CUDA GPU (pytest -m gpu): a quantized checkpoint served through the Triton kernels, eager and under CUDA
graphs, computes what the CPU engine computes from the same checkpoint with the torch references. bf16 on the GPU
against fp32 on the CPU: close log-probs and the same tokens for the first two steps (up to a near tie), for text,
one and two images."""
from __future__ import annotations

import pytest
import torch

from engine.model.quantization.layers import UnquantizedLinearMethod
from engine_helpers import make_llm
from quant_checkpoints import write_quantized
from test_gpu_engine import assert_same_until_near_tie, outputs
from test_quant_formats import VL_SPECS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", params=list(VL_SPECS))
def quantized(request, qwen3_vl_dir, tmp_path_factory):
    quant_dir, _ = write_quantized(qwen3_vl_dir, tmp_path_factory.mktemp("gpu-quant"), VL_SPECS[request.param])
    return quant_dir, outputs(make_llm(quant_dir, device="cpu"), batched=False)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
def test_gpu_quantized_matches_cpu_references(quantized, eager):
    quant_dir, cpu_reference = quantized
    llm = make_llm(quant_dir, device="cuda", dtype="bfloat16", enforce_eager=eager)
    layers = [m for m in llm.engine.model_executor.driver_worker.model.modules()
              if hasattr(m, "quant_method") and not isinstance(m.quant_method, UnquantizedLinearMethod)]
    assert layers and all(p.is_cuda for m in layers for p in m.parameters()), "quantized layers on the GPU"
    for batched in (False, True):
        for got, ref in zip(outputs(llm, batched), cpu_reference):
            assert_same_until_near_tie(got, ref, atol=0.15, steps=2)
