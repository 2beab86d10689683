"""The token embedding and the lm_head split along the vocabulary (vLLM's names). Rank r holds rows
[r * V_local, (r + 1) * V_local) with V_local = ceil(vocab / tp_size): the vocabulary is padded to a multiple of
tp_size, the padding rows are zero and their logits are cut off. At TP=1 they are nn.Embedding's lookup and
nn.Linear's product on the [vocab, hidden] weight, with no collective.

With --cpu-embeddings the embedding's table lives in page-locked host memory instead of on the GPU: a step reads
only the rows of its tokens, which the GPU fetches over PCIe in place (engine/ops/embedding.py), while the whole
table (1.24 GB for Qwen3-VL-8B in bf16) would otherwise take GPU memory the KV cache can use."""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import (get_tp_rank, get_tp_size, tensor_model_parallel_all_gather,
                                               tensor_model_parallel_all_reduce)
from engine.errors import ModelLoadError
from engine.ops import embedding, embedding_ref, linear, prepack_linear_weight, wna16_linear
from engine.ops.quant import quantize_wna16

# cudaHostRegisterPortable | cudaHostRegisterMapped: page-locked for every CUDA context, mapped into the GPUs'
# address space (under unified addressing at the host pointer's own address).
_HOST_REGISTER_FLAGS = 1 | 2
# --quantize-lm-head: 8-bit weights in groups of 128 along the hidden size (fewer where 128 does not divide it),
# float32 scales and zero points, quantized 8192 vocabulary rows at a time.
QUANT_BITS, QUANT_GROUP, QUANT_ROWS = 8, 128, 8192
# A tied table this large or smaller gets a oneDNN-packed copy for the logits on the CPU (ops.linear): SmolLM2's is
# 113 MB in fp32.
TIED_PACKED_COPY_BYTES = 512 * 2**20


