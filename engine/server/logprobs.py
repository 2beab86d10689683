"""The engine's per-token logprobs ({token_id: logprob}, the chosen token first, then the top-k) in the two
shapes OpenAI uses: chat's `{"content": [{token, logprob, bytes, top_logprobs}]}` and the legacy completions'
`{tokens, token_logprobs, top_logprobs, text_offset}`."""
from __future__ import annotations

from typing import Any

# JSON has no -Infinity (a token masked by top-k or min_tokens has that logprob); vLLM sends -9999.0 instead.
_MIN_LOGPROB = -9999.0


class TokenText:
    """Token id -> its text, as vLLM shows tokens in logprobs (the decoded token, not the BPE symbol)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text


def _finite(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]


def chat_logprobs(token_ids: list[int], entries: list[dict[int, float]], top_k: int,
                  text_of: TokenText) -> dict[str, Any]:
    content = []
    for token_id, entry in zip(token_ids, entries):
        text = text_of(token_id)
        content.append({
            "token": text, "logprob": _finite(entry[token_id]), "bytes": list(text.encode()),
            "top_logprobs": [{"token": text_of(t), "logprob": _finite(lp), "bytes": list(text_of(t).encode())}
                             for t, lp in _top(entry, top_k)],
        })
    return {"content": content}


def completion_logprobs(token_ids: list[int], entries: list[dict[int, float]], top_k: int, text_of: TokenText,
                        text_offset: int = 0) -> dict[str, Any]:
    """text_offset: characters of completion text before these tokens (streaming chunks continue the count)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = text_of(token_id)
        tokens.append(text)
        token_logprobs.append(_finite(entry[token_id]))
        tops.append({text_of(t): _finite(lp) for t, lp in _top(entry, top_k)} if top_k else None)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
