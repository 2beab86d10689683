"""Markdown in answers (bench: page_bench.py): lists, code inside lists and table alignment, with both renderers:
the vendored libraries (marked + DOMPurify) and the page's own markdown.js (where the libraries are missing)."""
from __future__ import annotations

import pytest

from browser_helpers import browser, expect, new_page, script_replies, send  # noqa: F401
from page_bench import FakeEngine, answer_done, open_page, page_proxy  # noqa: F401
from proxy.page import available_vendor
from servers import REPO

pytestmark = [pytest.mark.browser]

HAS_MARKED = {"marked", "dompurify"} <= set(available_vendor(REPO / "static"))
RENDERERS = [pytest.param("marked", marks=pytest.mark.skipif(not HAS_MARKED, reason="web/install_vendor.sh needs npm")),
             "builtin"]


@pytest.fixture(scope="module", params=RENDERERS)
def chat(request, browser, page_proxy):
    """One page per renderer for the module's tests (each test answers in a new chat)."""
    context, page, errors = new_page(browser, fake_stream=True)
    page.engine = FakeEngine(page)
    page.base_url = page_proxy.url
    if request.param == "builtin":
        page.engine.page_config = {"max_upload_bytes": 20 << 20, "vendor": []}
    open_page(page)
    expect(page.locator("html")).to_have_attribute("data-renderer", request.param)
    yield page
    context.close()
    assert not errors, f"errors in the page: {errors}"


def render(chat, text, chunk=5):
    """The answer's content element once `text` has streamed in, `chunk` characters at a time."""
    chat.click("#new-chat")
    script_replies(chat, {"chunks": [text[i:i + chunk] for i in range(0, len(text), chunk)], "delayMs": 1})
    send(chat, "markdown")
    return answer_done(chat).locator(".content")


def test_a_tight_nested_list_has_no_blank_lines(chat):
    content = render(chat, "Steps:\n\n- one\n  - nested a\n  - nested b\n- two\n- three")
    expect(content.locator("ul")).to_have_count(2)
    expect(content.locator("ul > li > ul > li")).to_have_count(2)
    # Every item is one line high: five lines, no gap between an item and its nested list.
    gaps = chat.evaluate("""() => {
        const items = [...document.querySelectorAll('.msg.assistant .content li')];
        const tops = items.map((li) => { const r = document.createRange(); r.setStart(li.firstChild, 0); r.setEnd(li.firstChild, 1);
                                         return r.getBoundingClientRect().top; });
        const line = parseFloat(getComputedStyle(items[0]).lineHeight);
        return tops.slice(1).map((t, i) => (t - tops[i]) / line);   // in order: one, nested a, nested b, two, three
    }""")
    assert all(0.8 < g < 1.3 for g in gaps), f"line steps between items (in line heights): {gaps}"


def test_a_loose_list_keeps_its_nesting_and_paragraphs(chat):
    content = render(chat, "Steps:\n1. First\n\n   - sub a\n   - sub b\n\n2. Second\n\n   More about the second.\n\n"
                           "3. Third\n\nAfter the list.")
    expect(content.locator("ol")).to_have_count(1)
    expect(content.locator("ol > li")).to_have_count(3)
    expect(content.locator("ol > li").nth(0).locator("ul > li")).to_have_text(["sub a", "sub b"])
    expect(content.locator("ol > li").nth(1)).to_contain_text("More about the second.")
    expect(content.locator("ol + p, .blk:last-child > p").last).to_have_text("After the list.")


@pytest.mark.parametrize("blank", ["\n", ""], ids=["loose", "tight"])
def test_a_code_block_inside_a_list_item_stays_in_the_list(chat, blank):
    content = render(chat, f"1. Install it:\n{blank}   ```bash\n   pip install x\n\n   echo done\n   ```\n{blank}"
                                     "2. Run it.")
    expect(content.locator("ol")).to_have_count(1)
    expect(content.locator("ol > li")).to_have_count(2)
    code = content.locator("ol > li").first.locator(".code-block pre")
    expect(code).to_have_text("pip install x\n\necho done")
    expect(content.locator("ol > li").nth(1)).to_have_text("Run it.")


def test_table_columns_keep_their_alignment(chat):
    content = render(chat, "| Left | Center | Right | Plain |\n|:---|:---:|---:|---|\n| a | b | c | d |")
    aligns = chat.evaluate("""() => [...document.querySelectorAll('.msg.assistant table tr')]
        .map((tr) => [...tr.children].map((c) => getComputedStyle(c).textAlign))""")
    expect(content.locator("table td")).to_have_count(4)
    assert [[a.replace("start", "left") for a in row] for row in aligns] == [["left", "center", "right", "left"]] * 2
