"""Where the time to first token of one image request goes, inside the real HTTP server: the server runs in
this process with probes on the functions of the request path; a client process sends chat requests with a
fresh image each (bench/serve.py's image kinds: the page's 1280x960 JPEG, 1024x1024 PNGs) and reports its own
TTFT. Printed per stage: the median time since the handler started, on the host, and the GPU's busy spans (CUDA
events) on the same clock.

    python bench/image_timeline.py --model DIR [--kinds jpeg screenshot photo] [--repeats 6] [engine flags, e.g.
        --load-format dummy]
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STAMPS: list[tuple[str, float]] = []        # (stage, seconds since the handler started), one request at a time
GPU: list[tuple[str, object, object]] = []  # (span, start event, end event)
T0 = [0.0]


def stamp(name: str) -> None:
    STAMPS.append((name, time.perf_counter() - T0[0]))


def _event():
    if not torch.cuda.is_available():
        return None
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def probe(owner, attr: str, name: str, gpu: bool = False, first_only: bool = False) -> None:
    """Wrap owner.attr (sync or async) so that it stamps `name:start` and `name:end` (and, with gpu, records
    CUDA events around it)."""
    fn = getattr(owner, attr)
    if asyncio.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapped(*a, **kw):
            seen = any(s.startswith(name + ":") for s, _ in STAMPS)
            if not (first_only and seen):
                stamp(name + ":start")
            out = await fn(*a, **kw)
            if not (first_only and seen):
                stamp(name + ":end")
            return out
    else:
        @functools.wraps(fn)
        def wrapped(*a, **kw):
            seen = any(s.startswith(name + ":") for s, _ in STAMPS)
            if first_only and seen:
                return fn(*a, **kw)
            stamp(name + ":start")
            e0 = _event() if gpu else None
            out = fn(*a, **kw)
            if gpu and e0 is not None:
                GPU.append((name, e0, _event()))
            stamp(name + ":end")
            return out
    setattr(owner, attr, wrapped)


def install_probes() -> None:
    from aiohttp import web

    from engine import async_llm
    from engine.async_llm import AsyncLLM
    from engine.inputs import processor
    from engine.inputs.chat_template import ChatTemplate
    from engine.inputs.image_processor import ImageProcessor
    from engine.llm_engine import LLMEngine
    from engine.worker.inflight import InflightStep
    from engine.worker.model_runner import ModelRunner
    from engine.server import protocol, serving
    from engine.server.sse import SSEWriter

    handler = serving.read_json_body

    async def first_stage(request):          # the handler's first await: the clock starts here
        STAMPS.clear()
        GPU.clear()
        T0[0] = time.perf_counter()
        GPU.append(("t0", _event(), None))
        return await handler(request)
    serving.read_json_body = first_stage
    probe(web.BaseRequest, "read", "body_read")
    probe(protocol, "_loads", "json")
    probe(processor.InputProcessor, "process_chat", "process_chat")
    probe(processor.InputProcessor, "_load_image", "image_load (worker)")
    probe(processor, "fetch_image_bytes", "base64")
    probe(processor, "decode_image", "decode")
    probe(ImageProcessor, "resize", "resize")
    probe(ChatTemplate, "render", "render")
    probe(processor.InputProcessor, "_encode", "tokenize")
    probe(processor.InputProcessor, "_content_hash", "content_hash")
    probe(processor, "get_mrope_positions", "mrope")
    probe(AsyncLLM, "_send", "to_engine", first_only=True)
    probe(LLMEngine, "add_request", "add_request")
    probe(ModelRunner, "launch", "launch", gpu=True, first_only=True)
    probe(ModelRunner, "_encode", "vision", gpu=True)
    probe(InflightStep, "result", "wait_token", first_only=True)
    deliver, put_all = AsyncLLM._deliver_step, async_llm._put_all

    def first_outputs(name, fn):             # stamps the first call that carries outputs (the first token)
        def wrapped(self_or_items, *rest):
            items = rest[0] if rest else self_or_items
            if items and not any(s == name for s, _ in STAMPS):
                stamp(name)
            return fn(self_or_items, *rest)
        return wrapped
    AsyncLLM._deliver_step = first_outputs("deliver (engine thread)", deliver)
    async_llm._put_all = first_outputs("loop_put (event loop)", put_all)
    probe(SSEWriter, "start", "sse_prepare", first_only=True)     # the response headers
    probe(SSEWriter, "send", "sse_send", first_only=True)


def gpu_spans() -> dict[str, tuple[float, float]]:
    """Each recorded span as (start, end) ms on the host clock of T0, assuming the GPU was idle at T0."""
    if not GPU or GPU[0][1] is None:
        return {}
    torch.cuda.synchronize()
    base = GPU[0][1]
    return {name: (base.elapsed_time(a), base.elapsed_time(b)) for name, a, b in GPU[1:]}


CLIENT = r"""
import asyncio, json, sys
sys.path.insert(0, sys.argv[1])
import aiohttp
from serve import image_data_url, stream_request
async def main(url, kinds, repeats, first_seed):
    async with aiohttp.ClientSession() as s:
        model = (await (await s.get(url + "/v1/models")).json())["data"][0]["id"]
        for kind in kinds:
            for seed in range(repeats + 1):
                body = json.dumps({"model": model, "max_tokens": 1, "stream": True, "temperature": 0.0,
                    "messages": [{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": image_data_url(kind, first_seed + seed)}},
                        {"type": "text", "text": "What is in this image?"}]}]}).encode()
                r = await stream_request(s, url + "/v1/chat/completions", body)
                print(json.dumps({"kind": kind, "seed": seed, "ttft_ms": r["ttft"] * 1e3}), flush=True)
