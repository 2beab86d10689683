#!/usr/bin/env bash
# Start the engine (vllm.log) and then the chat proxy (proxy.log), in the foreground: Ctrl-C stops both.
#   ./start_all.sh [--model PATH] [--detach] [engine flags, e.g. --block-size 16 --swap-space 4]
#   ./start_all.sh stop      stop a running app (also one started with --detach or in another terminal)
#   ./start_all.sh status    pids, engine health, KV block usage
# Ports: ENGINE_PORT (3001), PROXY_PORT (8000). The work is done by `python -m app` (app/launcher.py).
set -euo pipefail
cd "$(dirname "$0")"
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
case "${1:-}" in
  stop|status) exec "$PY" -m app "$@" ;;
  start) shift ;;
esac
exec "$PY" -m app start "$@"
