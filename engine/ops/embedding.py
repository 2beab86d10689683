"""Token embedding lookup over one tensor-parallel rank's vocabulary rows, for a table on the device or in
host memory (--cpu-embeddings: the table in page-locked host memory, read by the GPU over PCIe)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.ops.dispatch import use_triton


def embedding_ref(ids: torch.Tensor, weight: torch.Tensor, vocab_start: int, vocab_end: int) -> torch.Tensor:
    """ids [...] -> [..., hidden] in weight's dtype: row `id - vocab_start` of weight for an id in
    [vocab_start, vocab_end), zeros for any other id (another rank's rows: the sum over ranks is the embedding)."""
    mine = (ids >= vocab_start) & (ids < vocab_end)
    local = torch.where(mine, ids - vocab_start, 0)
    return F.embedding(local, weight) * mine.unsqueeze(-1).to(weight.dtype)


def embedding(ids: torch.Tensor, weight: torch.Tensor, vocab_start: int, vocab_end: int) -> torch.Tensor:
    """embedding_ref's result on ids' device. On CUDA the Triton kernel reads the table where it lives: in GPU
    memory, or in page-locked host memory that the GPU reads in place (no copy, so the ids stay on the GPU and
    the lookup can be captured in a CUDA graph)."""
    if use_triton(ids):
        from engine.ops.triton import embedding as triton_embedding
        return triton_embedding.embedding(ids, weight, vocab_start, vocab_end)
    if weight.device != ids.device:
        # A host table under ENGINE_DISABLE_TRITON=1: the lookup runs on the host (a synchronizing copy of the
        # ids; eager steps only, as CUDA graphs need Triton anyway).
        return embedding_ref(ids.to(weight.device), weight, vocab_start, vocab_end).to(ids.device)
    return embedding_ref(ids, weight, vocab_start, vocab_end)
