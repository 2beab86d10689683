"""Offline engine benchmark (no HTTP): TTFT, batch-1 decode, throughput at 64 and 256 requests, and GPU memory
growth over 10 chat rounds. Random token-id prompts, fixed output lengths (ignore_eos).

    python bench/offline.py --model DIR [--load-format dummy] [--kv-cache-dtype fp8] [--out results.json] [--quick]
        [--only ttft8192,decode1,decode8,tput64] [--max-num-seqs 64]

--only runs the named measurements alone (METRICS below; bench/emulated_paths.sh takes four of them per card).
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from engine import LLM, SamplingParams
from engine.ops.kernel_config import kernel_config


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    """`vocab`: the tokenizer's base vocabulary (no special tokens, so no stray image placeholders)."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab // 10, vocab) for _ in range(length)]} for _ in range(n)]


def timed_generate(llm: LLM, prompts, params) -> float:
    sync()
    start = time.perf_counter()
    llm.generate(prompts, params)
    sync()
    return time.perf_counter() - start


def ttft(llm: LLM, length: int, vocab: int, repeats: int = 5) -> float:
    """Median time to the first token of a single request (one prefill step + sampling)."""
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = [timed_generate(llm, random_prompts(1, length, vocab, seed=s), one) for s in range(repeats)]
    return sorted(times)[len(times) // 2]


def decode_rate(llm: LLM, batch: int, prompt_len: int, new: int, vocab: int) -> dict:
    """Decode speed at a batch size: new // 2 engine steps timed once every prompt is prefilled, so each timed step
    is one token for each of the `batch` requests (none finishes inside the window), after 3 untimed ones. (Until
    2026-12-06 this was the difference of two generate() runs of new and new // 2 tokens; at batch 256 each held a
    131k-token prefill, and the difference moved by 2 ms between calls of one tree.)"""
    engine = llm.engine
    steps = new // 2
    # Early prompts decode while later ones prefill (batch * prompt_len / 8192 steps at the default step size):
    # room for twice that, the untimed steps and the timed ones.
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16 + batch * prompt_len // 4096, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, prompt_len, vocab, seed=100 + batch)):
        engine.add_request(f"decode-{batch}-{i}", prompt, params)
    requests = engine.scheduler.requests
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    step = (time.perf_counter() - start) / steps
    assert len(requests) == batch, "a request finished inside the timed window"
    for rid in list(requests):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return {"batch": batch, "prompt": prompt_len, "steps": steps, "ms_per_step": step * 1e3,
            "decode_tok_s": batch / step}


def throughput(llm: LLM, n: int, prompt_len: int, new: int, vocab: int) -> dict:
    """All requests submitted at once; output tokens / wall time, prefill included."""
    prompts = random_prompts(n, prompt_len, vocab, seed=7 + n)
    t = timed_generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
    return {"requests": n, "prompt": prompt_len, "new": new, "seconds": t, "output_tok_s": n * new / t}


def image_ttft(llm: LLM, size: int, repeats: int = 3) -> dict | None:
    """One size x size PNG (as a data URL) + a short question: CPU preprocessing (decode, resize, patches,
    tokens) and the model's time to first token (vision encoder + prefill), each image new (no cache hits)."""
    if not llm.engine.model_config.is_multimodal:
        return None
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from serve import image_data_url
    from engine.inputs.image_io import decode_data_url, decode_image
    pre, model, b64, png, vision = [], [], [], [], []
    for seed in range(repeats + 1):
        url = image_data_url("noise", seed, (size, size))
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is in this image?"}]}]
        t0 = time.perf_counter()
        prompt = llm.engine.input_processor.process_chat(msgs)
        t1 = time.perf_counter()
        timed = timed_generate(llm, prompt, SamplingParams(temperature=0.0, max_tokens=1))
        # The parts: base64, PNG decode, and the vision encoder alone (its share of the model time).
        t2 = time.perf_counter()
        data = decode_data_url(url)
        t3 = time.perf_counter()
        decode_image(data)
        t4 = time.perf_counter()
        [image] = prompt.images
        pixels = llm.engine.input_processor.image_processor.to_pixel_values(image.raw.to(llm.engine.device))
        grid = torch.tensor([image.grid_thw])
        sync()
        t5 = time.perf_counter()
        with torch.inference_mode():
            llm.engine.model_executor.driver_worker.model.encode_images(pixels, grid)
        sync()
        t6 = time.perf_counter()
        if seed:
            pre.append((t1 - t0) * 1e3)
            model.append(timed * 1e3)
            b64.append((t3 - t2) * 1e3)
            png.append((t4 - t3) * 1e3)
            vision.append((t6 - t5) * 1e3)
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    return {"size": size, "prompt_tokens": len(prompt.prompt_token_ids), "preprocess_ms": med(pre),
            "base64_ms": med(b64), "png_decode_ms": med(png), "model_ttft_ms": med(model),
            "vision_encoder_ms": med(vision)}


def memory_growth(llm: LLM, rounds: int = 10) -> dict:
    """Chat for `rounds` rounds re-sending the history; device memory allocated after each round."""
    history, readings = [], []
    params = SamplingParams(temperature=0.7, max_tokens=64, ignore_eos=True, seed=1)
    for i in range(rounds):
        history.append({"role": "user", "content": f"Round {i}: tell me more about paged attention."})
        [out] = llm.chat(history, params)
        history.append({"role": "assistant", "content": out.outputs[0].text})
        sync()
        readings.append(torch.cuda.memory_allocated() if torch.cuda.is_available() else 0)
    return {"rounds": rounds, "allocated_bytes": readings, "growth_bytes": readings[-1] - readings[0]}


# Each measurement by name (--only): TTFT at a prompt length, decode at a batch, throughput at a request count.
METRICS = ("ttft512", "ttft8192", "decode1", "decode8", "decode64", "decode256", "tput64", "tput256", "memory",
           "image")


def parse_only(text: str | None) -> set[str]:
    if not text:
        return set(METRICS)
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = names - set(METRICS)
    if unknown:
        raise SystemExit(f"--only: unknown {sorted(unknown)}; choose from {', '.join(METRICS)}")
    return names


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke test of this script)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=10240)
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype) or fp8")
    ap.add_argument("--only", default=None, help=f"comma-separated measurements, of: {', '.join(METRICS)}")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="fewer decode graphs to capture (at least the "
                    "largest batch measured)")
    ap.add_argument("--quantize-lm-head", action="store_true", help="the engine's --quantize-lm-head")
    args = ap.parse_args()
    only = parse_only(args.only)
    t0 = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs,
              enforce_eager=args.enforce_eager, gpu_memory_utilization=0.85, kv_cache_dtype=args.kv_cache_dtype,
              quantize_lm_head=args.quantize_lm_head,
              **({"num_gpu_blocks_override": 512} if args.quick else {}))
    vocab = llm.get_tokenizer().vocab_size
    res = {"startup_s": time.perf_counter() - t0, "device": torch.cuda.get_device_name() if torch.cuda.is_available()
           else "cpu", "num_gpu_blocks": llm.engine.kv_cache_config.num_gpu_blocks, "kv_cache_dtype": args.kv_cache_dtype,
           "emulate_arch": kernel_config().emulate_arch, "quantize_lm_head": args.quantize_lm_head}
    small = args.quick
    timed_generate(llm, random_prompts(2, 64, vocab, 0), SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    if "ttft512" in only:
        res["ttft_512_ms"] = ttft(llm, 64 if small else 512, vocab) * 1e3
    if "ttft8192" in only:
        res["ttft_8192_ms"] = ttft(llm, 256 if small else 8192, vocab, repeats=3) * 1e3
    batches = (1, 4) if small else tuple(b for b in (1, 8, 64, 256) if f"decode{b}" in only)
    res["decode"] = [decode_rate(llm, b, 64 if small else 512, 16 if small else 128, vocab) for b in batches]
    counts = (4, 8) if small else tuple(n for n in (64, 256) if f"tput{n}" in only)
    res["throughput"] = [throughput(llm, n, 64 if small else 512, 16 if small else 256, vocab) for n in counts]
    res["memory"] = memory_growth(llm, 3 if small else 10) if "memory" in only else None
    res["image"] = image_ttft(llm, 64 if small else 1024) if "image" in only else None
    print(json.dumps(res, indent=1))
    print("\n| metric | value |\n|---|---|")
    for n in (512, 8192):
        if f"ttft_{n}_ms" in res:
            print(f"| TTFT {n} | {res[f'ttft_{n}_ms']:.1f} ms |")
    for d in res["decode"]:
        print(f"| decode batch {d['batch']} | {d['ms_per_step']:.2f} ms/step, {d['decode_tok_s']:.0f} tok/s |")
    for t in res["throughput"]:
        print(f"| {t['requests']} x {t['prompt']}/{t['new']} | {t['output_tok_s']:.0f} output tok/s ({t['seconds']:.2f} s) |")
    if res["memory"]:
        print(f"| memory growth over {res['memory']['rounds']} rounds | {res['memory']['growth_bytes']} bytes |")
    if res["image"]:
        im = res["image"]
        print(f"| image {im['size']}x{im['size']} ({im['prompt_tokens']} tokens) | preprocessing "
              f"{im['preprocess_ms']:.1f} ms (base64 {im['base64_ms']:.1f}, PNG {im['png_decode_ms']:.1f}) + model "
              f"TTFT {im['model_ttft_ms']:.1f} ms (vision encoder {im['vision_encoder_ms']:.1f}) |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
