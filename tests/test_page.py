"""The chat page in Chromium against the real proxy, with the engine's side played in the page: /api/status,
/v1/models and /stats are answered by page.route, answers come from the fake stream (browser_helpers.py).
Fast (no model), so each behaviour of the page gets its own test; test_browser.py runs the page end to end.
This file: the bugs of issue 16 and the sampling controls; test_page_chats.py: chats kept in the browser and
message actions; test_page_view.py: rendering, the KV block map, theme, shortcuts and the phone layout.
"""
from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from browser_helpers import (browser, expect, last_answer, new_page, reload, screenshot, script_replies, send,  # noqa: F401
                             sent_requests)
from page_bench import (MODEL, answer_done, chat, exchange, FakeEngine, open_page, page_proxy, png_file,  # noqa: F401
                        sent_images)
from proxy.page import available_vendor
from servers import REPO

pytestmark = [pytest.mark.browser]


# ---- 1. the bugs of issue 16 ---------------------------------------------------------------------------------
def test_earlier_images_beyond_the_engine_limit_are_not_sent_again(chat, tmp_path):
    open_page(chat, max_images_per_prompt=2)
    for turn in range(3):
        chat.set_input_files("#file-input", [str(png_file(tmp_path, f"{turn}.png", color=(turn * 80, 10, 10)))])
        expect(chat.locator(".thumb")).to_have_count(1)
        script_replies(chat, {"chunks": [f"answer {turn}"]})
        send(chat, f"image {turn}")
        answer_done(chat, turn)
    last = sent_requests(chat)[-1]
    assert [len(i) for i in sent_images(last)] == [0, 0, 1, 0, 1], "the two newest images, the oldest dropped"
    first_user = last["messages"][0]["content"]
    assert first_user == [{"type": "text", "text": "(an earlier image, not sent again)\nimage 0"}]
    expect(chat.locator("#send-note")).to_contain_text("1 earlier image is not sent again")
    expect(chat.locator("#send-note")).to_contain_text("at most 2 images per prompt")
    expect(chat.locator("#error")).to_be_hidden()

    # The user's choice: only this message's images.
    chat.click("#settings summary")
    chat.select_option("#earlier-images", "none")
    chat.set_input_files("#file-input", [str(png_file(tmp_path, "3.png"))])
    script_replies(chat, {"chunks": ["answer 3"]})
    send(chat, "image 3")
    answer_done(chat, 3)
    assert [len(i) for i in sent_images(sent_requests(chat)[-1])] == [0, 0, 0, 0, 0, 0, 1]
    expect(chat.locator("#send-note")).to_contain_text("3 earlier images are not sent again")


def test_a_conversation_never_outgrows_the_upload_limit(chat, tmp_path):
    chat.engine.page_config = {"max_upload_bytes": 300_000, "vendor": available_vendor(REPO / "static")}
    open_page(chat)
    for turn in range(4):   # each image is about 110 KB as a data URL: two fit in 300 KB, three do not
        chat.set_input_files("#file-input", [str(png_file(tmp_path, f"{turn}.png", size=(150, 180), noise=True))])
        expect(chat.locator(".thumb")).to_have_count(1)
        script_replies(chat, {"chunks": ["ok"]})
        send(chat, f"photo {turn}")
        answer_done(chat, turn)
    for request in sent_requests(chat):
        assert len(json.dumps(request)) < 300_000
    assert sum(map(len, sent_images(sent_requests(chat)[-1]))) == 2
    expect(chat.locator("#send-note")).to_contain_text("2 earlier images are not sent again")
    expect(chat.locator("#error")).to_be_hidden()


def test_images_too_large_for_one_request_are_refused_before_sending(chat, tmp_path):
    chat.engine.page_config = {"max_upload_bytes": 150_000, "vendor": []}
    open_page(chat)
    chat.set_input_files("#file-input", [str(png_file(tmp_path, f"{i}.png", size=(150, 180), noise=True))
                                         for i in range(2)])
    expect(chat.locator(".thumb")).to_have_count(2)
    send(chat, "two photos")
    expect(chat.locator("#error")).to_contain_text("too large together")
    expect(chat.locator("#error")).to_contain_text("remove one of them")
    assert sent_requests(chat) == []
    assert chat.input_value("#prompt") == "two photos"     # nothing lost: remove one and send again
    expect(chat.locator(".thumb")).to_have_count(2)
    chat.locator(".thumb .remove").first.click()
    request = exchange(chat, "one photo", "one photo")
    assert sum(map(len, sent_images(request))) == 1


