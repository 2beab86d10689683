"""Why the engine does not answer, from the two files written for the proxy; read only when the engine does not
answer, so they cost nothing while all is well:
- the engine's --load-status-file ({"pid", "phase", "progress", "time"}, engine/load_progress.py): how far its
  start has come; phase "ready" once it serves;
- the launcher's engine status file (app/supervision.py, EngineStatusFile): restarting after a crash (when, which
  restart, why) or given up after too many crashes.
Every 503 the proxy gives for a down engine comes from engine_down_response, so /api/status (the page's light)
and a refused chat request always say the same thing."""
from __future__ import annotations

import json
import math
import os
import time

from aiohttp import web

from proxy.config import ProxyConfig
from proxy.errors import engine_unavailable, error_response

# state in the file -> (the page's status word, the error code)
_STATES = {"restarting": ("restarting", "engine_restarting"), "failed": ("failed", "engine_failed")}


def read_engine_status(cfg: ProxyConfig) -> dict | None:
    if cfg.supervisor_status_file is None:
        return None
    try:
        status = json.loads(cfg.supervisor_status_file.read_text())
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) and status.get("state") in _STATES else None


def engine_loading(cfg: ProxyConfig) -> dict | None:
    """{"phase", "progress", "time"} (and, while the model downloads, "downloaded_bytes" and "total_bytes") of the
    process that writes the load status file (the engine, or the launcher downloading its model), while it is alive;
    None when there is no such file, it is unreadable, or its process is gone (a stale file)."""
    if cfg.engine_status_file is None:
        return None
    try:
        status = json.loads(cfg.engine_status_file.read_text())
        os.kill(int(status["pid"]), 0)
        loading = {"phase": str(status["phase"]), "progress": float(status["progress"]),
                   "time": float(status.get("time", 0.0))}
        if "total_bytes" in status:          # the launcher downloading the model (engine/load_progress.py)
            loading |= {"downloaded_bytes": int(status["downloaded_bytes"]), "total_bytes": int(status["total_bytes"])}
        return loading
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _page_fields(for_page: bool, state: str, **more) -> dict | None:
    return {"proxy": "ok", "engine": state, **more} if for_page else None


def loading_response(loading: dict, for_page: bool = True) -> web.Response:
    pct = int(100 * loading["progress"])
    download = {k: loading[k] for k in ("downloaded_bytes", "total_bytes") if k in loading}
    if download:
        done, total = download["downloaded_bytes"], download["total_bytes"]
        scale, unit = (1e9, "GB") if total >= 1e9 else (1e6, "MB")
        message = (f"The model is downloading ({pct}%, {done / scale:.1f} of {total / scale:.1f} {unit}); the "
                   f"engine starts after it.")
    else:
        message = f"The inference engine is loading the model ({loading['phase']}, {pct}%)."
    return error_response(503, message, "service_unavailable", code="engine_starting",
                          extra=_page_fields(for_page, "starting", phase=loading["phase"],
                                             progress=loading["progress"], **download))


def unresponsive_response(for_page: bool) -> web.Response:
    return error_response(503, "The inference engine is running but does not respond (its /health did not answer "
                               "in time): it may be hung; see vllm.log, and restart the app if this lasts.",
                          "service_unavailable", code="engine_unresponsive",
                          extra=_page_fields(for_page, "unresponsive"))


def _restarting(status: dict, loading: dict | None, now: float) -> tuple[str, float | None]:
    """The launcher's word as of now (a countdown, then how far the new engine's start has come), and the new
    engine's load progress once it loads. Files from a launcher that writes only a message are shown as they are."""
    if "restart_at" not in status:
        return str(status.get("message") or "The inference engine is restarting."), None
    head = f"The inference engine {status.get('crash', 'stopped')}"
    which = f"restart {status.get('restart', '?')} of at most {status.get('max_restarts', '?')}"
    tail = f" See {status['log']}." if status.get("log") else ""
    left = float(status["restart_at"]) - now
    if left > 0:
        return f"{head}; restarting it in {math.ceil(left)}s ({which}).{tail}", None
    if loading is not None and loading["time"] >= float(status["restart_at"]) - 1:
        pct = int(100 * loading["progress"])
        return f"{head}; {which}: loading the model ({loading['phase']}, {pct}%).{tail}", loading["progress"]
    return f"{head}; {which} began {int(-left)}s ago.{tail}", None


def engine_down_response(cfg: ProxyConfig, for_page: bool = False, timed_out: bool = False) -> web.Response:
    """503 for an engine that does not answer: restarting or failed (as the launcher says), loading, hung (it
    started but `timed_out` answering), else unreachable."""
    status = read_engine_status(cfg)
    loading = engine_loading(cfg)
    if status is None:
        if loading is not None and loading["phase"] != "ready":
            return loading_response(loading, for_page)
        if timed_out:
            return unresponsive_response(for_page)
        return engine_unavailable(cfg.engine_url, extra=_page_fields(for_page, "unreachable"))
    word, code = _STATES[status["state"]]
    if word == "restarting":
        message, progress = _restarting(status, loading, time.time())
        more = {} if progress is None else {"progress": progress}
    else:
        message, more = str(status.get("message") or f"The inference engine is {word}."), {}
    response = error_response(503, message, "service_unavailable", code=code,
                              extra=_page_fields(for_page, word, **more))
    if word == "restarting":
        response.headers["Retry-After"] = str(max(1, int(status.get("retry_after_s", 5))))
    return response
