"""The image chat under GPU memory caps: for each cap (GiB), start the engine server with --gpu-memory-limit CAP,
and report whether it started (else the engine's reason), its KV pool and maximum context, then the time to first
token and the decode speed of a chat carrying one 1024x1024 PNG and a question, over the HTTP API; then a long
image chat (turns that re-send the history) and a burst of 16 image chats at once. All along, from the server's
start (CUDA graph capture included) to its stop, the memory nvidia-smi counts for the server's process is sampled
every 100 ms (pynvml where it imports): the report gives the peak against the cap, per phase.

    python bench/memory_caps.py [--model DIR] [--caps 8 12 16 24] [--out caps.json] [engine flags, e.g.
        --quantization awq --max-model-len 8192]

Without --model it serves Qwen3-VL-8B-Instruct's shapes with random weights (bench/synthetic_model.py,
--load-format dummy). Every flag it does not know goes to the engine. Each cap also gets the flags the launcher
would fit to a card of that size (app/fit.py: smaller worst-case images, smaller steps, ...), so that the numbers
are what a user of that card gets; the JSON lists them with the KV pool they were computed to leave. Flags given
here win over them; --no-fit leaves them out. For example:

    python bench/memory_caps.py --caps 8 12 --quantization awq

The JSON is rewritten after every cap, and each server's log is kept beside it; a cap that fails to start, hangs
or crashes is recorded and the next one runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.checkpoints import GiB, weight_bytes, weight_format  # noqa: E402
from app.fit import fit  # noqa: E402
from app.memory_estimate import ModelShape  # noqa: E402
from bench.gpu_sampler import GpuSampler, gpu_used_mib  # noqa: E402
from bench.serve import image_data_url, stream_request  # noqa: E402

QUESTION = "Describe this image in detail."
IMAGE_SIDE = 1024
# Lines of the engine's start-up log worth keeping per cap (the memory profile says where the memory went).
LOG_PATTERNS = {
    "memory_profile": re.compile(r"Memory profile: (.*)"),
    "gpu_memory_limit": re.compile(r"GPU memory limit: (.*)"),
    "limit_ignored": re.compile(r"--gpu-memory-limit (.* applies to CUDA devices only.*)"),
    "weights": re.compile(r"Loading model weights took (.*)"),
    "host_embeddings": re.compile(r"Token embeddings in host memory \(([\d.]+ GB)"),   # --cpu-embeddings
    "max_model_len_reduced": re.compile(r"max_model_len reduced from (.*)"),
    "cuda_graphs": re.compile(r"Captured CUDA graphs (.*)"),
    "error": re.compile(r"(?:ERROR .*?\] )(.*)"),
}


def parse_log(text: str) -> dict[str, str]:
    """The last occurrence of each LOG_PATTERNS line in an engine log."""
    found = {}
    for line in text.splitlines():
        for key, pattern in LOG_PATTERNS.items():
            m = pattern.search(line)
            if m:
                found[key] = m.group(1).strip()
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(proc: subprocess.Popen, base: str, timeout: float) -> str | None:
    """None once /health answers 200; else why not (the server exited, or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"the server exited with code {proc.returncode} while starting"
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return None
        except OSError:
            pass
        time.sleep(0.5)
    return f"not ready after {timeout:.0f} s"


def stop(proc: subprocess.Popen) -> None:
    """SIGINT (the server's graceful stop), then SIGKILL; the server runs in its own process group."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


async def image_chat(base: str, model: str, seed: int, max_tokens: int, timeout: float) -> dict:
    """One streamed chat: a fresh 1024x1024 PNG (no encoder-cache hit) and a question; TTFT and decode tok/s."""
    body = json.dumps({
        "model": model, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_data_url("photo", seed, (IMAGE_SIDE, IMAGE_SIDE))}},
            {"type": "text", "text": QUESTION}]}]}).encode()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        r = await stream_request(session, f"{base}/v1/chat/completions", body)
    decode_s = r["e2e"] - r["ttft"]
    return {"ttft_ms": r["ttft"] * 1e3, "completion_tokens": r["tokens"],
            "decode_tok_s": (r["tokens"] - 1) / decode_s if r["tokens"] > 1 and decode_s > 0 else None}


def median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def quantization_flag(engine_flags: list[str]) -> str | None:
    """The --quantization / -q value among the engine flags (the layout of --load-format dummy weights)."""
    for i, flag in enumerate(engine_flags):
        name, eq, value = flag.partition("=")
        if name in ("--quantization", "-q"):
            return value if eq else (engine_flags[i + 1] if i + 1 < len(engine_flags) else None)
    return None


def fitted_flags(model: str, cap: float, engine_flags: list[str]):
    """What the launcher would add on a card of `cap` GiB (app/fit.py), for the model's config, its
    quantization_config or else the published layout of --quantization (bench/synthetic_model.py)."""
    from bench.synthetic_model import QUANTIZATION_CONFIGS

    config = json.loads((Path(model) / "config.json").read_text())
    method = quantization_flag(engine_flags)
    if "quantization_config" not in config and method in QUANTIZATION_CONFIGS:
        config["quantization_config"] = QUANTIZATION_CONFIGS[method]
    shape = ModelShape.from_model_dir(Path(model), config)
    return fit(int(cap * GiB), weight_bytes(config, weight_format(config)), shape, engine_flags)


def run_cap(cap: float, args, engine_flags: list[str], log_dir: Path) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"engine_cap{cap:g}GiB.log"
    plan, fit_error = None, None
    if not args.no_fit:
        try:
            plan = fitted_flags(args.model, cap, engine_flags)
        except (OSError, ValueError, KeyError, TypeError) as err:    # the engine then says what is wrong
            fit_error = f"{type(err).__name__}: {err}"
    fitted = plan.args() if plan is not None else []
    cmd = [sys.executable, "-m", "engine", "--model", args.model, "--port", str(port), "--gpu-memory-limit",
           f"{cap:g}", "--disable-log-requests", "--disable-uvicorn-access-log", *fitted, *engine_flags]
    res: dict = {"cap_gib": cap, "command": shlex.join(cmd), "log": str(log_path), "started": False,
                 "fitted_args": fitted, "fitted_flags": [str(f) for f in plan.flags] if plan is not None else None,
                 "fitted_kv_tokens_computed": plan.estimate.pool_tokens if plan is not None else None}
    if fit_error:
        res["fit_error"] = fit_error
    print(f"\n== cap {cap:g} GiB: {' '.join(cmd)}", flush=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parent.parent,
                                start_new_session=True)
    sampler = GpuSampler(proc.pid)
    try:
        start = time.monotonic()
        why = wait_ready(proc, base, args.start_timeout)
        res["start_s"] = round(time.monotonic() - start, 1)
        if why is not None:
            res["reason"] = why
            return res
        res["started"] = True
        measure(res, base, proc, args, sampler)
    except Exception as err:           # a bench-side failure is recorded; the other caps still run
        res["bench_error"] = f"{type(err).__name__}: {err}"[:500]
    finally:
        sampler.phase = "stopping"
        stop(proc)
        res["nvidia_smi"] = sampler.stop()
        peak = res["nvidia_smi"]["peak_mib"]
        res["peak_within_cap"] = None if peak is None else peak <= cap * 1024
        text = log_path.read_text(errors="replace")
        res["log_lines"] = parse_log(text)
        if not res["started"]:
            # The engine's ERROR line, else the log's last line (argparse's usage error, a traceback's end).
            last = next((line for line in reversed(text.splitlines()) if line.strip()), "")
            res["reason"] = f"{res.get('reason', 'not started')}: {res['log_lines'].get('error', last.strip())}"
    return res


def measure(res: dict, base: str, proc: subprocess.Popen, args, sampler: GpuSampler) -> None:
    card = http_json(f"{base}/v1/models")["data"][0]
    stats = http_json(f"{base}/stats")
    res.update(served_model=card["id"], max_model_len=card.get("max_model_len"),
               kv_blocks=stats["num_total_gpu_blocks"], block_size=stats["block_size"],
               kv_tokens=stats["num_total_gpu_blocks"] * stats["block_size"])
    sampler.phase = "image chat"
    runs = []
    for i in range(args.repeats + 1):        # the first one is a warm-up (vision graph capture, allocator)
        try:
            r = asyncio.run(image_chat(base, card["id"], i, args.max_tokens, args.request_timeout))
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as err:
            res["request_error"] = f"request {i}: {type(err).__name__}: {err}"[:500]
            break
        if i:
            runs.append(r)
    res["runs"] = runs
    res["ttft_ms_p50"] = median([r["ttft_ms"] for r in runs])
    res["decode_tok_s_p50"] = median([r["decode_tok_s"] for r in runs])
    res["gpu_used_mib"] = gpu_used_mib(proc.pid)
    sampler.phase = "long image chat"
    try:
        res["long_chat"] = asyncio.run(long_image_chat(base, card["id"], args.turns, args.max_tokens,
                                                       args.request_timeout))
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as err:
        res["long_chat_error"] = f"{type(err).__name__}: {err}"[:500]
    sampler.phase = f"burst of {args.burst}"
    try:
        burst = asyncio.run(image_burst(base, card["id"], args.burst, args.max_tokens, args.request_timeout))
        res["burst"] = {"requests": args.burst, "ok": sum(1 for r in burst if not isinstance(r, BaseException)),
                        "errors": sorted({f"{type(r).__name__}: {r}"[:200] for r in burst
                                          if isinstance(r, BaseException)})}
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as err:
        res["burst_error"] = f"{type(err).__name__}: {err}"[:500]
    sampler.phase = "idle"
    res["alive_after"] = proc.poll() is None


async def long_image_chat(base: str, model: str, turns: int, max_tokens: int, timeout: float) -> dict:
    """One conversation of `turns` turns that re-sends its history (the image in the first turn) each time, as
    the page does; the prompt's length at the last turn."""
    history = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_data_url("photo", 1000, (IMAGE_SIDE, IMAGE_SIDE))}},
        {"type": "text", "text": QUESTION}]}]
    prompt_tokens = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        for turn in range(turns):
            body = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
                    "messages": history}
            async with session.post(f"{base}/v1/chat/completions", json=body) as r:
                answer = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"turn {turn}: {r.status} {answer}")
            prompt_tokens = answer["usage"]["prompt_tokens"]
            history += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                        {"role": "user", "content": f"Turn {turn + 2}: say more about the colours."}]
    return {"turns": turns, "last_prompt_tokens": prompt_tokens}


