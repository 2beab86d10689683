"""The chat page's everyday features around one conversation (bench: page_bench.py): settings that belong to a
chat, a title the model writes, continuing a cut-off answer, editing an answer, copy feedback and the
newest-message button."""
from __future__ import annotations

import pytest

from browser_helpers import browser, expect, last_answer, new_page, reload, script_replies, send, sent_requests  # noqa: F401
from page_bench import FakeEngine, answer_done, chat, exchange, open_page, page_proxy  # noqa: F401

pytestmark = [pytest.mark.browser]


def set_field(page, field, value):
    page.fill(field, value)
    page.locator(field).dispatch_event("change")


# ---- settings per chat -----------------------------------------------------------------------------------------
def test_system_prompt_and_sampling_belong_to_their_chat(chat):
    open_page(chat)
    chat.click("#settings summary")
    set_field(chat, "#system-prompt", "Talk like a pirate.")
    set_field(chat, "#temperature", "0.3")
    sent = exchange(chat, "Ahoy?", "Arr.")
    assert sent["messages"][0] == {"role": "system", "content": "Talk like a pirate."}
    assert sent["temperature"] == 0.3

    chat.click("#new-chat")                       # a new chat starts from the defaults
    expect(chat.locator("#system-prompt")).to_have_value("")
    expect(chat.locator("#temperature")).to_have_value("")
    sent = exchange(chat, "Plain question", "Plain answer.")
    assert [m["role"] for m in sent["messages"]] == ["user"] and "temperature" not in sent

    chat.locator(".chat-open", has_text="Ahoy?").click()
    expect(chat.locator("#system-prompt")).to_have_value("Talk like a pirate.")
    reload(chat)
    expect(chat.locator("#system-prompt")).to_have_value("Talk like a pirate.")
    expect(chat.locator("#temperature")).to_have_value("0.3")
    script_replies(chat, {"chunks": ["Arr again."]})
    last_answer(chat).locator(".act-regenerate").click()
    answer_done(chat)
    assert sent_requests(chat)[-1]["messages"][0]["content"] == "Talk like a pirate."

    # "Use for new chats" makes this chat's settings the defaults.
    chat.click("#settings summary")
    chat.click("#settings-as-default")
    chat.click("#new-chat")
    expect(chat.locator("#system-prompt")).to_have_value("Talk like a pirate.")
    expect(chat.locator("#temperature")).to_have_value("0.3")


# ---- a title the model writes ------------------------------------------------------------------------------------
@pytest.fixture
def titled(browser, page_proxy):
    """The chat page with model-written titles on (as a user gets it)."""
    context, page, errors = new_page(browser, fake_stream=True, auto_title=True)
    page.engine = FakeEngine(page)
    page.base_url = page_proxy.url
    yield page
    context.close()
    assert not errors, f"errors in the page: {errors}"


def title_reply(text, **extra):
    return {"status": 200, "body": {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                                 "finish_reason": "stop"}]}, **extra}


def test_the_model_titles_a_new_chat_once_without_holding_it_up(titled):
    page = titled
    open_page(page)
    question = "what is the capital of france? asking for a quiz"
    script_replies(page, {"chunks": ["Paris ", "is the capital."]},
                   title_reply('Title: "Capital of France."', pauseAfter=0))        # the title takes its time
    send(page, question)
    answer_done(page)
    page.wait_for_function("window.__chat.requests.length === 2")
    title_request = sent_requests(page)[1]
    assert title_request["stream"] is False and title_request["max_tokens"] <= 32
    assert title_request["chat_template_kwargs"] == {"enable_thinking": False}
    assert question in title_request["messages"][-1]["content"]
    assert "is the capital." in title_request["messages"][-1]["content"]

    exchange(page, "And of Spain?", "Madrid.")       # the chat goes on while the title is being written
    expect(page.locator("#chat-list .chat-open")).to_have_text([question])
    page.evaluate("window.__chat.go = true")
    expect(page.locator("#chat-list .chat-open")).to_have_text(["Capital of France"])
    assert len(sent_requests(page)) == 3              # only the first answer asks for a title
    reload(page)
    expect(page.locator("#chat-list .chat-open")).to_have_text(["Capital of France"])


def test_titles_by_the_model_can_be_switched_off(titled):
    page = titled
    open_page(page)
    page.uncheck("#auto-title")
    exchange(page, "Second chat here", "Fine.")
    page.wait_for_timeout(300)
    assert len(sent_requests(page)) == 1
    expect(page.locator("#chat-list .chat-open")).to_have_text(["Second chat here"])
    reload(page)
    expect(page.locator("#auto-title")).not_to_be_checked()


def test_a_failed_title_request_keeps_the_first_words(titled):
    page = titled
    page.expected_errors = ["status of 503"]
    open_page(page)
    script_replies(page, {"chunks": ["Hello."]},
                   {"status": 503, "body": {"error": {"message": "busy", "type": "service_unavailable"}}})
    send(page, "Hi there, model")
    answer_done(page)
    page.wait_for_function("window.__chat.requests.length === 2")
    page.wait_for_timeout(200)
    expect(page.locator("#chat-list .chat-open")).to_have_text(["Hi there, model"])
    expect(page.locator("#error")).to_be_hidden()