def test_max_tokens_is_left_to_the_server_or_fitted_to_the_context_left(chat):
    open_page(chat)
    request = exchange(chat, "hello", "one")
    assert "max_tokens" not in request   # empty field: the server fits it to the room left
    expect(chat.locator("#max-tokens")).to_have_attribute("placeholder", "fit to context")

    chat.click("#settings summary")
    chat.fill("#max-tokens", "1024")
    too_long = {"error": {"message": "this model's maximum context length is 4096 tokens; the prompt has 3533 "
                                     "tokens and max_tokens asks for 1024 more (4557 in all); lower max_tokens to at "
                                     "most 563 or shorten the prompt", "type": "invalid_request_error",
                          "param": "max_tokens", "code": "context_length"}}
    script_replies(chat, {"status": 400, "body": too_long}, {"chunks": ["two"]})
    send(chat, "again")
    answer = answer_done(chat, 1)
    assert [r.get("max_tokens") for r in sent_requests(chat)[-2:]] == [1024, 563]
    expect(answer.locator(".meta")).to_contain_text("max tokens lowered from 1024 to 563")
    expect(chat.locator("#error")).to_be_hidden()


def test_status_shows_loading_progress_clears_stale_numbers_and_recovers(chat):
    engine = chat.engine
    engine.status = {"proxy": "ok", "engine": "starting", "progress": 0.42, "phase": "loading weights"}
    chat.goto(chat.base_url + "/")
    status = chat.locator("#status")
    expect(status).to_have_attribute("data-state", "starting")
    expect(status).to_have_text("Loading model… 42%")
    engine.status = {"proxy": "ok", "engine": "ready"}
    expect(status).to_have_attribute("data-state", "ready")
    expect(chat.locator("#model-name")).to_have_text(MODEL)
    expect(chat.locator("#kv-free")).to_have_text("64")      # the fake engine's idle block map

    # The engine goes away: the page stops showing what it said before.
    engine.status = {"proxy": "ok", "engine": "unreachable", "error": {"message": "not reachable"}}
    expect(status).to_have_attribute("data-state", "unreachable")
    expect(status).to_have_text("Engine not reachable")
    expect(chat.locator("#model-name")).to_have_text("—")
    expect(chat.locator("#kv-used")).to_have_text("—")
    expect(chat.locator("#kv-gpu-text")).to_have_text("—")
    send(chat, "are you there?")                       # not sent: the page says why and keeps the message
    expect(chat.locator("#error")).to_contain_text("the engine is not reachable")
    assert sent_requests(chat) == [] and chat.input_value("#prompt") == "are you there?"

    # Back: the error that said so goes away by itself.
    engine.status = {"proxy": "ok", "engine": "ready"}
    expect(status).to_have_attribute("data-state", "ready")
    expect(chat.locator("#error")).to_be_hidden()
    expect(chat.locator("#kv-free")).to_have_text("64")      # the fake engine's idle block map


def test_new_chat_shows_the_empty_chat_hint_again(chat):
    open_page(chat)
    expect(chat.locator("#empty-state")).to_be_visible()
    script_replies(chat, {"chunks": ["hi"]})
    send(chat, "hello")
    answer_done(chat)
    expect(chat.locator("#empty-state")).to_have_count(0)
    chat.click("#new-chat")
    expect(chat.locator("#empty-state")).to_be_visible()
    expect(chat.locator(".msg")).to_have_count(0)


