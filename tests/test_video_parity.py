"""Video chats on the tiny random Qwen3-VL give what transformers gives: the same prompt tokens (timestamps,
frame-group placeholders), the same pixel values bit for bit, and the same greedy tokens.

The reference inputs come from transformers' own pieces: its PyAV reader and Qwen3VLVideoProcessor's frame
sampling, smart resize and patchify, and Qwen3VLProcessor's timestamps and placeholder text. torchvision is not
installed here, so its resize is reproduced as torchvision's CPU uint8 path runs it: torch's antialiased bicubic
interpolate on uint8 (torchvision/transforms/v2/functional/_geometry.py, resize_image), and its normalize as
(x - mean / rescale) / (std / rescale) in float32 (TorchvisionBackend.rescale_and_normalize, fused).
"""
from __future__ import annotations

import functools
import io
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from engine.inputs.image_processor import ImageProcessor
from engine.inputs.video_processor import VideoProcessor
from engine.sampling_params import SamplingParams
from engine_helpers import assert_pool_idle, make_llm, noise_image
from oracle import hf_generate, hf_greedy
from test_engine_parity import image_part
from tiny_models import image_only_qwen3_vl_processor
from video_helpers import frames_url, make_clip, synthetic_frame, video_part, video_url

NEW_TOKENS = 6
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def vl_llm(qwen3_vl_dir):
    return make_llm(qwen3_vl_dir)


def transformers_inputs(model_dir, messages, frames: np.ndarray, indices, fps: float):
    """What transformers' Qwen3-VL processor makes of one video's decoded frames (uint8 [n, H, W, 3] at
    `indices` of a clip at `fps`) in a chat: input ids, pixel_values_videos, video_grid_thw, mm_token_type_ids."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
    from transformers.video_utils import VideoMetadata

    vp = VideoProcessor.from_model_dir(model_dir)        # the settings only: min/max pixels, mean, std
    hf = types.SimpleNamespace(merge_size=2, temporal_patch_size=2)
    video = torch.from_numpy(frames).permute(0, 3, 1, 2)                     # [n, C, H, W]
    h, w = smart_resize(len(frames), video.shape[2], video.shape[3], temporal_factor=2, factor=32,
                        min_pixels=vp.min_pixels, max_pixels=vp.max_pixels)
    if (h, w) != tuple(video.shape[2:]):
        video = F.interpolate(video, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
    mean = (torch.tensor(vp.image_mean) * (1.0 / vp.rescale_factor)).view(-1, 1, 1)
    std = (torch.tensor(vp.image_std) * (1.0 / vp.rescale_factor)).view(-1, 1, 1)
    normalized = (video.to(torch.float32) - mean) / std
    pixels, *grid = Qwen3VLVideoProcessor.patchify(hf, normalized[None], 16, 2, 2)
    grid_thw = torch.tensor([grid])
    tok = AutoTokenizer.from_pretrained(model_dir)
    processor = image_only_qwen3_vl_processor(Qwen2VLImageProcessorPil.from_pretrained(model_dir), tok)
    processor.video_processor = hf
    meta = VideoMetadata(total_num_frames=len(frames), fps=fps, frames_indices=list(indices))
    text = tok.apply_chat_template(_template_messages(messages), tokenize=False, add_generation_prompt=True)
    repl = Qwen3VLProcessor.replace_video_token(processor, {"video_grid_thw": grid_thw, "video_metadata": [meta]}, 0)
    [text], _ = processor.get_text_with_replacements([text], videos_replacements=[repl])
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    return ids, dict(pixel_values_videos=pixels[0], video_grid_thw=grid_thw,
                     mm_token_type_ids=2 * (ids == tok.convert_tokens_to_ids("<|video_pad|>")).int())


def _template_messages(messages):
    return [{**m, "content": [{"type": "video"} if p["type"] == "video_url" else p for p in m["content"]]}
            for m in messages]


def transformers_read(clip: bytes, tmp_path, model_dir):
    """transformers' PyAV reader with Qwen3VLVideoProcessor's frame sampling: (frames, indices, fps)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import read_video_pyav

    vp = VideoProcessor.from_model_dir(model_dir)
    path = tmp_path / "clip.mp4"
    path.write_bytes(clip)
    hf = types.SimpleNamespace(fps=vp.fps, min_frames=vp.min_frames, max_frames=vp.max_frames)
    frames, meta = read_video_pyav(str(path), functools.partial(Qwen3VLVideoProcessor.sample_frames, hf))
    return frames, meta.frames_indices, meta.fps


