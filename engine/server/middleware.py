"""Middlewares around every route: the access log (outermost) and the conversion of every error into the OpenAI
JSON shape, so that no client ever sees aiohttp's plain-text 404/405/413 pages or a traceback."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from engine.errors import EngineError, PayloadTooLargeError
from engine.logger import init_logger
from engine.server.errors import MethodNotAllowedError, NotFoundError, error_response
from engine.server.origin_policy import OriginPolicy, check_request, preflight_headers, response_cors

logger = init_logger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# nginx's code for "the client closed the connection before the response was complete".
STATUS_CLIENT_CLOSED = 499


def access_log_middleware() -> Callable:
    """One line per request, in the engine log's format: who, what, the status, how long (a stream's whole
    duration, since the handler returns only when the stream ends)."""
    @web.middleware
    async def access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
        start = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except (asyncio.CancelledError, ConnectionResetError):   # the client went away mid-request
            status = STATUS_CLIENT_CLOSED
            raise
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            logger.info('%s "%s %s HTTP/%d.%d" %d %.1fms', request.remote, request.method, request.path_qs,
                        request.version.major, request.version.minor, status,
                        (time.perf_counter() - start) * 1000)
    return access_log


def origin_guard_middleware(policy: OriginPolicy) -> Callable:
    """The proxy's rules (origin_policy.py) at the engine's own port: a page on a rebound or foreign name gets 403,
    a lax Host or request target 400; a preflight from an origin given with --allowed-origins is answered."""
    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        preflight = preflight_headers(request.method, origin, policy)
        if preflight is not None:
            return web.Response(status=204, headers=preflight)
        refused = check_request(request.raw_path, request.headers.get("Host"), origin, request.scheme, policy,
                                "engine")
        if refused is not None:
            err = EngineError(refused.message, code=refused.code)
            err.status = refused.status
            err.err_type = "forbidden" if refused.status == 403 else "invalid_request_error"
            raise err
        return await handler(request)
    return guard


def cors_signal(policy: OriginPolicy) -> Callable:
    """on_response_prepare: CORS headers for a listed origin, also on streams."""
    async def add_cors(request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(response_cors(request.headers.get("Origin"), request.host, request.scheme, policy))
    return add_cors


def error_middleware(max_request_body_mb: float) -> Callable:
    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except EngineError as err:
            return error_response(err)
        except web.HTTPException as exc:
            if exc.status < 400:               # redirects and the like pass through
                raise
            response = error_response(_from_http_exception(request, exc, max_request_body_mb))
            if isinstance(exc, web.HTTPMethodNotAllowed):
                response.headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
            return response
        except (asyncio.CancelledError, ConnectionResetError):   # the client left; nobody to answer
            raise
        except Exception as exc:  # noqa: BLE001 - a bug must still produce a JSON error, and a log line
            logger.exception("unhandled error in %s %s", request.method, request.path)
            return error_response(EngineError(f"internal server error ({type(exc).__name__}: {exc}); see the "
                                              f"server log", code="internal_error"))
    return errors


def _from_http_exception(request: web.Request, exc: web.HTTPException, limit_mb: float) -> EngineError:
    """aiohttp's own errors (router, body size) with messages that say what to do instead."""
    if exc.status == 404:
        return NotFoundError(f"no route {request.method} {request.path}; the API is GET /v1/models, "
                             f"POST /v1/chat/completions, POST /v1/completions (and GET /health, /stats, "
                             f"/metrics, /version, POST /tokenize, /detokenize)", code="not_found")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return MethodNotAllowedError(f"{request.method} is not allowed on {request.path}; use {allowed}",
                                     code="method_not_allowed")
    if exc.status == 413:
        return PayloadTooLargeError(f"the request body is over the limit of {limit_mb:g} MB "
                                    f"(--max-request-body-mb); send smaller or fewer images",
                                    code="request_too_large")
    err = EngineError(exc.reason or exc.text or f"HTTP {exc.status}", code=None)
    err.status = exc.status
    err.err_type = "invalid_request_error" if exc.status < 500 else "internal_error"
    return err
