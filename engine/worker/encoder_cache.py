"""Vision encoder outputs by image content hash, so a repeated image (a follow-up question, a re-sent chat
history, a preempted request) skips the ViT. Bounded by a number of LLM tokens, least recently used out first."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class EncoderOutput:
    embeds: torch.Tensor              # [n_tokens, hidden]
    deepstack: torch.Tensor | None    # [num_taps, n_tokens, hidden]


class EncoderCache:
    def __init__(self, capacity_tokens: int):
        self.capacity = capacity_tokens
        self.entries: OrderedDict[str, EncoderOutput] = OrderedDict()
        self.num_tokens = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> EncoderOutput | None:
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: str, value: EncoderOutput, keep: set[str] = frozenset()) -> None:
        """Insert, then evict the least recently used entries over capacity, sparing `keep` (this step's)."""
        if key in self.entries:
            return
        self.entries[key] = value
        self.num_tokens += value.embeds.shape[0]
        for old in list(self.entries):
            if self.num_tokens <= self.capacity:
                break
            if old in keep or old == key:
                continue
            self.num_tokens -= self.entries.pop(old).embeds.shape[0]
