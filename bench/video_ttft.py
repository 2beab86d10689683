"""Time to first token of a video chat, over HTTP and in its parts, against each part's floor.

Clips: 1280x720 H.264 (libx264, 30 fps, a keyframe every 2 s as phone cameras write them) of synthetic moving
frames, 10 s and 60 s by default, each request a clip of its own (new pixels: no upload, encoder or prefix cache
helps). Sent as a data URL in a chat at the model's own video settings (video_preprocessor_config.json: 2 fps).

1. HTTP: the engine is started on the model (--load-format dummy), one request per clip length warms it up
   (graph captures), then each other clip's TTFT is the time from sending the request to its first streamed
   token.
2. Parts, in this process on the same GPU once the server is stopped (the engine's own objects):
   - frame decoding on the host: InputProcessor.process_chat (fetch, demux, decode the frames up to the last
     sampled, convert and resize the sampled ones, hash, tokenize); floor: PyAV decoding those frames and
     nothing else, on all cores;
   - vision encoder: the runner encoding every frame group (upload, patchify, ViT, mergers); floor: its FLOPs
     at the measured bf16 GEMM rate;
   - prefill: a text prompt of the same length, one token out; floor: its FLOPs at the same rate.
   TTFT floor = the three floors in a row (the engine does them in that order for one request).

    python bench/synthetic_model.py /tmp/q8
    python bench/video_ttft.py --model /tmp/q8 --out video_ttft.json
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

import aiohttp
import av
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WIDTH, HEIGHT, FPS, GOP = 1280, 720, 30, 60
QUESTION = "Describe what happens in the video."


# ---- clips ---------------------------------------------------------------------------------------------------
def make_clip(seconds: int, seed: int) -> bytes:
    """A moving gradient and a sliding bar, different for every seed, H.264 in MP4."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    base = np.stack([x * 255 // WIDTH, y * 255 // HEIGHT, (x + y) * 127 // (WIDTH + HEIGHT)], -1)
    base = ((base + rng.integers(0, 256, 3)) % 256).astype(np.uint8)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=FPS, options={"preset": "veryfast"})
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.codec_context.gop_size = GOP
        for i in range(seconds * FPS):
            frame = base + np.uint8(3 * i % 256)          # uint8 arithmetic wraps around: a moving ramp
            bar = (i * 11) % (WIDTH - 64)
            frame[:, bar:bar + 64] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def messages(clip: bytes) -> list[dict]:
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


# ---- HTTP ----------------------------------------------------------------------------------------------------
def start_server(args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "engine", "--model", args.model, "--served-model-name", "bench", "--load-format", "dummy",
           "--port", str(args.port),
           "--max-model-len", str(args.max_model_len), "--gpu-memory-utilization", "0.85", "--disable-log-requests"]
    proc = subprocess.Popen(cmd, stdout=open(args.server_log, "w"), stderr=subprocess.STDOUT)
    for _ in range(300):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=2):
                return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"the engine exited; see {args.server_log}")
            time.sleep(1)
    proc.kill()
    raise RuntimeError("the engine did not start in 300 s")


def http_ttft(port: int, clip: bytes) -> float:
    """Seconds from sending one streamed chat request (its body encoded beforehand) to its first token."""
    from serve import stream_request

    body = json.dumps({"model": "bench", "messages": messages(clip), "max_tokens": 2, "stream": True,
                       "temperature": 0}).encode()

    async def one() -> float:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            return (await stream_request(session, f"http://127.0.0.1:{port}/v1/chat/completions", body))["ttft"]
    return asyncio.run(one())


