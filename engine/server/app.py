"""The aiohttp application: routes, middlewares and the small read-only routes.

| route                          | auth | answers                                                      |
|--------------------------------|------|--------------------------------------------------------------|
| GET  /health                   | no   | 200 "ok" while the engine loop runs, else 503 + error JSON   |
| GET  /v1/models[/{model}]      | key  | the served model (OpenAI list / model object)               |
| POST /v1/chat/completions      | key  | chat.completion, or SSE chunks with stream: true             |
| POST /v1/completions           | key  | text_completion, or SSE chunks with stream: true             |
| POST /v1/responses             | key  | a Response object, or its SSE events with stream: true       |
| GET, DELETE /v1/responses/{id} | key  | a stored response; delete it                                 |
| GET  /stats                    | no   | the engine's KV-block and scheduler counters, as JSON        |
| GET  /stats/blocks             | no   | the GPU block map and /stats of one moment (kv_map.py)       |
| GET  /metrics                  | no   | Prometheus text                                              |
| POST /tokenize, /detokenize    | no   | a prompt or chat messages -> token ids, and back (as vLLM)   |
| GET  /version                  | no   | {"version": ...}                                             |

auth: "key" routes need the --api-key when one is set. Started by the launcher (a proxy key in the environment,
auth.py), every route but /health needs a key. Every route first passes the Host/Origin guard (origin_policy.py).
"""
from __future__ import annotations

from dataclasses import asdict

from aiohttp import web

from engine import __version__
from engine.errors import EngineOverloadedError
from engine.server.auth import Keys, api_key_middleware
from engine.server.chat import create_chat_completion
from engine.server.cli import ServerArgs
from engine.server.completions import create_completion
from engine.server.errors import dumps, error_response
from engine.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from engine.server.metrics import render_metrics
from engine.server.middleware import access_log_middleware, cors_signal, error_middleware, origin_guard_middleware
from engine.server.origin_policy import OriginPolicy
from engine.server.request_body import BODY_TIMEOUT
from engine.server.responses import create_response, delete_response, retrieve_response
from engine.server.state import STATE, ServerState
from engine.server.tokenize import detokenize, tokenize

SHUTDOWN_GRACE_S = 5.0      # how long running generations may go on after SIGTERM/SIGINT


async def health(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    if engine.is_healthy:
        return web.Response(text="ok")
    reason = f": {engine.dead_error}" if engine.dead_error else ""
    return error_response(EngineOverloadedError(f"the engine loop is not running{reason}", code="engine_dead"))


def _model_card(state: ServerState) -> dict:
    # root is the served name, not vLLM's model path: the API must not hand out where files live on this machine.
    info = state.engine.model_info
    return {"id": state.served_model_name, "object": "model", "created": state.created, "owned_by": "localchat",
            "root": state.served_model_name, "parent": None, "max_model_len": state.max_model_len,
            "multimodal": info.multimodal, "demo_model": info.demo_model,
            # What the chat page needs to build requests the engine accepts, and to show the model's defaults.
            "max_images_per_prompt": info.max_images_per_prompt,
            "max_videos_per_prompt": info.max_videos_per_prompt if info.multimodal else 0,
            "video": info.video,
            "sampling_defaults": asdict(state.sampling_defaults)}


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[STATE])]}, dumps=dumps)


async def retrieve_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.check_model(request.match_info["model"])
    return web.json_response(_model_card(state), dumps=dumps)


async def stats(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    counters = engine.get_stats().counters
    return web.json_response({**counters, **engine.admission_stats(), "version": __version__}, dumps=dumps)


async def block_map(request: web.Request) -> web.Response:
    return web.json_response(await request.app[STATE].engine.get_block_map(), dumps=dumps)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    snapshot = state.engine.get_stats()
    text = render_metrics(snapshot.counters, state.metrics, state.served_model_name, snapshot.iteration_tokens)
    return web.Response(body=text.encode(), headers={"Content-Type": METRICS_CONTENT_TYPE})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__}, dumps=dumps)


ROUTES = [
    web.get("/health", health, allow_head=False),
    web.get("/v1/models", list_models, allow_head=False),
    web.get("/v1/models/{model:.+}", retrieve_model, allow_head=False),
    web.post("/v1/chat/completions", create_chat_completion),
    web.post("/v1/completions", create_completion),
    web.post("/v1/responses", create_response),
    web.get("/v1/responses/{response_id}", retrieve_response, allow_head=False),
    web.delete("/v1/responses/{response_id}", delete_response),
    web.post("/tokenize", tokenize),
    web.post("/detokenize", detokenize),
    web.get("/stats", stats, allow_head=False),
    web.get("/stats/blocks", block_map, allow_head=False),
    web.get("/metrics", metrics, allow_head=False),
    web.get("/version", version, allow_head=False),
]


def build_app(state: ServerState, args: ServerArgs, keys: Keys | None = None) -> web.Application:
    # The name it listens on is one it answers to (an address needs no listing).
    policy = OriginPolicy.from_lists(f"{args.allowed_hosts},{args.host}", args.allowed_origins)
    middlewares = [error_middleware(args.max_request_body_mb), origin_guard_middleware(policy),
                   api_key_middleware(keys or Keys(args.api_key))]
    if not args.disable_access_log:
        middlewares.insert(0, access_log_middleware())     # outermost: it sees the final status
    # client_max_size: aiohttp refuses larger bodies with 413 while reading them (turned into JSON above).
    app = web.Application(middlewares=middlewares, client_max_size=args.max_request_body_bytes)
    app.on_response_prepare.append(cors_signal(policy))
    app[STATE] = state
    app[BODY_TIMEOUT] = args.request_body_timeout
    app.add_routes(ROUTES)
    app.on_shutdown.append(_drain_generations)
    return app


async def _drain_generations(app: web.Application) -> None:
    await app[STATE].drain(SHUTDOWN_GRACE_S)


def route_table(app: web.Application) -> list[tuple[str, str]]:
    """(path, methods) for the start-up log, as vLLM lists its routes."""
    table: dict[str, set[str]] = {}
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource else {}
        path = info.get("path") or info.get("formatter") or "?"
        table.setdefault(path, set()).add(route.method)
    return [(path, ", ".join(sorted(methods))) for path, methods in table.items()]
