#!/usr/bin/env bash
# The test entry, for CI (a fresh Debian machine, as root, no GPU) and by hand:
#   ./run_tests.sh [pytest args]        e.g. ./run_tests.sh tests/test_proxy.py -x    or    ./run_tests.sh -m browser
# Installs Debian's Chromium (the browser tests drive it through Playwright; Playwright's own browser download
# does not work offline), sets up .venv as run_app.sh does plus the test extras, then runs pytest.
set -euo pipefail
cd "$(dirname "$0")"
log() { echo "[run_tests] $*"; }

if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null 2>&1; then SUDO=sudo; else SUDO=none; fi
if [ ! -x /usr/bin/chromium ]; then
  if [ "$SUDO" = none ]; then
    log "warning: /usr/bin/chromium is missing and this user cannot install it; browser tests will fail"
  else
    log "installing chromium (apt)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
  fi
fi

# npm installs the page's rendering libraries (web/install_vendor.sh); the page tests expect them.
if ! command -v npm >/dev/null 2>&1 && [ "$SUDO" != none ]; then
  log "installing npm (apt)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq npm >/dev/null
fi

./run_app.sh --install-only
PY=.venv/bin/python
STAMP=.venv/.localchat-test-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  log "installing test dependencies (pip install -e '.[test]')"
  "$PY" -m pip install -q -e '.[test]'
  echo "$want" > "$STAMP"
fi

mkdir -p test-output
exec "$PY" -m pytest -q "$@"
