"""Image decoding has a memory budget over all requests: pixels being decoded at once are capped, and an image
that does not fit beside those in flight is refused with 429 (retry) before any of its pixels is decoded."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from PIL import Image

from engine.errors import ServerBusyError
from engine.inputs.budget import PixelBudget
from engine.inputs.processor import InputLimits

from test_inputs_processor import data_url, make_processor


def chat_with(image: Image.Image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                         {"type": "text", "text": "What is it?"}]}]


def test_one_image_always_fits_and_the_rest_must_share():
    budget = PixelBudget(100)
    with budget.hold(150):                         # alone: admitted even past the budget
        with pytest.raises(ServerBusyError) as err:
            with budget.hold(1):
                pass
        assert err.value.status == 429 and "--max-pixels-in-flight" in err.value.message
    with budget.hold(60), budget.hold(40):
        assert budget.in_flight == 100
    assert budget.in_flight == 0


def test_an_image_past_the_budget_is_refused_before_decoding(qwen3_vl_dir):
    proc = make_processor(qwen3_vl_dir, InputLimits(max_pixels_in_flight=500_000))
    messages = chat_with(Image.new("RGB", (600, 600), "red"))
    with proc.pixel_budget.hold(400_000):          # another request's image is being decoded
        with pytest.raises(ServerBusyError) as err:
            proc.process_chat(messages)
    assert err.value.param == "messages[0].content[0].image_url"
    assert proc.process_chat(messages).images      # once it is done, the image goes through
    assert proc.pixel_budget.in_flight == 0


def test_parallel_huge_images_stay_within_the_budget(qwen3_vl_dir):
    """Eight requests with a 2000x2000 image each, at once, against a budget of two such images."""
    proc = make_processor(qwen3_vl_dir, InputLimits(max_pixels_in_flight=2 * 2000 * 2000))
    peak, lock = [0], threading.Lock()
    reserve = proc.pixel_budget._reserve

    def tracking_reserve(pixels, param):
        reserve(pixels, param)
        with lock:
            peak[0] = max(peak[0], proc.pixel_budget.in_flight)
    proc.pixel_budget._reserve = tracking_reserve
    images = [Image.new("RGB", (2000, 2000), (i * 30, 0, 0)) for i in range(8)]   # distinct: no cache hits

    def one(image):
        try:
            return proc.process_chat(chat_with(image)) is not None
        except ServerBusyError:
            return False
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, images))
    assert any(results)
    assert peak[0] <= 2 * 2000 * 2000
    assert proc.pixel_budget.in_flight == 0


def test_an_over_long_prompt_is_refused_before_it_is_tokenized_in_full(qwen3_vl_dir):
    from engine.errors import PromptTooLongError
    proc = make_processor(qwen3_vl_dir)
    proc.max_prompt_tokens = 2048
    longest, encode = [0], proc.tokenizer.encode

    def recording_encode(text, *args, **kwargs):
        longest[0] = max(longest[0], len(text))
        return encode(text, *args, **kwargs)
    proc.tokenizer.encode = recording_encode
    try:
        for call, param in ((lambda text: proc.process(text), "prompt"),
                            (lambda text: proc.process_chat([{"role": "user", "content": text}]), "messages")):
            longest[0] = 0
            with pytest.raises(PromptTooLongError) as err:
                call("hello world " * 500_000)                   # 6 MB
            assert err.value.param == param and "maximum context length is 2048" in err.value.message
            assert longest[0] <= 16384                           # only pieces were tokenized
        fits = "hello world " * 100      # under the limit, yet long enough to be counted first
        assert proc.process(fits).prompt_token_ids == encode(fits)
    finally:
        del proc.tokenizer.encode