def host_table(rows: int, cols: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialized [rows, cols] parameter in page-locked host memory that GPU kernels can read in place.
    Registered with cudaHostRegister rather than allocated by torch.empty(pin_memory=True): torch's pinned
    allocator rounds every block up to a power of two, which would lock 2 GiB of host memory for a 1.24 GB
    table. The registration ends with the parameter."""
    data = torch.empty(rows, cols, dtype=dtype, device="cpu")
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(data.data_ptr(), data.numel() * data.element_size(), _HOST_REGISTER_FLAGS))
    if err != 0:
        raise ModelLoadError(f"--cpu-embeddings: cannot page-lock {data.numel() * data.element_size() / 1e9:.2f} GB "
                             f"of host memory for the token embeddings (cudaHostRegister error {err}); run without "
                             f"--cpu-embeddings", code="cpu_embeddings")
    param = nn.Parameter(data, requires_grad=False)
    weakref.finalize(param, cudart.cudaHostUnregister, data.data_ptr())
    return param


class VocabParallelEmbedding(nn.Module):
    """`host_memory`: the table in page-locked host memory (--cpu-embeddings; CUDA only), read by the GPU."""

    def __init__(self, num_embeddings: int, embedding_dim: int, host_memory: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        # Rows of the checkpoint this rank holds (the last rank's share may be short, or empty).
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.in_host_memory = host_memory
        if host_memory:   # allocated there from the start: never, even briefly, a copy on the GPU
            self.weight = host_table(self.num_embeddings_per_partition, embedding_dim, torch.get_default_dtype())
        else:
            self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim),
                                       requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 and not self.in_host_memory:
            return F.embedding(input_ids, self.weight)
        # Each rank looks up the ids in its rows (zero for the others); the sum over ranks is the embedding.
        out = embedding(input_ids, self.weight, self.vocab_start, self.vocab_end)
        return out if self.tp_size == 1 else tensor_model_parallel_all_reduce(out)

    def check_host_lookup(self, device: torch.device) -> None:
        """With the table in host memory, the GPU looks its first and last rows up once, at load: a system where
        the GPU cannot read page-locked host memory in place fails here, naming the flag, not in a request."""
        if not self.in_host_memory or self.vocab_end <= self.vocab_start:
            return
        ids = torch.tensor([self.vocab_start, self.vocab_end - 1])
        try:
            got = embedding(ids.to(device), self.weight, self.vocab_start, self.vocab_end).cpu()
        except (ValueError, RuntimeError) as err:
            raise ModelLoadError(f"--cpu-embeddings: the GPU cannot read the token embeddings in host memory "
                                 f"({err}); run without --cpu-embeddings", code="cpu_embeddings") from None
        if not torch.equal(got, embedding_ref(ids, self.weight, self.vocab_start, self.vocab_end)):
            raise ModelLoadError("--cpu-embeddings: rows read by the GPU from host memory differ from the table; "
                                 "run without --cpu-embeddings", code="cpu_embeddings")

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
    """The output projection over this rank's vocabulary rows (the embedding's own rows when tied). With
    --quantize-lm-head the logits come from 8-bit weights instead (`qweight`, `scales`, `zeros`: ops.wna16_linear's
    layout, groups of `quant_group` along the hidden size): half the bytes a decode step reads for them."""
    quant_group = QUANT_GROUP

    @property
    def quantized(self) -> bool:
        return "qweight" in self._parameters

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead computes logits (compute_logits), it does not embed tokens")

    def process_weights_after_loading(self, tied: bool, quantize: bool = False) -> None:
        """On the CPU the table is repacked as the linear layers are (ops.prepack_linear_weight). A tied table stays
        plain for the token embedding's lookup, and up to TIED_PACKED_COPY_BYTES the logits get a packed copy of
        their own (`packed_weight`). `quantize`: see quantize_weights."""
        if quantize:
            self.quantize_weights(tied)
            return
        table = self.weight.data
        if tied and table.numel() * table.element_size() > TIED_PACKED_COPY_BYTES:
            return
        packed = prepack_linear_weight(table)
        if packed is not None:
            setattr(self, "packed_weight" if tied else "weight", nn.Parameter(packed, requires_grad=False))

    def quantize_weights(self, tied: bool) -> None:
        """The table as QUANT_BITS-bit weights, QUANT_ROWS vocabulary rows at a time into tensors allocated once
        (the float32 copy a chunk needs stays small, and no second copy of the result is made). A tied table stays
        for the token embedding; an untied one is freed."""
        table = self.weight.data
        (vocab, hidden), pack = table.shape, 32 // QUANT_BITS
        group = QUANT_GROUP
        while hidden % group and group > pack:
            group //= 2
        if hidden % group:
            raise ModelLoadError(f"--quantize-lm-head needs a hidden size divisible by {pack}, this model's is "
                                 f"{hidden}; run without --quantize-lm-head", code="quantize_lm_head")
        self.quant_group = group
        qweight = torch.empty(hidden // pack, vocab, dtype=torch.int32, device=table.device)
        scales = torch.empty(hidden // group, vocab, dtype=torch.float32, device=table.device)
        zeros = torch.empty_like(scales)
        for i in range(0, vocab, QUANT_ROWS):
            rows = slice(i, min(i + QUANT_ROWS, vocab))
            qweight[:, rows], scales[:, rows], zeros[:, rows] = quantize_wna16(table[rows], QUANT_BITS, group)
        self.qweight, self.scales, self.zeros = (nn.Parameter(t, requires_grad=False) for t in (qweight, scales, zeros))
        if not tied:
            del self.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> float32 [S, vocab]. Under tensor parallelism every rank must call it (it gathers
        every rank's vocabulary slice) and every rank gets the full logits."""
        if self.quantized:
            logits = wna16_linear(hidden, self.qweight, self.scales, self.zeros, self.quant_group, QUANT_BITS)
        else:
            logits = linear(hidden, self._parameters.get("packed_weight", self.weight))
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)[..., :self.num_embeddings]
        return logits.float()
