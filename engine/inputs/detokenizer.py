"""Streaming detokenization: generated token ids in, newly finished text out, one step at a time.

Decoding each new token alone is wrong: byte-level BPE splits a multi-byte character (an emoji, a CJK character)
across tokens, and SentencePiece decides a token's leading space from its neighbour. So, as vLLM does, we decode a
short window twice: ids[prefix_offset:read_offset] (text already emitted) and ids[prefix_offset:] (the same plus
the new tokens); the difference is the new text. If the window's text ends in U+FFFD the last character is still
incomplete, so nothing is emitted and the offsets stay until a later token completes it. The window starts in
the last few prompt tokens, so the first generated token is decoded in context too.
"""
from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Fast tokenizers: call the Rust backend directly. transformers' decode() adds argument handling per
        # call around the same backend call, paid once per running request every step.
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._num_context = len(self._ids)
        self.prefix_offset = 0
        self.read_offset = self._num_context
        # A context that ends mid-character (token ids sent by a client can) would make the first delta wrong.
        if self._decode(0, self.read_offset).endswith(REPLACEMENT_CHAR):
            self.prefix_offset = self.read_offset
        self.output_text = ""

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context:]

    def add(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Append generated tokens; return the text they complete ("" while a character is still partial).
        final: the stream ends here, so the held-back text comes out too (see flush)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self._ids))
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """At the end of the stream: the held-back text, i.e. the U+FFFD of bytes that never became a character
        (the full decode shows them too)."""
        return self.add((), final=True)

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        # No clean-up of tokenization spaces: it rewrites " ." across the window edge and breaks the difference.
        if self._backend is not None:
            return self._backend.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)
