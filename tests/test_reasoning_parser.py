"""--reasoning-parser qwen3 on detokenized text (no model): the split at `</think>` of a whole output and of the
same output streamed piece by piece, whether the prompt opened the reasoning (a Thinking template) or the model
writes `<think>` itself; and the grammar that starts a structured output after the reasoning."""
from __future__ import annotations

import pytest

from engine.sampling_params import StructuredOutputsParams
from engine.server.reasoning import PARSERS, ReasoningStream, after_reasoning, request_reasoning

QWEN3 = PARSERS["qwen3"]
THINKING_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
PLAIN_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
CLOSED_PROMPT = PLAIN_PROMPT + "<think>\n\n</think>\n\n"     # enable_thinking false in a hybrid template


def test_the_prompt_tells_whether_the_output_starts_inside_the_reasoning():
    assert QWEN3.opened_by(THINKING_PROMPT)
    assert not QWEN3.opened_by(PLAIN_PROMPT)
    assert not QWEN3.opened_by(CLOSED_PROMPT)
    assert not QWEN3.opened_by(None)


@pytest.mark.parametrize("text, opened, reasoning, content", [
    ("Let me see.\n</think>\n\nParis.", True, "Let me see.\n", "\n\nParis."),          # Thinking template
    ("<think>\nLet me see.</think>Paris.", False, "\nLet me see.", "Paris."),          # the model opens it
    ("\n<think>a</think>b", False, "a", "b"),
    ("Paris.", False, None, "Paris."),                                                  # no reasoning at all
    ("still thinking when max_tokens hit", True, "still thinking when max_tokens hit", None),
    ("a</think>b</think>c", True, "a", "b</think>c"),                                   # the first tag ends it
    ("</think>x", True, "", "x"),
])
def test_a_whole_output_is_split_exactly_at_the_first_end_tag(text, opened, reasoning, content):
    assert QWEN3.split(text, opened) == (reasoning, content)


def stream(text: str, opened: bool, pieces: list[int]) -> tuple[list[str], list[str]]:
    """Feed `text` grown by the piece lengths given (as a detokenizer would), then the end."""
    s, reasoning, content, at = ReasoningStream(QWEN3, opened), [], [], 0
    for n in pieces:
        at = min(len(text), at + n)
        r, so_far, c = s.feed(text[:at], final=False)
        reasoning.append(r)
        content.append(c)
        assert so_far == "".join(content)
    r, _, c = s.feed(text, final=True)
    return reasoning + [r], content + [c]


@pytest.mark.parametrize("text, opened", [
    ("Let me see.\n</think>\n\nParis.", True),
    ("<think>\nhmm <thin </ think</think>The answer: </think> stays content.", False),
    ("no tags here, < and </ are plain", False),
    ("cut inside the reasoning </thi", True),
])
@pytest.mark.parametrize("pieces", [[1] * 80, [3] * 30, [7, 1, 2, 9, 4, 13, 2, 2, 30]])
def test_streamed_deltas_add_up_to_the_whole_split(text, opened, pieces):
    reasoning, content = stream(text, opened, pieces)
    whole_reasoning, whole_content = QWEN3.split(text, opened)
    assert "".join(reasoning) == (whole_reasoning or "")
    assert "".join(content) == (whole_content or "")


def test_a_partial_end_tag_is_held_back_from_the_reasoning_until_settled():
    s = ReasoningStream(QWEN3, opened=True)
    assert s.feed("abc</thi", final=False) == ("abc", "", "")
    assert s.feed("abc</think>\n\nOK", final=False) == ("", "\n\nOK", "\n\nOK")


def test_an_output_that_may_still_open_think_sends_nothing_yet():
    s = ReasoningStream(QWEN3, opened=False)
    assert s.feed("  <thi", final=False) == ("", "", "")
    assert s.feed("  <thing", final=False) == ("", "  <thing", "  <thing")


def test_thinking_turned_off_or_no_parser_means_no_split():
    assert request_reasoning(None, None) is None
    assert request_reasoning("qwen3", {"enable_thinking": False}) is None
    assert request_reasoning("qwen3", {"enable_thinking": True}) is QWEN3
    assert request_reasoning("qwen3", None) is QWEN3


@pytest.fixture(scope="module", params=["spelled", "added-token"])
def grammars(request, tmp_path_factory):
    """A vocabulary that spells `</think>` in pieces, and one that holds it as one added token (Qwen3's)."""
    import tiny_models
    from engine.structured_output import StructuredOutputManager
    tok = tiny_models.build_tokenizer(tmp_path_factory.mktemp("tok"), tiny_models.CHATML_TEMPLATE,
                                      thinking=request.param == "added-token")
    assert (len(tok.encode("</think>", add_special_tokens=False)) == 1) == (request.param == "added-token")
    return tok, StructuredOutputManager(tok, len(tok), [tok.convert_tokens_to_ids("<|im_end|>")])


def admits(grammars, so: StructuredOutputsParams, text: str) -> bool:
    """Whether the compiled constraint takes `text` whole (every token, and then it may end)."""
    tok, manager = grammars
    matcher = manager.compile(so).matcher
    ok = all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False))
    return ok and not matcher.is_error() and matcher.is_accepting()


@pytest.mark.parametrize("so, good, bad", [
    (StructuredOutputsParams(choice=["yes", "no"]), "\nhm, yes or no?\n</think>\n\nyes", "yes"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
     'x</think>{"a": 1}', 'x</think>{"b": 1}'),
    (StructuredOutputsParams(regex="[0-9]+"), "4</think>2", "</think>4x"),
    (StructuredOutputsParams(grammar='start: "<tool_call>" %json {"type": "object"} "</tool_call>"'),
     "a <tool_call> b</think>\n<tool_call>{}</tool_call>", "a</think>b</think><tool_call>{}</tool_call>"),
])
def test_a_constraint_applies_from_the_end_of_the_reasoning_on(grammars, so, good, bad):
    assert after_reasoning(so, None) is so
    wrapped = after_reasoning(so, QWEN3)
    assert wrapped.reasoning_end == "</think>"
    assert admits(grammars, wrapped, good)
    assert not admits(grammars, wrapped, bad)
    assert admits(grammars, so, good.split("</think>")[-1].lstrip())     # the constraint itself is unchanged
