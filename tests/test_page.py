"""The chat page in Chromium against the real proxy, with the engine's side played in the page: /api/status,
/v1/models and /stats are answered by page.route, answers come from the fake stream (browser_helpers.py).
Fast (no model), so each behaviour of the page gets its own test; test_browser.py runs the page end to end.
"""
from __future__ import annotations

import base64
import io
import json
import random
from pathlib import Path

import pytest
from PIL import Image

from browser_helpers import (browser, expect, last_answer, new_page, screenshot, script_replies,  # noqa: F401
                             send, sent_requests)
from proxy.page import available_vendor
from servers import REPO, free_port, start_proxy

pytestmark = [pytest.mark.browser]

MODEL = "tiny-qwen3-vl"


def model_card(**over):
    card = {"id": MODEL, "object": "model", "max_model_len": 4096, "multimodal": True, "demo_model": False,
            "max_images_per_prompt": 8, "sampling_defaults": {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                              "min_p": 0.0, "repetition_penalty": 1.0,
                                                              "max_tokens": None}}
    return {**card, **over}


def engine_stats(**over):
    stats = {"num_total_gpu_blocks": 64, "num_free_gpu_blocks": 60, "num_used_gpu_blocks": 4, "num_cached_blocks": 2,
             "num_total_cpu_blocks": 0, "num_free_cpu_blocks": 0, "block_size": 16, "bytes_per_block": 65536, "num_running": 0,
             "num_waiting": 0, "num_swapped": 0, "prefix_cache_hit_rate": 0.0, "num_preemptions": 0, "num_swaps": 0,
             "model": MODEL, "demo_model": False, "multimodal": True}
    return {**stats, **over}


class FakeEngine:
    """The engine as the page sees it through the proxy; tests change its fields while the page runs."""

    def __init__(self, page, **card):
        self.status = {"proxy": "ok", "engine": "ready"}
        self.card = model_card(**card)
        self.stats = engine_stats(multimodal=self.card["multimodal"])
        self.page_config = None
        self.blocks = {"num_blocks": 64, "bytes_per_block": 65536, "runs": [[-1, 64]], "requests": [], "shared": []}
        page.route("**/api/status", lambda r: r.fulfill(json=self.status))
        page.route("**/stats/blocks", lambda r: r.fulfill(json=self.blocks))
        page.route("**/v1/models", lambda r: r.fulfill(json={"object": "list", "data": [self.card]}))
        page.route("**/stats", lambda r: r.fulfill(json=self.stats))
        page.route("**/api/page-config", self._config)

    def _config(self, route):
        if self.page_config is None:
            route.continue_()
        else:
            route.fulfill(json=self.page_config)


@pytest.fixture(scope="module")
def page_proxy(tmp_path_factory):
    """The proxy, serving the page; its engine URL leads nowhere (the tests answer for the engine)."""
    server = start_proxy(f"http://127.0.0.1:{free_port()}", tmp_path_factory.mktemp("proxy-logs"))
    yield server
    server.stop()


@pytest.fixture
def chat(browser, page_proxy):
    context, page, errors = new_page(browser, fake_stream=True)
    engine = FakeEngine(page)
    page.engine = engine
    page.base_url = page_proxy.url
    yield page
    context.close()
    assert not errors, f"errors in the page: {errors}"


def open_page(page, **card):
    page.engine.card.update(card)
    if "multimodal" in card:
        page.engine.stats["multimodal"] = card["multimodal"]
    page.goto(page.base_url + "/")
    expect(page.locator("#status")).to_have_attribute("data-state", "ready")
    expect(page.locator("#model-name")).to_have_text(MODEL)
    expect(page.locator("body")).to_have_attribute("data-ready", "true")


def answer_done(page, n=None):
    answer = page.locator(".msg.assistant").nth(n) if n is not None else last_answer(page)
    expect(answer).to_have_attribute("data-status", "done")
    return answer


def exchange(page, text: str, reply: str) -> dict:
    """Send `text`, let the scripted server answer `reply`, and return the request the page sent."""
    script_replies(page, {"chunks": [reply]})
    send(page, text)
    answer_done(page)
    return sent_requests(page)[-1]


