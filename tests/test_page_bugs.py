"""The chat page's bugs of issue 34, one test each (bench: page_bench.py): what a new user hit, at the window
sizes where layout matters (1366×768 and 1280×860 laptops, a 390×844 phone). The status bugs (a hung engine, a
restart, a launcher that gave up) run against a proxy of their own that reads real status files; the engine
behind it is a socket that accepts connections and never answers, or a closed port."""
from __future__ import annotations

import json
import os
import re
import socket
import time

import pytest

from app.supervision import EngineStatusFile, EngineWatch, RestartPolicy
from browser_helpers import (browser, expect, last_answer, new_page, reload, screenshot, script_replies, send,  # noqa: F401
                             sent_requests)
from page_bench import answer_done, chat, exchange, FakeEngine, open_page, page_proxy, png_file  # noqa: F401
from servers import free_port, start_proxy

pytestmark = [pytest.mark.browser]

SIZES = [(1366, 768), (1280, 860), (390, 844)]


def sized_page(browser, page_proxy, size, **kw):
    context, page, errors = new_page(browser, viewport=size, fake_stream=True, **kw)
    page.engine, page.base_url = FakeEngine(page), page_proxy.url
    return context, page, errors



def titles(page) -> list[str]:
    return page.locator("#chat-list .chat-open").all_inner_texts()


# ---- 1. a failed first message leaves no chat behind --------------------------------------------------------------
def test_a_first_message_that_fails_leaves_no_ghost_chat(chat):
    chat.expected_errors.append("status of 503")
    open_page(chat)
    script_replies(chat, {"status": 503, "body": {"error": {"message": "The inference engine is loading the model."}}})
    send(chat, "hello?")
    expect(chat.locator("#error")).to_contain_text("loading the model")
    assert chat.input_value("#prompt") == "hello?"          # the message is given back
    chat.click("#new-chat")
    expect(chat.locator("#chat-list .chat-item")).to_have_count(0)
    reload(chat)
    expect(chat.locator("#chat-list .chat-item")).to_have_count(0)
    expect(chat.locator(".msg")).to_have_count(0)


# ---- 2. two tabs on one chat ---------------------------------------------------------------------------------------
def test_two_tabs_on_one_chat_keep_every_turn(chat):
    open_page(chat)
    exchange(chat, "first", "one")
    tab_b = chat.context.new_page()
    tab_b.engine, tab_b.base_url = FakeEngine(tab_b), chat.base_url
    open_page(tab_b)
    expect(tab_b.locator(".msg.user")).to_have_count(1)       # the same chat, as it was
    exchange(chat, "from tab A", "two")
    request = exchange(tab_b, "from tab B", "three")             # tab B has not seen tab A's turn
    assert [m["content"] for m in request["messages"]] == ["first", "one", "from tab A", "two", "from tab B"]
    for tab in (chat, tab_b):
        reload(tab)
        expect(tab.locator(".msg.user .content")).to_have_text(["first", "from tab A", "from tab B"])
        expect(tab.locator(".msg.assistant .content")).to_have_text(["one", "two", "three"])
    tab_b.close()


# ---- 6. speed of an answer whose chunks arrive together ------------------------------------------------------------
def test_no_absurd_speed_when_chunks_arrive_together(chat):
    open_page(chat)
    script_replies(chat, {"chunks": [f"w{i} " for i in range(40)], "bursts": 2, "delayMs": 2})
    send(chat, "quick")
    meta = answer_done(chat).locator(".meta")
    expect(meta).to_contain_text("40 tokens")
    rates = [float(r) for r in re.findall(r"([\d.]+) tok/s", meta.inner_text())]
    assert all(r < 2000 for r in rates), meta.inner_text()
    # A stream that lasts is measured.
    script_replies(chat, {"chunks": [f"w{i} " for i in range(12)], "delayMs": 40})
    send(chat, "slow")
    expect(answer_done(chat).locator(".meta")).to_contain_text(re.compile(r"\b(1\d|2\d)\.\d tok/s"))


