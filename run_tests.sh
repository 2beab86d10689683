#!/usr/bin/env bash
# The test entry, for CI (a fresh Debian machine, as root, no GPU) and by hand:
#   ./run_tests.sh                       everything CI runs, in two pytest sessions: the Triton kernel tests in
#                                        Triton's interpreter (TRITON_INTERPRET=1), then every other test
#   ./run_tests.sh [pytest args]         both sessions with these args, e.g. tests/test_ops_triton.py -k rotary
#   ./run_tests.sh --kernels [args]      the interpreter session only
#   ./run_tests.sh --no-kernels [args]   the other session only, e.g. --no-kernels tests/test_proxy.py -x
# TRITON_INTERPRET must be set before triton is imported, hence two sessions; tests/conftest.py gives each its
# tests (the kernel tests are marked triton_interpret). A session that the args leave with no tests is no failure
# unless both are. After both, a last line sums their counts ("N failed, N passed, ...", pytest's wording); the
# exit status is non-zero when either session fails.
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
case "${1:-}" in
  --kernels) shift; TRITON_INTERPRET=1 exec "$PY" -m pytest -q "$@" ;;
  --no-kernels) shift; TRITON_INTERPRET=0 exec "$PY" -m pytest -q "$@" ;;
esac

# session NAME INTERPRET [args]: runs pytest (unbuffered, for tee), its output also in test-output/pytest-NAME.log;
# sets rc_NAME.
session() {
  local name=$1 interpret=$2 rc=0
  shift 2
  log "session '$name' (TRITON_INTERPRET=$interpret)"
  TRITON_INTERPRET=$interpret "$PY" -u -m pytest -q "$@" 2>&1 | tee "test-output/pytest-$name.log" || rc=$?
  printf -v "rc_$name" %d "$rc"
}

# The sessions' final counts summed, worded as pytest words its summary line.
totals() {
  for f in "$@"; do { grep -E '^(no tests ran|[0-9]+ [a-z]+.*) in [0-9.]+s' "$f" || true; } | tail -1; done | awk -v secs="$SECONDS" '
    { for (i = 1; i < NF; i++) if ($i ~ /^[0-9]+$/) { w = $(i + 1); sub(/,$/, "", w); sub(/s$/, "", w); n[w] += $i } }
    END {
      split("failed passed skipped xfailed xpassed warning error", order, " ")
      for (k = 1; k <= 7; k++) { w = order[k]; if (n[w] == 0) continue
        if ((w == "warning" || w == "error") && n[w] != 1) w = w "s"
        line = line (line ? ", " : "") n[order[k]] " " w }
      printf "%s in %ds\n", (line ? line : "no tests ran"), secs
    }'
}

SECONDS=0
session kernels 1 "$@"
session main 0 "$@"
log "both sessions: the kernel tests in Triton's interpreter, then every other test (exit $rc_kernels, $rc_main)"
totals test-output/pytest-kernels.log test-output/pytest-main.log
# 5 is pytest's "no tests collected": the args may leave one session empty, not both.
if [ "$rc_kernels" = 5 ] && [ "$rc_main" = 5 ]; then exit 5; fi
for rc in "$rc_kernels" "$rc_main"; do
  if [ "$rc" != 0 ] && [ "$rc" != 5 ]; then exit "$rc"; fi
done
