"""Serving benchmark over HTTP against the real server, reported as `vllm bench serve` does: TTFT, TPOT, ITL and
end-to-end latency (p50/p99) and output tok/s at several concurrency levels; plus time to first token of a chat
request carrying one image as a data URL, by kind (IMAGE_KINDS: the page's 1280x960 JPEG, 1024x1024 PNGs).

    python bench/serve.py --url http://127.0.0.1:3001 --concurrency 1 8 64 256 --out serve.json
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import statistics
import time

import aiohttp
import numpy as np
from PIL import Image, ImageDraw, ImageFilter


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


async def stream_request(session, url: str, payload: dict | bytes) -> dict:
    """One streamed request: arrival times of every content chunk, and the completion token count. A payload
    given as bytes is sent as is: the clock then starts with the request, not with the client's JSON encoding
    (18 ms for a 4 MB image data URL, which is the client's cost, not the server's)."""
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    start = time.perf_counter()
    stamps, tokens = [], 0
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                stamps.append(time.perf_counter())
    end = time.perf_counter()
    return {"ttft": stamps[0] - start, "itl": np.diff(stamps).tolist(), "e2e": end - start, "tokens": tokens}


async def run_level(base: str, model: str, concurrency: int, num_prompts: int, prompt_len: int, out_len: int,
                    vocab: int) -> dict:
    rng = random.Random(concurrency)
    prompts = [[rng.randrange(vocab // 10, vocab) for _ in range(prompt_len)] for _ in range(num_prompts)]
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        before = await engine_counters(session, base)

        async def one(p):
            async with sem:
                return await stream_request(session, f"{base}/v1/completions", {
                    "model": model, "prompt": p, "max_tokens": out_len, "ignore_eos": True, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True}})
        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - start
        after = await engine_counters(session, base)
    ttft = [r["ttft"] * 1e3 for r in results]
    itl = [x * 1e3 for r in results for x in r["itl"]]
    tpot = [(r["e2e"] - r["ttft"]) / max(r["tokens"] - 1, 1) * 1e3 for r in results]
    e2e = [r["e2e"] * 1e3 for r in results]
    out_tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "num_prompts": num_prompts, "prompt_len": prompt_len, "output_len": out_len,
            "wall_s": wall, "output_tok_s": out_tokens / wall, "completed_tokens": out_tokens,
            **{k: after[k] - before[k] for k in after},
            **{f"{name}_{stat}_ms": fn(vals) for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl),
                                                                 ("e2e", e2e))
               for stat, fn in (("p50", lambda v: pct(v, 50)), ("p99", lambda v: pct(v, 99)),
                                ("mean", lambda v: statistics.fmean(v) if v else float("nan")))}}


async def engine_counters(session, base: str) -> dict[str, int]:
    """The engine's preemption and swap counters (GET /stats): a level that preempts measures that too."""
    async with session.get(f"{base}/stats") as r:
        stats = await r.json()
    return {k: stats[k] for k in ("num_preemptions", "num_swaps")}


# name -> (format, width, height, what it stands for)
IMAGE_KINDS = {
    "jpeg": ("JPEG", 1280, 960, "a photo as the page sends it: static/attachments.js re-encodes pictures over "
                                "1280 px or 1.5 MB as JPEG, quality 0.9, longest side 1280"),
    "screenshot": ("PNG", 1024, 1024, "a UI capture: text and flat boxes"),
    "photo": ("PNG", 1024, 1024, "a photo saved as PNG (the page passes PNGs under 1.5 MB through as they are)"),
    "noise": ("PNG", 1024, 1024, "incompressible pixels: PNG's worst case"),
}


def synthetic_image(width: int, height: int, seed: int, kind: str) -> Image.Image:
    """A width x height RGB test image. noise: uniform random bytes, the worst case for PNG (incompressible:
    ~3 MB at 1024x1024). photo (and jpeg): smooth shapes and gradients plus sensor-like noise (sigma 3), which
    compresses about as badly as a camera photo does. screenshot: text and flat boxes on white, as a UI capture
    or a chart is."""
    rng = np.random.default_rng(seed)
    if kind == "noise":
        return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    if kind in ("photo", "jpeg"):
        low = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
        draw = ImageDraw.Draw(low)
        for _ in range(12):
            x, y, r = (int(v) for v in rng.integers(0, (width, height, max(width, height))) // (1, 1, 4))
            draw.ellipse((x - r, y - r, x + r, y + r), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
        low = low.filter(ImageFilter.GaussianBlur(6))
        noisy = np.asarray(low, dtype=np.float32) + rng.normal(0, 3, (height, width, 3))
        return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))
    if kind == "screenshot":
        img = Image.new("RGB", (width, height), "white")
        draw = ImageDraw.Draw(img)
        draw.rectangle((0, 0, width, 40), fill=(40, 60, 90))
        words = ["paged", "attention", "kv", "cache", "block", "prefill", "decode", "token", "graph", "swap"]
        for y in range(60, height - 20, 18):
            line = " ".join(words[i] for i in rng.integers(0, len(words), 12))
            draw.text((20 + int(rng.integers(0, 40)), y), line, fill=(20, 20, 20))
        for _ in range(6):
            x, y = (int(v) for v in rng.integers(0, (width - 200, height - 200)))
            draw.rectangle((x, y, x + 180, y + 90), outline=(0, 90, 200), width=2)
        return img
    raise ValueError(f"unknown image kind {kind!r}; choose from {list(IMAGE_KINDS)}")


