"""The token embedding and the lm_head split along the vocabulary (vLLM's names). Rank r holds rows
[r * V_local, (r + 1) * V_local) with V_local = ceil(vocab / tp_size): the vocabulary is padded to a multiple of
tp_size, the padding rows are zero and their logits are cut off. At TP=1 they are nn.Embedding's lookup and
nn.Linear's product on the [vocab, hidden] weight, with no collective."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import (get_tp_rank, get_tp_size, tensor_model_parallel_all_gather,
                                               tensor_model_parallel_all_reduce)
from engine.errors import ModelLoadError


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        # Rows of the checkpoint this rank holds (the last rank's share may be short, or empty).
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim),
                                   requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Each rank looks up the ids in its rows (zero for the others); the sum over ranks is the embedding.
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(out)

    def checkpoint_ranges(self, index: None) -> tuple[tuple[int, int], None]:
        return (self.vocab_start, max(self.vocab_end - self.vocab_start, 0)), None

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, index: None, name: str) -> None:
        rows = self.vocab_end - self.vocab_start
        if tuple(tensor.shape) != (rows, param.shape[1]):
            raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)}, expected "
                                 f"{(rows, param.shape[1])}" + (f" (rows {self.vocab_start}..{self.vocab_end} of "
                                                                 f"the vocabulary, this rank's share)"
                                                                 if self.tp_size > 1 else ""),
                                 code="shape_mismatch")
        param.data[:rows].copy_(tensor)
        param.data[rows:].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection over this rank's vocabulary rows (the embedding's own rows when tied)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead computes logits (compute_logits), it does not embed tokens")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> float32 [S, vocab]. Under tensor parallelism every rank must call it (it gathers
        every rank's vocabulary slice) and every rank gets the full logits."""
        logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)[..., :self.num_embeddings]
        return logits.float()
