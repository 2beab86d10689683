"""On a CUDA GPU (run on the device machine: pytest -m gpu tests/test_gpu_spec_eagle3.py): the target's hidden
states for EAGLE-3 come out of CUDA-graph replays as they come out of eager steps, and the proposer drafts on the
GPU (the target's token embedding in host memory included) what it drafts on the CPU."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.worker.cuda_graphs import enable_cuda_graphs
from engine_helpers import assert_pool_idle, make_llm
from test_spec_eagle3 import History, fresh_drafts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = ["The capital of France is", "Once upon a time there was a small cat who liked to sleep in the sun."]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)


def test_graph_replays_record_the_same_hidden_states_as_eager_steps(qwen3_vl_dir):
    llm = make_llm(qwen3_vl_dir, device="cuda", dtype="float32", enforce_eager=False)
    worker = llm.engine.model_executor.driver_worker
    decoder = worker.model.decoder
    off = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]

    decoder.aux_hidden_state_layers = (0, 1, 3)
    enable_cuda_graphs(worker)            # captured again, now with the capture layers set
    graphs = worker.model_runner.graphs
    replay, compared = graphs.run, []

    def run_checked(inp):
        eager = worker.model(inp.input_ids, inp.positions, worker.model_runner.kv_caches, inp.md, inp.mm)
        eager_aux = decoder.aux_hidden_states.clone()
        out = replay(inp)
        got = decoder.aux_hidden_states
        assert got.shape == eager_aux.shape == (inp.input_ids.shape[0], 3 * worker.model.config.hidden_size)
        compared.append(((got - eager_aux).norm() / eager_aux.norm()).item())
        assert ((out - eager).norm() / eager.norm()).item() < 1e-3
        return out

    graphs.run = run_checked
    on = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert compared, "the steps replayed graphs"
    assert max(compared) < 1e-3
    assert on == off
    assert_pool_idle(llm)


@pytest.mark.parametrize("cpu_embeddings", [False, True])
def test_proposer_on_the_gpu_drafts_as_on_the_cpu(qwen3_vl_dir, tmp_path, cpu_embeddings):
    import tiny_models
    from engine.spec_decode.eagle3_proposer import Eagle3Proposer

    draft = tiny_models.build_eagle3(qwen3_vl_dir, tmp_path / "draft")
    cpu_target = make_llm(qwen3_vl_dir, device="cpu").engine.model_executor.driver_worker.model
    gpu_llm = make_llm(qwen3_vl_dir, device="cuda", dtype="float32", cpu_embeddings=cpu_embeddings)
    gpu_target = gpu_llm.engine.model_executor.driver_worker.model
    assert gpu_target.decoder.embed_tokens.in_host_memory == cpu_embeddings
    history = History(0, 30, cpu_target.config.vocab_size, 3 * cpu_target.config.hidden_size)
    gpu = Eagle3Proposer(draft, gpu_target, "cuda", torch.float32, 3)
    for end in (5, 17, 30):
        feed, aux = history.feed("r", 0, end, True)
        gpu.forget("r")
        assert gpu.propose([feed], aux.cuda())["r"] == fresh_drafts(draft, cpu_target, history, end)