def test_a_selection_survives_streaming(chat):
    open_page(chat)
    chunks = ["First paragraph, ", "finished early.\n\n", "Second ", "paragraph ", "grows"] + \
             [f" word{i}" for i in range(30)] + ["\n\nThird paragraph."]
    script_replies(chat, {"chunks": chunks, "pauseAfter": 3, "delayMs": 15})
    send(chat, "write three paragraphs")
    first = last_answer(chat).locator(".content p").first
    expect(first).to_have_text("First paragraph, finished early.")
    chat.evaluate("""() => {
        const p = document.querySelector('.msg.assistant .content p');
        const range = document.createRange();
        range.selectNodeContents(p);
        getSelection().removeAllRanges();
        getSelection().addRange(range);
        window.__firstP = p;
    }""")
    chat.evaluate("window.__chat.go = true")
    answer_done(chat)
    expect(last_answer(chat).locator(".content p")).to_have_count(3)
    assert chat.evaluate("getSelection().toString()") == "First paragraph, finished early."
    assert chat.evaluate("window.__firstP.isConnected"), "the finished paragraph was rebuilt while streaming"


def test_markdown_images_and_bare_urls(chat):
    open_page(chat)
    dot = base64.b64encode(_png_bytes()).decode()
    text = (f"Inline ![a red dot](data:image/png;base64,{dot}) and ![remote](https://example.com/cat.png).\n\n"
            "See https://example.com/docs, or [the site](https://example.com/).")
    script_replies(chat, {"chunks": [text[i:i + 9] for i in range(0, len(text), 9)]})
    send(chat, "images")
    content = answer_done(chat).locator(".content")
    expect(content.locator("img")).to_have_count(1)
    assert content.locator("img").get_attribute("alt") == "a red dot"
    remote = content.locator("button.remote-image")
    expect(remote).to_contain_text("Image: remote (example.com), show")   # a web image is fetched only when asked
    links = content.locator("a")
    expect(links).to_have_count(2)
    assert links.nth(0).get_attribute("href") == "https://example.com/docs"
    expect(links.nth(0)).to_have_text("https://example.com/docs")
    assert "!" not in content.inner_text().split("Inline")[1].split("and")[0]