def assert_same_as_transformers(llm, model_dir, messages, ref_ids, ref_kwargs):
    prompt = llm.engine.input_processor.process_chat(messages)
    assert prompt.prompt_token_ids == ref_ids[0].tolist()
    to_pixels = llm.engine.input_processor.image_processor.to_pixel_values
    assert torch.equal(torch.cat([to_pixels(it.raw) for it in prompt.images]), ref_kwargs["pixel_values_videos"])
    [out] = llm.generate(prompt, PARAMS)
    tokens, _ = hf_generate(model_dir, ref_ids, NEW_TOKENS, **ref_kwargs)
    assert out.outputs[0].token_ids == tokens
    assert_pool_idle(llm)


def test_an_mp4_clip_matches_transformers(vl_llm, qwen3_vl_dir, tmp_path):
    clip = make_clip(25, fps=10, width=96, height=64)            # 2.5 s: 5 frames sampled at 2 fps
    messages = [{"role": "user", "content": [video_part(video_url(clip)), {"type": "text", "text": "Describe."}]}]
    frames, indices, fps = transformers_read(clip, tmp_path, qwen3_vl_dir)
    assert len(indices) == 5
    assert_same_as_transformers(vl_llm, qwen3_vl_dir, messages, *transformers_inputs(qwen3_vl_dir, messages, frames, indices, fps))


def test_a_list_of_frames_is_one_video_and_matches_transformers(vl_llm, qwen3_vl_dir):
    frames = np.stack([synthetic_frame(i, 80, 48) for i in range(4)])
    pngs = []
    for frame in frames:
        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, video_part(frames_url(pngs)),
                                             {"type": "text", "text": "What moves?"}]}]
    # All frames are used, at 1 frame per second unless the request says otherwise (vLLM's default).
    assert_same_as_transformers(vl_llm, qwen3_vl_dir, messages, *transformers_inputs(qwen3_vl_dir, messages, frames, range(4), 1.0))


def test_image_and_video_in_one_chat_match_transformers(vl_llm, qwen3_vl_dir):
    messages = [{"role": "user", "content": [image_part(noise_image(64, 64, 1)), {"type": "text", "text": "and"},
                                             video_part(video_url(make_clip(12, fps=4))),
                                             {"type": "text", "text": "Same colors?"}]}]
    prompt = vl_llm.engine.input_processor.process_chat(messages)
    cfg = vl_llm.engine.model_config
    kinds = [prompt.prompt_token_ids[it.offset] for it in prompt.images]
    assert kinds == [cfg.image_token_id] + [cfg.video_token_id] * (len(kinds) - 1) and len(kinds) > 2
    [out] = vl_llm.generate(prompt, PARAMS)
    tokens, ref_logprobs = hf_greedy(qwen3_vl_dir, prompt, NEW_TOKENS, cfg.image_token_id, cfg.video_token_id)
    assert out.outputs[0].token_ids == tokens
    for ours, ref in zip(out.outputs[0].logprobs, ref_logprobs):
        ids = torch.tensor(list(ours))
        torch.testing.assert_close(torch.tensor(list(ours.values())), ref[ids], atol=1e-4, rtol=0)


def test_request_fps_and_num_frames_change_the_sampling(vl_llm):
    clip = video_url(make_clip(40, fps=10))                       # 4 s
    messages = [{"role": "user", "content": [video_part(clip), {"type": "text", "text": "x"}]}]
    ip = vl_llm.engine.input_processor
    groups = {kw.get("fps", kw.get("num_frames")): len(ip.process_chat(messages, mm_processor_kwargs=kw).images)
              for kw in ({}, {"fps": 1}, {"num_frames": 12})}
    assert groups == {None: 4, 1: 2, 12: 6}                       # 8 frames at 2 fps, 4 at 1 fps (min 4), 12


def test_the_video_processor_follows_transformers_sampling_and_resize():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
    from transformers.video_utils import VideoMetadata

    vp = VideoProcessor(min_pixels=4096, max_pixels=25165824)
    hf = types.SimpleNamespace(fps=2, min_frames=4, max_frames=768)
    for total, fps in ((300, 30.0), (1800, 30.0), (7, 24.0), (100_000, 29.97), (25, 10.0)):
        ref = Qwen3VLVideoProcessor.sample_frames(hf, VideoMetadata(total_num_frames=total, fps=fps))
        assert vp.sample_indices(total, fps).tolist() == ref.tolist()
    for n, h, w in ((20, 720, 1280), (120, 720, 1280), (5, 64, 96), (4, 20, 3000), (768, 1080, 1920)):
        assert vp.resized_size(n, h, w) == smart_resize(n, h, w, 2, 32, 4096, 25165824)
    assert ImageProcessor().cache_key != vp.cache_key