def png_file(tmp_path, name, size=(64, 48), color=(200, 30, 30), noise=False):
    img = Image.new("RGB", size, color)
    if noise:   # incompressible pixels: a file of a predictable, large size
        img = Image.frombytes("RGB", size, random.Random(name).randbytes(size[0] * size[1] * 3))
    path = tmp_path / name
    img.save(path)
    return path


def sent_images(request) -> list[list[str]]:
    """Per message: the image data URLs it carries."""
    out = []
    for m in request["messages"]:
        parts = m["content"] if isinstance(m["content"], list) else []
        out.append([p["image_url"]["url"] for p in parts if p["type"] == "image_url"])
    return out


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
    expect(chat.locator("#kv-used")).to_have_text("4")

    # The engine goes away: the page stops showing what it said before.
    engine.status = {"proxy": "ok", "engine": "unreachable", "error": {"message": "not reachable"}}
    expect(status).to_have_attribute("data-state", "unreachable")
    expect(status).to_have_text("Engine not reachable")
    expect(chat.locator("#model-name")).to_have_text("—")
    expect(chat.locator("#kv-used")).to_have_text("—")
    expect(chat.locator("#kv-gpu-text")).to_have_text("—")
    script_replies(chat, {"status": 503, "body": {"error": {"message": "The inference engine is not reachable."}}})
    send(chat, "are you there?")
    expect(chat.locator("#error")).to_contain_text("not reachable")

    # Back: the error that said so goes away by itself.
    engine.status = {"proxy": "ok", "engine": "ready"}
    expect(status).to_have_attribute("data-state", "ready")
    expect(chat.locator("#error")).to_be_hidden()
    expect(chat.locator("#kv-used")).to_have_text("4")


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


def test_text_only_model_says_so_in_the_empty_chat(chat):
    open_page(chat, multimodal=False)
    expect(chat.locator("#attach")).to_be_disabled()
    expect(chat.locator("#empty-state")).to_contain_text("This model reads text only")
    expect(chat.locator("#empty-state")).not_to_contain_text("Attach images")


# ---- 2. chats kept in the browser ------------------------------------------------------------------------------
def chat_titles(page) -> list[str]:
    return page.locator("#chat-list .chat-open").all_inner_texts()


def test_chats_survive_a_reload_with_their_images(chat, tmp_path):
    open_page(chat)
    chat.set_input_files("#file-input", [str(png_file(tmp_path, "a.png"))])
    script_replies(chat, {"chunks": ["About ", "the picture."]})
    send(chat, "What is in this picture?\nSecond line.")
    answer_done(chat)
    chat.click("#new-chat")
    script_replies(chat, {"chunks": ["Paris."]})
    send(chat, "Capital of France?")
    answer_done(chat)
    expect(chat.locator("#chat-list .chat-open")).to_have_count(2)
    assert chat_titles(chat) == ["Capital of France?", "What is in this picture?"]   # newest first, first line

    chat.reload()
    expect(chat.locator("body")).to_have_attribute("data-ready", "true")
    assert chat_titles(chat) == ["Capital of France?", "What is in this picture?"]
    expect(chat.locator(".msg.assistant .content")).to_have_text("Paris.")    # the chat open before the reload
    chat.locator("#chat-list .chat-open", has_text="picture").click()
    expect(chat.locator(".msg.user .content p")).to_have_text("What is in this picture?\nSecond line.")
    expect(chat.locator(".msg.user img")).to_have_count(1)
    assert chat.locator(".msg.user img").get_attribute("src").startswith("data:image/png;base64,")
    expect(chat.locator(".msg.assistant .content")).to_have_text("About the picture.")
    expect(chat.locator(".msg.assistant .meta")).to_contain_text("2 tokens")


def test_a_question_survives_a_reload_mid_answer_and_can_be_answered(chat):
    open_page(chat)
    script_replies(chat, {"chunks": ["never ", "finished"], "pauseAfter": 1})
    send(chat, "Are you still there?")
    expect(last_answer(chat).locator(".content")).to_have_text("never")
    expect(chat.locator(".msg.user .act-answer")).to_be_hidden()
    chat.reload()
    expect(chat.locator("body")).to_have_attribute("data-ready", "true")
    expect(chat.locator(".msg.user .content")).to_have_text("Are you still there?")
    expect(chat.locator(".msg.assistant")).to_have_count(0)
    script_replies(chat, {"chunks": ["Yes."]})
    chat.locator(".msg.user .act-answer").click()
    expect(answer_done(chat).locator(".content")).to_have_text("Yes.")
    expect(chat.locator(".msg.user .act-answer")).to_be_hidden()


