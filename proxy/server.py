"""Routes of the proxy: the page and its assets, the engine's health for the page, and the forwarded API.

| route                  | what                                                                    |
|------------------------|-------------------------------------------------------------------------|
| GET /, /chat.html      | the chat page (static/chat.html)                                        |
| GET /static/{file}     | the page's assets (no directory traversal: resolved inside static_dir)  |
| GET /api/health        | proxy alive; 200 {"engine": "ready"} or 503 + OpenAI error (why not)    |
| GET /api/page-config   | the page's limits (upload bytes) and which static/vendor/ libraries exist |
| GET /api/status        | /api/health's answer with status 200, for the page's polling             |
| GET /stats/blocks      | forwarded: the engine's GPU block map (the page's KV grid)               |
| * /v1/{...}            | forwarded to the engine, streamed, API key added                        |
| GET /stats, /metrics, /version | forwarded to the engine                                         |
"""
from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from proxy.config import CONFIG, SESSION, ProxyConfig
from proxy.errors import engine_unavailable, error_response
from proxy.forward import forward
from proxy.page import add_page_routes, engine_loading, loading_response

log = logging.getLogger("proxy")


async def _client_session(app: web.Application):
    cfg = app[CONFIG]
    # No total or read timeout: a generation may legitimately stay silent for a long prefill.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout)
    # auto_decompress=False with identity encoding keeps bytes flowing exactly as the engine wrote them.
    async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
        app[SESSION] = session
        yield


def _static_file(cfg: ProxyConfig, rel: str) -> web.StreamResponse:
    root = cfg.static_dir.resolve()
    target = (root / rel).resolve()
    if not target.is_relative_to(root) or not target.is_file():
        raise web.HTTPNotFound(text="not found")
    # no-cache: the browser revalidates, so an updated page is picked up without a hard reload.
    return web.FileResponse(target, headers={"Cache-Control": "no-cache"})


async def page(request: web.Request) -> web.StreamResponse:
    return _static_file(request.app[CONFIG], "chat.html")


async def asset(request: web.Request) -> web.StreamResponse:
    return _static_file(request.app[CONFIG], request.match_info["path"])


async def health(request: web.Request) -> web.Response:
    """The page's status light: is the engine up and ready to serve?"""
    cfg = request.app[CONFIG]
    session = request.app[SESSION]
    try:
        async with session.get(cfg.engine_url + "/health",
                               timeout=aiohttp.ClientTimeout(total=cfg.health_timeout)) as up:
            status = up.status
    except (aiohttp.ClientError, asyncio.TimeoutError):
        loading = engine_loading(cfg)     # not listening yet: is it still loading the model?
        if loading is not None:
            return loading_response(loading)
        return engine_unavailable(cfg.engine_url, extra={"proxy": "ok", "engine": "unreachable"})
    if status == 200:
        return web.json_response({"proxy": "ok", "engine": "ready"})
    return error_response(503, f"The inference engine is not ready yet (its /health answered {status}); "
                               "it is probably still loading the model.", "service_unavailable",
                          code="engine_starting", extra={"proxy": "ok", "engine": "starting"})


async def forward_engine(request: web.Request) -> web.StreamResponse:
    return await forward(request)


def create_app(cfg: ProxyConfig) -> web.Application:
    # Bodies are read and capped by forward.read_body (to answer 413 in OpenAI shape), so aiohttp's own
    # limit is set just above ours and never fires first.
    app = web.Application(client_max_size=cfg.max_upload_bytes + 1)
    app[CONFIG] = cfg
    app.cleanup_ctx.append(_client_session)
    app.router.add_get("/", page)
    app.router.add_get("/chat.html", page)
    app.router.add_get("/static/{path:.+}", asset)
    app.router.add_get("/api/health", health)
    add_page_routes(app)
    app.router.add_route("*", "/v1/{tail:.*}", forward_engine)
    for path in ("/stats", "/metrics", "/version"):
        app.router.add_get(path, forward_engine)
    return app