# ---- 7, 11 and 12 (launcher's wording): the status from the proxy's files ------------------------------------------
@pytest.fixture(scope="module")
def status_proxy(tmp_path_factory):
    """A proxy with both status files; its engine port is closed unless a test listens on it (a hung engine)."""
    logs = tmp_path_factory.mktemp("status-proxy")
    port = free_port()
    load_file, supervisor_file = logs / "engine-load.json", logs / "engine-status.json"
    server = start_proxy(f"http://127.0.0.1:{port}", logs, engine_status_file=load_file,
                         extra_args=("--supervisor-status-file", str(supervisor_file)))
    server.engine_port, server.load_file, server.supervisor_file, server.logs = port, load_file, supervisor_file, logs
    yield server
    server.stop()


@pytest.fixture
def files(status_proxy):
    yield status_proxy
    for f in (status_proxy.load_file, status_proxy.supervisor_file):
        f.unlink(missing_ok=True)


def open_on(page, server):
    """The page from the status proxy; its /api/status is played by the test until real_status()."""
    page.base_url = server.url
    open_page(page)


def real_status(page):
    """The page's /api/status from the proxy itself (the rest of the engine's side still played by the test)."""
    page.unroute("**/api/status")


def write_load_status(server, phase, progress, at=None):
    server.load_file.write_text(json.dumps({"pid": os.getpid(), "phase": phase, "progress": progress,
                                            "time": at or time.time()}))


class ExitedEngine:
    returncode = 1

    def poll(self):
        return 1


def crash(server, max_restarts, backoff_s):
    """The launcher's EngineWatch sees its engine exit once: it writes the status file as it does for real."""
    watch = EngineWatch(lambda: ExitedEngine(), lambda: False, RestartPolicy(max_restarts=max_restarts,
                        backoff_s=backoff_s), EngineStatusFile(server.supervisor_file), server.logs / "vllm.log",
                        lambda message: None)
    watch.attach(ExitedEngine())
    watch.poll()


def test_a_hung_engine_is_shown_and_a_pending_answer_gives_up(chat, files):
    open_on(chat, files)
    script_replies(chat, {"chunks": ["never"], "pauseAfter": 0})
    send(chat, "are you there?")
    expect(last_answer(chat)).to_have_attribute("data-status", "streaming")
    expect(last_answer(chat).locator(".content")).to_have_attribute("data-wait", re.compile(r"^\d+ s$"))   # "Thinking… 1 s"
    hung = socket.socket()
    hung.bind(("127.0.0.1", files.engine_port))
    hung.listen(8)                                  # accepts connections, never answers
    try:
        write_load_status(files, "ready", 1.0)      # it had started
        real_status(chat)
        status = chat.locator("#status")
        expect(status).to_have_attribute("data-state", "unresponsive", timeout=15_000)
        expect(status).to_have_text("Engine not responding")
        expect(chat.locator("#error")).to_contain_text("stopped answering", timeout=20_000)
        expect(chat.locator(".msg")).to_have_count(0)
        assert chat.input_value("#prompt") == "are you there?"
        expect(chat.locator("#send")).to_be_disabled()
    finally:
        chat.goto("about:blank")
        hung.close()


def test_a_restart_shows_how_far_the_new_engine_has_come(chat, files):
    open_on(chat, files)
    crash(files, max_restarts=3, backoff_s=0)
    write_load_status(files, "loading weights", 0.5, at=time.time() + 1)
    real_status(chat)
    status = chat.locator("#status")
    expect(status).to_have_attribute("data-state", "restarting")
    expect(status).to_have_text("Engine restarting… 50%")
    title = status.get_attribute("title")
    assert "loading the model (loading weights, 50%)" in title and "restart 1 of at most 3" in title, title
    assert "restarting it in" not in title, title


def test_a_launcher_that_gave_up_after_one_crash_says_once(chat, files):
    open_on(chat, files)
    crash(files, max_restarts=0, backoff_s=0)
    real_status(chat)
    status = chat.locator("#status")
    expect(status).to_have_attribute("data-state", "failed")
    expect(status).to_have_attribute("title", re.compile("has now failed once;"))
    assert "1 times" not in status.get_attribute("title")