def test_sidebar_search_rename_and_delete(chat):
    open_page(chat)
    for question in ("Tell me about cats", "Tell me about dogs", "Weather today?"):
        chat.click("#new-chat")
        script_replies(chat, {"chunks": [f"Answer to {question}"]})
        send(chat, question)
        answer_done(chat)
    chat.fill("#chat-search", "tell me")
    assert chat_titles(chat) == ["Tell me about dogs", "Tell me about cats"]
    chat.fill("#chat-search", "answer to weather")       # the messages are searched too
    assert chat_titles(chat) == ["Weather today?"]
    chat.fill("#chat-search", "")

    item = chat.locator(".chat-item", has_text="cats")
    item.locator(".chat-rename").click()
    chat.fill(".chat-rename-input", "Felines")
    chat.press(".chat-rename-input", "Enter")
    expect(chat.locator(".chat-item", has_text="Felines")).to_have_count(1)

    dogs = chat.locator(".chat-item", has_text="dogs")
    dogs.locator(".chat-delete").click()
    expect(dogs.locator(".chat-delete")).to_have_text("Delete?")   # asks once more
    dogs.locator(".chat-delete").click()
    expect(chat.locator(".chat-item")).to_have_count(2)
    chat.reload()
    expect(chat.locator("body")).to_have_attribute("data-ready", "true")
    assert sorted(chat_titles(chat)) == ["Felines", "Weather today?"]


def test_export_and_import_round_trip(chat, tmp_path):
    open_page(chat)
    chat.set_input_files("#file-input", [str(png_file(tmp_path, "b.png"))])
    script_replies(chat, {"chunks": ["A **bold** answer."]})
    send(chat, "First chat")
    answer_done(chat)
    chat.click("#new-chat")
    script_replies(chat, {"chunks": ["Second answer."]})
    send(chat, "Second chat")
    answer_done(chat)

    with chat.expect_download() as all_download:
        chat.click("#export-all")
    everything = tmp_path / "all.json"
    all_download.value.save_as(everything)
    doc = json.loads(everything.read_text())
    assert doc["format"] == "localchat-chats" and len(doc["chats"]) == 2
    with chat.expect_download() as one_download:
        chat.locator(".chat-item", has_text="First chat").locator(".chat-export").click()
    one = tmp_path / "one.json"
    one_download.value.save_as(one)
    assert [c["title"] for c in json.loads(one.read_text())["chats"]] == ["First chat"]

    # A fresh browser profile: nothing saved, then the export imported.
    chat.evaluate("""async () => {
        const db = await new Promise((ok) => { const r = indexedDB.open('localchat', 1); r.onsuccess = () => ok(r.result); });
        await new Promise((ok) => { const t = db.transaction('chats', 'readwrite'); t.objectStore('chats').clear(); t.oncomplete = ok; });
        localStorage.clear();
    }""")
    chat.reload()
    expect(chat.locator("body")).to_have_attribute("data-ready", "true")
    expect(chat.locator(".chat-item")).to_have_count(0)
    chat.set_input_files("#import-file", [str(everything)])
    expect(chat.locator(".chat-item")).to_have_count(2)
    chat.locator(".chat-open", has_text="First chat").click()
    expect(chat.locator(".msg.assistant .content strong")).to_have_text("bold")
    expect(chat.locator(".msg.user img")).to_have_count(1)

    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    chat.set_input_files("#import-file", [str(bad)])
    expect(chat.locator("#error")).to_contain_text("not a Local Chat export")
    expect(chat.locator(".chat-item")).to_have_count(2)


