"""The README's "Flags per card" table, written by app/fit.py's own function: what the launcher adds on 8, 12,
16 and 24 GiB cards for each kind of Qwen3-VL-8B checkpoint (tests/test_app_fit.py checks that the README holds
exactly this table).

    python -m app.fit --table
"""
from __future__ import annotations

import json
import shlex

from app.checkpoints import BF16, GB, GiB, REFERENCE_CONFIG, WeightFormat, weight_bytes
from app.fit import MIN_CONTEXT, fit
from app.memory_estimate import ModelShape

CARDS_GIB = (8, 12, 16, 24)
KINDS = (("bf16", BF16), ("FP8 (128x128 blocks)", WeightFormat("fp8", 8, block=(128, 128))),
         ("4-bit (AWQ, GPTQ, W4A16; group 128)", WeightFormat("int4 g128", 4, 128)))
BEGIN, END = "<!-- fit-table: begin (python -m app.fit --table) -->", "<!-- fit-table: end -->"


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


def readme_table(text: str) -> str:
    """The table between the markers in the README's text ('' when they are missing)."""
    if BEGIN not in text or END not in text:
        return ""
    return text[text.index(BEGIN):text.index(END) + len(END)]
