"""The chat page (bench: page_bench.py): chats kept in the browser, and the actions on a message."""
from __future__ import annotations

import json

import pytest

from browser_helpers import browser, expect, last_answer, reload, script_replies, send, sent_requests  # noqa: F401
from page_bench import answer_done, chat, exchange, open_page, page_proxy, png_file  # noqa: F401

pytestmark = [pytest.mark.browser]


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

    reload(chat)
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
    reload(chat)
    expect(chat.locator(".msg.user .content")).to_have_text("Are you still there?")
    expect(chat.locator(".msg.assistant")).to_have_count(0)
    script_replies(chat, {"chunks": ["Yes."]})
    chat.locator(".msg.user .act-answer").click()
    expect(answer_done(chat).locator(".content")).to_have_text("Yes.")
    expect(chat.locator(".msg.user .act-answer")).to_be_hidden()


# The moment an answer shows as finished, read what the browser has stored: a transaction begun right then (in the
# observer's microtask, on a connection opened before) sees every save that has ended, and none begun after it.
WATCH_FINISHED_ANSWERS = """async () => {
  window.__storedWhenDone = [];
  const db = await new Promise((ok) => { const r = indexedDB.open('localchat', 1); r.onsuccess = () => ok(r.result); });
  new MutationObserver((records) => {
    for (const r of records) {
      if (!r.target.matches('.msg.assistant') || r.target.dataset.status !== 'done') continue;
      const id = r.target.dataset.id;
      const all = db.transaction('chats').objectStore('chats').getAll();
      all.onsuccess = () => window.__storedWhenDone.push(all.result.some((c) => c.nodes?.[id]?.text));
    }
  }).observe(document.body, { attributes: true, subtree: true, attributeFilter: ['data-status'] });
}"""


def test_an_answer_is_stored_before_it_shows_as_finished(chat):
    # So a reload the moment it shows as finished keeps it.
    open_page(chat)
    chat.evaluate(WATCH_FINISHED_ANSWERS)
    script_replies(chat, {"chunks": ["Stored ", "first."]})
    send(chat, "Hello")
    answer_done(chat)
    chat.wait_for_function("window.__storedWhenDone.length > 0")
    assert chat.evaluate("window.__storedWhenDone") == [True]
    chat.reload()                                    # at once: no wait for saves
    expect(answer_done(chat).locator(".content")).to_have_text("Stored first.")


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
    reload(chat)
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
    reload(chat)
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
    reload(chat)
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
    reload(chat)
    expect(chat.locator(".msg")).to_have_count(1)
