"""The host's image intake alone: a chat request with one fresh image of each kind (bench/serve.py's
IMAGE_KINDS) through InputProcessor.process_chat (base64, decode, resize, content hash, template, tokens), as
the server's worker thread runs it, and the same request again (the re-sent image: a decoded-upload cache hit).
Median and min ms. Only the model directory's tokenizer and configs are read (no weights, no device), and only
InputProcessor.process_chat is called, so any tree can be timed: run it with PYTHONPATH set to that tree.
With --alternate, two trees are timed in turns, image by image, in separate processes.

    PYTHONPATH=TREE python bench/image_intake.py --model DIR [--kinds jpeg screenshot photo] [--repeats 15]
    python bench/image_intake.py --model DIR --alternate TREE_A TREE_B [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import IMAGE_KINDS, describe, image_data_url  # noqa: E402


def messages(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is in this image?"}]}]


def time_kinds(model: str, kinds: list[str], repeats: int, first_seed: int) -> dict[str, dict[str, list[float]]]:
    from engine.args import EngineArgs
    from engine.inputs.setup import build_input_processor
    from engine.model.loader import load_model_config

    processor = build_input_processor(EngineArgs(model=model), load_model_config(model))
    out = {}
    for kind in kinds:
        urls = [image_data_url(kind, first_seed + seed) for seed in range(repeats + 1)]
        cold, resent = [], []
        for i, url in enumerate(urls):
            for times in (cold, resent):     # the first call decodes; the second finds the upload cached
                t0 = time.perf_counter()
                processor.process_chat(messages(url))
                if i:                        # the first image is a warm-up
                    times.append((time.perf_counter() - t0) * 1e3)
        out[kind] = {"cold": cold, "resent": resent}
    return out


def summary(times: list[float]) -> str:
    return f"{np.median(times):7.2f} (min {min(times):6.2f})"


def alternate(args) -> None:
    """Each round runs every tree once, in a fresh process, on the round's own images."""
    results: dict[str, dict[str, dict[str, list[float]]]] = {t: {} for t in args.alternate}
    for round_ in range(args.rounds):
        for tree in args.alternate:
            cmd = [sys.executable, __file__, "--model", args.model, "--repeats", str(args.repeats), "--json",
                   "--first-seed", str(1000 * (round_ + 1)), "--kinds", *args.kinds]
            env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
            got = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
                             .strip().splitlines()[-1])
            for kind, series in got.items():
                for name, times in series.items():
                    results[tree].setdefault(kind, {}).setdefault(name, []).extend(times)
    print(f"median (min) ms over {args.rounds} rounds x {args.repeats} images, trees in turns")
    for kind in args.kinds:
        for tree in args.alternate:
            r = results[tree][kind]
            print(f"  {describe(kind):28s} {tree:40s} cold {summary(r['cold'])}  re-sent {summary(r['resent'])}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--kinds", nargs="+", default=["jpeg", "screenshot", "photo"], choices=list(IMAGE_KINDS))
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the raw times as one JSON line")
    ap.add_argument("--alternate", nargs=2, metavar="TREE", help="time two trees in turns")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.alternate:
        return alternate(args)
    results = time_kinds(args.model, args.kinds, args.repeats, args.first_seed)
    if args.json:
        print(json.dumps(results))
        return
    for kind, r in results.items():
        print(f"{describe(kind):28s} cold {summary(r['cold'])}  re-sent {summary(r['resent'])}  ms")


if __name__ == "__main__":
    main()
