"""A Thinking model's reasoning on the page (static/reasoning.js): streamed into a collapsed block above the
answer ("Thinking…", then "Thought for N s"), shown as plain text, kept with the chat, and never sent back."""
from __future__ import annotations

import re

import pytest

from browser_helpers import browser, expect, last_answer, new_page, reload, script_replies, send, sent_requests  # noqa: F401
from page_bench import FakeEngine, answer_done, chat, open_page, page_proxy  # noqa: F401

pytestmark = [pytest.mark.browser]

THOUGHTS = ["The user asks ", "for a capital. ", "<img src=x onerror=\"window.__pwned=1\"> is not HTML here."]


def test_reasoning_streams_into_a_collapsed_block_above_the_answer(chat):
    open_page(chat)
    script_replies(chat, {"chunks": [{"reasoning": t} for t in THOUGHTS] + ["**Paris**", " is the capital."],
                          "pauseAfter": 3, "delayMs": 5})
    send(chat, "Capital of France?")
    answer = last_answer(chat)
    block = answer.locator(".thought")
    expect(block.locator("summary")).to_have_text("Thinking…")        # the answer has not begun
    expect(block).not_to_have_attribute("open", "")
    expect(answer.locator(".content")).to_be_empty()
    chat.wait_for_timeout(1100)                                        # long enough to have thought for 1 s
    chat.evaluate("window.__chat.go = true")
    answer_done(chat)
    expect(block.locator("summary")).to_have_text(re.compile(r"^Thought for \d+ s$"))
    expect(block).not_to_have_attribute("open", "")
    expect(answer.locator(".content")).to_have_text("Paris is the capital.")
    expect(answer.locator(".content strong")).to_have_text("Paris")   # the answer is Markdown; the thoughts are not
    block.locator("summary").click()
    expect(block.locator(".thought-text")).to_be_visible()
    expect(block.locator(".thought-text")).to_have_text("".join(THOUGHTS))
    assert block.locator("img").count() == 0 and not chat.evaluate("window.__pwned")
    assert answer.locator(".thought").evaluate("(b) => b.nextElementSibling.classList.contains('content')")

    label = block.locator("summary").text_content()
    reload(chat)   # kept with the chat
    kept = last_answer(chat).locator(".thought")
    expect(kept.locator("summary")).to_have_text(label)
    expect(kept.locator(".thought-text")).to_have_text("".join(THOUGHTS))

    script_replies(chat, {"chunks": ["Yes."]})
    send(chat, "Sure?")
    answer_done(chat)
    sent = sent_requests(chat)[-1]["messages"]
    assert sent[1] == {"role": "assistant", "content": "**Paris** is the capital."}   # the thoughts stay here
    expect(last_answer(chat).locator(".thought")).to_have_count(0)    # an answer without reasoning has no block


def test_an_answer_cut_inside_its_reasoning_keeps_its_thoughts(chat):
    open_page(chat)
    script_replies(chat, {"chunks": [{"reasoning": "Hmm, let me count: one, two"}], "finish": "length"})
    send(chat, "Count")
    answer = answer_done(chat)
    expect(answer.locator(".thought summary")).to_have_text(re.compile(r"^Thought for \d+ s$"))
    expect(answer.locator(".meta")).to_contain_text("hit the max-tokens limit")
