"""Speculative decoding on the page (bench: page_bench.py): the KV panel shows the engine's draft acceptance beside
the throughput while /stats' spec_decode has drafts, and nothing of it otherwise."""
from __future__ import annotations

import pytest

from browser_helpers import browser, expect, new_page  # noqa: F401
from page_bench import FakeEngine, chat, open_page, page_proxy  # noqa: F401

pytestmark = [pytest.mark.browser]


def spec_decode(num_drafts=100, accepted=190, drafted=264, method="eagle3") -> dict:
    return {"method": method, "num_speculative_tokens": 3, "num_drafts": num_drafts, "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted, "num_accepted_tokens_per_pos": [80, 62, 48],
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + accepted / num_drafts if num_drafts else 0.0}


def open_kv_panel(page):
    open_page(page)
    if page.locator("#kv").is_hidden():          # a drawer on a narrow window
        page.click("#toggle-kv")


def test_the_panel_shows_the_draft_acceptance_beside_the_throughput(chat):
    chat.engine.spec_decode = spec_decode()
    open_kv_panel(chat)
    spec = chat.locator("#kv-spec")
    expect(spec).to_be_visible()
    expect(spec).to_have_text("72% (mean 2.9 tokens/step, eagle3)")
    expect(chat.locator("#kv-spec-label")).to_have_text("Draft acceptance")
    # It follows the engine's counters (the idle page polls every 2.5 s).
    chat.engine.spec_decode = spec_decode(num_drafts=200, accepted=264, drafted=528)
    expect(spec).to_have_text("50% (mean 2.3 tokens/step, eagle3)", timeout=12_000)


@pytest.mark.parametrize("viewport", [(1366, 768), (1280, 860), (390, 844)])
def test_the_added_row_keeps_the_page_from_scrolling(browser, page_proxy, viewport):
    context, page, errors = new_page(browser, viewport=viewport, fake_stream=True)
    page.engine, page.base_url = FakeEngine(page), page_proxy.url
    page.engine.spec_decode = spec_decode()
    open_kv_panel(page)
    expect(page.locator("#kv-spec")).to_be_visible()
    size = page.evaluate("[document.documentElement.scrollHeight, window.innerHeight]")
    assert size[0] == size[1], f"the page is {size[0]} px tall in a {size[1]} px window"
    context.close()
    assert not errors, errors


@pytest.mark.parametrize("state", ["off", "no drafts yet"])
def test_nothing_of_it_shows_without_drafts(chat, state):
    chat.engine.spec_decode = None if state == "off" else spec_decode(num_drafts=0, accepted=0, drafted=0)
    open_kv_panel(chat)
    expect(chat.locator("#kv-throughput")).to_be_visible()
    expect(chat.locator("#kv-map-box")).to_have_attribute("data-state", "live")
    expect(chat.locator("#kv-spec")).to_be_hidden()
    expect(chat.locator("#kv-spec-label")).to_be_hidden()


def test_a_method_name_is_text_never_markup(chat):
    chat.engine.spec_decode = spec_decode(method="<img src=x onerror=alert(1)>")
    open_kv_panel(chat)
    expect(chat.locator("#kv-spec")).to_have_text("72% (mean 2.9 tokens/step, <img src=x onerror=alert(1)>)")
    assert chat.locator("#kv-spec img").count() == 0
