"""Request processing has a memory budget: the pixels a request's images decode to and the bytes of its prompt
text are capped per request (413, before any pixel is decoded or any text rendered), and the pixels being decoded
and the text being tokenized at once over all requests are capped too (429, retry)."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from PIL import Image

from engine.errors import PayloadTooLargeError, ServerBusyError
from engine.inputs.budget import PixelBudget, text_bytes
from engine.inputs.processor import InputLimits

from test_inputs_processor import data_url, make_processor


def chat_with(*images: Image.Image) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]


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


def test_a_request_whose_images_decode_past_its_pixel_cap_is_refused_before_decoding(qwen3_vl_dir):
    """Each image is within --max-image-pixels; together they are not within --max-pixels-per-request."""
    proc = make_processor(qwen3_vl_dir, InputLimits(max_pixels_per_request=1_000_000))
    images = [Image.new("RGB", (800, 800), (i * 60, 0, 0)) for i in range(2)]      # 1.28 Mpx in all
    messages = chat_with(*images)
    reserved, reserve = [], proc.pixel_budget._reserve
    proc.pixel_budget._reserve = lambda pixels, param: reserved.append(pixels) or reserve(pixels, param)
    with pytest.raises(PayloadTooLargeError) as err:
        proc.process_chat(messages)
    assert err.value.status == 413 and err.value.param == "messages"
    assert "--max-pixels-per-request" in err.value.message and "1.0 Mpx" in err.value.message
    assert reserved == []              # no decode starts: every header is read and counted before any decode
    assert proc.pixel_budget.in_flight == 0
    for image in images:                           # each alone fits (and is kept in the image cache)
        assert proc.process_chat(chat_with(image)).images
    with pytest.raises(PayloadTooLargeError):      # the cache, which decodes nothing, does not change the answer
        proc.process_chat(messages)


def test_prompt_text_over_the_per_request_cap_is_refused_before_it_is_read(qwen3_vl_dir):
    proc = make_processor(qwen3_vl_dir, InputLimits(max_prompt_text_bytes=10_000))
    calls = []
    proc.tokenizer.encode = lambda *args, **kwargs: calls.append(args)
    try:
        for call, param in ((lambda text: proc.process(text), "prompt"),
                            (lambda text: proc.process({"prompt": text}), "prompt"),
                            (lambda text: proc.process_chat([{"role": "user", "content": text}]), "messages"),
                            (lambda text: proc.process_chat([{"role": "user", "content": [
                                {"type": "text", "text": text[:6000]}, {"type": "text", "text": text[6000:]}]}]),
                             "messages")):
            with pytest.raises(PayloadTooLargeError) as err:
                call("x" * 10_001)
            assert err.value.status == 413 and err.value.param == param
            assert "--max-prompt-text-mb" in err.value.message
    finally:
        del proc.tokenizer.encode
    assert calls == [] and proc.text_budget.in_flight == 0
    assert proc.process("x" * 9000).prompt_token_ids


def test_text_is_counted_in_utf8_bytes_with_tools_and_template_kwargs():
    assert text_bytes("héllo") == 6 and text_bytes("日本") == 6
    messages, tools, kwargs = [{"role": "user", "content": "abc"}], [{"name": "f"}], {"k": "v"}
    assert text_bytes((messages, tools, kwargs)) == len("role" "user" "content" "abc") + len("name" "f") + len("kv")


def test_prompt_text_past_the_in_flight_budget_gets_429_and_fits_once_the_other_is_done(qwen3_vl_dir):
    proc = make_processor(qwen3_vl_dir, InputLimits(max_prompt_text_bytes_in_flight=50_000))
    messages = [{"role": "user", "content": "hello " * 2000}]                 # 12 kB
    with proc.text_budget.hold(45_000):            # another request's long prompt is being tokenized
        with pytest.raises(ServerBusyError) as err:
            proc.process_chat(messages)
        assert err.value.status == 429 and "--max-prompt-text-mb-in-flight" in err.value.message
    assert proc.process_chat(messages).prompt_token_ids
    assert proc.text_budget.in_flight == 0
