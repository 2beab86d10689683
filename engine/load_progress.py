"""How far `python -m engine` has come in starting, for whoever waits on it (the proxy shows it as "Loading
model… N%"): a small JSON file, {"pid", "phase", "progress" (0..1), "time"}, rewritten whole (a rename, so a
reader never sees half of it) and at most every REPORT_INTERVAL_S unless the phase changes. No file is written
unless `--load-status-file` names one. Standard library only: it runs before torch is imported.

Before the engine starts, the launcher writes the same file while it downloads the model from the Hub (app/hub.py):
phase "downloading" with "downloaded_bytes" and "total_bytes" (`downloading`); the engine's first report replaces it.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

REPORT_INTERVAL_S = 0.25

# The share of the start each phase ends at; weights fill the span before "weights loaded".
WEIGHTS_START, WEIGHTS_END = 0.05, 0.85

_path: Path | None = None
_last: tuple[str, float] = ("", 0.0)


def start(path: str | None) -> None:
    global _path
    _path = Path(path) if path else None
    report("starting", 0.0)


def report(phase: str, progress: float, **detail: int) -> None:
    global _last
    if _path is None:
        return
    now = time.monotonic()
    if phase == _last[0] and now - _last[1] < REPORT_INTERVAL_S and progress < 1.0:
        return
    _last = (phase, now)
    body = {"pid": os.getpid(), "phase": phase, "progress": round(max(0.0, min(1.0, progress)), 4),
            "time": time.time(), **detail}
    tmp = _path.with_name(_path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(body))
        os.replace(tmp, _path)
    except OSError:
        pass            # progress is a courtesy: a read-only or vanished directory must not stop the engine


def weights(done: int, total: int) -> None:
    report("loading weights", WEIGHTS_START + (WEIGHTS_END - WEIGHTS_START) * min(1.0, done / max(1, total)))


def downloading(done: int, total: int) -> None:
    report("downloading", done / max(1, total), downloaded_bytes=done, total_bytes=total)