async def image_burst(base: str, model: str, n: int, max_tokens: int, timeout: float) -> list:
    """`n` image chats at once, each a fresh image (every one goes through the vision encoder)."""
    return await asyncio.gather(*(image_chat(base, model, 2000 + i, max_tokens, timeout) for i in range(n)),
                                return_exceptions=True)


def table(results: list[dict]) -> str:
    rows = ["| cap | fitted flags | started | KV pool (tokens): computed / engine | max context | TTFT p50 ms | "
            "decode tok/s p50 | GPU used (nvidia-smi) | peak, every 100 ms (phase) | within the cap |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        flags = shlex.join(r.get("fitted_args") or []) or "—"
        computed = r.get("fitted_kv_tokens_computed")
        computed = "—" if computed is None else str(computed)
        if not r["started"]:
            rows.append(f"| {r['cap_gib']:g} GiB | `{flags}` | no: {r.get('reason', '?')} | {computed} / — | | | | | "
                        f"{peak_text(r)} |")
            continue
        fmt = lambda v, spec: "—" if v is None else format(v, spec)   # noqa: E731
        used = "—" if r.get("gpu_used_mib") is None else f"{r['gpu_used_mib'] / 1024:.2f} GiB"
        note = "" if not r.get("request_error") else f" ({r['request_error'][:80]})"
        if "limit_ignored" in r.get("log_lines", {}):
            note += " (cap ignored: not on CUDA)"
        rows.append(f"| {r['cap_gib']:g} GiB | `{flags}` | yes{note} | {computed} / {r['kv_tokens']} | "
                    f"{r['max_model_len']} | {fmt(r.get('ttft_ms_p50'), '.1f')} | "
                    f"{fmt(r.get('decode_tok_s_p50'), '.1f')} | {used} | {peak_text(r)} |")
    return "\n".join(rows)


def peak_text(r: dict) -> str:
    """'8.02 GiB (burst of 16) | yes' from the sampler's summary ('— | —' without readings)."""
    smi = r.get("nvidia_smi") or {}
    if smi.get("peak_mib") is None:
        return "— | —"
    within = "yes" if r.get("peak_within_cap") else f"NO, by {smi['peak_mib'] - r['cap_gib'] * 1024:.0f} MiB"
    return f"{smi['peak_mib'] / 1024:.2f} GiB ({smi['peak_phase']}) | {within}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Other flags (e.g. --quantization awq, --max-model-len 8192) go to the engine.")
    ap.add_argument("--model", default=None, help="model directory (default: Qwen3-VL-8B shapes, random weights)")
    ap.add_argument("--caps", type=float, nargs="+", default=[8, 12, 16, 24], help="GiB")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens generated per chat (ignore_eos)")
    ap.add_argument("--repeats", type=int, default=3, help="measured chats per cap, after one warm-up")
    ap.add_argument("--turns", type=int, default=6, help="turns of the long image chat (0: none)")
    ap.add_argument("--burst", type=int, default=16, help="image chats sent at once after it (0: none)")
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds for a server to become ready")
    ap.add_argument("--request-timeout", type=float, default=300, help="seconds per chat request")
    ap.add_argument("--out", default=None, help="JSON results (default: memory_caps.json in the log folder)")
    ap.add_argument("--log-dir", default=None, help="where the servers' logs go (default: a new temp folder)")
    ap.add_argument("--no-fit", action="store_true", help="leave out the flags the launcher fits to each card")
    args, engine_flags = ap.parse_known_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="memory_caps_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from bench.synthetic_model import build
        args.model = str(build(log_dir / "qwen3-vl-8b-synthetic"))
        if not any(f.startswith("--load-format") for f in engine_flags):
            engine_flags += ["--load-format", "dummy"]
    out = Path(args.out) if args.out else log_dir / "memory_caps.json"
    report = {"model": args.model, "engine_flags": engine_flags, "max_tokens": args.max_tokens,
              "repeats": args.repeats, "question": QUESTION, "image": "1024x1024 PNG (bench/serve.py 'photo')",
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "caps": []}
    for cap in args.caps:
        res = run_cap(cap, args, engine_flags, log_dir)
        report["caps"].append(res)
        out.write_text(json.dumps(report, indent=1))
        print(json.dumps({k: v for k, v in res.items() if k not in ("runs", "command")}), flush=True)
    print("\n" + table(report["caps"]))
    print(f"\nJSON: {out}\nlogs: {log_dir}")
    return report


if __name__ == "__main__":
    main()
