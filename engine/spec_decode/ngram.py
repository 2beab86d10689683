"""N-gram prompt lookup (vLLM's `ngram` method): the draft is what followed the last time the context's newest
n tokens appeared in it. It needs no weights and pays off whenever the answer repeats its context (rewriting a
document, editing code, quoting a page)."""
from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to min(k, max_tokens) draft tokens continuing `token_ids`, or [] when no suffix of length
        min_n..max_n occurs earlier. The longest matching suffix wins and, among its occurrences, the latest:
        the nearer context predicts the next tokens better."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        n_total = len(token_ids)
        if k <= 0 or n_total <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, n_total - 1), self.min_n - 1, -1):
            start = _latest_match(tokens, n)
            if start is not None:
                follow = tokens[start + n:start + n + k]
                return follow.tolist()
        return []


def _latest_match(tokens: np.ndarray, n: int) -> int | None:
    """The start of the latest earlier occurrence of the last n tokens (not the suffix itself, and leaving a
    token after it), or None. n whole-array comparisons: no Python loop over the context."""
    starts = len(tokens) - n                      # candidate starts 0 .. starts-1
    match = tokens[:starts] == tokens[-n]
    for i in range(1, n):
        match &= tokens[i:starts + i] == tokens[-n + i]
    hits = np.flatnonzero(match)
    return int(hits[-1]) if hits.size else None
