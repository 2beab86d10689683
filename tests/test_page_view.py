"""The chat page (bench: page_bench.py): rendering with the vendored libraries, the KV block map, theme,
shortcuts and the phone layout."""
from __future__ import annotations

from pathlib import Path

import pytest

from browser_helpers import browser, expect, last_answer, new_page, reload, screenshot, script_replies, send  # noqa: F401
from page_bench import answer_done, chat, FakeEngine, open_page, page_proxy  # noqa: F401

pytestmark = [pytest.mark.browser]


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
    expect(chat.locator("#kv-gpu-bytes")).to_have_text("512 KiB used of 4 MiB (64 KiB per block)")   # the map's 8
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
    reload(chat)
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
