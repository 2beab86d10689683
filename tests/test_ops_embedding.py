"""The token-embedding op (engine/ops/embedding.py): its reference against torch's F.embedding under the
tensor-parallel shard rule (rows of other ranks give zeros), and its Triton kernel against the reference in
Triton's CPU interpreter:

  CPU reference:               pytest tests/test_ops_embedding.py
  Triton's interpreter:        TRITON_INTERPRET=1 pytest tests/test_ops_embedding.py  (tests/conftest.py)
The kernel reading a page-locked host table on a GPU: tests/test_gpu_cpu_embeddings.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.ops import embedding_ref

VOCAB, HIDDEN = 103, 40     # a vocabulary that no rank count divides; a hidden size that is no power of two


def shards(tp_size: int) -> list[tuple[int, int, int]]:
    """(vocab_start, vocab_end, rows held) per rank, as VocabParallelEmbedding splits VOCAB."""
    per_rank = -(-VOCAB // tp_size)
    return [(r * per_rank, min((r + 1) * per_rank, VOCAB), per_rank) for r in range(tp_size)]


def edge_ids(tp_size: int, gen: torch.Generator, n: int = 64) -> torch.Tensor:
    """Random ids plus every shard's first and last id and its neighbours."""
    edges = [i for start, end, _ in shards(tp_size) for i in (start - 1, start, end - 1, end) if 0 <= i < VOCAB]
    return torch.cat([torch.tensor(edges), torch.randint(0, VOCAB, (n,), generator=gen)])


def rank_tables(full: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
    """Each rank's rows of `full`, its padding rows (past the vocabulary) filled with garbage that must never be
    read."""
    tables = []
    for start, end, rows in shards(tp_size):
        table = torch.full((rows, full.shape[1]), float("nan"), dtype=full.dtype)
        table[:end - start] = full[start:end]
        tables.append(table)
    return tables


@pytest.mark.parametrize("tp_size", [1, 2, 3, 4])
def test_reference_gives_a_ranks_rows_and_zeros_elsewhere(tp_size, gen):
    full = torch.randn(VOCAB, HIDDEN, generator=gen)
    ids = edge_ids(tp_size, gen)
    parts = [embedding_ref(ids, table, start, end)
             for table, (start, end, _) in zip(rank_tables(full, tp_size), shards(tp_size))]
    for part, (start, end, _) in zip(parts, shards(tp_size)):
        mine = (ids >= start) & (ids < end)
        assert torch.equal(part[mine], F.embedding(ids[mine], full))
        assert torch.equal(part[~mine], torch.zeros(int((~mine).sum()), HIDDEN))
    # The all-reduce's sum over ranks is the embedding.
    assert torch.equal(torch.stack(parts).sum(0), F.embedding(ids, full))


def test_reference_keeps_the_ids_shape_and_the_tables_dtype(gen):
    table = torch.randn(VOCAB, HIDDEN, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (3, 5), generator=gen)
    out = embedding_ref(ids, table, 0, VOCAB)
    assert out.shape == (3, 5, HIDDEN) and out.dtype == torch.bfloat16
    assert torch.equal(out, F.embedding(ids, table))


@pytest.mark.triton_interpret   # in Triton's interpreter: the TRITON_INTERPRET=1 session
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("tp_size", [1, 3])
@pytest.mark.parametrize("hidden", [HIDDEN, 1500])   # one column block; several, the last one partial
def test_triton_kernel_equals_the_reference(tp_size, dtype, hidden, gen):
    from engine.ops.triton.embedding import embedding

    full = torch.randn(VOCAB, hidden, generator=gen).to(dtype)
    ids = edge_ids(tp_size, gen, n=16)
    for table, (start, end, _) in zip(rank_tables(full, tp_size), shards(tp_size)):
        got = embedding(ids, table, start, end)
        assert torch.equal(got, embedding_ref(ids, table, start, end)), "a copy: bit for bit"


@pytest.mark.triton_interpret   # in Triton's interpreter: the TRITON_INTERPRET=1 session
def test_triton_kernel_with_no_tokens_and_2d_ids(gen):
    from engine.ops.triton.embedding import embedding

    table = torch.randn(VOCAB, HIDDEN, generator=gen)
    assert embedding(torch.zeros(0, dtype=torch.int64), table, 0, VOCAB).shape == (0, HIDDEN)
    ids = torch.randint(0, VOCAB, (2, 7), generator=gen)
    assert torch.equal(embedding(ids, table, 0, VOCAB), F.embedding(ids, table))