# ---- 3. message actions -----------------------------------------------------------------------------------------
def test_regenerate_keeps_every_version(chat):
    open_page(chat)
    script_replies(chat, {"chunks": ["First ", "version."]})
    send(chat, "Say something")
    answer_done(chat)
    script_replies(chat, {"chunks": ["Second ", "version."]})
    last_answer(chat).locator(".act-regenerate").click()
    answer = answer_done(chat)
    expect(answer.locator(".content")).to_have_text("Second version.")
    expect(answer.locator(".version-count")).to_have_text("2/2")
    assert sent_requests(chat)[-1]["messages"] == [{"role": "user", "content": "Say something"}]

    last_answer(chat).locator(".act-prev").click()
    expect(last_answer(chat).locator(".content")).to_have_text("First version.")
    expect(last_answer(chat).locator(".version-count")).to_have_text("1/2")
    # The next turn continues from the version on screen.
    request = exchange(chat, "And then?", "Follow-up.")
    assert request["messages"][1] == {"role": "assistant", "content": "First version."}
    chat.reload()
    expect(chat.locator(".msg.assistant").first.locator(".version-count")).to_have_text("1/2")


def test_edit_and_resend_branches_from_there(chat):
    open_page(chat)
    script_replies(chat, {"chunks": ["Four."]})
    send(chat, "What is 2+2?")
    answer_done(chat)
    script_replies(chat, {"chunks": ["Later answer."]})
    send(chat, "Thanks")
    answer_done(chat)

    chat.locator(".msg.user").first.locator(".act-edit").click()
    chat.fill(".edit-text", "What is 3+3?")
    script_replies(chat, {"chunks": ["Six."]})
    chat.press(".edit-text", "Enter")
    answer_done(chat)
    expect(chat.locator(".msg")).to_have_count(2)       # the branch: the later turns belong to the old question
    expect(chat.locator(".msg.user .content")).to_have_text("What is 3+3?")
    expect(chat.locator(".msg.assistant .content")).to_have_text("Six.")
    assert sent_requests(chat)[-1]["messages"] == [{"role": "user", "content": "What is 3+3?"}]
    user = chat.locator(".msg.user").first
    expect(user.locator(".version-count")).to_have_text("2/2")
    user.locator(".act-prev").click()
    expect(chat.locator(".msg")).to_have_count(4)       # the old branch, whole
    expect(chat.locator(".msg.user .content").first).to_have_text("What is 2+2?")
    expect(chat.locator(".msg.assistant .content").last).to_have_text("Later answer.")


def test_delete_copy_and_retry_after_an_error(chat):
    open_page(chat)
    script_replies(chat, {"chunks": ["Partial "], "error": "out of KV blocks"})
    send(chat, "Question")
    expect(chat.locator("#error")).to_contain_text("out of KV blocks")
    answer = last_answer(chat)
    expect(answer).to_have_attribute("data-status", "error")
    script_replies(chat, {"chunks": ["Whole ", "answer."]})
    answer.locator(".act-retry").click()
    answer = answer_done(chat)
    expect(answer.locator(".content")).to_have_text("Whole answer.")
    expect(chat.locator("#error")).to_be_hidden()

    answer.locator(".act-copy").click()
    chat.wait_for_function("async () => (await navigator.clipboard.readText()) === 'Whole answer.'")

    script_replies(chat, {"chunks": ["Second."]})
    send(chat, "Another")
    answer_done(chat)
    chat.locator(".msg.user").nth(1).locator(".act-delete").click()   # a question goes with what follows it
    expect(chat.locator(".msg")).to_have_count(2)
    last_answer(chat).locator(".act-delete").click()     # one version of two: the other one shows
    expect(chat.locator(".msg")).to_have_count(2)
    expect(last_answer(chat).locator(".content")).to_have_text("Partial")
    expect(last_answer(chat).locator(".versions")).to_have_count(0)
    last_answer(chat).locator(".act-delete").click()
    expect(chat.locator(".msg")).to_have_count(1)
    chat.reload()
    expect(chat.locator("body")).to_have_attribute("data-ready", "true")
    expect(chat.locator(".msg")).to_have_count(1)


# ---- 4. rendering with the libraries ------------------------------------------------------------------------------
MATH_AND_CODE = ("Euler: $e^{i\\pi} + 1 = 0$ and \\(a_1^2\\).\n\n$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$\n\n"
                 "\\[ \\sum_{k=1}^n k \\]\n\nPrices: $5 and $10 stay text.\n\n"
                 "```python\ndef square(x):\n    return x * x  # <b>not bold</b>\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
                 "<script>window.__pwned = 1</script> <img src=x onerror=\"window.__pwned = 1\"> "
                 "[bad](javascript:window.__pwned=1)\n\nThe end.")


