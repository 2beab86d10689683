"""Start-up and shutdown of `python -m engine`: flags, log file, the engine (model load, KV pool), then the
socket. The port is bound only once the engine is ready, so a 200 from /health always means "serving"; SIGINT
and SIGTERM stop accepting, give in-flight responses a few seconds, then stop the engine loop."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
from dataclasses import MISSING, Field, fields

from aiohttp import web

from engine import __version__, load_progress
from engine.args import EngineArgs
from engine.errors import ModelLoadError
from engine.logger import add_log_file, init_logger
from engine.server.auth import Keys
from engine.server.cli import ServerArgs, parse_args

logger = init_logger(__name__)

LISTEN_BACKLOG = 2048


def run(argv: list[str] | None = None) -> None:
    engine_args, server_args = parse_args(argv)
    keys = Keys.from_env(server_args.api_key)       # before any worker process could inherit the proxy key
    if server_args.log_file:
        add_log_file(server_args.log_file)
    logger.info("engine server version %s", __version__)
    logger.info("non-default args: %s", _describe_args(engine_args, server_args))
    load_progress.start(server_args.load_status_file)

    from engine.async_llm import AsyncLLM            # torch and the model code: only after the flags are good
    from engine.server.app import build_app
    from engine.server.defaults import load_sampling_defaults
    from engine.server.request_body import BodyLimits
    from engine.server.state import ServerState

    try:
        engine = AsyncLLM(engine_args, max_waiting=server_args.max_waiting_requests)
    except ModelLoadError as e:
        logger.error("cannot load the model: %s", e.message)
        sys.exit(1)
    load_progress.report("starting the server", 0.97)
    defaults = load_sampling_defaults(engine_args.model, server_args.generation_config)
    state = ServerState(engine=engine, served_model_name=engine.model_name, model_path=engine_args.model,
                        sampling_defaults=defaults, log_requests=not server_args.disable_log_requests,
                        auto_tool_choice=server_args.enable_auto_tool_choice,
                        reasoning_parser=server_args.reasoning_parser,
                        stream_write_timeout=server_args.stream_write_timeout,
                        stream_buffer_bytes=server_args.max_stream_buffer_kb << 10,
                        allow_anonymous_priority=server_args.allow_anonymous_priority,
                        body_limits=BodyLimits(server_args.max_chat_messages, server_args.max_content_parts,
                                               engine.model_info.max_images_per_prompt,
                                               engine.model_info.max_videos_per_prompt),
                        return_tokens_as_token_ids=server_args.return_tokens_as_token_ids)
    try:
        code = asyncio.run(_serve(build_app(state, server_args, keys), server_args))
    finally:
        engine.shutdown()
    sys.exit(code)


async def _serve(app: web.Application, args: ServerArgs) -> int:
    from engine.server.app import route_table

    # handler_cancellation: when a client disconnects, aiohttp cancels its handler at once, which closes the
    # engine's output iterator and aborts the request, even while it is still waiting for its first token.
    # Running generations get their grace period from the app's on_shutdown hook (ServerState.drain).
    # keepalive_timeout also closes a connection whose request headers never finish (aiohttp arms it when the
    # connection opens); lingering_time bounds how long an unread body is drained after an early answer (408).
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0,
                           keepalive_timeout=args.timeout_keep_alive, lingering_time=1.0)
    await runner.setup()
    try:
        # backlog: a burst of clients (hundreds of streams opening at once) waits in the kernel, not refused.
        await web.TCPSite(runner, args.host, args.port, reuse_address=True, backlog=LISTEN_BACKLOG).start()
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", args.host, args.port, e.strerror or e)
        await runner.cleanup()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    logger.info("Available routes are:")
    for path, methods in route_table(app):
        logger.info("Route: %s, Methods: %s", path, methods)
    load_progress.report("ready", 1.0)
    logger.info("Started server process [%d]", os.getpid())
    logger.info("Serving on %s (Press CTRL+C to quit)", args.url)
    await stop.wait()
    for sig in (signal.SIGINT, signal.SIGTERM):     # a second Ctrl-C stops at once, without the grace period
        loop.remove_signal_handler(sig)
    logger.info("Shutting down")
    await runner.cleanup()
    return 0


def _describe_args(engine_args: EngineArgs, server_args: ServerArgs) -> dict:
    """The model and the flags that differ from their defaults, for the start-up log; the API key itself is
    never logged."""
    changed = {f.name: getattr(args, f.name) for args in (engine_args, server_args) for f in fields(args)
               if f.name == "model" or getattr(args, f.name) != _default(f)}
    if "api_key" in changed:
        changed["api_key"] = "(set)"
    return changed


def _default(f: Field):
    return f.default_factory() if f.default_factory is not MISSING else f.default