asyncio.run(main(sys.argv[2], sys.argv[3].split(","), int(sys.argv[4]), int(sys.argv[5])))
"""


async def run(args) -> None:
    from aiohttp import web
    from engine.async_llm import AsyncLLM
    from engine.server.app import build_app
    from engine.server.cli import parse_args
    from engine.server.defaults import load_sampling_defaults
    from engine.server.state import ServerState

    install_probes()
    engine_args, server_args = parse_args(["--model", args.model, "--max-model-len", "10240",
                                           "--gpu-memory-utilization", "0.85", "--disable-log-requests",
                                           "--disable-uvicorn-access-log", *args.engine_args])
    engine = AsyncLLM(engine_args)
    state = ServerState(engine=engine, served_model_name=engine.model_name, model_path=args.model,
                        sampling_defaults=load_sampling_defaults(args.model, server_args.generation_config),
                        log_requests=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runner = web.AppRunner(build_app(state, server_args), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    rows = defaultdict(list)
    for round_ in range(args.rounds):
        # fresh images each round: a decoded-upload cache hit would skip the decoder
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CLIENT, str(Path(__file__).parent), f"http://127.0.0.1:{port}",
            ",".join(args.kinds), str(args.repeats), str(1000 + 100 * round_), stdout=subprocess.PIPE)
        while line := await client.stdout.readline():
            r = json.loads(line)
            await asyncio.sleep(0.05)                    # the handler has finished its last stamps
            if r["seed"] == 0:
                continue                                  # warm-up (first of its kind: graph capture, caches)
            stages = {name: t * 1e3 for name, t in STAMPS}
            stages.update({f"gpu {name}:{edge}": t for name, span in gpu_spans().items()
                           for edge, t in zip(("start", "end"), span)})
            stages["client TTFT"] = r["ttft_ms"]
            rows[(r["kind"], round_)].append(stages)
        await client.wait()
    await runner.cleanup()
    engine.shutdown()
    for (kind, round_), reqs in rows.items():
        print(f"\n== {kind}, round {round_ + 1}: {len(reqs)} requests, median ms since the handler started")
        names = sorted({n for r in reqs for n in r}, key=lambda n: float(np.median([r[n] for r in reqs if n in r])))
        for n in names:
            print(f"  {np.median([r[n] for r in reqs if n in r]):8.2f}  {n}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--kinds", nargs="+", default=["jpeg", "screenshot", "photo"])
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1, help="rounds of fresh images (each kind per round)")
    args, args.engine_args = ap.parse_known_args()     # the rest are engine flags, e.g. --load-format dummy
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
