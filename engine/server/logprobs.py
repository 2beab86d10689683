"""The engine's per-token logprobs ({token_id: logprob}, the chosen token first, then the top-k) in the two
shapes OpenAI uses: chat's `{"content": [{token, logprob, bytes, top_logprobs}]}` and the legacy completions'
`{tokens, token_logprobs, top_logprobs, text_offset}`."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

# JSON has no -Infinity (a token masked by top-k or min_tokens has that logprob); vLLM sends -9999.0 instead.
_MIN_LOGPROB = -9999.0


# Token id -> its text, as vLLM shows tokens in logprobs (the decoded token, not the BPE symbol): AsyncLLM.token_text.
TokenText = Callable[[int], str]


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


def completion_logprobs(token_ids: list[int], entries: list[dict[int, float] | None], top_k: int,
                        text_of: TokenText, text_offset: int = 0) -> dict[str, Any]:
    """text_offset: characters of completion text before these tokens (streaming chunks continue the count).
    An entry of None (an echoed prompt's first token: nothing predicts it) gives null logprobs. As vLLM's, each
    top_logprobs dict holds the chosen token beside the top k (with logprobs 0: the chosen token alone)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = text_of(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(_finite(entry[token_id]))
        top = {text_of(t): _finite(lp) for t, lp in _top(entry, top_k)}
        top.setdefault(text, _finite(entry[token_id]))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(entries: list[dict[int, float] | None] | None, text_of: TokenText) -> list | None:
    """vLLM's prompt_logprobs: per prompt token null (the first) or {"token id": {logprob, decoded_token}}, the
    prompt's own token first, then the top k."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": _finite(lp), "decoded_token": text_of(t)}
                                    for t, lp in e.items()} for e in entries]