def image_bytes(kind: str, seed: int = 0, size: tuple[int, int] | None = None) -> bytes:
    """An image of this kind (IMAGE_KINDS), in its format, at its size or at `size` (width, height)."""
    fmt, width, height, _ = IMAGE_KINDS[kind]
    width, height = size or (width, height)
    buf = io.BytesIO()
    synthetic_image(width, height, seed, kind).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def image_data_url(kind: str, seed: int = 0, size: tuple[int, int] | None = None) -> str:
    """image_bytes as a data URL; each seed gives other pixels."""
    data = image_bytes(kind, seed, size)
    return f"data:image/{IMAGE_KINDS[kind][0].lower()};base64," + base64.b64encode(data).decode()


def describe(kind: str) -> str:
    fmt, width, height, _ = IMAGE_KINDS[kind]
    return f"{width}x{height} {kind} {fmt}" if kind != "jpeg" else f"{width}x{height} photo JPEG"


async def image_ttft(base: str, model: str, repeats: int, kind: str = "noise") -> dict:
    """Chat with one image of this kind (a fresh image each time: no cache hits) + a short question."""
    urls = [image_data_url(kind, seed) for seed in range(repeats + 1)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        times = []
        for i, url in enumerate(urls):
            body = json.dumps({
                "model": model, "max_tokens": 1, "stream": True, "temperature": 0.0,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": "What is in this image?"}]}]})
            r = await stream_request(session, f"{base}/v1/chat/completions", body.encode())
            if i:   # the first one is a warm-up
                times.append(r["ttft"] * 1e3)
    return {"kind": kind, "image_bytes": len(base64.b64decode(urls[0].split(",", 1)[1])), "repeats": repeats,
            "ttft_p50_ms": pct(times, 50), "ttft_min_ms": min(times), "all_ms": times}


async def main_async(args) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{args.url}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
    res = {"model": model, "levels": []}
    if args.image:
        res["image"] = [await image_ttft(args.url, model, args.image_repeats, kind) for kind in args.image_kinds]
        for im in res["image"]:
            print("image TTFT", json.dumps(im))
    if args.concurrency:
        await run_level(args.url, model, 4, 4, 64, 8, args.vocab)   # warm-up
    for c in args.concurrency:
        n = args.num_prompts or max(4, 2 * c if c < 256 else c)
        level = await run_level(args.url, model, c, n, args.prompt_len, args.output_len, args.vocab)
        res["levels"].append(level)
        print(json.dumps(level))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:3001")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 64, 256],
                    help="levels to run (none: only the image requests)")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151643, help="token ids are drawn below this")
    ap.add_argument("--image", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--image-repeats", type=int, default=5)
    ap.add_argument("--image-kinds", nargs="+", default=list(IMAGE_KINDS), choices=list(IMAGE_KINDS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = asyncio.run(main_async(args))
    print("\n| concurrency | output tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | ITL p50/p99 ms | E2E p50/p99 ms | "
          "preemptions |")
    print("|---|---|---|---|---|---|---|")
    for lv in res["levels"]:
        print(f"| {lv['concurrency']} | {lv['output_tok_s']:.0f} | {lv['ttft_p50_ms']:.1f} / {lv['ttft_p99_ms']:.1f} | "
              f"{lv['tpot_p50_ms']:.2f} / {lv['tpot_p99_ms']:.2f} | {lv['itl_p50_ms']:.2f} / {lv['itl_p99_ms']:.2f} | "
              f"{lv['e2e_p50_ms']:.0f} / {lv['e2e_p99_ms']:.0f} | {lv['num_preemptions']} |")
    for im in res.get("image", []):
        print(f"| image {describe(im['kind'])} ({im['image_bytes'] / 1e6:.2f} MB) TTFT p50 / min | "
              f"{im['ttft_p50_ms']:.1f} / {im['ttft_min_ms']:.1f} ms |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
