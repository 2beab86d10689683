"""The decoder takes image rows in two forms that must agree exactly: indexed (the eager path: only the image
tokens' rows) and dense (the CUDA-graph path: a row per token, a mask, zero deepstack on text rows)."""
from __future__ import annotations

import torch

from engine import SamplingParams
from engine.model.decoder import DenseMultimodalEmbeds
from engine_helpers import assert_pool_idle, make_llm, noise_image
from test_engine_parity import image_part


def test_dense_image_rows_give_the_same_tokens_and_logprobs(qwen3_vl_dir, monkeypatch):
    llm = make_llm(qwen3_vl_dir, enable_prefix_caching=False)   # the second run must compute every row
    chat = [{"role": "user", "content": [image_part(noise_image(64, 96, 5)), {"type": "text", "text": "What?"}]}]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
    indexed = llm.chat([chat], params)[0].outputs[0]

    model = llm.engine.model_executor.driver_worker.model
    eager_forward = model.forward
    seen = []

    def dense_forward(input_ids, positions, kv_caches, md, mm=None):
        if mm is not None:
            dense = DenseMultimodalEmbeds.zeros(model, input_ids.shape[0], input_ids.device)
            dense.scatter_(mm)
            seen.append(int(dense.mask.sum()))
            out = eager_forward(input_ids, positions, kv_caches, md, dense)
            dense.clear_(mm)
            assert not dense.mask.any() and not dense.deepstack.any(), "clear_ must restore the all-text state"
            return out
        return eager_forward(input_ids, positions, kv_caches, md, mm)

    monkeypatch.setattr(model, "forward", dense_forward)
    dense = llm.chat([chat], params)[0].outputs[0]
    assert seen == [6], "the image's 6 rows (64x96 pixels: 4x6 patches, merged 2x2) went through the dense form"
    assert dense.token_ids == indexed.token_ids
    for a, b in zip(dense.logprobs, indexed.logprobs):
        assert a.keys() == b.keys()
        assert all(torch.isclose(torch.tensor(a[t]), torch.tensor(b[t]), atol=1e-6) for t in a)
    assert_pool_idle(llm)
