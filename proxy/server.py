"""Routes of the proxy: the page and its assets, the engine's health for the page, and the forwarded API.

| route                  | what                                                                    |
|------------------------|-------------------------------------------------------------------------|
| GET /, /chat.html      | the chat page (static/chat.html)                                        |
| GET /static/{file}     | the page's assets (no directory traversal: resolved inside static_dir)  |
| GET /api/health        | proxy alive; 200 {"engine": "ready"} or 503 + OpenAI error (why not)    |
| GET /api/page-config   | the page's limits (upload bytes) and which static/vendor/ libraries exist |
| GET /api/status        | /api/health's answer with status 200, for the page's polling             |
| GET /stats/blocks      | forwarded: the engine's GPU block map (the page's KV grid)               |
| GET /v1/models[/{id}], POST /v1/chat/completions, /v1/completions, /v1/responses, /tokenize,       |
| /detokenize, GET and DELETE /v1/responses/{id}: forwarded to the engine, streamed, API key added;     |
|                        | any other path is a 404 here (never forwarded)                          |
| GET /stats, /metrics, /version | forwarded to the engine on a pool of their own (never queued behind |
|                        | generations)                                                            |

Every request first passes proxy/guard.py (Host, Origin, JSON Content-Type). While the engine is down, answers
say whether the launcher is restarting it (proxy/engine_status.py).
"""
from __future__ import annotations

import asyncio
import logging
from urllib.parse import quote

import aiohttp
from aiohttp import web

from proxy.config import CONFIG, CONTROL_SESSION, OPEN_FORWARDS, SESSION, OpenForwards, ProxyConfig
from proxy.engine_status import engine_down_response, read_engine_status
from proxy.errors import error_response
from proxy.forward import end_open_forwards, forward
from proxy.page import add_page_routes
from proxy.guard import cors_signal, guard_middleware

log = logging.getLogger("proxy")


async def _client_session(app: web.Application):
    cfg = app[CONFIG]
    # No total or read timeout: a generation may legitimately stay silent for a long prefill.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout)
    # Generations hold a connection each for their whole stream: the pool is sized for everything the engine
    # runs and queues. The small routes get their own pool, so the page's KV panel never waits behind them.
    streams = aiohttp.TCPConnector(limit=cfg.max_upstream_connections)
    control = aiohttp.TCPConnector(limit=16)
    # auto_decompress=False with identity encoding keeps bytes flowing exactly as the engine wrote them.
    async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False, connector=streams) as session, \
            aiohttp.ClientSession(timeout=timeout, auto_decompress=False, connector=control) as control_session:
        app[SESSION] = session
        app[CONTROL_SESSION] = control_session
        yield


def _static_file(cfg: ProxyConfig, rel: str) -> web.StreamResponse:
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in rel):     # a NUL would make the file system raise
        return error_response(400, "the path holds a control character", "invalid_request_error",
                              code="invalid_path")
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
    session = request.app[CONTROL_SESSION]
    try:
        async with session.get(cfg.engine_url + "/health",
                               timeout=aiohttp.ClientTimeout(total=cfg.health_timeout)) as up:
            status = up.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        # Restarting or given up (the launcher says so), still loading the model, or listening but hung.
        return engine_down_response(cfg, for_page=True, timed_out=isinstance(exc, asyncio.TimeoutError))
    if status == 200:
        return web.json_response({"proxy": "ok", "engine": "ready"})
    if read_engine_status(cfg) is not None:          # up but still loading after a restart
        return engine_down_response(cfg, for_page=True)
    return error_response(503, f"The inference engine is not ready yet (its /health answered {status}); "
                               "it is probably still loading the model.", "service_unavailable",
                          code="engine_starting", extra={"proxy": "ok", "engine": "starting"})


async def forward_api(request: web.Request) -> web.StreamResponse:
    # The path sent upstream is the route's own, rebuilt here: never the client's spelling of it.
    return await _forward_generation(request, request.match_info.route.resource.canonical)


async def forward_model(request: web.Request) -> web.StreamResponse:
    return await _forward_generation(request, "/v1/models/" + quote(request.match_info["model"], safe=""))


async def _forward_generation(request: web.Request, upstream_path: str) -> web.StreamResponse:
    """Through the generations' pool, or 503 at once when every connection of it is taken: a request never
    waits inside the proxy without an answer (the pool holds all the engine runs and queues, so this is rare)."""
    cfg, forwards = request.app[CONFIG], request.app[OPEN_FORWARDS]
    if forwards.generations >= cfg.max_upstream_connections:
        log.warning("refused %s %s: all %d connections to the engine are in use", request.method, request.path,
                    cfg.max_upstream_connections)
        return error_response(503, f"The server is busy: all {cfg.max_upstream_connections} connections to the "
                                   "inference engine are in use (--max-upstream-connections); retry shortly.",
                              "service_unavailable", code="proxy_busy")
    forwards.generations += 1
    try:
        return await forward(request, upstream_path, request.app[SESSION])
    finally:
        forwards.generations -= 1


async def forward_response(request: web.Request) -> web.StreamResponse:
    return await _forward_generation(request, "/v1/responses/" + quote(request.match_info["response_id"], safe=""))


async def forward_control(request: web.Request) -> web.StreamResponse:
    return await forward(request, request.match_info.route.resource.canonical, request.app[CONTROL_SESSION])


# The engine routes the page and API clients use; nothing else is forwarded.
API_ROUTES = (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
              ("POST", "/v1/responses"), ("POST", "/tokenize"), ("POST", "/detokenize"))
CONTROL_ROUTES = ("/stats", "/stats/blocks", "/metrics", "/version")   # /stats/blocks: the page's KV grid


def create_app(cfg: ProxyConfig) -> web.Application:
    # Bodies are read and capped by forward.read_body (to answer 413 in OpenAI shape), so aiohttp's own
    # limit is set just above ours and never fires first.
    app = web.Application(client_max_size=cfg.max_upload_bytes + 1,
                          middlewares=[json_errors, guard_middleware(cfg.origin_policy)])
    app[CONFIG] = cfg
    app[OPEN_FORWARDS] = OpenForwards()
    app.cleanup_ctx.append(_client_session)
    app.on_shutdown.append(end_open_forwards)
    app.on_response_prepare.append(cors_signal(cfg.origin_policy))
    app.router.add_get("/", page)
    app.router.add_get("/chat.html", page)
    app.router.add_get("/static/{path:.+}", asset)
    app.router.add_get("/api/health", health)
    add_page_routes(app)
    for method, path in API_ROUTES:
        app.router.add_route(method, path, forward_api)
    app.router.add_get("/v1/models/{model}", forward_model)
    app.router.add_get("/v1/responses/{response_id}", forward_response)
    app.router.add_delete("/v1/responses/{response_id}", forward_response)
    for path in CONTROL_ROUTES:
        app.router.add_get(path, forward_control)
    return app


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """The router's 404 and 405 in the OpenAI error shape, as the engine answers them."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return error_response(404, f"no route {request.method} {request.path[:200]} on this server",
                              "invalid_request_error", code="not_found")
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        response = error_response(405, f"{request.method} is not allowed on {request.path[:200]}; use {allowed}",
                                  "invalid_request_error", code="method_not_allowed")
        response.headers["Allow"] = allowed
        return response