def test_frame_groups_encoded_a_few_at_a_time_give_the_same_answer(vl_llm, monkeypatch):
    from engine.worker import model_runner
    from engine.worker.encoder_cache import EncoderCache

    runner = vl_llm.engine.model_executor.driver_worker.model_runner
    messages = [{"role": "user", "content": [video_part(video_url(make_clip(30, fps=10))),
                                             {"type": "text", "text": "Again?"}]}]
    prompt = vl_llm.engine.input_processor.process_chat(messages)
    outputs = []
    for limit in (model_runner.MAX_GRAPH_PATCHES, prompt.images[0].grid_thw[2] * 2):   # all at once; 1 per batch
        monkeypatch.setattr(model_runner, "MAX_GRAPH_PATCHES", limit)
        runner.encoder_cache = EncoderCache(runner.encoder_cache.capacity)
        [out] = vl_llm.generate(prompt, PARAMS)
        outputs.append((out.outputs[0].token_ids, out.outputs[0].logprobs))
    (tokens, lps), (tokens_split, lps_split) = outputs
    assert len(prompt.images) >= 3 and tokens == tokens_split
    for a, b in zip(lps, lps_split):        # a batch's GEMMs may round differently from a smaller one's
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)


@pytest.mark.parametrize("codec,container", [("libvpx-vp9", "webm"), ("mpeg4", "matroska")])
def test_a_clip_whose_header_has_no_frame_count_is_sampled_like_an_mp4(vl_llm, codec, container):
    """WebM and MKV headers give no frame count: the packets are counted instead, so the frames sampled are the
    MP4's, and with the same pixels (within what the codec changes) the same number of groups and tokens."""
    ip = vl_llm.engine.input_processor
    prompts = [ip.process_chat([{"role": "user", "content": [video_part(video_url(make_clip(
        25, fps=10, codec=c, container=f), f"video/{f}")), {"type": "text", "text": "x"}]}])
        for c, f in (("libx264", "mp4"), (codec, container))]
    assert [len(p.prompt_token_ids) for p in prompts][0] == len(prompts[1].prompt_token_ids)
    assert [it.grid_thw for it in prompts[0].images] == [it.grid_thw for it in prompts[1].images]


@pytest.mark.parametrize("gop", [5, 250])
def test_sparse_frames_are_transformers_frames_whether_the_decoder_seeks_or_not(gop, tmp_path):
    """Every 33rd frame of a 100-frame clip: with a keyframe every 5 frames the decoder seeks from keyframe to
    keyframe, with one keyframe it decodes on; either way the frames are those transformers' reader returns."""
    from transformers.video_utils import read_video_pyav

    from engine.inputs.video_io import OpenVideo, VideoLimits

    clip = make_clip(100, fps=10, gop=gop)
    path = tmp_path / "clip.mp4"
    path.write_bytes(clip)
    indices = np.array([0, 33, 66, 99])
    reference, _ = read_video_pyav(str(path), lambda metadata, **kw: indices)
    decoded = []
    with OpenVideo(clip, VideoLimits(), "v") as video:
        frames = video.decode(indices, lambda f: decoded.append(1) or f)
        work = video.frames_decoded
    assert len(decoded) == 4 and (work < 50 if gop == 5 else work == 100), work
    assert all(torch.equal(f, torch.from_numpy(r)) for f, r in zip(frames, reference))


def test_request_pixel_bounds_resize_images_below_the_servers(vl_llm):
    from engine.errors import InvalidInputError

    ip = vl_llm.engine.input_processor
    messages = [{"role": "user", "content": [image_part(noise_image(256, 256, 5)), {"type": "text", "text": "x"}]}]
    full = ip.process_chat(messages)
    small = ip.process_chat(messages, mm_processor_kwargs={"max_pixels": 64 * 64})
    assert full.images[0].grid_thw == (1, 16, 16) and small.images[0].grid_thw == (1, 4, 4)
    assert full.images[0].content_hash != small.images[0].content_hash
    with pytest.raises(InvalidInputError, match="over this server's"):
        ip.process_chat(messages, mm_processor_kwargs={"max_pixels": ip.image_processor.max_pixels + 1})
