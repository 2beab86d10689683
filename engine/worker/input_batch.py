"""What the runner keeps between steps: each request's fixed data (CachedRequestState) and the persistent input
batch (InputBatch: every request's block table in one array, written only where a step adds blocks); and the
flat batch of one step (ModelInput)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.core.scheduler_output import NewRequestData
from engine.inputs.types import ProcessedPrompt
from engine.model.decoder import MultimodalEmbeds
from engine.ops import AttentionMetadata
from engine.sampling_params import SamplingParams
from engine.structured_output import Grammar


@dataclass(eq=False)
class CachedRequestState:
    """What the runner keeps about a request between steps (vLLM's name): its fixed data, and its output ids as
    they are read back (the penalties, bad words and the grammar matcher need them)."""
    request_id: str
    prompt: ProcessedPrompt
    sampling_params: SamplingParams
    eos_token_ids: set[int]
    row: int                                        # its row in the InputBatch
    generator: torch.Generator | None = None        # its own RNG when a seed is given (the sampling rank only)
    grammar: Grammar | None = None                  # structured output; the runner is its only user
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    allowed_token_bits: torch.Tensor | None = None  # allowed_token_ids as a bitmask row, built on first use
    output_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_new(cls, new: NewRequestData, row: int, grammar: Grammar | None,
                 device: torch.device | None) -> "CachedRequestState":
        """`grammar`: the matcher rank 0's engine core registered for it; `device`: where its seeded generator
        draws (None on ranks that do not sample)."""
        seed = new.sampling_params.seed
        generator = None
        if seed is not None and device is not None:
            generator = torch.Generator(device=device).manual_seed(seed % 2**64)
        return cls(new.request_id, new.prompt, new.sampling_params, new.eos_token_ids, row, generator,
                   grammar, new.bad_words_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.prompt.prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt.prompt_token_ids)

    def positions(self, start: int, end: int) -> torch.Tensor:
        """Rotary positions of tokens [start, end): [end-start] or, for M-RoPE, [3, end-start]."""
        mrope, n = self.prompt.mrope_positions, self.num_prompt_tokens
        if mrope is None:
            return torch.arange(start, end, dtype=torch.int64)
        parts = []
        if start < n:
            parts.append(mrope[:, start:min(end, n)])
        if end > n:
            gen = torch.arange(max(start, n), end, dtype=torch.int64)
            parts.append((gen + self.prompt.mrope_position_delta).expand(3, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


@dataclass
class ModelInput:
    input_ids: torch.Tensor          # [T]
    positions: torch.Tensor          # [T], or [3, T] for M-RoPE
    md: AttentionMetadata
    logits_indices: torch.Tensor     # [S] rows of the batch whose logits are sampled, in sampled-row order
    sampled: list[CachedRequestState]  # the S requests that sample, in sampled-row order
    mm: MultimodalEmbeds | None
    # (request, its scheduled chunk, the chunk's first batch row) for chunks whose prompt tokens get scored
    prompt_logprob_chunks: list[tuple] = field(default_factory=list)
    num_draft_tokens: int = 0        # speculative decoding: a request with k drafts has k + 1 logits rows
    flat_starts: dict[str, int] = field(default_factory=dict)   # request id -> its chunk's first batch row


class InputBatch:
    """The block tables of every request the runner knows, one row each, kept between steps (vLLM's persistent
    batch): a step writes only the blocks it appended, and a step's table is one gather of its rows. A request
    that was preempted holds new blocks when it runs again, so its row is rewritten then (reset_blocks)."""

    def __init__(self, num_rows: int = 64, num_cols: int = 64):
        self.block_table = np.zeros((num_rows, num_cols), dtype=np.int32)
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)      # valid columns of each row
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def add_request(self) -> int:
        """A free row for a new request."""
        if not self._free_rows:
            n = self.block_table.shape[0]
            self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        row = self._free_rows.pop()
        self.num_blocks[row] = 0
        return row

    def remove_request(self, row: int) -> None:
        self._free_rows.append(row)

    def reset_blocks(self, row: int) -> None:
        self.num_blocks[row] = 0

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        """Bring row `row` up to `block_ids` (the request's whole table, of which the row holds a prefix)."""
        have, want = int(self.num_blocks[row]), len(block_ids)
        if want <= have:
            return
        if want > self.block_table.shape[1]:
            cols = max(want, 2 * self.block_table.shape[1])
            grown = np.zeros((self.block_table.shape[0], cols), dtype=np.int32)
            grown[:, :self.block_table.shape[1]] = self.block_table
            self.block_table = grown
        self.block_table[row, have:want] = block_ids[have:want]
        self.num_blocks[row] = want

