"""The emulated-paths table (bench/emulated_paths.sh): bench/offline.py's JSON per (card, weight format) in one
table, with the two rules each path must keep:
- a batch-8 decode step costs at most BATCH8_RATIO times the same path's batch-1 step (a kernel that reads the
  weights once per step, whatever the batch);
- FP8 weights are never slower than bf16 on the same card: decode steps at batch 1 and 8, the 64 x 512/256
  throughput and TTFT 8192.

    python bench/emulated_table.py DIR     # DIR holds offline_CARD_FORMAT.json; exit 1 if a rule fails
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

BATCH8_RATIO = 1.3


def read_runs(folder: Path) -> dict[tuple[str, str], dict]:
    """(card, format) -> the offline benchmark's JSON, from files named offline_CARD_FORMAT.json."""
    runs = {}
    for path in sorted(folder.glob("offline_*_*.json")):
        card, fmt = path.stem.removeprefix("offline_").rsplit("_", 1)
        runs[(card, fmt)] = json.loads(path.read_text())
    return runs


def numbers(res: dict) -> dict[str, float | None]:
    """The four numbers of a run: ms per decode step at batch 1 and 8, output tok/s of 64 requests, TTFT 8192."""
    step = {d["batch"]: d["ms_per_step"] for d in res.get("decode", [])}
    tput = {t["requests"]: t["output_tok_s"] for t in res.get("throughput", [])}
    return {"b1_ms": step.get(1), "b8_ms": step.get(8), "tput64": tput.get(64), "ttft8192_ms": res.get("ttft_8192_ms")}


def failures(runs: dict[tuple[str, str], dict]) -> list[str]:
    """Each broken rule, one line each."""
    out = []
    table = {key: numbers(res) for key, res in runs.items()}
    for (card, fmt), n in sorted(table.items()):
        if n["b1_ms"] and n["b8_ms"] and n["b8_ms"] > BATCH8_RATIO * n["b1_ms"]:
            out.append(f"{card} {fmt}: batch-8 step {n['b8_ms']:.2f} ms > {BATCH8_RATIO} x batch-1 {n['b1_ms']:.2f} ms")
        base = table.get((card, "bf16"))
        if fmt != "fp8" or base is None:
            continue
        for key, lower_is_better in (("b1_ms", True), ("b8_ms", True), ("tput64", False), ("ttft8192_ms", True)):
            a, b = n[key], base[key]
            if a is not None and b is not None and (a > b if lower_is_better else a < b):
                out.append(f"{card}: fp8 {key} {a:.2f} is slower than bf16's {b:.2f}")
    return out


def render(runs: dict[tuple[str, str], dict]) -> str:
    fmt_num = lambda v, spec: "-" if v is None else format(v, spec)   # noqa: E731
    lines = ["| card | weights | batch-1 step | batch-8 step | b8/b1 | 64 x 512/256 | TTFT 8192 |",
             "|---|---|---|---|---|---|---|"]
    for (card, fmt), res in sorted(runs.items()):
        n = numbers(res)
        ratio = n["b8_ms"] / n["b1_ms"] if n["b1_ms"] and n["b8_ms"] else None
        lines.append(f"| {card} | {fmt} | {fmt_num(n['b1_ms'], '.2f')} ms | {fmt_num(n['b8_ms'], '.2f')} ms | "
                     f"{fmt_num(ratio, '.2f')} | {fmt_num(n['tput64'], '.0f')} tok/s | "
                     f"{fmt_num(n['ttft8192_ms'], '.0f')} ms |")
    return "\n".join(lines)


def main(folder: str) -> int:
    runs = read_runs(Path(folder))
    if not runs:
        print(f"no offline_*_*.json in {folder}")
        return 1
    device = next(iter(runs.values())).get("device", "?")
    print(f"Emulated paths on {device} (dummy weights, Qwen3-VL-8B shapes)\n")
    print(render(runs))
    broken = failures(runs)
    print("\n" + ("\n".join(f"FAIL {line}" for line in broken) if broken else
                  f"every path: batch-8 <= {BATCH8_RATIO} x batch-1, fp8 never slower than bf16"))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
