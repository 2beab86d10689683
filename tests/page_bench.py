"""The chat page's test bench: the proxy serving the page, with the engine's side played in the page
(/api/status, /v1/models, /stats and the block map answered by page.route; answers from the fake stream of
browser_helpers.py), and the helpers the page's tests share (test_page*.py). A test module imports the fixtures
it uses by name, with those they depend on: `chat` needs `page_proxy` here and `browser` from browser_helpers."""
from __future__ import annotations

import random

import pytest
from PIL import Image

from browser_helpers import expect, last_answer, new_page, script_replies, send, sent_requests
from servers import free_port, start_proxy

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
        self.spec_decode = None         # /stats' speculative decoding counters, as both /stats answers carry them
        page.route("**/api/status", lambda r: r.fulfill(json=self.status))
        page.route("**/stats/blocks", lambda r: r.fulfill(json={**self.blocks, "spec_decode": self.spec_decode}))
        page.route("**/v1/models", lambda r: r.fulfill(json={"object": "list", "data": [self.card]}))
        page.route("**/stats", lambda r: r.fulfill(json={**self.stats, "spec_decode": self.spec_decode}))
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
    before = page.locator(".msg.assistant").count()
    send(page, text)
    answer_done(page, before)        # its own answer: the last one may still be the one before, already done
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
