"""Command-line flags of `python -m engine`: the engine's vLLM flags (engine.args) plus the server's own.

Only the standard library and engine.args are imported here, so `--help` and flag errors answer at once,
before torch is loaded.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine.args import EngineArgs, add_cli_args, api_key_from_env

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 3001
DEFAULT_MAX_REQUEST_BODY_MB = 32.0
DEFAULT_TIMEOUT_KEEP_ALIVE = 5.0        # uvicorn's (and so vLLM's) default
DEFAULT_REQUEST_BODY_TIMEOUT = 60.0
DEFAULT_STREAM_WRITE_TIMEOUT = 60.0
DEFAULT_MAX_WAITING_REQUESTS = 1024


@dataclass(frozen=True)
class ServerArgs:
    host: str
    port: int
    api_key: str | None
    log_file: str | None
    max_request_body_mb: float
    generation_config: str           # "auto" (the model's generation_config.json), "vllm", or a directory
    disable_access_log: bool
    disable_log_requests: bool
    load_status_file: str | None = None     # where engine.load_progress reports how far the start has come
    enable_auto_tool_choice: bool = False     # tool_choice "auto": parse the model's tool calls
    tool_call_parser: str | None = None
    timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE          # idle connection, and headers, in seconds
    request_body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT      # a whole request body, in seconds
    stream_write_timeout: float = DEFAULT_STREAM_WRITE_TIMEOUT      # one SSE write to a stalled reader, seconds
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS        # queued (not yet running); past it: 503

    @property
    def max_request_body_bytes(self) -> int:
        return int(self.max_request_body_mb * 1024 * 1024)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m engine",
        description="OpenAI-compatible server on the paged-KV engine (flags named as in `vllm serve`).")
    add_cli_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to listen on (default {DEFAULT_HOST}; 0.0.0.0 exposes the API to the network)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT)
    s.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every /v1 route (default: env VLLM_API_KEY)")
    s.add_argument("--log-file", default=None, help="also append the log to this file, e.g. vllm.log")
    s.add_argument("--max-request-body-mb", type=float, default=DEFAULT_MAX_REQUEST_BODY_MB,
                   help="larger request bodies are refused with 413 (images travel inside the body)")
    s.add_argument("--generation-config", default="auto",
                   help="default sampling parameters: 'auto' reads the model's generation_config.json, 'vllm' "
                        "uses vLLM's defaults, or a directory holding a generation_config.json")
    s.add_argument("--disable-uvicorn-access-log", dest="disable_access_log", action="store_true",
                   help="no access-log line per HTTP request")
    s.add_argument("--disable-log-requests", action="store_true", help="no log line per finished generation")
    s.add_argument("--load-status-file", default=None,
                   help="write start-up progress here as JSON (phase, progress 0..1) until the server listens; "
                        "the proxy's --engine-status-file reads it to show 'Loading model… N%%'")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    s.add_argument("--tool-call-parser", choices=["hermes"], default=None,
                   help="how the model writes tool calls: hermes (<tool_call>{json}</tool_call>, Qwen and Hermes)")
    s.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_TIMEOUT_KEEP_ALIVE,
                   help="seconds an idle connection, or one whose request headers have not all arrived, stays "
                        "open (default %(default)s)")
    s.add_argument("--request-body-timeout", type=float, default=DEFAULT_REQUEST_BODY_TIMEOUT,
                   help="seconds a request body may take to arrive; slower ones get 408 (default %(default)s)")
    s.add_argument("--stream-write-timeout", type=float, default=DEFAULT_STREAM_WRITE_TIMEOUT,
                   help="seconds a streamed response may wait for a client that stopped reading; then the "
                        "request is aborted and its KV blocks freed (default %(default)s)")
    s.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                   help="requests queued for a running slot beyond which new ones get 503 with Retry-After "
                        "(requests with a priority below 0 may exceed it; default %(default)s)")
    return p


def parse_args(argv: list[str] | None = None) -> tuple[EngineArgs, ServerArgs]:
    parser = make_parser()
    ns = parser.parse_args(argv)
    if not 0 <= ns.port <= 65535:
        parser.error(f"--port must be in [0, 65535], not {ns.port}")
    if ns.max_request_body_mb <= 0:
        parser.error("--max-request-body-mb must be positive")
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
    for flag in ("timeout_keep_alive", "request_body_timeout", "stream_write_timeout"):
        if getattr(ns, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive")
    if ns.max_waiting_requests < 0:
        parser.error("--max-waiting-requests must be 0 or more")
    try:
        engine_args = EngineArgs.from_cli(ns)
    except ValueError as e:            # EngineArgs checks ranges and choices: a usage error, not a crash
        parser.error(str(e))
    server_args = ServerArgs(
        host=ns.host, port=ns.port, api_key=api_key_from_env(ns.api_key), log_file=ns.log_file,
        max_request_body_mb=ns.max_request_body_mb, generation_config=ns.generation_config,
        disable_access_log=ns.disable_access_log, disable_log_requests=ns.disable_log_requests,
        load_status_file=ns.load_status_file, enable_auto_tool_choice=ns.enable_auto_tool_choice,
        tool_call_parser=ns.tool_call_parser,
        timeout_keep_alive=ns.timeout_keep_alive, request_body_timeout=ns.request_body_timeout,
        stream_write_timeout=ns.stream_write_timeout, max_waiting_requests=ns.max_waiting_requests)
    return engine_args, server_args