@pytest.mark.skipif(not (Path(__file__).resolve().parent.parent / "static/vendor/katex/katex.mjs").is_file(),
                    reason="the rendering libraries are not installed (web/install_vendor.sh needs npm)")
def test_math_and_highlighted_code_render_while_streaming(chat):
    open_page(chat)
    expect(chat.locator("html")).to_have_attribute("data-renderer", "marked")
    chunks = [MATH_AND_CODE[i:i + 6] for i in range(0, len(MATH_AND_CODE), 6)]
    script_replies(chat, {"chunks": chunks, "pauseAfter": len(chunks) - 3, "delayMs": 5})
    send(chat, "math and code")
    answer = last_answer(chat)
    content = answer.locator(".content")
    # Still streaming: everything above the last lines is already rendered.
    expect(content.locator(".code-block code.hljs .hljs-keyword").first).to_have_text("def")
    assert answer.get_attribute("data-status") == "streaming"
    expect(content.locator(".math-inline .katex")).to_have_count(2)
    expect(content.locator(".math-display .katex-display")).to_have_count(2)
    chat.evaluate("window.__chat.go = true")
    answer_done(chat)
    expect(content.locator(".math .katex-error")).to_have_count(0)
    expect(content).to_contain_text("Prices: $5 and $10 stay text.")
    expect(content.locator(".code-block .code-lang")).to_have_text("python")
    expect(content.locator("pre code")).to_contain_text("# <b>not bold</b>")
    expect(content.locator("table td")).to_have_count(2)
    expect(content.locator("script, img, b")).to_have_count(0)
    expect(content).to_contain_text("<script>window.__pwned = 1</script>")
    expect(content.locator("a")).to_have_count(0)
    assert chat.evaluate("window.__pwned") is None


def test_plain_markdown_where_the_libraries_are_missing(chat):
    chat.engine.page_config = {"max_upload_bytes": 20 << 20, "vendor": []}
    open_page(chat)
    expect(chat.locator("html")).to_have_attribute("data-renderer", "builtin")
    chunks = [MATH_AND_CODE[i:i + 6] for i in range(0, len(MATH_AND_CODE), 6)]
    script_replies(chat, {"chunks": chunks})
    send(chat, "math and code")
    content = answer_done(chat).locator(".content")
    expect(content.locator(".code-block pre code")).to_contain_text("def square(x):")
    expect(content.locator(".math-inline")).to_have_count(2)       # TeX shown as written
    expect(content.locator(".math-inline").first).to_have_text("$e^{i\\pi} + 1 = 0$")
    expect(content.locator("table td")).to_have_count(2)
    expect(content.locator("script, img, b")).to_have_count(0)
    assert chat.evaluate("window.__pwned") is None


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
    chat.reload()
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


BLOCK_PIXELS = """(blocks) => {
    const c = document.getElementById('kv-map'), ctx = c.getContext('2d');
    const cell = Number(c.dataset.cell), cols = Number(c.dataset.cols), dpr = window.devicePixelRatio || 1;
    return blocks.map((i) => Array.from(ctx.getImageData(((i % cols) * cell + 1) * dpr,
                                                         (Math.floor(i / cols) * cell + 1) * dpr, 1, 1).data).join(','));
}"""