# ---- parts ---------------------------------------------------------------------------------------------------
def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gemm_ceiling_flops() -> float:
    """Measured bf16 GEMM rate (FLOP/s) of an 8192^3 matmul: the GPU floors divide FLOPs by it. (On a host
    without a GPU, where this script only checks itself: fp32 at 1024^3.)"""
    cuda = torch.cuda.is_available()
    n, dtype = (8192, torch.bfloat16) if cuda else (1024, torch.float32)
    a = torch.randn(n, n, device="cuda" if cuda else "cpu", dtype=dtype)
    b = torch.randn(n, n, device=a.device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    return 10 * 2 * n ** 3 / (time.perf_counter() - start)


def vision_flops(vision: dict, group_patches: list[int]) -> float:
    """Patch embedding, every block's linears and attention (within each frame), the final and deepstack mergers."""
    h, inner = vision["hidden_size"], vision["intermediate_size"]
    patch_dim = 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    merged, out = h * vision["spatial_merge_size"] ** 2, vision["out_hidden_size"]
    n = sum(group_patches)
    per_block = 2 * n * (3 * h * h + h * h + 2 * h * inner) + sum(4 * s * s * h for s in group_patches)
    mergers = (1 + len(vision["deepstack_visual_indexes"])) * 2 * (n // 4) * (merged * merged + merged * out)
    return 2 * n * patch_dim * h + vision["depth"] * per_block + mergers


def prefill_flops(text: dict, tokens: int) -> float:
    """Every decoder linear per token, causal attention over the prompt, lm_head for the last token."""
    h, inner, layers = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    q = text["num_attention_heads"] * text["head_dim"]
    kv = text["num_key_value_heads"] * text["head_dim"]
    linear = 2 * tokens * layers * (h * q + 2 * h * kv + q * h + 3 * h * inner)
    attention = layers * 2 * tokens * tokens * q           # QK^T and PV, each over half the square
    return linear + attention + 2 * h * text["vocab_size"]


def decode_floor(clip: bytes, last_index: int) -> float:
    """PyAV decoding frames 0..last_index, no conversion, FFmpeg's threads on: the host's least work."""
    start = time.perf_counter()
    with av.open(io.BytesIO(clip)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for i, _ in enumerate(container.decode(stream)):
            if i >= last_index:
                break
    return time.perf_counter() - start


def parts(args, clips: dict[int, list[bytes]]) -> dict:
    from engine import LLM, SamplingParams
    from engine.worker.encoder_cache import EncoderCache

    llm = LLM(args.model, load_format="dummy", max_model_len=args.max_model_len, gpu_memory_utilization=0.85)
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    ip = llm.engine.input_processor
    runner = llm.engine.model_executor.driver_worker.model_runner
    ceiling = gemm_ceiling_flops()
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out = {"gemm_tflops": ceiling / 1e12}
    for seconds, variants in clips.items():
        rows = []
        for k, clip in enumerate(variants):
            start = time.perf_counter()
            prompt = ip.process_chat(messages(clip))
            host = time.perf_counter() - start
            info = ip.video_processor.sample_indices(seconds * FPS, FPS)
            floor_host = decode_floor(clip, int(info[-1]))
            runner.encoder_cache = EncoderCache(runner.encoder_cache.capacity)
            sync()
            start = time.perf_counter()
            runner._encode(prompt.images)
            sync()
            vision = time.perf_counter() - start
            n = len(prompt.prompt_token_ids)
            base_vocab = ip.tokenizer.vocab_size              # no special tokens: no stray placeholders
            rng = random.Random(k)
            text_prompt = {"prompt_token_ids": [rng.randrange(base_vocab // 10, base_vocab) for _ in range(n)]}
            sync()
            start = time.perf_counter()
            llm.generate(text_prompt, one)
            sync()
            prefill = time.perf_counter() - start
            runner.encoder_cache = EncoderCache(runner.encoder_cache.capacity)
            sync()
            start = time.perf_counter()
            llm.generate(prompt, one)
            sync()
            gpu_total = time.perf_counter() - start
            patches = [it.grid_thw[0] * it.grid_thw[1] * it.grid_thw[2] for it in prompt.images]
            rows.append({"host_s": host, "host_floor_s": floor_host, "vision_s": vision,
                         "vision_floor_s": vision_flops(cfg["vision_config"], patches) / ceiling,
                         "prefill_s": prefill, "prefill_floor_s": prefill_flops(cfg["text_config"], n) / ceiling,
                         "gpu_total_s": gpu_total, "prompt_tokens": n, "frames": len(info),
                         "frame_groups": len(prompt.images), "patches": sum(patches),
                         "frame_size": list(prompt.images[0].raw.shape[1:3])})
        first = rows[0]
        out[seconds] = {key: (statistics.median(r[key] for r in rows[1:] or rows) if isinstance(first[key], float)
                              else first[key]) for key in first}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--seconds", type=int, nargs="+", default=[10, 60])
    ap.add_argument("--repeats", type=int, default=2, help="measured clips per length (plus one warm-up)")
    ap.add_argument("--no-parts", action="store_true", help="HTTP only (e.g. on a CPU host)")
    ap.add_argument("--port", type=int, default=3011)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--server-log", default="/tmp/video_ttft_server.log")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    start = time.perf_counter()
    # One warm-up clip and `repeats` measured ones per length; the in-process parts reuse them (a new process:
    # its caches are empty), the first again as a warm-up.
    clips = {s: [make_clip(s, seed=100 * s + k) for k in range(args.repeats + 1)] for s in args.seconds}
    print(f"clips made in {time.perf_counter() - start:.1f} s: "
          + ", ".join(f"{s} s = {len(c[0]) / 1e6:.1f} MB" for s, c in clips.items()), flush=True)
    server = start_server(args)
    http = {}
    try:
        for s, variants in clips.items():
            http_ttft(args.port, variants[0])                       # warm-up: graph captures for these shapes
            runs = [http_ttft(args.port, clip) for clip in variants[1:args.repeats + 1]]
            http[s] = {"ttft_s": statistics.median(runs), "all_s": runs}
            print(f"HTTP {s} s clip: TTFT {http[s]['ttft_s'] * 1e3:.0f} ms (runs "
                  + ", ".join(f"{t * 1e3:.0f}" for t in runs) + ")", flush=True)
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(60)
    if args.no_parts:
        return
    result = {"http": http, "parts": parts(args, clips)}
    print("| clip | HTTP TTFT | host: decode, resize, hash (floor: decode only) | vision encoder (floor) | prefill (floor) | GPU vision+prefill"
          " | TTFT floor | tokens | frames -> groups, size |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in args.seconds:
        p, ms = result["parts"][s], lambda v: f"{v * 1e3:.0f} ms"
        floor = p["host_floor_s"] + p["vision_floor_s"] + p["prefill_floor_s"]
        print(f"| {s} s | {ms(http[s]['ttft_s'])} | {ms(p['host_s'])} ({ms(p['host_floor_s'])}) | "
              f"{ms(p['vision_s'])} ({ms(p['vision_floor_s'])}) | {ms(p['prefill_s'])} ({ms(p['prefill_floor_s'])}) | "
              f"{ms(p['gpu_total_s'])} | {ms(floor)} | {p['prompt_tokens']} | {p['frames']} -> {p['frame_groups']}, "
              f"{p['frame_size'][1]}x{p['frame_size'][0]} |")
    print(f"bf16 GEMM ceiling measured: {result['parts']['gemm_tflops']:.0f} TFLOP/s")
    if args.out:
        json.dump(result, open(args.out, "w"), indent=2, default=str)


if __name__ == "__main__":
    main()
