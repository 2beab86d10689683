"""--cpu-embeddings on a CUDA GPU (pytest -m gpu; bench/device_check.sh's engine stage): the token-embedding table
lives in page-locked host memory and the Triton lookup kernel reads its rows over PCIe, in place.

- the kernel on such a table equals F.embedding (bf16, the 8B's table shape, shard edges, 1..8192 tokens), also
  replayed from a CUDA graph with new ids; without Triton the op still answers, gathering on the host;
- an engine with the flag holds the table's bytes less GPU memory after start-up, at its peak too (the rows go
  straight to host memory, never through a GPU copy), and says where the table is;
- its greedy tokens are those of the same engine without the flag: text and an image, eager and CUDA graphs, a
  4-bit checkpoint, dummy weights, two ranks.
CPU side (the flag on the CPU, tied embeddings, two ranks over gloo): tests/test_cpu_embeddings.py."""
from __future__ import annotations

import gc
import importlib

import pytest
import torch
import torch.nn.functional as F

from engine import SamplingParams
from engine.ops import embedding_ref
from engine_helpers import assert_pool_idle, make_llm, noise_image
from quant_checkpoints import Spec, write_quantized
from test_engine_parity import image_part

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
TEXT = [{"role": "user", "content": "Hello! How can I help you today?"}]
IMAGE = [{"role": "user", "content": [image_part(noise_image(96, 160, 2)), {"type": "text", "text": "Describe."}]}]
VOCAB_8B, HIDDEN_8B = 151936, 4096
BIG_VOCAB = 131072      # a tiny Llama whose table dominates its weights (12.6 MB in bf16)


def greedy_tokens(llm, conversations) -> list[list[int]]:
    prompts = [llm.engine.input_processor.process_chat(c) for c in conversations]
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    tokens += [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]   # alone: prefill graphs
    assert_pool_idle(llm)
    return tokens


def assert_table_in_host_memory(llm) -> None:
    model = llm.engine.model_executor.driver_worker.model
    table = model.decoder.embed_tokens
    assert table.in_host_memory and table.weight.device.type == "cpu" and table.weight.is_pinned()
    assert model.lm_head.weight.is_cuda


# ---- the kernel ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def table_8b():
    """The 8B's bf16 table on the GPU: the expected values."""
    return torch.randn(VOCAB_8B, HIDDEN_8B, device="cuda").to(torch.bfloat16)


