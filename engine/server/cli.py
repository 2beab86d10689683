"""Command-line flags of `python -m engine`: the engine's vLLM flags (engine.args) plus the server's own.

ServerArgs declares each server flag once, with its default and help, as EngineArgs does; both become flags
through engine.args.add_cli_args. Only the standard library and engine.args are imported here, so `--help` and
flag errors answer at once, before torch is loaded.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from engine.args import EngineArgs, add_cli_args, api_key_from_env, flag, from_cli

# The per-run key the launcher gives the engine and the proxy (engine/server/auth.py): in the environment, never
# a flag, so that no other user reads it in `ps`.
PROXY_KEY_ENV = "LOCALCHAT_PROXY_KEY"


@dataclass(frozen=True)
class ServerArgs:
    host: str = flag("127.0.0.1", help="address to listen on (default %(default)s; 0.0.0.0 exposes the API to the "
                                       "network)")
    port: int = flag(3001)
    api_key: str | None = flag(None, help="require `Authorization: Bearer KEY` on every /v1 route (default: env "
                                          "VLLM_API_KEY)")
    log_file: str | None = flag(None, help="also append the log to this file, e.g. vllm.log")
    max_request_body_mb: float = flag(32.0, help="larger request bodies are refused with 413 (images travel inside "
                                                 "the body)")
    generation_config: str = flag("auto", help="default sampling parameters: 'auto' reads the model's "
                                               "generation_config.json, 'vllm' uses vLLM's defaults, or a directory "
                                               "holding a generation_config.json")
    disable_access_log: bool = flag(False, option="--disable-uvicorn-access-log",
                                    help="no access-log line per HTTP request")
    disable_log_requests: bool = flag(False, help="no log line per finished generation")
    load_status_file: str | None = flag(None, help="write start-up progress here as JSON (phase, progress 0..1) "
                                                   "until the server listens; the proxy's --engine-status-file reads "
                                                   "it to show 'Loading model… N%%'")
    enable_auto_tool_choice: bool = flag(False, help='let the model decide when to call tools (tool_choice "auto"); '
                                                     'needs --tool-call-parser')
    tool_call_parser: str | None = flag(None, choices=["hermes"],
                                        help="how the model writes tool calls: hermes (<tool_call>{json}</tool_call>, "
                                             "Qwen and Hermes)")
    reasoning_parser: str | None = flag(None, choices=["qwen3"],
                                        help="split a Thinking model's output at </think> into reasoning_content "
                                             "and content: qwen3 (<think>...</think>, Qwen3 and Qwen3-VL "
                                             "Thinking)")
    timeout_keep_alive: float = flag(5.0, help="seconds an idle connection, or one whose request headers have not "
                                               "all arrived, stays open (default %(default)s, uvicorn's and so "
                                               "vLLM's)")
    request_body_timeout: float = flag(60.0, help="seconds a request body may take to arrive; slower ones get 408 "
                                                  "(default %(default)s)")
    stream_write_timeout: float = flag(60.0, help="seconds a streamed response may wait for a client that stopped "
                                                  "reading; then the request is aborted and its KV blocks freed "
                                                  "(default %(default)s)")
    return_tokens_as_token_ids: bool = flag(False, help='logprobs name each token "token_id:N" (a request\'s '
                                                        'return_tokens_as_token_ids overrides it), for tokens that '
                                                        'are not valid text on their own')
    max_waiting_requests: int = flag(1024, help="requests queued for a running slot beyond which new ones get 503 "
                                                "with Retry-After (requests with a priority below 0 that carry the "
                                                "--api-key may exceed it; default %(default)s)")
    allow_anonymous_priority: bool = flag(False, help="accept a priority below 0 from clients without the --api-key "
                                                      "(they still meet --max-waiting-requests); by default it "
                                                      "needs the key")
    allowed_hosts: str = flag("", help="comma-separated host names besides localhost and IP addresses under which "
                                       "the API may be reached (DNS-rebinding guard; env LOCALCHAT_ALLOWED_HOSTS)")
    allowed_origins: str = flag("", help="comma-separated origins (https://example.com) whose pages may call the "
                                         "API from a browser, with CORS; '*' allows any (env "
                                         "LOCALCHAT_ALLOWED_ORIGINS; default none)")
    max_chat_messages: int = flag(4096, help="messages one chat request may hold; more are refused (413) before "
                                             "anything renders them (default %(default)s)")
    max_content_parts: int = flag(512, help="content parts one message may hold; more are refused (413) before "
                                            "anything renders them (default %(default)s)")
    max_stream_buffer_kb: int = flag(1024, help="KiB of output a stream may have waiting for a slow reader; past "
                                                "it the reader is cut off and the request aborted (default "
                                                "%(default)s)")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], not {self.port}")
        if self.max_request_body_mb <= 0:
            raise ValueError("--max-request-body-mb must be positive")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
        for name in ("timeout_keep_alive", "request_body_timeout", "stream_write_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.max_waiting_requests < 0:
            raise ValueError("--max-waiting-requests must be 0 or more")
        for name in ("max_chat_messages", "max_content_parts", "max_stream_buffer_kb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")

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
    add_cli_args(p.add_argument_group("server"), ServerArgs)
    return p


def parse_args(argv: list[str] | None = None) -> tuple[EngineArgs, ServerArgs]:
    parser = make_parser()
    ns = parser.parse_args(argv)
    ns.api_key = api_key_from_env(ns.api_key)
    ns.allowed_hosts = ns.allowed_hosts or os.environ.get("LOCALCHAT_ALLOWED_HOSTS", "")
    ns.allowed_origins = ns.allowed_origins or os.environ.get("LOCALCHAT_ALLOWED_ORIGINS", "")
    try:            # the dataclasses check ranges and combinations: a usage error, not a crash
        return EngineArgs.from_cli(ns), from_cli(ServerArgs, ns)
    except ValueError as e:
        parser.error(str(e))
