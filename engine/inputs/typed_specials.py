"""Special tokens typed by a user stay text.

The chat template writes the control tokens (<|im_start|>, <|im_end|>, <|vision_start|><|image_pad|>...); a
user who types `<|im_start|>system` into a message must not get a real one (role injection), nor an
<|image_pad|> that the server would try to fill with an image. Tokenizing the rendered prompt as a whole cannot
tell the two apart, so the special-token strings inside message text are swapped for private markers before
rendering; the rendered text is then cut at the special tokens that remain (the template's own), each cut
tokenized as HF does between added tokens, with the markers put back and tokenized as plain text
(split_special_tokens).

Prompts whose message text holds no special-token string take the ordinary path (one tokenizer call), so
their token ids are exactly transformers' apply_chat_template(..., tokenize=True).
"""
from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedTokenizerBase


class TypedSpecialTokens:
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special and t.content}
        # Longest first: of two specials where one starts the other, the longer is the token.
        self.specials = sorted(specials, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, self.specials))) if self.specials else None

    def mask(self, value: Any) -> tuple[Any, dict[str, str]]:
        """`value` (messages, template kwargs) with every special-token string inside its strings replaced by a
        marker, and marker -> the string it replaced. Nothing found: `value` itself and {}."""
        markers: dict[str, str] = {}
        if self._pattern is None:
            return value, markers
        nonce = secrets.token_hex(6)

        def swap(match: re.Match) -> str:
            marker = f"\ue000{nonce}.{len(markers)}\ue001"
            markers[marker] = match.group(0)
            return marker

        masked = _map_strings(value, lambda s: self._pattern.sub(swap, s))
        return (masked, markers) if markers else (value, markers)

    @staticmethod
    def unmask(rendered: str, markers: dict[str, str]) -> str:
        """The rendered prompt as text, the markers replaced by what the user typed."""
        for marker, text in markers.items():
            rendered = rendered.replace(marker, text)
        return rendered

    def encode(self, rendered: str, markers: dict[str, str]) -> list[int]:
        """Token ids of a rendered prompt whose user text was masked: template specials stay tokens, the
        markers' text is tokenized as text."""
        restore = re.compile("|".join(map(re.escape, markers)))
        ids: list[int] = []
        done = 0
        for match in self._pattern.finditer(rendered):
            ids += self._text_ids(rendered[done:match.start()], restore, markers)
            ids.append(self.tokenizer.convert_tokens_to_ids(match.group(0)))
            done = match.end()
        ids += self._text_ids(rendered[done:], restore, markers)
        return ids

    def _text_ids(self, text: str, restore: re.Pattern, markers: dict[str, str]) -> list[int]:
        if not text:
            return []
        text = restore.sub(lambda m: markers[m.group(0)], text)
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def _map_strings(value: Any, fn) -> Any:
    """`value` rebuilt with fn applied to every string value (not keys) inside dicts, lists and tuples."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(v, fn) for v in value)
    return value
