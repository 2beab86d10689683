"""What the browser tests share: Debian's Chromium through Playwright, a page fixture that fails the test on any
JavaScript error or console error, and a fake chat stream inside the page for tests about the page alone.

The fake stream replaces window.fetch for /v1/chat/completions only (everything else goes to the real proxy):
each request body is recorded in window.__chat.requests and answered with the next scripted reply, one SSE
event per chunk, `delayMs` apart; `pauseAfter: k` holds the stream after k chunks until window.__chat.go is set
(a whole reply {status, body} with `pauseAfter: 0`); a chunk {reasoning: text} is a reasoning_content delta;
`bursts: k` sends the chunks in k network reads instead (several events each, as a buffering network does);
`drop: true` breaks the connection after the chunks (the browser's TypeError); `queued: [n, ...]` first sends the
engine's `: queued n ahead` comments, `delayMs` apart. A request that asks for stream_options.continuous_usage_stats
gets the running usage in every chunk, as the engine sends it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from servers import REPO

CHROMIUM = "/usr/bin/chromium"
# Without the background-networking flags Chromium keeps dialing Google hosts that this closed network refuses.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]

FAKE_STREAM = """
window.__chat = { requests: [], replies: [], go: false };
const realFetch = window.fetch.bind(window);
window.fetch = async (input, init = {}) => {
  const url = typeof input === "string" ? input : input.url;
  if (!url.includes("/v1/chat/completions") || !window.__chat.replies.length) return realFetch(input, init);
  const request = JSON.parse(init.body);
  window.__chat.requests.push(request);
  const reply = window.__chat.replies.shift();
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  if (reply.status) {
    if (reply.pauseAfter === 0) while (!window.__chat.go) await sleep(20);
    return new Response(JSON.stringify(reply.body), { status: reply.status, headers: { "Content-Type": "application/json" } });
  }
  const enc = new TextEncoder();
  const event = (obj) => enc.encode(`data: ${JSON.stringify(obj)}\\n\\n`);
  const signal = init.signal;
  const promptTokens = reply.usage?.prompt_tokens ?? 100;
  const running = (i) => request.stream_options?.continuous_usage_stats
    ? { usage: { prompt_tokens: promptTokens, completion_tokens: i + 1, total_tokens: promptTokens + i + 1 } } : {};
  // A chunk is answer text, or {reasoning: text}: a Thinking model's reasoning_content delta.
  const deltaOf = (chunk) => typeof chunk === "string" ? { content: chunk } : { reasoning_content: chunk.reasoning };
  const chunkEvent = (chunk, i) => event({ choices: [{ index: 0, delta: deltaOf(chunk), finish_reason: null }], ...running(i) });
  const stream = new ReadableStream({
    async start(controller) {
      signal?.addEventListener("abort", () => { try { controller.error(new DOMException("aborted", "AbortError")); } catch {} });
      for (const ahead of reply.queued || []) {
        await sleep(reply.delayMs ?? 10);
        controller.enqueue(enc.encode(`: queued ${ahead} ahead\n\n`));
      }
      if (reply.bursts) {
        const size = Math.ceil(reply.chunks.length / reply.bursts);
        for (let i = 0; i < reply.chunks.length; i += size) {
          await sleep(reply.delayMs ?? 10);
          const events = reply.chunks.slice(i, i + size).map((c, k) => chunkEvent(c, i + k));
          controller.enqueue(new Uint8Array(events.flatMap((e) => [...e])));
        }
      }
      for (const [i, chunk] of (reply.bursts ? [] : reply.chunks).entries()) {
        if (reply.pauseAfter === i) while (!window.__chat.go) await sleep(20);
        await sleep(reply.delayMs ?? 10);
        if (signal?.aborted) return;
        controller.enqueue(chunkEvent(chunk, i));
      }
      if (signal?.aborted) return;
      if (reply.drop) { controller.error(new TypeError("network error")); return; }
      if (reply.error) controller.enqueue(event({ error: { message: reply.error } }));
      controller.enqueue(event({ choices: [{ index: 0, delta: {}, finish_reason: reply.finish || "stop" }],
                                 usage: reply.usage || { prompt_tokens: 100, completion_tokens: reply.chunks.length } }));
      controller.enqueue(enc.encode("data: [DONE]\\n\\n"));
      controller.close();
    },
  });
  return new Response(stream, { status: 200, headers: { "Content-Type": "text/event-stream" } });
};
"""


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (./run_tests.sh does)")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def new_page(browser, viewport=(1200, 820), color_scheme="light", fake_stream=False, auto_title=False):
    """(context, page, errors): errors collects uncaught exceptions and console errors, less those a test
    expects (page.expected_errors: substrings, e.g. the browser's own line for an HTTP error the test causes).
    auto_title: whether the page asks the model for chat titles (off unless a test is about it, so that the
    chat requests a test scripts or counts are its own)."""
    context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]}, color_scheme=color_scheme,
                                  accept_downloads=True)
    context.grant_permissions(["clipboard-read", "clipboard-write"])
    if fake_stream:
        context.add_init_script(FAKE_STREAM)
    if not auto_title:
        # (try: an error page, such as a reload while the proxy is down, has no storage)
        context.add_init_script("try { localStorage.setItem('localchat.auto-title', 'off'); } catch {}")
    pg = context.new_page()
    errors: list[str] = []
    pg.expected_errors = []

    def on_console(msg):
        if msg.type == "error" and not any(e in msg.text for e in pg.expected_errors):
            errors.append(f"console: {msg.text}")

    pg.on("pageerror", lambda err: errors.append(f"uncaught: {err}"))
    pg.on("console", on_console)
    return context, pg, errors


# The page polls the engine's health every 4 s once it is ready, so a change of state shows up to 4 s and a
# request later; Playwright's 5 s default leaves too little room on a loaded 2-core CI machine.
EXPECT_TIMEOUT_MS = 12_000


def expect(locator):
    from playwright.sync_api import expect as pw_expect
    pw_expect.set_options(timeout=EXPECT_TIMEOUT_MS)
    return pw_expect(locator)


def send(page, text):
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def reload(page):
    """Reload once every chat save the page began has finished (body[data-saving] back to 0), then wait until the
    page is ready again."""
    page.wait_for_function("() => (document.body.dataset.saving ?? '0') === '0'")
    page.reload()
    expect(page.locator("body")).to_have_attribute("data-ready", "true")


def last_answer(page):
    return page.locator(".msg.assistant").last


def screenshot(page, tmp_path, name):
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    out = REPO / "test-output"
    out.mkdir(exist_ok=True)
    shutil.copy(path, out / name)


def sse(*events) -> str:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)


def delta(text):
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


def script_replies(page, *replies):
    """Queue fake-stream replies: each a dict {chunks, delayMs?, pauseAfter?, queued?, error?, usage?} or {status, body,
    pauseAfter?}."""
    page.evaluate("(rs) => window.__chat.replies.push(...rs)", list(replies))


def sent_requests(page) -> list[dict]:
    return page.evaluate("window.__chat.requests")