def _png_bytes():
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (255, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


def test_settings_values_are_checked_before_sending(chat):
    open_page(chat)
    chat.click("#settings summary")
    chat.fill("#temperature", "5")
    chat.fill("#max-tokens", "0")
    send(chat, "hello")
    expect(chat.locator("#error")).to_contain_text("Temperature must be between 0 and 2")
    expect(chat.locator("#error")).to_contain_text("Max tokens must be between 1")
    expect(chat.locator("#temperature")).to_have_attribute("aria-invalid", "true")
    assert sent_requests(chat) == []
    assert chat.input_value("#prompt") == "hello"       # nothing lost
    expect(chat.locator(".msg")).to_have_count(0)

    chat.fill("#temperature", "0.3")
    chat.fill("#max-tokens", "64")
    request = exchange(chat, "hello", "fine")
    assert request["temperature"] == 0.3 and request["max_tokens"] == 64
    expect(chat.locator("#temperature")).to_have_attribute("aria-invalid", "false")


def test_conversation_keeps_its_width_at_390px_with_panels_open(browser, page_proxy, tmp_path):
    context, page, errors = new_page(browser, viewport=(390, 844), fake_stream=True)
    page.engine, page.base_url = FakeEngine(page), page_proxy.url
    open_page(page)
    script_replies(page, {"chunks": ["A reply that is long enough to wrap over a few lines on a phone screen."]})
    send(page, "hello from a phone")
    answer_done(page)
    page.click("#toggle-kv")
    page.click("#toggle-sidebar")
    expect(page.locator("#kv")).to_be_visible()
    expect(page.locator("#sidebar")).to_be_visible()
    box = page.locator("#messages").bounding_box()
    assert box["width"] >= 340 and box["height"] >= 300, box
    assert page.evaluate("document.documentElement.scrollWidth") <= 390   # nothing sticks out sideways
    page.click("#toggle-kv")
    page.click("#toggle-sidebar")
    screenshot(page, tmp_path, "mobile.png")
    context.close()
    assert not errors, errors


def test_text_only_model_says_so_in_the_empty_chat(chat, tmp_path):
    open_page(chat, multimodal=False)
    expect(chat.locator("#empty-state")).to_contain_text("This model reads text only")
    expect(chat.locator("#empty-state")).not_to_contain_text("Attach images")
    expect(chat.locator("#image-note")).to_contain_text("text-only")
    # Text files still go; images are refused with the reason.
    expect(chat.locator("#attach")).to_be_enabled()
    chat.set_input_files("#file-input", [str(png_file(tmp_path, "a.png"))])
    expect(chat.locator("#error")).to_contain_text("the model being served is text-only")
    expect(chat.locator(".thumb")).to_have_count(0)
    chat.set_input_files("#file-input", [{"name": "notes.txt", "mimeType": "text/plain", "buffer": b"plain words"}])
    expect(chat.locator(".file-chip")).to_have_count(1)




# ---- 5. controls, presets, context meter ---------------------------------------------------------------------------
def test_every_sampling_field_reaches_the_request(chat):
    open_page(chat)
    chat.click("#settings summary")
    expect(chat.locator("#temperature")).to_have_attribute("placeholder", "model: 0.7")   # the model's defaults
    expect(chat.locator("#top-k")).to_have_attribute("placeholder", "model: 20")
    values = {"#temperature": "0.4", "#top-p": "0.9", "#top-k": "30", "#min-p": "0.05", "#repetition-penalty": "1.1",
              "#presence-penalty": "0.5", "#frequency-penalty": "-0.5", "#seed": "1234", "#max-tokens": "200"}
    for selector, value in values.items():
        chat.fill(selector, value)
    chat.fill("#system-prompt", "Answer briefly.")
    chat.fill("#stop-strings", "END\nSTOP")
    request = exchange(chat, "hello", "ok")
    assert {k: request[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                                    "frequency_penalty", "seed", "max_tokens", "stop")} == {
        "temperature": 0.4, "top_p": 0.9, "top_k": 30, "min_p": 0.05, "repetition_penalty": 1.1,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "seed": 1234, "max_tokens": 200, "stop": ["END", "STOP"]}
    assert request["messages"][0] == {"role": "system", "content": "Answer briefly."}

    # Settings are kept; a preset replaces the sampling fields, "Model defaults" empties them.
    reload(chat)   # the open chat's settings are shown
    chat.click("#settings summary")
    expect(chat.locator("#top-k")).to_have_value("30")
    chat.select_option("#preset", "precise")
    expect(chat.locator("#temperature")).to_have_value("0.2")
    expect(chat.locator("#top-k")).to_have_value("")
    chat.click("#reset-settings")
    expect(chat.locator("#temperature")).to_have_value("")
    request = exchange(chat, "again", "ok")
    assert not {"temperature", "top_p", "top_k", "min_p"} & request.keys()
    assert request["max_tokens"] == 200                      # a preset is about sampling, not length


def test_context_meter_shows_the_last_turn_of_max_model_len(chat):
    open_page(chat, max_model_len=2048)
    script_replies(chat, {"chunks": ["a", "b", "c"], "usage": {"prompt_tokens": 1500, "completion_tokens": 100}})
    send(chat, "long")
    answer_done(chat)
    meter = chat.locator("#context-meter")
    expect(meter).to_contain_text("Context 1,600 / 2,048 tokens")
    expect(meter).to_have_attribute("data-used", "1600")
    chat.click("#new-chat")
    expect(meter).to_contain_text("Context 0 / 2,048 tokens")


def test_a_queued_answer_shows_its_place_in_the_queue(chat):
    """The engine's `: queued N ahead` comments show as "Waiting for a free slot (N ahead)" until the first words
    (text from an attribute through CSS: nothing the stream sends becomes HTML)."""
    open_page(chat)
    script_replies(chat, {"chunks": ["hello"], "queued": [2, 1], "pauseAfter": 0, "delayMs": 50})
    send(chat, "hi")
    content = last_answer(chat).locator(".content")
    expect(content).to_have_attribute("data-queue", "1")
    shown = content.evaluate("(el) => getComputedStyle(el, '::after').content")
    assert shown.startswith('"Waiting for a free slot (1 ahead)… '), shown
    chat.evaluate("window.__chat.go = true")
    answer_done(chat, 0)
    expect(content).to_have_text("hello")

