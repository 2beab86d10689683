"""`python -m proxy --port 8000 --engine-url http://127.0.0.1:3001`: the chat page and API in front of the engine."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from aiohttp import web

from proxy.config import DEFAULT_MAX_UPSTREAM_CONNECTIONS, ProxyConfig
from engine.server.origin_policy import OriginPolicy
from proxy.server import create_app

REPO = Path(__file__).resolve().parent.parent
# The same line shape as vllm.log, so both logs read alike: `INFO 01-24 10:23:42 [server.py:57] message`.
LOG_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
ACCESS_FORMAT = '%a "%r" %s %b %Tfs "%{User-Agent}i"'


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m proxy", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                   "only; 0.0.0.0 exposes the chat and the engine's API, with its key, to the network)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--engine-url", default="http://127.0.0.1:3001", help="where `python -m engine` listens")
    p.add_argument("--static-dir", type=Path, default=REPO / "static", help="folder holding chat.html")
    p.add_argument("--api-key-file", type=Path, help="file holding the engine's API key (else env "
                   "ENGINE_API_KEY, else VLLM_API_KEY); sent upstream, never to the browser")
    p.add_argument("--max-upload-mb", type=float, default=20.0, help="largest request body accepted (images "
                   "travel inside it as data URLs); larger bodies get 413")
    p.add_argument("--engine-status-file", type=Path, help="the engine's --load-status-file: while the engine "
                   "loads, /api/health says how far it has come (the page shows 'Loading model… N%%')")
    p.add_argument("--log-file", type=Path, help="append log and access lines here instead of stderr")
    p.add_argument("--allowed-hosts", default=os.environ.get("LOCALCHAT_ALLOWED_HOSTS", ""),
                   help="comma-separated host names besides localhost and IP addresses under which the page and "
                        "API may be reached (DNS-rebinding guard; env LOCALCHAT_ALLOWED_HOSTS)")
    p.add_argument("--allowed-origins", default=os.environ.get("LOCALCHAT_ALLOWED_ORIGINS", ""),
                   help="comma-separated origins (https://example.com) whose pages may call the API from a "
                        "browser, with CORS; '*' allows any (env LOCALCHAT_ALLOWED_ORIGINS; default none)")
    p.add_argument("--timeout-keep-alive", type=float, default=15.0, help="seconds an idle connection, or one "
                   "whose request headers have not all arrived, stays open (default %(default)s)")
    p.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request body may take to arrive; slower ones get 408 (default %(default)s)")
    p.add_argument("--write-timeout", type=float, default=60.0, help="seconds a response may wait for a "
                   "browser that stopped reading before the request is dropped (default %(default)s)")
    p.add_argument("--max-upstream-connections", type=int, default=DEFAULT_MAX_UPSTREAM_CONNECTIONS,
                   help="connections to the engine for generations: its --max-num-seqs plus its "
                        "--max-waiting-requests and some room (default %(default)s; the launcher computes it "
                        "from the engine flags it passes)")
    p.add_argument("--supervisor-status-file", type=Path, help="JSON file where the launcher says the engine is "
                   "restarting or failed; read when the engine does not answer")
    return p.parse_args(argv)


def load_api_key(key_file: Path | None) -> str | None:
    if key_file is not None:
        return key_file.read_text().strip() or None
    return os.environ.get("ENGINE_API_KEY") or os.environ.get("VLLM_API_KEY") or None


def setup_logging(log_file: Path | None) -> None:
    handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.log_file)
    static_dir = args.static_dir.resolve()
    if not (static_dir / "chat.html").is_file():
        sys.exit(f"proxy: {static_dir}/chat.html not found (--static-dir)")
    cfg = ProxyConfig(engine_url=args.engine_url.rstrip("/"), static_dir=static_dir,
                      api_key=load_api_key(args.api_key_file),
                      max_upload_bytes=int(args.max_upload_mb * (1 << 20)), body_timeout=args.body_timeout,
                      write_timeout=args.write_timeout, max_upstream_connections=args.max_upstream_connections,
                      engine_status_file=args.engine_status_file,
                      supervisor_status_file=args.supervisor_status_file,
                      origin_policy=OriginPolicy.from_lists(f"{args.allowed_hosts},{args.host}",
                                                            args.allowed_origins))
    log = logging.getLogger("proxy")
    log.info("proxy on http://%s:%d -> engine %s (api key %s, upload limit %g MB)", args.host, args.port,
             cfg.engine_url, "set" if cfg.api_key else "not set", args.max_upload_mb)
    # handler_cancellation: a browser that disconnects cancels its handler at once, which closes the upstream
    # request (see forward.py); shutdown_timeout: open streams must not hold a stop for a minute.
    # keepalive_timeout also closes a connection whose headers never finish; lingering_time bounds the reading
    # of a body nobody will use (after a 408 or 413); backlog: a burst of clients waits, not refused.
    web.run_app(create_app(cfg), host=args.host, port=args.port, access_log=logging.getLogger("proxy.access"),
                access_log_format=ACCESS_FORMAT, handler_cancellation=True, shutdown_timeout=2.0,
                keepalive_timeout=args.timeout_keep_alive, lingering_time=1.0, backlog=2048, print=None)


if __name__ == "__main__":
    main()
