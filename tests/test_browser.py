"""The chat page in Debian's Chromium, driven by Playwright, against the proxy and the real engine.

Chat requests from the page are extended in flight (page.route) with `ignore_eos` and a larger `max_tokens`
where a test needs a long answer: the tiny random model may otherwise stop after a few tokens.
"""
from __future__ import annotations

import base64
import io
import json
import re
import signal

import pytest
from PIL import Image

from browser_helpers import browser, delta, expect, last_answer, new_page, screenshot, send, sse  # noqa: F401
from servers import (ENGINE_START_TIMEOUT, PYTHON, SERVED_NAME, engine, free_port,  # noqa: F401
                     long_generation_tokens, proxy, spawn, start_engine, start_proxy, wait_idle)

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture
def page(browser):
    context, pg, errors = new_page(browser)
    yield pg
    context.close()
    assert not errors, f"errors on the page: {errors}"


def open_chat(page, server):
    page.goto(server.url + "/")
    expect(page.locator("#status")).to_have_attribute("data-state", "ready", timeout=30_000)
    expect(page.locator("#model-name")).to_have_text(SERVED_NAME)


def extend_chat_requests(page, **extra) -> list[dict]:
    """Add fields to every chat request the page sends; returns the bodies as the page built them."""
    sent: list[dict] = []

    def handle(route):
        body = json.loads(route.request.post_data)
        sent.append(json.loads(json.dumps(body)))
        body.update(extra)
        route.continue_(post_data=json.dumps(body))  # continue_ streams the response through untouched

    page.route("**/v1/chat/completions", handle)
    return sent


