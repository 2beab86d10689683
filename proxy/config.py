"""The proxy's settings and the keys under which the app keeps them."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from engine.server.origin_policy import OriginPolicy

# The engine's default --max-num-seqs (256) plus its default --max-waiting-requests (1024), and room for the
# streams that are ending: past this, requests would queue inside the proxy instead of being answered.
DEFAULT_MAX_UPSTREAM_CONNECTIONS = 256 + 1024 + 64


@dataclass(frozen=True)
class ProxyConfig:
    engine_url: str                  # e.g. http://127.0.0.1:3001, no trailing slash
    static_dir: Path
    api_key: str | None = None       # sent upstream as a Bearer token; never given to the page
    max_upload_bytes: int = 20 << 20
    connect_timeout: float = 5.0     # seconds to open a connection to the engine
    health_timeout: float = 3.0      # seconds for the engine's /health to answer
    engine_status_file: Path | None = None   # the engine's --load-status-file: how far its start has come
    body_timeout: float = 60.0       # seconds a request body may take to arrive (408 after)
    write_timeout: float = 60.0      # seconds one write may wait for a browser that stopped reading
    max_upstream_connections: int = DEFAULT_MAX_UPSTREAM_CONNECTIONS
    origin_policy: OriginPolicy = field(default_factory=OriginPolicy)
    supervisor_status_file: Path | None = None   # the launcher's word on the engine (restarting, failed)


CONFIG = web.AppKey("config", ProxyConfig)
SESSION = web.AppKey("session", aiohttp.ClientSession)                   # generations: a large pool
CONTROL_SESSION = web.AppKey("control_session", aiohttp.ClientSession)   # /health, /stats...: never behind them


@dataclass
class OpenForwards:
    """The requests being forwarded now, so that a stop can end each one with a word (proxy/forward.py)."""
    tasks: set[asyncio.Task] = field(default_factory=set)
    stopping: bool = False
    generations: int = 0         # forwards holding (or waiting for) a connection of the generations' pool


OPEN_FORWARDS = web.AppKey("open_forwards", OpenForwards)
