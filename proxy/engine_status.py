"""What the launcher says about the engine while it cannot answer for itself: restarting after a crash (and
why), or given up after too many crashes. The launcher writes a small JSON file (app/launcher.py,
EngineStatus); the proxy reads it only when the engine does not answer, so it costs nothing while all is well."""
from __future__ import annotations

import json

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


def engine_down_response(cfg: ProxyConfig, for_page: bool = False) -> web.Response:
    """503 for an engine that does not answer: restarting or failed (as the launcher says), else unreachable."""
    status = read_engine_status(cfg)
    if status is None:
        return engine_unavailable(cfg.engine_url, extra={"proxy": "ok", "engine": "unreachable"} if for_page else None)
    word, code = _STATES[status["state"]]
    message = str(status.get("message") or f"The inference engine is {word}.")
    response = error_response(503, message, "service_unavailable", code=code,
                              extra={"proxy": "ok", "engine": word} if for_page else None)
    if word == "restarting":
        response.headers["Retry-After"] = str(max(1, int(status.get("retry_after_s", 5))))
    return response