# ---- 9. no sending while the model loads ---------------------------------------------------------------------------
def test_send_waits_for_the_model_to_load(chat):
    chat.engine.status = {"proxy": "ok", "engine": "starting", "progress": 0.3, "phase": "loading weights"}
    chat.goto(chat.base_url + "/")
    expect(chat.locator("#status")).to_have_text("Loading model… 30%")
    expect(chat.locator("#send")).to_be_disabled()
    send(chat, "hello")
    expect(chat.locator("#error")).to_contain_text("still loading")
    expect(chat.locator("#error")).not_to_contain_text("not reachable")
    assert sent_requests(chat) == [] and chat.input_value("#prompt") == "hello"
    chat.engine.status = {"proxy": "ok", "engine": "ready"}
    expect(chat.locator("#send")).to_be_enabled()
    expect(chat.locator("#error")).to_be_hidden()


# ---- 10. a dropped connection is not an unreachable server ----------------------------------------------------------
def test_a_dropped_connection_says_so_and_agrees_with_the_status(chat):
    chat.expected_errors.append("network error")
    open_page(chat)
    script_replies(chat, {"chunks": ["Half ", "an answer"], "drop": True})
    send(chat, "tell me")
    expect(last_answer(chat)).to_have_attribute("data-status", "error")
    error = chat.locator("#error")
    expect(error).to_contain_text("dropped during the answer")
    expect(error).not_to_contain_text("could not reach")
    expect(chat.locator("#status")).to_have_attribute("data-state", "ready")
    script_replies(chat, {"chunks": ["Whole answer."]})
    last_answer(chat).locator(".act-retry").click()
    expect(answer_done(chat).locator(".content")).to_have_text("Whole answer.")


# ---- 12. the small ones ---------------------------------------------------------------------------------------------
PLACEHOLDER_FITS = """(id) => {
    const input = document.getElementById(id), style = getComputedStyle(input);
    const ctx = document.createElement('canvas').getContext('2d');
    ctx.font = `${style.fontSize} ${style.fontFamily}`;
    const room = input.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    return ctx.measureText(input.placeholder).width <= room;
}"""


