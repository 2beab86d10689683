#!/usr/bin/env bash
# The paths of consumer GPUs on this one (issue 38): the H100 as itself and as an sm80, sm86 and sm89 card
# (ENGINE_EMULATE_ARCH: that card's kernels, tiles and Triton instructions, engine/ops/emulation.py).
#   1. the GPU tests once per card, all cards at once (correctness only: they share the GPU), a count line each;
#   2. per card and weight format, one after the other: batch-1 and batch-8 decode steps, 64 x 512/256 throughput
#      and TTFT 8192 (bench/offline.py --only, dummy weights at Qwen3-VL-8B's shapes), then the table and the two
#      rules (bench/emulated_table.py: batch-8 <= 1.3 x batch-1 on every path, fp8 never slower than bf16).
#
#   bash bench/emulated_paths.sh
# Knobs (environment):
#   CARDS="native sm80 sm86 sm89"   FORMATS="bf16 fp8 awq"   TEST_T=120 (the tests' limit, 0: no tests)
#   TESTS="tests/test_ops_quant.py ..." (default: the kernel suites; add tests/test_gpu_quant_engine.py
#   tests/test_gpu_kv_fp8.py for the engine's)  TEST_WORKERS=4 (xdist per card)  BENCH_T=75 (per benchmark run)
#   METRICS="ttft8192,decode1,decode8,tput64"   BENCH_T=0: the tests alone
# The tests run first: they compile most kernels for each card, so the benchmarks after them start warm.
# All four cards' tests together need more than the default 120 s (one card alone: ~70 s with -n 12): on an H100,
# run the tests in one call (TEST_T=300 TEST_WORKERS=6 BENCH_T=0) and the benchmarks in another (TEST_T=0).
# Full logs and JSON under $OUT (packed into $OUT/emulated.tgz at the end).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
CARDS=${CARDS:-"native sm80 sm86 sm89"}
FORMATS=${FORMATS:-"bf16 fp8 awq"}
TESTS=${TESTS:-"tests/test_ops_triton.py tests/test_ops_triton_kv_fp8.py tests/test_ops_quant.py tests/test_ops_wna16.py tests/test_ops_quant_dispatch.py"}
arch_of() { [ "$1" = native ] && echo "" || echo "${1#sm}"; }
echo "=== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader) commit ${COMMIT:-$(git log -1 --format=%h 2>/dev/null)}"

if [ "${TEST_T:-120}" != 0 ]; then
  echo "=== GPU tests per card ($(date +%T)): $CARDS"
  for card in $CARDS; do
    (ENGINE_EMULATE_ARCH=$(arch_of $card) timeout "${TEST_T:-120}" python3 -m pytest -m gpu $TESTS -q \
      -n "${TEST_WORKERS:-4}" -p no:cacheprovider > "$OUT/tests_$card.txt" 2>&1; echo "rc=$?" >> "$OUT/tests_$card.txt") &
  done
  wait
  for card in $CARDS; do
    counts=$(grep -E '^[0-9]+ (passed|failed|skipped|error)|^=+ .*(passed|failed|error)' "$OUT/tests_$card.txt" | tail -1)
    echo "$card: ${counts:-no summary} ($(tail -1 "$OUT/tests_$card.txt"); 124: timed out at TEST_T)"
    grep -E '^(FAILED|ERROR) ' "$OUT/tests_$card.txt" | cut -c1-200 | head -8
  done
fi

[ "${BENCH_T:-75}" = 0 ] && exit 0
echo "=== benchmarks per card and weight format ($(date +%T)): $CARDS x $FORMATS"
for fmt in $FORMATS; do
  dir=/tmp/q8-$fmt
  if [ "$fmt" = bf16 ]; then python3 bench/synthetic_model.py $dir > /dev/null
  else python3 bench/synthetic_model.py $dir --quantization $fmt > /dev/null; fi
done
for card in $CARDS; do
  for fmt in $FORMATS; do
    ENGINE_EMULATE_ARCH=$(arch_of $card) timeout "${BENCH_T:-75}" python3 bench/offline.py --model /tmp/q8-$fmt \
      --load-format dummy --only "${METRICS:-ttft8192,decode1,decode8,tput64}" --max-num-seqs 64 \
      --out "$OUT/offline_${card}_$fmt.json" > "$OUT/offline_${card}_$fmt.txt" 2>&1
    rc=$?
    echo "$card $fmt: rc=$rc $(grep -o '"startup_s": [0-9.]*' "$OUT/offline_${card}_$fmt.txt")"
    [ $rc != 0 ] && grep -E 'Error|error' "$OUT/offline_${card}_$fmt.txt" | tail -3
  done
done
echo "=== table ($(date +%T))"
python3 bench/emulated_table.py "$OUT"
(cd "$OUT" && tar czf emulated.tgz --exclude emulated.tgz ./* && find . -type f ! -name emulated.tgz ! -name 'offline_*.json' -delete)
