"""A video's pixels count against the request's cap (413) and the in-flight budget (429) as an image's do, from
its header on: its resized frames plus one frame at the clip's size."""
from __future__ import annotations

import pytest

from engine.errors import ImageError, PayloadTooLargeError, ServerBusyError
from engine.inputs.processor import InputLimits
from engine.inputs.video_processor import VideoProcessor
from test_inputs_processor import image_part, make_processor, noise
from video_helpers import make_clip, video_part, video_url

CLIP = make_clip(20, fps=10, width=96, height=64)    # 4 frames sampled, resized to 96x64: 4 * 6144 + 6144 pixels
COST = 5 * 96 * 64


def chat():
    return [{"role": "user", "content": [{"type": "text", "text": "See:"}, video_part(video_url(CLIP))]}]


def processor(qwen3_vl_dir, **limits):
    ip = make_processor(qwen3_vl_dir, InputLimits(**limits))
    ip.video_processor = VideoProcessor.from_model_dir(qwen3_vl_dir)
    return ip


def test_a_video_over_the_request_pixel_cap_is_413(qwen3_vl_dir):
    processor(qwen3_vl_dir, max_pixels_per_request=COST).process_chat(chat())      # exactly fits
    with pytest.raises(PayloadTooLargeError, match="--max-pixels-per-request") as e:
        processor(qwen3_vl_dir, max_pixels_per_request=COST - 1).process_chat(chat())
    assert e.value.param == "messages"


def test_a_video_beside_others_in_flight_is_429_and_the_budget_is_returned(qwen3_vl_dir):
    ip = processor(qwen3_vl_dir, max_pixels_per_request=COST, max_pixels_in_flight=COST)
    with ip.pixel_budget.hold(1):                      # another request is decoding
        with pytest.raises(ServerBusyError) as e:
            ip.process_chat(chat())
    assert e.value.param == "messages[0].content[1].video_url" and ip.pixel_budget.in_flight == 0
    ip.process_chat(chat())
    assert ip.pixel_budget.in_flight == 0


def test_an_image_refused_by_its_header_starts_no_video_decode(qwen3_vl_dir):
    """Every image's size is checked from its header before any load starts: a request refused for an image
    decodes none of its videos either."""
    ip = processor(qwen3_vl_dir, max_image_pixels=64 * 64 - 1)
    loads = []
    real_load = ip.video_intake.load
    ip.video_intake.load = lambda *args: loads.append(args) or real_load(*args)
    messages = [{"role": "user", "content": [video_part(video_url(CLIP)), image_part(noise(64, 64))]}]
    with pytest.raises(ImageError, match="over the limit") as e:
        ip.process_chat(messages)
    assert e.value.param == "messages[0].content[1].image_url" and loads == []
    ip.process_chat(chat())                            # the same processor still loads a video
    assert len(loads) == 1
