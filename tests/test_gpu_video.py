"""On a CUDA GPU (run on the device machine: pytest -m gpu): a video chat — an mp4 clip, a list of frames, an
image beside a video — runs the video path on CUDA (frame groups patchified by the Triton kernel, the vision
encoder through its graphs, eagerly too) and gives the CPU engine's greedy tokens and log-probs in fp32."""
from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from engine import SamplingParams
from engine_helpers import assert_pool_idle, make_llm, noise_image
from test_engine_parity import image_part
from video_helpers import frames_url, make_clip, synthetic_frame, video_part, video_url

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)


def _png(frame) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="PNG")
    return buf.getvalue()


def conversations():
    frames = [_png(synthetic_frame(i, 80, 48)) for i in range(5)]
    return [
        [{"role": "user", "content": [video_part(video_url(make_clip(30, fps=10))), {"type": "text", "text": "Why?"}]}],
        [{"role": "user", "content": [{"type": "text", "text": "Frames:"}, video_part(frames_url(frames))]}],
        [{"role": "user", "content": [image_part(noise_image(64, 64, 1)), video_part(video_url(make_clip(12, fps=4))),
                                      {"type": "text", "text": "Compare."}]}],
    ]


def run(llm):
    prompts = [llm.engine.input_processor.process_chat(c) for c in conversations()]
    outs = llm.generate(prompts, PARAMS)
    assert_pool_idle(llm)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module")
def cpu_reference(qwen3_vl_dir):
    return run(make_llm(qwen3_vl_dir, device="cpu"))


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
def test_gpu_video_matches_cpu(qwen3_vl_dir, cpu_reference, eager):
    llm = make_llm(qwen3_vl_dir, device="cuda", dtype="float32", enforce_eager=eager)
    for (tokens, lps), (ref_tokens, ref_lps) in zip(run(llm), cpu_reference):
        assert tokens == ref_tokens
        for step, (a, b) in enumerate(zip(lps, ref_lps)):
            for tok in set(a) & set(b):
                assert abs(a[tok] - b[tok]) <= 1e-3, f"step {step} token {tok}: {a[tok]} vs {b[tok]}"
