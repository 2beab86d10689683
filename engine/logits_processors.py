"""Per-request changes to the logits before sampling: the structured-output mask, allowed_token_ids, logit_bias
(vLLM's logits processors; bad words are banned ids, which the sampler applies with min_tokens'). Built once per step for the rows that ask for one; a batch where no
request asks costs nothing.

The grammar and allowed_token_ids become one bitmask (rows x ceil(V/32) int32, filled on the host, unpacked on
the device); logit_bias adds to a few logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.structured_output import apply_token_bitmask, bitmask_width
from engine.transfer import to_device


@dataclass
class LogitsMasks:
    bitmask: torch.Tensor | None                   # [R, W] int32 on the device
    bitmask_rows: torch.Tensor | None              # [R] int64: the batch rows they apply to
    bias: list[tuple[int, torch.Tensor, torch.Tensor]]   # (row, token ids, added values) on the device

    @classmethod
    def from_requests(cls, reqs: list, vocab_size: int, device: torch.device) -> "LogitsMasks | None":
        """reqs: the runner's records of the sampled requests (CachedRequestState), in row order."""
        masked = [(i, r) for i, r in enumerate(reqs)
                  if r.grammar is not None or r.sampling_params.allowed_token_ids]
        biased = [(i, r.sampling_params.logit_bias) for i, r in enumerate(reqs) if r.sampling_params.logit_bias]
        if not masked and not biased:
            return None
        bitmask = rows = None
        if masked:
            host = torch.full((len(masked), bitmask_width(vocab_size)), -1, dtype=torch.int32)
            for k, (_, req) in enumerate(masked):
                if req.grammar is not None:
                    req.grammar.fill_bitmask(host, k)
                if req.sampling_params.allowed_token_ids:
                    if req.allowed_token_bits is None:
                        req.allowed_token_bits = _bits(req.sampling_params.allowed_token_ids, host.shape[1])
                    host[k] &= req.allowed_token_bits
            bitmask = to_device(host, torch.int32, device)
            rows = to_device([i for i, _ in masked], torch.int64, device)
        bias = [(i, to_device(list(b), torch.int64, device), to_device(list(b.values()), torch.float32, device))
                for i, b in biased]
        return cls(bitmask, rows, bias)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, ids, values in self.bias:
            logits[row, ids] += values
        if self.bitmask is not None:
            apply_token_bitmask(logits, self.bitmask, self.bitmask_rows)
        return logits


def _bits(token_ids: list[int], width: int) -> torch.Tensor:
    """An int32 bitmask row with the bits of `token_ids` set."""
    bits = torch.zeros(width * 32, dtype=torch.bool)
    bits[torch.tensor(token_ids, dtype=torch.int64)] = True
    weights = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int64)
    return (bits.view(width, 32).long() * weights).sum(-1).to(torch.int32)


def banned_by_bad_words(req) -> list[int]:
    """vLLM's bad_words: a word's last token is banned where the output so far ends with the word's other
    tokens (a one-token word: always)."""
    out = req.output_token_ids
    banned = []
    for ids in req.bad_words_token_ids:
        prefix = ids[:-1]
        if not prefix or (len(out) >= len(prefix) and out[len(out) - len(prefix):] == prefix):
            banned.append(ids[-1])
    return banned