@pytest.mark.parametrize("size", [(1366, 768), (390, 844)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_setting_placeholders_read_whole_and_keep_their_meaning(browser, page_proxy, size):
    context, page, errors = sized_page(browser, page_proxy, size)
    open_page(page)
    page.click("#settings summary")
    expect(page.locator("#seed")).to_have_attribute("placeholder", "random")       # after the model's defaults came
    expect(page.locator("#max-tokens")).to_have_attribute("placeholder", "fit to context")
    for field in ("max-tokens", "seed", "temperature", "repetition-penalty"):
        assert page.evaluate(PLACEHOLDER_FITS, field), f"the placeholder of #{field} is cut off"
    context.close()
    assert not errors, errors


STORED_TITLE = """async (title) => {
    const db = await new Promise((ok) => { const r = indexedDB.open('localchat', 1); r.onsuccess = () => ok(r.result); });
    const chats = await new Promise((ok) => { const q = db.transaction('chats').objectStore('chats').getAll(); q.onsuccess = () => ok(q.result); });
    db.close();
    return chats.some((c) => c.title === title);
}"""


def test_renaming_a_chat_keeps_its_place(chat):
    open_page(chat)
    exchange(chat, "older chat", "a")
    chat.click("#new-chat")
    exchange(chat, "newer chat", "b")
    chat.locator(".chat-item", has_text="older").locator(".chat-rename").click()
    chat.fill(".chat-rename-input", "Renamed")
    chat.press(".chat-rename-input", "Enter")
    expect(chat.locator("#chat-list .chat-open")).to_have_text(["newer chat", "Renamed"])
    # The list shows the new title at once; the reload waits until the browser has stored it.
    chat.wait_for_function(STORED_TITLE, arg="Renamed")
    reload(chat)
    expect(chat.locator("#chat-list .chat-open")).to_have_text(["newer chat", "Renamed"])


def test_context_meter_counts_streaming_and_stopped_answers(chat):
    open_page(chat, max_model_len=2048)
    script_replies(chat, {"chunks": ["a", "b", "c", "d"], "pauseAfter": 2, "usage": {"prompt_tokens": 1500}})
    send(chat, "long")
    meter = chat.locator("#context-meter")
    expect(meter).to_have_attribute("data-used", "1502")              # while it streams
    chat.click("#stop")
    expect(last_answer(chat)).to_have_attribute("data-status", "stopped")
    expect(meter).to_have_attribute("data-used", "1502")              # a stopped answer took its room too
    reload(chat)
    expect(meter).to_have_attribute("data-used", "1502")


def test_the_draft_and_its_images_survive_a_reload(chat, tmp_path):
    open_page(chat)
    exchange(chat, "earlier", "ok")
    chat.set_input_files("#file-input", [str(png_file(tmp_path, "draft.png"))])
    expect(chat.locator(".thumb")).to_have_count(1)
    chat.fill("#prompt", "half-written\nthought")
    chat.wait_for_timeout(1000)                   # the draft is written a moment (300 ms) after the last change
    reload(chat)
    expect(chat.locator("#prompt")).to_have_value("half-written\nthought")   # read back once the page is ready
    expect(chat.locator(".thumb")).to_have_count(1)
    chat.click("#new-chat")                       # each chat has its own draft
    expect(chat.locator("#prompt")).to_have_value("")
    expect(chat.locator(".thumb")).to_have_count(0)
    chat.locator(".chat-open", has_text="earlier").click()
    expect(chat.locator(".thumb")).to_have_count(1)
    script_replies(chat, {"chunks": ["seen"]})
    chat.press("#prompt", "Enter")                # sent: the draft is gone
    answer_done(chat, 1)
    reload(chat)
    expect(chat.locator("#prompt")).to_have_value("")
    expect(chat.locator(".thumb")).to_have_count(0)


def test_help_opens_from_the_message_box(chat):
    open_page(chat)
    assert chat.evaluate("document.activeElement.id") == "prompt"
    chat.keyboard.press("Control+/")
    expect(chat.locator("#shortcuts")).to_be_visible()
    expect(chat.locator("#shortcuts")).to_contain_text("from anywhere")
    chat.keyboard.press("Escape")
    expect(chat.locator("#shortcuts")).to_be_hidden()
    assert chat.input_value("#prompt") == ""


# ---- 4. settings open: the conversation keeps half the window; how the page looks at each size -------------------
SAMPLE_ANSWER = ("Here is a **short** answer with a list:\n\n- one\n- two\n\n```python\nprint('hello')\n```\n\n"
                 "| a | b |\n|---|---|\n| 1 | 2 |\n\nThe end.")


def assert_conversation_keeps_half(page, height):
    assert page.locator("#messages").bounding_box()["height"] >= height / 2
    assert page.evaluate("document.documentElement.scrollHeight") <= height     # the page itself never scrolls
    send_box = page.locator("#send").bounding_box()
    assert send_box["y"] + send_box["height"] <= height


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_settings_leave_the_conversation_half_the_window(browser, page_proxy, tmp_path, size):
    """And the screenshots, in test-output/: page-{W}x{H}-{light,dark}.png, a conversation; ...-settings.png,
    the same with Settings open and a long draft."""
    context, page, errors = sized_page(browser, page_proxy, size)
    open_page(page, max_model_len=4096)
    script_replies(page, {"chunks": [SAMPLE_ANSWER[i:i + 12] for i in range(0, len(SAMPLE_ANSWER), 12)],
                          "delayMs": 1, "usage": {"prompt_tokens": 900}})
    send(page, "Show me a list, some code and a table.")
    answer_done(page)
    name = f"page-{size[0]}x{size[1]}"
    screenshot(page, tmp_path, f"{name}-light.png")

    page.click("#settings summary")
    page.fill("#prompt", "\n".join(f"line {i} of a long draft" for i in range(30)))
    assert_conversation_keeps_half(page, size[1])
    screenshot(page, tmp_path, f"{name}-light-settings.png")
    page.locator("#max-tokens").scroll_into_view_if_needed()                   # every field within reach
    expect(page.locator("#max-tokens")).to_be_in_viewport()

    page.click("#theme")            # system (light here) -> light
    page.click("#theme")            # -> dark
    expect(page.locator("html")).to_have_attribute("data-theme", "dark")
    screenshot(page, tmp_path, f"{name}-dark-settings.png")
    page.click("#settings summary")
    page.fill("#prompt", "")
    screenshot(page, tmp_path, f"{name}-dark.png")
    context.close()
    assert not errors, errors
