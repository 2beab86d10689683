"""The proxy's settings and the keys under which the app keeps them."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web


@dataclass(frozen=True)
class ProxyConfig:
    engine_url: str                  # e.g. http://127.0.0.1:3001, no trailing slash
    static_dir: Path
    api_key: str | None = None       # sent upstream as a Bearer token; never given to the page
    max_upload_bytes: int = 20 << 20
    connect_timeout: float = 5.0     # seconds to open a connection to the engine
    health_timeout: float = 3.0      # seconds for the engine's /health to answer
    engine_status_file: Path | None = None   # the engine's --load-status-file: how far its start has come


CONFIG = web.AppKey("config", ProxyConfig)
SESSION = web.AppKey("session", aiohttp.ClientSession)