@pytest.mark.parametrize("tp_size, rank", [(1, 0), (2, 0), (2, 1)], ids=["tp1", "tp2-rank0", "tp2-rank1"])
def test_kernel_reads_a_page_locked_host_table(table_8b, tp_size, rank):
    from engine.model.vocab_parallel_embedding import host_table
    from engine.ops.triton.embedding import embedding

    per_rank = -(-VOCAB_8B // tp_size)
    start, end = rank * per_rank, min((rank + 1) * per_rank, VOCAB_8B)
    host = host_table(per_rank, HIDDEN_8B, torch.bfloat16)
    assert host.device.type == "cpu" and host.is_pinned()
    host.data[:end - start].copy_(table_8b[start:end])
    edges = torch.tensor([start, end - 1, min(end, VOCAB_8B - 1), max(start - 1, 0), 0, VOCAB_8B - 1],
                         device="cuda")
    for tokens in (1, 2, 7, 64, 1000, 8192):
        ids = torch.cat([edges, torch.randint(0, VOCAB_8B, (tokens,), device="cuda")])[:tokens]
        got = embedding(ids, host, start, end)
        assert got.is_cuda and got.shape == (tokens, HIDDEN_8B)
        assert torch.equal(got, embedding_ref(ids, table_8b[start:end], start, end)), tokens
        if tp_size == 1:
            assert torch.equal(got, F.embedding(ids, table_8b)), tokens


def test_kernel_on_a_host_table_replays_from_a_cuda_graph(table_8b):
    from engine.model.vocab_parallel_embedding import host_table
    from engine.ops.triton.embedding import embedding

    host = host_table(VOCAB_8B, HIDDEN_8B, torch.bfloat16)
    host.data.copy_(table_8b)
    ids = torch.randint(0, VOCAB_8B, (64,), device="cuda")
    embedding(ids, host, 0, VOCAB_8B)        # compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = embedding(ids, host, 0, VOCAB_8B)
    for _ in range(3):
        ids.copy_(torch.randint(0, VOCAB_8B, (64,), device="cuda"))
        graph.replay()
        assert torch.equal(out, F.embedding(ids, table_8b))


def test_without_triton_the_lookup_runs_on_the_host(table_8b, monkeypatch):
    """ENGINE_DISABLE_TRITON=1: the op gathers on the host and copies the rows to the ids' device (eager only)."""
    from engine.model.vocab_parallel_embedding import host_table

    op = importlib.import_module("engine.ops.embedding")   # `import ... as` finds engine.ops' function of that name

    monkeypatch.setattr(op, "use_triton", lambda t: False)
    host = host_table(VOCAB_8B, HIDDEN_8B, torch.bfloat16)
    host.data.copy_(table_8b)
    ids = torch.randint(0, VOCAB_8B, (100,), device="cuda")
    got = op.embedding(ids, host, 0, VOCAB_8B)
    assert got.is_cuda and torch.equal(got, F.embedding(ids, table_8b))


# ---- the engine: GPU memory ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def big_vocab_llama(tmp_path_factory):
    import tiny_models

    return tiny_models.build_llama(tmp_path_factory.mktemp("models") / "big-vocab-llama", vocab_size=BIG_VOCAB)


def started(model_dir, **kwargs):
    """(engine, GPU bytes it holds once started, its peak GPU bytes while starting)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    llm = make_llm(model_dir, device="cuda", dtype="bfloat16", **kwargs)
    torch.cuda.synchronize()
    return llm, torch.cuda.memory_allocated() - before, torch.cuda.max_memory_allocated() - before


def test_the_table_takes_no_gpu_memory(big_vocab_llama, engine_log):
    llm, held, peak = started(big_vocab_llama)
    expected = greedy_tokens(llm, [TEXT])
    del llm
    llm, held_flag, peak_flag = started(big_vocab_llama, cpu_embeddings=True)
    table_bytes = BIG_VOCAB * 48 * 2
    assert_table_in_host_memory(llm)
    assert held - held_flag >= 0.99 * table_bytes, (held, held_flag)
    assert peak - peak_flag >= 0.99 * table_bytes, "the table passed through GPU memory while loading"
    assert any(f"Token embeddings in host memory ({table_bytes / 1e9:.2f} GB, --cpu-embeddings" in r.getMessage()
               for r in engine_log.records)
    assert greedy_tokens(llm, [TEXT]) == expected


# ---- the engine: the same tokens -----------------------------------------------------------------------------
@pytest.mark.parametrize("model, conversations, eager", [
    ("qwen3_vl_dir", [TEXT, IMAGE], True), ("qwen3_vl_dir", [TEXT, IMAGE], False), ("llama_dir", [TEXT], False)],
    ids=["qwen3-vl-eager", "qwen3-vl-cuda-graphs", "llama-cuda-graphs"])
def test_same_greedy_tokens_with_and_without_the_flag(model, conversations, eager, request):
    model_dir = request.getfixturevalue(model)
    expected = greedy_tokens(make_llm(model_dir, device="cuda", dtype="bfloat16", enforce_eager=eager),
                             conversations)
    llm = make_llm(model_dir, device="cuda", dtype="bfloat16", enforce_eager=eager, cpu_embeddings=True)
    assert_table_in_host_memory(llm)
    if not eager:
        assert llm.engine.model_executor.driver_worker.model_runner.graphs is not None, "CUDA graphs captured with the host table"
    assert greedy_tokens(llm, conversations) == expected


@pytest.mark.parametrize("load", ["awq", "dummy"])
def test_quantized_and_dummy_weights_fill_the_host_table(load, qwen3_vl_dir, tmp_path_factory):
    if load == "awq":
        model_dir, kwargs = write_quantized(qwen3_vl_dir, tmp_path_factory.mktemp("awq"),
                                            Spec("awq", group_size=32, symmetric=False))[0], {}
    else:
        model_dir, kwargs = qwen3_vl_dir, dict(load_format="dummy")
    expected = greedy_tokens(make_llm(model_dir, device="cuda", dtype="bfloat16", **kwargs), [TEXT, IMAGE])
    llm = make_llm(model_dir, device="cuda", dtype="bfloat16", cpu_embeddings=True, **kwargs)
    assert_table_in_host_memory(llm)
    assert greedy_tokens(llm, [TEXT, IMAGE]) == expected


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_each_with_its_share_in_host_memory(qwen3_vl_dir):
    tp = dict(device="cuda", dtype="bfloat16", enforce_eager=False, tensor_parallel_size=2)
    llm = make_llm(qwen3_vl_dir, **tp)
    try:
        expected = greedy_tokens(llm, [TEXT, IMAGE])
    finally:
        llm.shutdown()
    llm = make_llm(qwen3_vl_dir, cpu_embeddings=True, **tp)
    try:
        assert_table_in_host_memory(llm)
        assert greedy_tokens(llm, [TEXT, IMAGE]) == expected
    finally:
        llm.shutdown()