# ---- continue, edit, copy --------------------------------------------------------------------------------------
def test_an_answer_cut_off_by_max_tokens_can_be_continued(chat):
    open_page(chat)
    script_replies(chat, {"chunks": ["Counting: one,", " two, "], "finish": "length"})
    send(chat, "Count to three")
    answer = answer_done(chat)
    expect(answer.locator(".meta")).to_contain_text("max-tokens limit")
    script_replies(chat, {"chunks": [" three."]})
    answer.locator(".act-continue").click()
    answer = answer_done(chat)
    expect(answer.locator(".content")).to_have_text("Counting: one, two, three.")
    expect(chat.locator(".msg.assistant")).to_have_count(1)
    expect(answer.locator(".act-continue")).to_have_count(0)
    expect(answer.locator(".meta")).to_contain_text("3 tokens")       # 2 before, 1 now
    sent = sent_requests(chat)[-1]
    assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False
    assert sent["messages"][-1] == {"role": "assistant", "content": "Counting: one, two,"}

    # A stopped answer continues too; its text is kept when the continuation brings nothing.
    script_replies(chat, {"chunks": ["Once", " upon", " a time"], "pauseAfter": 1})
    send(chat, "A story")
    expect(last_answer(chat).locator(".content")).to_have_text("Once")
    chat.click("#stop")
    expect(last_answer(chat)).to_have_attribute("data-status", "stopped")
    script_replies(chat, {"chunks": [" there was a cat."]})
    last_answer(chat).locator(".act-continue").click()
    expect(answer_done(chat).locator(".content")).to_have_text("Once there was a cat.")
    reload(chat)
    expect(last_answer(chat).locator(".content")).to_have_text("Once there was a cat.")


def test_an_edited_answer_is_saved_as_a_version_and_sent_as_edited(chat):
    open_page(chat)
    exchange(chat, "Name a colour", "Blue, **clearly**.")
    last_answer(chat).locator(".act-edit").click()
    expect(chat.locator(".edit-text")).to_have_value("Blue, **clearly**.")
    chat.fill(".edit-text", "Green, *obviously*.")
    chat.locator(".edit-form button.primary").click()
    answer = last_answer(chat)
    expect(answer.locator(".content em")).to_have_text("obviously")
    expect(answer.locator(".version-count")).to_have_text("2/2")
    expect(answer.locator(".meta")).to_contain_text("edited")
    assert len(sent_requests(chat)) == 1                  # an edit asks nothing of the model
    sent = exchange(chat, "Why?", "Because.")
    assert sent["messages"][1] == {"role": "assistant", "content": "Green, *obviously*."}
    reload(chat)
    first = chat.locator(".msg.assistant").first
    expect(first.locator(".content")).to_have_text("Green, obviously.")
    first.locator(".act-prev").click()
    expect(chat.locator(".msg.assistant").first.locator(".content")).to_have_text("Blue, clearly.")


def test_copy_buttons_say_copied(chat):
    open_page(chat)
    exchange(chat, "Code please", "Here:\n\n```python\nprint(1)\n```")
    copy = last_answer(chat).locator(".act-copy")
    copy.click()
    expect(copy).to_have_text("Copied")
    assert chat.evaluate("navigator.clipboard.readText()") == "Here:\n\n```python\nprint(1)\n```"
    expect(copy).to_have_text("Copy", timeout=4000)        # back after a moment
    code_copy = last_answer(chat).locator(".code-block .copy")
    code_copy.click()
    expect(code_copy).to_have_text("Copied")
    assert chat.evaluate("navigator.clipboard.readText()").rstrip("\n") == "print(1)"


# ---- the newest-message button -----------------------------------------------------------------------------------
def test_newest_message_button_appears_when_scrolled_up_and_returns_to_the_end(chat):
    open_page(chat)
    button = chat.locator("#scroll-down")
    lines = [f"Line {i} of a long answer.\n\n" for i in range(80)]
    script_replies(chat, {"chunks": lines, "pauseAfter": 60, "delayMs": 1})
    send(chat, "Something long")
    expect(last_answer(chat).locator(".content")).to_contain_text("Line 59")
    expect(button).to_be_hidden()                        # following the answer at its end
    chat.evaluate("document.getElementById('messages').scrollTop = 0")
    expect(button).to_be_visible()
    chat.evaluate("window.__chat.go = true")
    answer_done(chat)
    expect(button).to_be_visible()                       # the answer did not pull the reader down
    assert chat.evaluate("document.getElementById('messages').scrollTop") == 0
    button.click()
    expect(button).to_be_hidden()
    assert chat.evaluate("""() => { const m = document.getElementById('messages');
                                    return m.scrollHeight - m.scrollTop - m.clientHeight; }""") < 2