# ---- 7. the KV block map -------------------------------------------------------------------------------------------
def test_block_map_shows_requests_cached_shared_and_swapped_with_bytes(chat, tmp_path):
    chat.engine.blocks = {"num_blocks": 64, "bytes_per_block": 65536, "shared": [[0, 2]],
                          "runs": [[0, 5], [1, 3], [-2, 4], [-1, 52]],
                          "requests": [{"id": "chatcmpl-aaaa1111", "state": "running", "blocks": 5, "cpu_blocks": 0},
                                       {"id": "chatcmpl-bbbb2222", "state": "running", "blocks": 5, "cpu_blocks": 0},
                                       {"id": "chatcmpl-cccc3333", "state": "swapped", "blocks": 0, "cpu_blocks": 7}]}
    open_page(chat)
    box = chat.locator("#kv-map-box")
    expect(box).to_have_attribute("data-state", "live")
    expect(box).to_have_attribute("data-held", "8")
    expect(box).to_have_attribute("data-cached", "4")
    expect(box).to_have_attribute("data-free", "52")
    expect(box).to_have_attribute("data-swapped", "1")
    expect(chat.locator("#kv-map-summary")).to_have_text(
        "held 8 (512 KiB) · cached 4 (256 KiB) · free 52 (3.3 MiB) · 64 KiB per block")
    rows = chat.locator("#kv-requests li")
    expect(rows).to_have_count(3)
    expect(rows.nth(0)).to_contain_text("aaaa1111")
    expect(rows.nth(0)).to_contain_text("running · 5 blocks (320 KiB)")
    expect(rows.nth(2)).to_contain_text("swapped out · 7 CPU blocks (448 KiB)")
    expect(chat.locator("#kv-gpu-bytes")).to_have_text("256 KiB used of 4 MiB (64 KiB per block)")
    # Cells are drawn in the request's colour: block 0 (request 0) differs from block 63 (free).
    colors = chat.evaluate(BLOCK_PIXELS, [0, 5, 63])
    assert len(set(colors)) == 3, colors             # request 0, request 1, free
    script_replies(chat, {"chunks": [MATH_AND_CODE.split("<script>")[0]], "usage": {"prompt_tokens": 900,
                                                                                     "completion_tokens": 180}})
    send(chat, "Show me some math and code")
    answer_done(chat)
    screenshot(chat, tmp_path, "desktop-light.png")
    chat.click("#theme")        # system (light here) -> light
    chat.click("#theme")        # -> dark
    expect(chat.locator("html")).to_have_attribute("data-theme", "dark")
    dark_free = chat.evaluate(BLOCK_PIXELS, [63])[0]
    assert dark_free != colors[2], "the map was not redrawn in the dark theme's colours"
    screenshot(chat, tmp_path, "desktop-dark.png")

    chat.engine.status = {"proxy": "ok", "engine": "unreachable"}
    expect(box).to_have_attribute("data-state", "none")
    expect(rows).to_have_count(0)


# ---- 8. theme, shortcuts, phone ---------------------------------------------------------------------------------------
def test_theme_toggle_and_keyboard_shortcuts(chat):
    open_page(chat)
    html = chat.locator("html")
    expect(html).to_have_attribute("data-theme", "light")            # the system's (light in this browser)
    chat.click("#theme")
    chat.click("#theme")
    expect(html).to_have_attribute("data-theme", "dark")
    chat.reload()
    expect(chat.locator("body")).to_have_attribute("data-ready", "true")
    expect(html).to_have_attribute("data-theme", "dark")             # the choice is kept
    assert chat.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(15, 17, 21)"

    chat.locator("#messages").click()
    chat.keyboard.press("?")
    help_box = chat.locator("#shortcuts")
    expect(help_box).to_be_visible()
    expect(help_box).to_contain_text("new chat")
    expect(help_box.locator("kbd", has_text="Enter").first).to_be_visible()
    chat.keyboard.press("Escape")
    expect(help_box).to_be_hidden()

    script_replies(chat, {"chunks": ["hi"]})
    send(chat, "hello")
    answer_done(chat)
    chat.keyboard.press("Control+Shift+O")                          # new chat
    expect(chat.locator("#empty-state")).to_be_visible()
    chat.keyboard.press("Control+Shift+K")
    expect(chat.locator("#kv")).to_be_hidden()
    chat.keyboard.press("Control+Shift+L")                          # dark -> system
    expect(html).to_have_attribute("data-theme", "light")
    chat.locator("#messages").click()
    chat.keyboard.press("/")
    assert chat.evaluate("document.activeElement.id") == "prompt"


def test_phone_drawers_close_when_a_chat_is_chosen(browser, page_proxy):
    context, page, errors = new_page(browser, viewport=(390, 844), fake_stream=True)
    page.engine, page.base_url = FakeEngine(page), page_proxy.url
    open_page(page)
    expect(page.locator("#sidebar")).to_be_hidden()                 # folded away on a phone
    expect(page.locator("#kv")).to_be_hidden()
    script_replies(page, {"chunks": ["one"]})
    send(page, "first chat")
    answer_done(page)
    page.click("#new-chat")
    page.click("#toggle-sidebar")
    page.locator(".chat-open", has_text="first chat").click()
    expect(page.locator("#sidebar")).to_be_hidden()
    expect(page.locator(".msg.user .content")).to_have_text("first chat")
    context.close()
    assert not errors, errors
