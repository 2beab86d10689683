"""--cpu-embeddings (EngineArgs.cpu_embeddings) where CI runs, on the CPU: the table is in host memory there
already, so the flag changes nothing and says so; a model whose lm_head shares the table gets a warning; neither
fails, and the tokens are those of an engine without the flag (one rank and two). Where the flag moves the
table (a GPU): tests/test_gpu_cpu_embeddings.py; the lookup op: tests/test_ops_embedding.py."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from engine import SamplingParams
from engine.args import EngineArgs
from engine.errors import ModelLoadError
from engine.model.loader import embeddings_in_host_memory, load_model_config
from engine.model.vocab_parallel_embedding import VocabParallelEmbedding, host_table
from engine.server.cli import parse_args
from engine_helpers import make_llm, noise_image
from test_engine_parity import image_part

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TEXT = [{"role": "user", "content": "Hello! How can I help you today?"}]
IMAGE = [{"role": "user", "content": [image_part(noise_image(64, 96, 7)), {"type": "text", "text": "Describe."}]}]
ON_CPU = "--cpu-embeddings changes nothing on the CPU"
TIED = "--cpu-embeddings saves nothing for this model"


def said(log, text: str) -> bool:
    return any(text in r.getMessage() for r in log.records)


def greedy_tokens(llm, conversations) -> list[list[int]]:
    prompts = [llm.engine.input_processor.process_chat(c) for c in conversations]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_the_flag_is_an_engine_switch():
    assert parse_args(["--model", "m", "--cpu-embeddings"])[0] == EngineArgs(model="m", cpu_embeddings=True)
    assert EngineArgs(model="m").cpu_embeddings is False


def test_the_table_moves_to_host_memory_only_on_a_gpu_and_only_when_lm_head_does_not_share_it(
        llama_dir, qwen3_dir, engine_log):
    untied, tied = load_model_config(llama_dir), load_model_config(qwen3_dir)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert embeddings_in_host_memory(True, untied, cuda)
    assert not embeddings_in_host_memory(False, untied, cuda)
    assert not said(engine_log, "--cpu-embeddings")
    assert not embeddings_in_host_memory(True, untied, cpu) and said(engine_log, ON_CPU)
    assert not embeddings_in_host_memory(True, tied, cuda)
    assert [r.levelname for r in engine_log.records if TIED in r.getMessage()] == ["WARNING"]


class FakeCudart:
    """Stands in for torch.cuda.cudart() on a machine without CUDA: records what would be page-locked."""

    def __init__(self, error: int = 0):
        self.error, self.calls = error, []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        return self.error

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0


def test_a_host_table_page_locks_its_bytes_exactly_until_the_parameter_is_gone(monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    table = host_table(1000, 48, torch.bfloat16)
    ptr = table.data_ptr()
    assert table.device.type == "cpu" and table.shape == (1000, 48) and not table.requires_grad
    # (cudaHostRegisterPortable | cudaHostRegisterMapped; no rounding up, unlike torch's pinned allocator)
    assert cudart.calls == [("register", ptr, 1000 * 48 * 2, 3)]
    del table
    gc.collect()
    assert cudart.calls[-1] == ("unregister", ptr)


def test_a_table_that_cannot_be_page_locked_is_refused_naming_the_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(error=2))
    with pytest.raises(ModelLoadError, match="--cpu-embeddings: cannot page-lock .* error 2"):
        host_table(1000, 48, torch.float32)


def test_a_host_table_looks_up_through_the_op(monkeypatch, gen):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    module = VocabParallelEmbedding(100, 16, host_memory=True)
    full = torch.randn(100, 16, generator=gen)
    module.weight_loader(module.weight, full, None, "embed_tokens.weight")
    ids = torch.randint(0, 100, (2, 9), generator=gen)
    assert module.in_host_memory and torch.equal(module(ids), F.embedding(ids, full))


def test_a_gpu_that_cannot_read_the_host_table_is_refused_at_load_naming_the_flag(monkeypatch, gen):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    module = VocabParallelEmbedding(100, 16, host_memory=True)
    module.weight_loader(module.weight, torch.randn(100, 16, generator=gen), None, "embed_tokens.weight")
    module.check_host_lookup(torch.device("cpu"))           # readable: nothing to say

    def unreadable(*args):
        raise ValueError("Pointer argument (at 1) cannot be accessed from Triton (cpu tensor?)")
    monkeypatch.setattr("engine.model.vocab_parallel_embedding.embedding", unreadable)
    with pytest.raises(ModelLoadError, match="--cpu-embeddings: the GPU cannot read .* run without"):
        module.check_host_lookup(torch.device("cpu"))


@pytest.mark.parametrize("model, conversations", [("llama_dir", [TEXT]), ("qwen3_vl_dir", [TEXT, IMAGE])],
                         ids=["llama", "qwen3-vl"])
def test_on_the_cpu_the_flag_changes_nothing_and_says_so(model, conversations, request, engine_log):
    model_dir = request.getfixturevalue(model)
    expected = greedy_tokens(make_llm(model_dir, device="cpu"), conversations)
    llm = make_llm(model_dir, device="cpu", cpu_embeddings=True)
    table = llm.engine.model_executor.driver_worker.model.decoder.embed_tokens
    assert not table.in_host_memory and table.weight.device.type == "cpu"
    assert said(engine_log, ON_CPU)
    assert greedy_tokens(llm, conversations) == expected


def test_a_model_whose_lm_head_shares_the_table_warns_and_serves(qwen3_dir, engine_log):
    expected = greedy_tokens(make_llm(qwen3_dir), [TEXT])
    llm = make_llm(qwen3_dir, cpu_embeddings=True)
    model = llm.engine.model_executor.driver_worker.model
    assert model.lm_head.weight is model.decoder.embed_tokens.weight and not model.decoder.embed_tokens.in_host_memory
    assert said(engine_log, TIED)
    assert greedy_tokens(llm, [TEXT]) == expected


@pytest.mark.slow
def test_two_ranks_with_the_flag_give_the_tokens_of_one_without(qwen3_vl_dir):
    """Each rank's share of the table goes through the lookup op with its vocabulary range (the rows of other
    ranks give zeros) and the all-reduce sums them: the same tokens as one rank without the flag."""
    expected = greedy_tokens(make_llm(qwen3_vl_dir), [TEXT, IMAGE])
    llm = make_llm(qwen3_vl_dir, tensor_parallel_size=2, cpu_embeddings=True)
    try:
        assert greedy_tokens(llm, [TEXT, IMAGE]) == expected
    finally:
        llm.shutdown()
