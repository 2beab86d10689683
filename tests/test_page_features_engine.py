"""The page's features that ask the model something of their own, against the proxy and the real engine (the tiny
random Qwen3-VL): continuing a cut-off answer (continue_final_message) and the title request."""
from __future__ import annotations

import json

import pytest

from browser_helpers import browser, expect, last_answer, new_page, send  # noqa: F401
from servers import SERVED_NAME, engine, proxy  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture
def page(browser):
    context, pg, errors = new_page(browser, auto_title=True)
    yield pg
    context.close()
    assert not errors, f"errors on the page: {errors}"


def test_a_cut_off_answer_continues_and_the_model_is_asked_for_a_title(page, proxy):
    streamed: list[dict] = []
    titles: list[dict] = []

    def handle(route):
        body = json.loads(route.request.post_data)
        if body.get("stream"):
            streamed.append(body)
            body.update(max_tokens=4, ignore_eos=True)       # cut off by the limit, whatever the random model says
        else:
            titles.append(body)
        route.continue_(post_data=json.dumps(body))

    page.route("**/v1/chat/completions", handle)
    page.goto(proxy.url + "/")
    expect(page.locator("#status")).to_have_attribute("data-state", "ready", timeout=30_000)
    expect(page.locator("#model-name")).to_have_text(SERVED_NAME)
    with page.expect_response(lambda r: "/v1/chat/completions" in r.url and r.request.post_data_json.get("stream") is False,
                              timeout=60_000) as title_response:
        send(page, "Count with me")
        answer = last_answer(page)
        expect(answer).to_have_attribute("data-status", "done", timeout=60_000)
    assert title_response.value.status == 200                   # the engine answers the title request
    assert titles and titles[0]["messages"][-1]["content"].startswith("Question: Count with me")
    expect(answer.locator(".meta")).to_contain_text("max-tokens limit")
    before = page.evaluate("() => document.querySelector('.msg.assistant .content').textContent")

    answer.locator(".act-continue").click()
    expect(answer).to_have_attribute("data-status", "done", timeout=60_000)
    expect(page.locator("#error")).to_be_hidden()
    expect(page.locator(".msg.assistant")).to_have_count(1)
    expect(answer.locator(".meta")).to_contain_text("8 tokens")
    after = page.evaluate("() => document.querySelector('.msg.assistant .content').textContent")
    assert len(after) > len(before.rstrip())
    assert streamed[-1]["continue_final_message"] is True and streamed[-1]["add_generation_prompt"] is False
    assert streamed[-1]["messages"][-1]["role"] == "assistant"
