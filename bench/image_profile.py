"""Where the time to first token of one image request goes: the CPU phases of turning a data URL into a prompt
(base64, decode, resize, hash, template and tokens), then torch.profiler kernel tables for the vision encoder and for
the prefill step that follows it.

    python bench/image_profile.py --model DIR --load-format dummy [--out FILE]
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engine import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from serve import IMAGE_KINDS, describe, image_bytes, image_data_url  # noqa: E402


def median_ms(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[repeats // 2]


def cpu_phases(llm: LLM, kind: str) -> dict:
    """Each CPU phase alone, median of 7, for one image of this kind."""
    from engine.inputs.image_cache import ImageCache
    from engine.inputs.image_io import decode_data_url, decode_image
    from engine.server.protocol import _loads
    url = image_data_url(kind)
    data = image_bytes(kind)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is in this image?"}]}]
    body = json.dumps({"model": "m", "messages": msgs}).encode()
    cold = copy.copy(llm.engine.input_processor)
    cold.image_cache = ImageCache(max_bytes=0)    # keeps nothing: every call decodes
    return {"kind": describe(kind), "bytes": len(data), "json_loads": median_ms(lambda: _loads(body)),
            "base64": median_ms(lambda: decode_data_url(url)), "decode": median_ms(lambda: decode_image(data)),
            # The whole request processing: cold (nothing kept), and for the image re-sent by a later chat turn.
            "process_chat_cold": median_ms(lambda: cold.process_chat(msgs)),
            "process_chat_resent": median_ms(lambda: llm.engine.input_processor.process_chat(msgs))}


def kernel_table(fn, rows: int = 30) -> tuple[str, float]:
    """(torch.profiler's top kernels of one call of fn, the sum of their device times in ms)."""
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    events = prof.key_averages()
    busy = sum(e.self_device_time_total if cuda else e.self_cpu_time_total for e in events) / 1e3
    return events.table(sort_by="cuda_time_total" if cuda else "self_cpu_time_total", row_limit=rows), busy


def host_profile(fn, rows: int = 35) -> str:
    """cProfile of one call: where the host's time goes (by own time, then by cumulative time)."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumtime").print_stats(rows)
    return out.getvalue()


def wall_ms(fn, repeats: int = 5) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed():
        sync()
        fn()
        sync()
    return median_ms(timed, repeats)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = LLM(args.model, load_format=args.load_format, max_model_len=10240, gpu_memory_utilization=0.85)
    phases = [cpu_phases(llm, kind) for kind in IMAGE_KINDS]
    for p in phases:
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in p.items()}))

    msgs = lambda seed: [{"role": "user", "content": [  # noqa: E731
        {"type": "image_url", "image_url": {"url": image_data_url("photo", seed)}},
        {"type": "text", "text": "What is in this image?"}]}]
    process = llm.engine.input_processor.process_chat
    prompt = process(msgs(1))
    [image] = prompt.images
    pixels = llm.engine.input_processor.image_processor.to_pixel_values(image.raw.to(llm.engine.device))
    grid = torch.tensor([image.grid_thw])
    with torch.inference_mode():
        encode = lambda: llm.engine.model_executor.driver_worker.model.encode_images(pixels, grid)  # noqa: E731
        vision, vision_busy = kernel_table(encode)
        vision_wall = wall_ms(encode)
        graphs = llm.engine.model_executor.driver_worker.model_runner.vision_graphs
        dtype = llm.engine.model_executor.driver_worker.model.lm_head.weight.dtype
        graph_wall = (wall_ms(lambda: graphs.encode(pixels.to(dtype), grid)) if graphs is not None
                      else float("nan"))
    # Fresh images each call (no encoder- or prefix-cache hits), processed before the clock starts.
    params = SamplingParams(temperature=0.0, max_tokens=1)
    prompts = iter([process(msgs(seed)) for seed in range(100, 114)])
    generate = lambda: llm.generate(next(prompts), params)  # noqa: E731
    step, step_busy = kernel_table(generate)
    step_wall = wall_ms(generate)
    host = host_profile(generate)
    summary = {"vision_eager_wall_ms": vision_wall, "vision_graph_wall_ms": graph_wall,
               "vision_kernels_ms": vision_busy,
               "model_ttft_wall_ms": step_wall, "model_ttft_kernels_ms": step_busy}
    print(json.dumps({k: round(v, 2) for k, v in summary.items()}))
    text = (f"==== vision encoder, 4096 patches\n{vision}\n==== generate(max_tokens=1), one image\n{step}\n"
            f"==== host functions of one generate(max_tokens=1), one image (cProfile)\n{host}\n")
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps([*phases, summary], indent=1) + "\n" + text)


if __name__ == "__main__":
    main()