def test_send_message_streams_answer(page, proxy, tmp_path):
    open_chat(page, proxy)
    # Long enough (~0.5 s on the tiny model) that the stream cannot arrive in one network read.
    sent = extend_chat_requests(page, max_tokens=400, ignore_eos=True, temperature=0)
    # Record the answer's length at every DOM change: a streamed answer grows in several steps.
    page.evaluate("""() => {
        window.__lengths = [];
        new MutationObserver(() => {
            const a = document.querySelector('.msg.assistant[data-status="streaming"] .content');
            if (a) window.__lengths.push(a.textContent.length);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")
    send(page, "Hello, who are you?")
    answer = last_answer(page)
    expect(answer).to_have_attribute("data-status", "done", timeout=60_000)
    growth = sorted(set(n for n in page.evaluate("window.__lengths") if n > 0))
    assert len(growth) >= 2, f"the answer did not stream in: lengths seen {growth}"
    assert int(answer.get_attribute("data-chunks")) > 1
    assert answer.locator(".content").inner_text().strip()
    meta = answer.locator(".meta")
    expect(meta).to_contain_text("to first token")
    expect(meta).to_contain_text("tok/s")
    expect(page.locator(".msg.user .content").last).to_have_text("Hello, who are you?")
    assert page.input_value("#prompt") == ""
    expect(page.locator("#kv-used")).not_to_have_text("—")  # the KV panel shows live /stats

    send(page, "And a second question?")
    expect(last_answer(page)).to_have_attribute("data-status", "done", timeout=60_000)
    roles = [m["role"] for m in sent[-1]["messages"]]
    assert roles == ["user", "assistant", "user"], roles  # multi-turn: the history goes with every request
    assert sent[-1]["stream"] is True and sent[-1]["model"] == SERVED_NAME
    expect(page.locator("#error")).to_be_hidden()
    screenshot(page, tmp_path, "chat.png")


def test_image_upload_and_answer(page, proxy, tmp_path):
    open_chat(page, proxy)
    big, small = tmp_path / "big.png", tmp_path / "small.png"
    Image.new("RGB", (2400, 1600), (20, 120, 220)).save(big)
    Image.new("RGB", (200, 100), (250, 200, 0)).save(small)
    page.set_input_files("#file-input", [str(big), str(small)])
    thumbs = page.locator(".thumb")
    expect(thumbs).to_have_count(2)
    expect(thumbs.first.locator("figcaption")).to_have_text("1280×853")  # downscaled before sending
    thumbs.nth(1).locator(".remove").click()
    expect(thumbs).to_have_count(1)

    sent = extend_chat_requests(page, max_tokens=8, ignore_eos=True)   # a random model may stop at once
    send(page, "What is in this image?")
    answer = last_answer(page)
    expect(answer).to_have_attribute("data-status", "done", timeout=90_000)
    expect(page.locator("#error")).to_be_hidden()
    expect(thumbs).to_have_count(0)
    expect(page.locator(".msg.user img")).to_have_count(1)
    parts = sent[-1]["messages"][-1]["content"]
    images = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
    assert [p["text"] for p in parts if p["type"] == "text"] == ["What is in this image?"]
    assert len(images) == 1 and images[0].startswith("data:image/jpeg;base64,")
    decoded = Image.open(io.BytesIO(base64.b64decode(images[0].split(",", 1)[1])))
    assert max(decoded.size) <= 1280
    screenshot(page, tmp_path, "image-answer.png")


def test_a_video_clip_is_answered_by_the_real_engine(page, proxy, tmp_path):
    """The clip goes from the file input through the proxy to the engine, which samples, encodes and answers."""
    from video_helpers import make_clip
    open_chat(page, proxy)
    clip = make_clip(12, fps=6, width=96, height=64)
    page.set_input_files("#file-input", [{"name": "clip.mp4", "mimeType": "video/mp4", "buffer": clip}])
    # The page gives the browser up to 15 s to read a clip (10 s of metadata, 5 s to seek a frame:
    # static/video_attach.js); on a loaded 2-core machine a fresh Chromium took longer than a 12 s wait.
    expect(page.locator(".video-card .video-duration")).to_have_text("0:02", timeout=30_000)

    sent = extend_chat_requests(page, max_tokens=8, ignore_eos=True)
    send(page, "What happens in this clip?")
    expect(last_answer(page)).to_have_attribute("data-status", "done", timeout=90_000)
    expect(page.locator("#error")).to_be_hidden()
    parts = sent[-1]["messages"][-1]["content"]
    assert [p["video_url"]["url"] for p in parts if p["type"] == "video_url"] == \
        ["data:video/mp4;base64," + base64.b64encode(clip).decode()]
    expect(page.locator(".msg.user video")).to_have_count(1)


def test_stop_mid_answer(page, proxy, engine):
    open_chat(page, proxy)
    n = long_generation_tokens(engine, seconds=30)
    extend_chat_requests(page, max_tokens=n, ignore_eos=True)
    send(page, "Tell me a very long story.")
    answer = last_answer(page)
    page.wait_for_function("() => Number(document.querySelector('.msg.assistant')?.dataset.chunks || 0) >= 3",
                           timeout=60_000)
    # The block map follows the request: its blocks grow while it generates.
    page.evaluate("""() => {
        window.__held = [];
        const box = document.getElementById('kv-map-box');
        new MutationObserver(() => window.__held.push(Number(box.dataset.held))).observe(box, {attributes: true});
    }""")
    page.wait_for_function("new Set(window.__held.filter((n) => n > 0)).size >= 2", timeout=30_000)
    expect(page.locator("#kv-requests li[data-state=running]")).to_have_count(1)
    page.click("#stop")
    expect(answer).to_have_attribute("data-status", "stopped", timeout=5_000)
    expect(page.locator("#kv-map-box")).to_have_attribute("data-held", "0", timeout=5_000)   # all free after Stop
    expect(page.locator("#kv-requests li")).to_have_count(0)
    expect(page.locator("#stop")).to_be_hidden()
    expect(page.locator("#send")).to_be_enabled()
    expect(answer.locator(".meta")).to_contain_text("stopped")
    wait_idle(engine, timeout=5)  # the engine really stopped generating
    assert int(answer.get_attribute("data-tokens")) < n
    expect(page.locator("#error")).to_be_hidden()


def test_markdown_rendered_without_raw_html(page, proxy):
    open_chat(page, proxy)
    text = ("Intro with **bold**, *italic* and `inline <b>code</b>`.\n\n- one\n- two\n\n1. first\n2. second\n\n"
            "```js\nconsole.log('<script>window.__pwned = 1</script>')\n```\n\n"
            "<img src=x onerror=\"window.__pwned = 1\"> [bad](javascript:window.__pwned=1) [good](https://example.com)")
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]  # split mid-markup, as a stream does
    body = sse(*[delta(p) for p in pieces], "[DONE]")
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    send(page, "Show me markdown")
    answer = last_answer(page)
    expect(answer).to_have_attribute("data-status", "done")
    content = answer.locator(".content")
    expect(content.locator("strong")).to_have_text("bold")
    expect(content.locator("em")).to_have_text("italic")
    expect(content.locator("p code")).to_have_text("inline <b>code</b>")
    expect(content.locator("ul > li")).to_have_count(2)
    expect(content.locator("ol > li")).to_have_count(2)
    expect(content.locator("pre code")).to_contain_text("<script>window.__pwned = 1</script>")
    expect(content.locator("img, script, b")).to_have_count(0)
    expect(content.locator("a")).to_have_count(1)
    assert content.locator("a").get_attribute("href") == "https://example.com/"
    expect(content).to_contain_text('<img src=x onerror="window.__pwned = 1">')
    assert page.evaluate("window.__pwned") is None


def answer_with_an_error_event(page):
    """Chat requests get a stream that breaks after its first token: an error event, then [DONE]."""
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"},
        body=sse(delta("Partial "), {"error": {"message": "out of KV blocks", "type": "internal_error"}}, "[DONE]")))


def test_a_message_sent_before_the_page_has_started_waits_for_it(page, proxy):
    """Enter works as soon as the model is ready, even while the page is still loading its chats and settings
    (its /api/page-config held back here): the message waits for the start, then goes out, and its answer (an
    error event at once) is shown and saved without a page error."""
    held = []
    page.route("**/api/page-config", lambda route: held.append(route))
    open_chat(page, proxy)
    answer_with_an_error_event(page)
    send(page, "early")
    assert page.evaluate("document.body.dataset.ready") is None, "the start should still be waiting"
    held[0].continue_()
    expect(page.locator("#error")).to_contain_text("out of KV blocks")
    expect(page.locator(".msg.user")).to_have_count(1)
    page.unroute("**/v1/chat/completions")


def test_errors_are_shown(page, proxy):
    page.expected_errors.append("status of 400")
    open_chat(page, proxy)
    # An error event after the stream began: the partial answer stays, marked incomplete.
    answer_with_an_error_event(page)
    send(page, "first")
    expect(page.locator("#error")).to_contain_text("out of KV blocks")
    expect(last_answer(page)).to_have_attribute("data-status", "error")
    expect(last_answer(page).locator(".meta")).to_contain_text("incomplete")
    page.unroute("**/v1/chat/completions")
    # An HTTP error before any token: its JSON message is shown and the message goes back into the box.
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=400, content_type="application/json",
        body=json.dumps({"error": {"message": "prompt is too long", "type": "invalid_request_error"}})))
    send(page, "second")
    expect(page.locator("#error")).to_contain_text("Error 400: prompt is too long")
    assert page.input_value("#prompt") == "second"
    expect(page.locator(".msg.user")).to_have_count(1)


def test_demo_model_banner_and_text_only(page, proxy):
    stats = {"num_total_gpu_blocks": 2048, "num_free_gpu_blocks": 1832, "num_used_gpu_blocks": 216,
             "num_cached_blocks": 40, "num_total_cpu_blocks": 512, "num_free_cpu_blocks": 500, "block_size": 16,
             "num_running": 1, "num_waiting": 0, "num_swapped": 0, "prefix_cache_hit_rate": 0.5,
             "num_preemptions": 0, "num_swaps": 0, "model": "SmolLM2-135M-Instruct", "demo_model": True,
             "multimodal": False}
    # The KV panel's numbers come from the block map's snapshot, which carries the counters with the map.
    blocks = {**stats, "num_blocks": 2048, "bytes_per_block": 65536, "runs": [[0, 216], [-2, 40], [-1, 1792]],
              "shared": [], "requests": [{"id": "cmpl-a", "state": "running", "blocks": 216, "cpu_blocks": 0},
                                         {"id": "cmpl-b", "state": "swapped", "blocks": 0, "cpu_blocks": 12}]}
    page.route("**/stats", lambda route: route.fulfill(status=200, content_type="application/json",
                                                       body=json.dumps(stats)))
    page.route("**/stats/blocks", lambda route: route.fulfill(status=200, content_type="application/json",
                                                              body=json.dumps(blocks)))
    open_chat(page, proxy)
    banner = page.locator("#demo-banner")
    expect(banner).to_be_visible()
    expect(banner).to_contain_text("./run_app.sh --model /path/to/Qwen3-VL-8B-Instruct")
    expect(page.locator("#attach")).to_be_enabled()          # text files still go to a text-only model
    expect(page.locator("#image-note")).to_contain_text("text-only")
    expect(page.locator("#kv-used")).to_have_text("216")
    expect(page.locator("#kv-cached")).to_have_text("40")
    expect(page.locator("#kv-free")).to_have_text("1,792")           # empty: the cached 40 are counted apart
    expect(page.locator("#kv-cpu-text")).to_have_text("12 / 512")


def test_engine_stopped_shows_error(page, qwen3_vl_dir, tmp_path):
    eng = start_engine(qwen3_vl_dir, tmp_path)
    prx = start_proxy(eng.url, tmp_path)
    page.expected_errors.append("status of 503")   # the chat request sent while the engine is gone
    try:
        open_chat(page, prx)
        n = long_generation_tokens(eng, seconds=30)
        extend_chat_requests(page, max_tokens=n, ignore_eos=True)
        send(page, "Keep talking.")
        page.wait_for_function("() => Number(document.querySelector('.msg.assistant')?.dataset.chunks || 0) >= 2",
                               timeout=60_000)
        eng.proc.send_signal(signal.SIGKILL)  # the engine dies mid-answer
        expect(page.locator("#error")).to_contain_text("lost", timeout=15_000)
        expect(last_answer(page)).to_have_attribute("data-status", "error")
        expect(page.locator("#status")).to_have_attribute("data-state", "unreachable", timeout=15_000)

        send(page, "Are you there?")
        expect(page.locator("#error")).to_contain_text("not reachable", timeout=15_000)
        assert page.input_value("#prompt") == "Are you there?"
        screenshot(page, tmp_path, "engine-down.png")
    finally:
        page.goto("about:blank")     # the page stops polling before its proxy goes away
        prx.stop()
        eng.stop()


def test_loading_state_during_a_real_engine_start(page, qwen3_vl_dir, tmp_path):
    """The proxy is up first (as run_app.sh starts them); the page follows the engine's own load progress."""
    status_file = tmp_path / "engine-load.json"
    port = free_port()
    prx = start_proxy(f"http://127.0.0.1:{port}", tmp_path, engine_status_file=status_file)
    eng = None
    try:
        page.goto(prx.url + "/")
        status = page.locator("#status")
        expect(status).to_have_attribute("data-state", "unreachable")      # no engine yet
        eng = spawn("engine", [PYTHON, "-m", "engine", "--model", str(qwen3_vl_dir), "--served-model-name",
                               SERVED_NAME, "--port", str(port), "--load-status-file", str(status_file)],
                    tmp_path / "engine.log", f"http://127.0.0.1:{port}")
        expect(status).to_have_attribute("data-state", "starting", timeout=30_000)
        expect(status.locator(".status-text")).to_have_text(re.compile(r"^Loading model… \d{1,3}%$"))
        progress = [status.get_attribute("data-progress")]
        page.wait_for_function("document.getElementById('status').dataset.state !== 'starting'",
                               timeout=ENGINE_START_TIMEOUT * 1000)
        expect(status).to_have_attribute("data-state", "ready")
        expect(page.locator("#model-name")).to_have_text(SERVED_NAME)
        expect(page.locator("#kv-used")).not_to_have_text("—")
        assert progress[0].endswith("%")
    finally:
        page.goto("about:blank")     # the page stops polling before its proxy goes away
        if eng is not None:
            eng.stop()
        prx.stop()


def test_ten_image_turns_without_an_error(page, proxy, tmp_path):
    """More images than the engine takes in one prompt (8) over a conversation: the oldest are not sent again."""
    open_chat(page, proxy)
    sent = extend_chat_requests(page, max_tokens=2, ignore_eos=True, temperature=0)
    for turn in range(10):
        path = tmp_path / f"{turn}.png"
        Image.new("RGB", (56, 56), (25 * turn, 90, 200 - 15 * turn)).save(path)
        page.set_input_files("#file-input", [str(path)])
        expect(page.locator(".thumb")).to_have_count(1)
        send(page, f"Image {turn}?")
        expect(page.locator(".msg.assistant").nth(turn)).to_have_attribute("data-status", "done", timeout=60_000)
        expect(page.locator("#error")).to_be_hidden()
    counts = [sum(p["type"] == "image_url" for p in m["content"]) for m in sent[-1]["messages"]
              if isinstance(m["content"], list)]
    assert sum(counts) == 8 and counts[:2] == [0, 0], counts
    expect(page.locator("#send-note")).to_contain_text("2 earlier images are not sent again")
