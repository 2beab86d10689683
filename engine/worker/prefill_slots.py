"""The prefill CUDA graphs' sequence slots (engine/worker/cuda_graphs.py).

A prefill graph runs every sequence of its step through the prefill attention kernel, whose launch grid depends only
on the token count (the graph's bucket) and the number of sequences. So each graph holds a fixed number of them:
`seq_slots` for the step's real sequences, which take the first slots, the slots after them empty (no query rows,
no context: the kernel's programs for them do nothing), and one last, dummy sequence that owns the bucket's unused
rows, its K/V written to scratch blocks outside the pool. These buffers are shared by every prefill graph; each
replay copies its step's sequences in.
"""
from __future__ import annotations

import torch

from engine.ops import AttentionMetadata
from engine.transfer import to_device


def block_slots(blocks: list[int], block_size: int, device: torch.device) -> torch.Tensor:
    """The KV slots of `blocks`, in order."""
    j = torch.arange(len(blocks) * block_size)
    return (torch.tensor(blocks, dtype=torch.int64)[j // block_size] * block_size + j % block_size).to(device)


class PrefillSlots:
    def __init__(self, seq_slots: int, width: int, dummy_blocks: list[int], block_size: int,
                 slot_mapping: torch.Tensor, device: torch.device):
        """width: block-table columns (at least a real sequence's and the dummy's); slot_mapping: the graphs'
        static per-row KV slots (shared with the decode graphs)."""
        self.seq_slots, self.block_size, self.device = seq_slots, block_size, device
        self.slot_mapping = slot_mapping
        self.query_start_loc = torch.zeros(seq_slots + 2, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(seq_slots + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(seq_slots + 1, width, dtype=torch.int32, device=device)
        self.block_tables[seq_slots, :len(dummy_blocks)] = torch.tensor(dummy_blocks, dtype=torch.int32)
        self.dummy_slots = block_slots(dummy_blocks, block_size, device)

    def set(self, bucket: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
            slots: torch.Tensor) -> None:
        """The real sequences (device tensors: query_start_loc [r + 1], seq_lens [r], block_tables [r, w], slots
        [n] for their n query tokens) in the first r slots; the empty slots after them get no rows and no
        context, and the dummy fills the bucket's other rows."""
        n, r = slots.shape[0], seq_lens.shape[0]
        empty = self.seq_slots - r
        self.slot_mapping[:n].copy_(slots, non_blocking=True)
        self.slot_mapping[n:bucket].copy_(self.dummy_slots[:bucket - n], non_blocking=True)
        self.query_start_loc[:r + 1].copy_(query_start_loc, non_blocking=True)
        self.seq_lens[:r].copy_(seq_lens, non_blocking=True)
        tail = to_device([n] * empty + [bucket] + [0] * empty + [bucket - n], torch.int32, self.device)
        self.query_start_loc[r + 1:].copy_(tail[:empty + 1], non_blocking=True)
        self.seq_lens[r:].copy_(tail[empty + 1:], non_blocking=True)
        self.block_tables[:r, :block_tables.shape[1]].copy_(block_tables, non_blocking=True)

    def metadata(self, bucket: int) -> AttentionMetadata:
        """A graph's metadata over these buffers. Host-side lengths are placeholders: the kernels read the device
        copies, and the grid depends only on query_start_loc_cpu[-1] (the bucket) and the number of sequences."""
        half = bucket // 2
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
            block_tables=self.block_tables, num_decodes=0, num_decode_tokens=0, max_query_len=bucket,
            max_seq_len=self.block_tables.shape[1] * self.block_size,
            query_start_loc_cpu=[0] + [half] * self.seq_slots + [bucket],
            seq_lens_cpu=[half] + [0] * (self.seq_slots - 1) + [bucket - half])
