"""The chat page's everyday features around the list of chats (bench: page_bench.py): tabs that stay in sync,
pinned chats, dates in the list and on messages, and a chat exported as Markdown."""
from __future__ import annotations

import json
import re
import time
from datetime import datetime, timedelta

import pytest

from browser_helpers import browser, expect, reload, script_replies, send  # noqa: F401
from page_bench import FakeEngine, answer_done, chat, exchange, open_page, page_proxy  # noqa: F401

pytestmark = [pytest.mark.browser]


def titles(page) -> list[str]:
    return page.locator("#chat-list .chat-open").all_inner_texts()


def list_rows(page) -> list[str]:
    """The chat list as read: group headings and chat titles, in order."""
    return page.evaluate("""() => [...document.querySelectorAll('#chat-list > li')]
        .map((li) => (li.querySelector('.chat-open') || li).textContent)""")



# ---- tabs in sync --------------------------------------------------------------------------------------------
def test_two_tabs_on_one_chat_see_each_others_turns(chat):
    a = chat
    b = a.context.new_page()          # the same browser profile: the same saved chats
    b_errors = []
    b.on("pageerror", lambda err: b_errors.append(str(err)))
    b.engine = FakeEngine(b)
    b.base_url = a.base_url
    open_page(a)
    open_page(b)

    exchange(a, "From tab A", "Answer to A.")
    expect(b.locator("#chat-list .chat-open")).to_have_text(["From tab A"])      # live, without a reload
    b.locator(".chat-open", has_text="From tab A").click()
    expect(b.locator(".msg.assistant .content")).to_have_text(["Answer to A."])

    exchange(b, "From tab B", "Answer to B.")
    expect(a.locator(".msg.user .content")).to_have_text(["From tab A", "From tab B"])
    exchange(a, "Again from A", "Answer to A again.")
    expect(b.locator(".msg.user .content")).to_have_text(["From tab A", "From tab B", "Again from A"])

    for page in (a, b):
        reload(page)
        expect(page.locator(".msg.user .content")).to_have_text(["From tab A", "From tab B", "Again from A"])
        expect(page.locator(".msg.assistant .content")).to_have_text(["Answer to A.", "Answer to B.", "Answer to A again."])

    b.locator(".chat-item", has_text="From tab A").locator(".chat-delete").click()
    b.locator(".chat-item", has_text="From tab A").locator(".chat-delete").click()
    expect(a.locator(".chat-item")).to_have_count(0)
    expect(a.locator(".msg")).to_have_count(0)
    assert not b_errors


# ---- pinned chats, dates ---------------------------------------------------------------------------------------
def ms(when: datetime) -> int:
    return int(when.timestamp() * 1000)


def old_chat(title, when: datetime, text="Old question"):
    node = {"id": "u1", "parent": "root", "role": "user", "text": text, "images": [], "children": [], "sel": 0,
            "status": "done", "time": ms(when), "meta": {}}
    return {"title": title, "created": ms(when), "updated": ms(when),
            "nodes": {"root": {"id": "root", "children": ["u1"], "sel": 0}, "u1": node}}


def test_chats_are_grouped_by_day_and_pinned_ones_stay_on_top(chat, tmp_path):
    now = datetime.now()
    noon = now.replace(hour=12, minute=0, second=0, microsecond=0)
    long_ago = noon - timedelta(days=75)
    doc = {"format": "localchat-chats", "version": 1,
           "chats": [old_chat("Yesterday's chat", noon - timedelta(days=1)), old_chat("Last week", noon - timedelta(days=5)),
                     old_chat("Long ago", long_ago, "Asked in the past")]}
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(doc))
    open_page(chat)
    chat.set_input_files("#import-file", [str(path)])
    expect(chat.locator(".chat-item")).to_have_count(3)
    chat.click("#new-chat")
    exchange(chat, "Today's question", "Today's answer.")
    expect(chat.locator("#chat-list li")).to_have_count(8)
    assert list_rows(chat) == [
        "Today", "Today's question", "Yesterday", "Yesterday's chat", "Previous 7 days", "Last week",
        long_ago.strftime("%B %Y"), "Long ago"]
    tooltip = chat.locator(".chat-open", has_text="Long ago").get_attribute("title").replace("\u202f", " ")
    assert tooltip.endswith(f"{long_ago.strftime('%B')} {long_ago.day}, {long_ago.year} at 12:00 PM")

    # Dates on messages: the time today, the date for older ones, the full date on hover.
    stamp = chat.locator(".msg.user .msg-time")
    assert re.fullmatch(r"\d{1,2}:\d{2}\s?[AP]M", stamp.inner_text())
    assert abs(datetime.fromisoformat(stamp.get_attribute("datetime").replace("Z", "+00:00")).timestamp() - time.time()) < 60
    chat.locator(".chat-open", has_text="Long ago").click()
    stamp = chat.locator(".msg.user .msg-time")
    expected = (long_ago.strftime("%b ") + str(long_ago.day) + (f", {long_ago.year}" if long_ago.year != now.year else ""))
    expect(stamp).to_contain_text(expected)
    assert str(long_ago.year) in stamp.get_attribute("title")

    chat.locator(".chat-item", has_text="Long ago").locator(".chat-pin").click()
    expect(chat.locator("#chat-list li").first).to_have_text("Pinned")
    assert list_rows(chat)[:3] == ["Pinned", "Long ago", "Today"]
    assert titles(chat)[0] == "Long ago"
    expect(chat.locator(".chat-item", has_text="Long ago").locator(".chat-pin")).to_have_attribute("aria-pressed", "true")
    reload(chat)
    assert titles(chat) == ["Long ago", "Today's question", "Yesterday's chat", "Last week"]
    chat.locator(".chat-item", has_text="Long ago").locator(".chat-pin").click()
    expect(chat.locator("#chat-list .chat-open")).to_have_text(["Today's question", "Yesterday's chat", "Last week", "Long ago"])
    assert "Pinned" not in chat.locator("#chat-list").inner_text()


# ---- Markdown export --------------------------------------------------------------------------------------------
def test_a_chat_exports_as_markdown(chat, tmp_path):
    open_page(chat)
    exchange(chat, "What is 2+2?", "It is **4**.\n\n```python\nprint(2 + 2)\n```")
    exchange(chat, "And 3+3?", "6.")
    with chat.expect_download() as download:
        chat.locator(".chat-item", has_text="What is 2+2?").locator(".chat-markdown").click()
    assert download.value.suggested_filename == "what-is-2-2.md"
    path = tmp_path / "chat.md"
    download.value.save_as(path)
    text = path.read_text()
    assert text.startswith("# What is 2+2?\n")
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert [s.split(" · ")[0] for s in sections] == ["You", "Assistant", "You", "Assistant"]
    assert sections[0].rstrip().endswith("What is 2+2?")
    assert sections[1].rstrip().endswith("It is **4**.\n\n```python\nprint(2 + 2)\n```")   # the model's markdown as written
    assert sections[3].rstrip().endswith("6.")
