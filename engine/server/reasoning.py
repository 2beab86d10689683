"""vLLM's `--reasoning-parser`: a Thinking model's output split into its reasoning and its answer.

Qwen3 models think inside `<think>` … `</think>`, then answer. A Thinking template opens the block in the
generation prompt (`<|im_start|>assistant\\n<think>\\n`), so the output starts inside the reasoning and shows only
`</think>`; a hybrid model writes `<think>` itself. The split is exact: the reasoning is the text between the
opening (the prompt's, or a `<think>` the output starts with) and the first `</think>`, the content everything
after that tag, as vLLM's qwen3 parser cuts it. An output that ends inside its reasoning (max_tokens) has no
content. With `chat_template_kwargs: {"enable_thinking": false}` there is no reasoning and nothing is split.

Structured output and forced tool calls apply to the answer: their grammar starts after `</think>`
(StructuredOutputsParams.reasoning_end, engine/structured_output.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from engine.inputs.types import ProcessedPrompt
from engine.outputs import RequestOutput
from engine.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str
    end: str

    def opened_by(self, prompt: str | None) -> bool:
        """Whether the prompt leaves a reasoning block open (a Thinking template's generation prompt)."""
        return bool(prompt) and prompt.rfind(self.start) > prompt.rfind(self.end)

    def split(self, text: str, opened: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of an output: reasoning None when the output has none; content None while the
        output is still inside its reasoning."""
        lead = len(text) - len(text.lstrip())
        if text.startswith(self.start, lead):
            opened, text = True, text[lead + len(self.start):]
        if not opened:
            return None, text
        reasoning, tag, content = text.partition(self.end)
        return reasoning, (content if tag else None)

    def undecided(self, text: str, opened: bool) -> bool:
        """While streaming: the output so far may still become `<think>` (nothing can be sent yet)."""
        return not opened and self.start.startswith(text.lstrip())


PARSERS = {"qwen3": ReasoningParser("qwen3", "<think>", "</think>")}


def request_reasoning(parser_name: str | None, template_kwargs: dict[str, Any] | None) -> ReasoningParser | None:
    """The split a chat request gets: none without --reasoning-parser, or when it turns thinking off."""
    if parser_name is None or (template_kwargs or {}).get("enable_thinking", True) is False:
        return None
    return PARSERS[parser_name]


def after_reasoning(so: StructuredOutputsParams | None, parser: ReasoningParser | None) \
        -> StructuredOutputsParams | None:
    """The request's output constraint, applied from the end of the reasoning on."""
    if so is None or parser is None:
        return so
    return replace(so, reasoning_end=parser.end, compiled=None)


def _partial_suffix(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ReasoningStream:
    """Feed the whole text so far; get what to send. One per streamed choice."""
    parser: ReasoningParser
    opened: bool                      # the prompt opened the reasoning
    sent_reasoning: int = 0
    sent_content: int = 0

    def feed(self, text: str, final: bool) -> tuple[str, str, str]:
        """(reasoning delta, content so far, content delta). A trailing piece of text that may begin
        `<think>` or `</think>` is held back until the next token settles it (or the output ends)."""
        if not final and self.parser.undecided(text, self.opened):
            return "", "", ""
        reasoning, content = self.parser.split(text, self.opened)
        reasoning = reasoning or ""
        if content is None and not final:
            reasoning = reasoning[:len(reasoning) - _partial_suffix(reasoning, self.parser.end)]
        delta, self.sent_reasoning = reasoning[self.sent_reasoning:], max(self.sent_reasoning, len(reasoning))
        content = content or ""
        content_delta, self.sent_content = content[self.sent_content:], max(self.sent_content, len(content))
        return delta, content, content_delta


@dataclass
class ReasoningStreams:
    """The streams of one response's choices (by choice index), all opened alike by their shared prompt."""
    parser: ReasoningParser
    opened: bool
    streams: dict[int, ReasoningStream] = field(default_factory=dict)

    @classmethod
    def of(cls, parser: ReasoningParser | None, prompt: ProcessedPrompt) -> "ReasoningStreams | None":
        return None if parser is None else cls(parser, parser.opened_by(prompt.prompt))

    def feed(self, out: RequestOutput, index: int) -> tuple[str, str, str]:
        """(reasoning delta, content so far, content delta) of choice `index`."""
        stream = self.streams.setdefault(index, ReasoningStream(self.parser, self.opened))
        return stream.feed(out.outputs[0].text, out.finished)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output."""
        return self.parser.split(text, self.opened)
