"""The README's "Flags per card" table, written by app/fit.py's own function: what the launcher adds on 8, 12,
16 and 24 GiB cards for each kind of Qwen3-VL-8B checkpoint; and its "Which checkpoint for which GPU" table: the
Hub checkpoint the launcher names for each card (app/checkpoints.py, hub_suggestion) and what the card gets with
it (tests/test_app_fit.py checks that the README holds exactly these tables).

    python -m app.fit --table
    python -m app.fit --hub-table
"""
from __future__ import annotations

import json
import shlex

from app.checkpoints import BF16, GB, GiB, REFERENCE_CONFIG, WeightFormat, hub_suggestion, weight_bytes
from app.fit import MIN_CONTEXT, fit
from app.memory_estimate import ModelShape

CARDS_GIB = (8, 12, 16, 24)
KINDS = (("bf16", BF16), ("FP8 (128x128 blocks)", WeightFormat("fp8", 8, block=(128, 128))),
         ("4-bit (AWQ, GPTQ, W4A16; group 128)", WeightFormat("int4 g128", 4, 128)))
BEGIN, END = "<!-- fit-table: begin (python -m app.fit --table) -->", "<!-- fit-table: end -->"
HUB_BEGIN, HUB_END = "<!-- hub-table: begin (python -m app.fit --hub-table) -->", "<!-- hub-table: end -->"
# (card GiB, repo) -> decode and TTFT of that card's path, measured on an H100 emulating it
# (bench/emulated_paths.sh, with the date and commit); a card without an entry says so.
MEASURED_SPEEDS: dict[tuple[int, str], str] = {}
SPEED_NOT_MEASURED = "not measured yet (bench/emulated_paths.sh)"


def reference_shape() -> ModelShape:
    return ModelShape.from_model_dir(REFERENCE_CONFIG.parent)


def table() -> str:
    config, shape = json.loads(REFERENCE_CONFIG.read_text()), reference_shape()
    rows = [BEGIN, "| card | checkpoint | flags the launcher adds | KV pool (computed) | context |",
            "|---|---|---|---|---|"]
    for gib in CARDS_GIB:
        for kind, fmt in KINDS:
            weights = weight_bytes(config, fmt)
            plan = fit(gib * GiB, weights, shape.with_format(fmt))
            e = plan.estimate
            if not plan.fits:
                rows.append(f"| {gib} GiB | {kind} | does not fit: weights {weights / GB:.2f} GB, KV pool "
                            f"{max(e.pool_tokens, 0):,} tokens < {MIN_CONTEXT:,} even with every step | | |")
                continue
            flags = f"`{shlex.join(plan.args())}`" if plan.flags else "none (the defaults fit)"
            pool_gb = e.pool_tokens * e.kv_bytes_per_token / GB
            graphs = "" if e.prefill_graphs or not e.graphs else "; prefill CUDA graphs left out"
            rows.append(f"| {gib} GiB | {kind} | {flags} | ~{e.pool_tokens:,} tokens ({pool_gb:.2f} GB{graphs}) | "
                        f"{e.context:,}{'' if plan.flags else ' (KV pool)'} |")
    return "\n".join(rows + [END])


def hub_table(speeds: dict[tuple[int, str], str] | None = None) -> str:
    """Per card: the checkpoint `./run_app.sh` names for it, its download, and the context and images the card
    gets with the flags the launcher fits; `speeds` (card GiB, repo) -> the measured speed, where there is one."""
    shape = reference_shape()
    rows = [HUB_BEGIN, "| card | checkpoint (`./run_app.sh --model ...`) | weights (download ~) | context | images | "
                       "expected speed |", "|---|---|---|---|---|---|"]
    for gib in CARDS_GIB:
        pick = hub_suggestion((f"{gib} GiB", gib * GiB)).checkpoint
        plan = fit(gib * GiB, pick.weights, shape.with_format(pick.fmt))
        pixels = next((json.loads(f.args[1])["max_pixels"] for f in plan.flags
                       if f.args[0] == "--mm-processor-kwargs"), shape.max_pixels)
        side = int(pixels ** 0.5)
        context = f"{plan.estimate.context:,} tokens" if plan.fits else "does not fit"
        speed = (MEASURED_SPEEDS if speeds is None else speeds).get((gib, pick.repo), SPEED_NOT_MEASURED)
        rows.append(f"| {gib} GiB | `{pick.repo}` ({pick.fmt.name}) | {pick.weights / GB:.1f} GB | {context} | "
                    f"up to {side}x{side} px each | {speed} |")
    return "\n".join(rows + [HUB_END])


def readme_table(text: str, begin: str = BEGIN, end: str = END) -> str:
    """The table between the markers in the README's text ('' when they are missing)."""
    if begin not in text or end not in text:
        return ""
    return text[text.index(begin):text.index(end) + len(end)]
