#!/usr/bin/env bash
# One call on the GPU machine: environment, Triton kernel tests, GPU engine tests, offline benchmark.
# Every stage has its own time limit and writes its full log under $OUT; the tail of each is printed.
#   bash bench/device_check.sh            (stages: ops engine offline; STAGES="..." to choose from
#                                          ops engine opsbench offline profile imageprof imageparts imagetl intake quant wna16 dense kvfp8
#                                          hf serve imageab memcaps emulated tp ab video spec lmhead); every file it writes is packed into $OUT/logs.tgz at the end
#                                          (the device tool returns at most 8 files)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STAGES=${STAGES:-"ops engine offline"}
stage() { echo "=== $1 ($(date +%T))"; }

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)" | tee -a "$OUT/env.txt"
# The device's copy of .git can be stale: the caller passes COMMIT=$(git rev-parse HEAD) where it matters.
echo "commit ${COMMIT:-$(git log -1 --format=%H 2>/dev/null) [from the copy of .git on the device]}" | tee -a "$OUT/env.txt"
# The device has no network: wheels of pure-runtime dependencies it lacks travel in .whl/ (run's `carry`), made with
#   pip download pybase64 orjson blake3 llguidance py-spy --no-deps -d .whl --python-version 3.12 --only-binary=:all: \
#     --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64     (py-spy: only for SPY=1)
# Every wheel there is installed, so that an older tree timed against this one (imageab) finds its own too.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --find-links .whl $(ls .whl/*.whl | grep -v py_spy) 2>&1 | tail -1
fi
python3 -c "import PIL, pybase64, orjson, blake3; print('pillow', PIL.__version__, 'pybase64', pybase64.__version__, \
'orjson', orjson.__version__, 'blake3', blake3.__version__)" | tee -a "$OUT/env.txt"
lscpu | grep -E '^(Model name|CPU\(s\)|CPU max MHz)' | tr -s ' ' | tee -a "$OUT/env.txt"

for s in $STAGES; do
  case $s in
    ops)
      stage "kernel tests"
      timeout "${OPS_T:-180}" python3 -m pytest -m gpu ${OPS_TESTS:-tests/test_ops_triton.py tests/test_ops_triton_kv_fp8.py tests/test_ops_quant.py tests/test_ops_wna16.py} -q -n 8 -p no:cacheprovider \
        > "$OUT/ops_tests.txt" 2>&1; echo "rc=$?"; tail -12 "$OUT/ops_tests.txt" ;;
    engine)
      stage "GPU engine tests"
      timeout "${ENG_T:-210}" python3 -m pytest -m gpu ${ENG_TESTS:-tests/test_gpu_engine.py tests/test_gpu_quant_engine.py tests/test_gpu_memory_limit.py tests/test_gpu_cpu_embeddings.py tests/test_gpu_kv_fp8.py} -q -p no:cacheprovider \
        > "$OUT/engine_tests.txt" 2>&1; echo "rc=$?"; grep -v '^INFO' "$OUT/engine_tests.txt" | tail -25 ;;
    opsbench)
      stage "kernel benchmark"
      timeout "${OPSB_T:-150}" python3 bench/bench_ops.py --quick --json "$OUT/bench_ops.json" \
        --groups "${OPSB_GROUPS:-decode,prefill,vision,elementwise}" ${OPSB_ARGS:-} \
        > "$OUT/bench_ops.txt" 2>&1; echo "rc=$?"; tail -40 "$OUT/bench_ops.txt" ;;
    offline)
      stage "offline benchmark (Qwen3-VL-8B shapes, dummy weights)"
      python3 bench/synthetic_model.py /tmp/q8 > /dev/null
      timeout "${BENCH_T:-240}" python3 bench/offline.py --model /tmp/q8 --load-format dummy \
        --out "$OUT/offline.json" > "$OUT/offline.txt" 2>&1; echo "rc=$?"
      grep -E 'Memory profile|Total blocks|Captured|Engine ready|Loading model|Error|error' "$OUT/offline.txt" | head
      grep -v -E '^(INFO|WARNING)' "$OUT/offline.txt" | tail -14 ;;
    profile)
      stage "step profile"
      python3 bench/synthetic_model.py /tmp/q8 > /dev/null
      timeout "${PROF_T:-200}" python3 bench/step_profile.py --model /tmp/q8 --load-format dummy \
        --out "$OUT/step_profile.json" > "$OUT/step_profile.txt" 2>&1
      echo "rc=$?"; grep -v -E '^(INFO|WARNING)' "$OUT/step_profile.txt" | tail -8 ;;
    imageprof)
      stage "image request profile"
      python3 bench/synthetic_model.py /tmp/q8 > /dev/null
      timeout "${IMG_T:-200}" python3 bench/image_profile.py --model /tmp/q8 --load-format dummy \
        --out "$OUT/image_profile.txt" > "$OUT/image_profile_log.txt" 2>&1
      echo "rc=$?"; grep -v -E '^(INFO|WARNING)' "$OUT/image_profile_log.txt" | cut -c1-150 | tail -90 ;;
    imageparts)
      stage "GPU parts of an image request (vision attention, prefill attention tiles, pixel patches)"
      timeout "${PARTS_T:-200}" python3 bench/image_gpu_parts.py --json "$OUT/image_gpu_parts.json" \
        ${PARTS_ARGS:-} > "$OUT/image_gpu_parts.txt" 2>&1
      echo "rc=$?"; grep -v -E '^(INFO|WARNING)' "$OUT/image_gpu_parts.txt" | cut -c1-220 | tail -60 ;;
    wna16)
      # The 4-bit kernels in one call: GPU kernel tests, the tile sweep (it prints the TUNED_W4G128 table to
      # paste), then the dispatch vs dequantize + cuBLAS vs bf16 per shape and token count, and per step.
      if [ "${WNA16_TEST_T:-180}" != 0 ]; then   # WNA16_TEST_T=0: the sweep alone
        stage "4-bit kernel tests"
        timeout "${WNA16_TEST_T:-180}" python3 -m pytest -m gpu tests/test_ops_wna16.py tests/test_ops_quant.py \
          -q -n 8 -p no:cacheprovider > "$OUT/wna16_tests.txt" 2>&1; echo "rc=$?"; tail -15 "$OUT/wna16_tests.txt"
      fi
      stage "4-bit tile sweep and the dispatch vs dequantize + cuBLAS (bench/tune_wna16.py ${WNA16_ARGS:-})"
      timeout "${WNA16_TUNE_T:-380}" python3 bench/tune_wna16.py --jobs 12 ${WNA16_ARGS:-} \
        --json "$OUT/tune_wna16.json" > "$OUT/tune_wna16.txt" 2>&1; echo "rc=$?"
      # (the per-config sweep lines stay in the log: logs.tgz)
      grep -E '^(compiled|Traceback|[A-Za-z]*Error)' "$OUT/tune_wna16.txt" | cut -c1-200 | tail -8
      echo "configs skipped: $(grep -c '^  skip' "$OUT/tune_wna16.txt")"
      grep -E '^  top ' "$OUT/tune_wna16.txt" | cut -c1-220
      sed -n '/^TUNED_W4G128/,$p' "$OUT/tune_wna16.txt" | cut -c1-200 ;;
    quant)
      # The offline benchmark once per weight format (QUANTS: "none" is bf16), dummy weights at the 8B shapes.
      # An entry FORMAT+smNN (e.g. "fp8+sm86") runs with the paths and tiles of that GPU class
      # (ENGINE_EMULATE_ARCH, engine/ops/kernel_config.py); FORMAT+kv8 (e.g. "fp8+kv8") with an fp8 KV cache.
      for q in ${QUANTS:-none awq fp8}; do
        stage "offline benchmark, weights: $q"
        fmt=${q%+kv8}; kv=auto; [ "$fmt" != "$q" ] && kv=fp8
        arch=; case $fmt in *+sm*) arch=${fmt##*+sm}; fmt=${fmt%+sm*} ;; esac
        dir=/tmp/q8-$fmt
        if [ "$fmt" = none ]; then python3 bench/synthetic_model.py $dir > /dev/null
        else python3 bench/synthetic_model.py $dir --quantization $fmt > /dev/null; fi
        ENGINE_EMULATE_ARCH=$arch timeout "${QBENCH_T:-200}" python3 bench/offline.py \
          --model $dir --load-format dummy --kv-cache-dtype $kv ${QBENCH_ARGS:-} \
          --out "$OUT/offline_$q.json" > "$OUT/offline_$q.txt" 2>&1; echo "rc=$?"
        grep -E 'Loading model|Memory profile|Error|error' "$OUT/offline_$q.txt" | head -4
        grep -E '^\| ' "$OUT/offline_$q.txt" | tail -10
      done ;;
    ab)
      # The offline benchmark of the tree before a change (OLD_TREE, e.g. .old from `git archive BASE engine bench`)
      # and of this tree, per weight format (AB_QUANTS: "none" is bf16), in turns on this machine.
      for q in ${AB_QUANTS:-none awq fp8}; do
        dir=/tmp/q8-$q
        if [ "$q" = none ]; then python3 bench/synthetic_model.py $dir > /dev/null
        else python3 bench/synthetic_model.py $dir --quantization $q > /dev/null; fi
        for side in old new; do
          stage "offline benchmark, weights: $q, tree: $side"
          tree=$PWD; [ $side = old ] && tree=${OLD_TREE:-.old}
          (cd "$tree" && PYTHONPATH=$PWD timeout "${QBENCH_T:-200}" python3 bench/offline.py --model $dir \
            --load-format dummy ${QBENCH_ARGS:-} --out "$OUT/ab_${q}_$side.json" > "$OUT/ab_${q}_$side.txt" 2>&1)
          echo "rc=$?"; grep -E 'Error|error' "$OUT/ab_${q}_$side.txt" | head -4
          grep -E '^\| ' "$OUT/ab_${q}_$side.txt" | tail -9
        done
      done ;;
    lmhead)
      # --quantize-lm-head (issue 37): batch-1 and batch-8 decode steps with and without it, in turns, per weight
      # format in LMHEAD_FORMATS (none: bf16), on this GPU.
      for fmt in ${LMHEAD_FORMATS:-awq none}; do
        dir=/tmp/q8-$fmt
        if [ "$fmt" = none ]; then python3 bench/synthetic_model.py $dir > /dev/null
        else python3 bench/synthetic_model.py $dir --quantization $fmt > /dev/null; fi
        for side in plain quantized; do
          flag=""; [ $side = quantized ] && flag=--quantize-lm-head
          timeout "${LMHEAD_T:-70}" python3 bench/offline.py --model $dir --load-format dummy --only decode1,decode8 \
            --max-num-seqs 64 $flag --out "$OUT/lmhead_${fmt}_$side.json" > "$OUT/lmhead_${fmt}_$side.txt" 2>&1
          echo "$fmt $side rc=$? $(grep -E '^\| ' "$OUT/lmhead_${fmt}_$side.txt" | tr '\n' ' ' | cut -c1-300)"
        done
      done ;;
    kvfp8)
      stage "paged attention on an fp8 KV cache against a bf16 one (bench/kv_fp8_attention.py)"
      timeout "${KVFP8_T:-150}" python3 bench/kv_fp8_attention.py --json "$OUT/kv_fp8_attention.json" \
        > "$OUT/kv_fp8_attention.txt" 2>&1; echo "rc=$?"; tail -10 "$OUT/kv_fp8_attention.txt" ;;
    intake)
      stage "image intake on this host (process_chat alone), trees in turns"
      python3 bench/synthetic_model.py /tmp/q8 > /dev/null
      timeout 240 python3 bench/image_intake.py --model /tmp/q8 --alternate ${OLD_TREE:-$PWD} $PWD \
        > "$OUT/image_intake.txt" 2>&1; echo "rc=$?"; tail -8 "$OUT/image_intake.txt" ;;
    imagetl)
      stage "image request timeline inside the HTTP server"
      python3 bench/synthetic_model.py /tmp/q8 > /dev/null
      timeout "${TL_T:-200}" python3 bench/image_timeline.py --model /tmp/q8 --load-format dummy \
        --kinds ${TL_KINDS:-jpeg screenshot photo} ${TL_ARGS:-} > "$OUT/image_timeline.txt" 2>&1
      echo "rc=$?"; grep -v -E '^(INFO|WARNING)' "$OUT/image_timeline.txt" | tail -150 ;;
    hf)
      stage "transformers baseline"
      python3 bench/synthetic_model.py /tmp/q8 > /dev/null
      timeout "${HF_T:-240}" python3 bench/hf_baseline.py --model /tmp/q8 --out "$OUT/hf.json" \
        > "$OUT/hf.txt" 2>&1; echo "rc=$?"; grep -E '^\{"batch|ttft|image' "$OUT/hf.txt" | tail -8 ;;
    imageab)
      # Image TTFT over HTTP for the tree in $OLD_TREE (e.g. `git archive <commit> | tar -x -C .old`, carried)
      # and for this one, on the same machine, one server after the other; AB_TREES="dir dir ..." names the
      # trees instead (to bisect: one tree per reverted change). AB_ARGS adds levels to serve.py
      # (e.g. AB_ARGS="--concurrency 256"; default: images only).
      trees=${AB_TREES:-"$OLD_TREE $PWD"}
      stage "image TTFT over HTTP: $trees"
      python3 bench/synthetic_model.py /tmp/q8 > /dev/null
      for tree in $trees; do
        (cd "$tree" && PYTHONPATH=$tree exec python3 -m engine --model /tmp/q8 --load-format dummy --port 3001 \
          --max-model-len 10240 --gpu-memory-utilization 0.85 --disable-log-requests > "$OUT/server_ab.log" 2>&1) &
        spid=$!
        for _ in $(seq 120); do curl -sf localhost:3001/health > /dev/null && break; sleep 1; done
        echo "-- $tree"
        timeout 300 python3 bench/serve.py ${AB_ARGS:---concurrency} --image-repeats 7 2>&1 | grep -E '^\| (image|[0-9])'
        if [ -n "${SPY:-}" ]; then
          # py-spy (from .whl) samples this server's threads for 8 s of one more concurrency-256 level
          python3 -m pip install -q --no-index --find-links .whl py-spy 2>&1 | tail -1
          n=$(basename "$tree")$RANDOM
          spy="$(dirname "$(python3 -c "import sys; print(sys.executable)")")/py-spy"
          (sleep 3; "$spy" record --pid $spid --duration 8 --rate 200 --format raw --threads --nonblocking \
            --output "$OUT/spy_$n.txt" > "$OUT/spy_$n.log" 2>&1) &
          spy_job=$!
          timeout 60 python3 bench/serve.py --no-image --concurrency 256 2>&1 | grep -E '^\| [0-9]'
          wait $spy_job      # (a bare wait would wait for the server too)
          python3 bench/spy_summary.py "$OUT/spy_$n.txt" | head -60
        fi
        kill $spid; wait $spid 2>/dev/null; sleep 2
      done ;;
    dense)
      # A fresh prompt's attention: the Triton prefill kernel against cuDNN / FlashAttention per layer, then TTFT
      # with the dense path on and off in turns, per weight format (DENSE_QUANTS; "none" is bf16).
      models=""
      for q in ${DENSE_QUANTS:-none fp8}; do
        dir=/tmp/q8-$q
        if [ "$q" = none ]; then python3 bench/synthetic_model.py $dir > /dev/null
        else python3 bench/synthetic_model.py $dir --quantization $q > /dev/null; fi
        models="$models $dir"
      done
      stage "dense prefill attention (bench/dense_prefill.py, models:$models)"
      timeout "${DENSE_T:-300}" python3 bench/dense_prefill.py --models $models --json "$OUT/dense_prefill.json" \
        ${DENSE_ARGS:-} > "$OUT/dense_prefill.txt" 2>&1; echo "rc=$?"
      grep -E '^(\||Traceback|[A-Za-z]*Error)' "$OUT/dense_prefill.txt" | tail -30 ;;
    memcaps)
      # Issue 14's image chat under GPU memory caps, each cap with the flags the launcher fits to such a card
      # (app/fit.py), once per weight format (MEMCAPS_QUANTS), dummy weights at the 8B shapes.
      # An entry QUANT:CAPS (e.g. "awq:8,12 fp8:16") gives that format its own caps.
      for entry in ${MEMCAPS_QUANTS:-awq fp8}; do
        q=${entry%%:*}; caps=${MEMCAPS_CAPS:-8 12 16 24}
        [ "$q" != "$entry" ] && caps=$(echo "${entry#*:}" | tr , ' ')
        stage "image chat under memory caps $caps GiB, weights: $q"
        timeout "${MEMCAPS_T:-280}" python3 bench/memory_caps.py --caps $caps --quantization $q \
          --repeats 2 --out "$OUT/memcaps_$q.json" --log-dir /tmp/memcaps_$q > "$OUT/memcaps_$q.txt" 2>&1
        echo "rc=$?"; mkdir -p "$OUT/memcaps_$q" && cp /tmp/memcaps_$q/*.log "$OUT/memcaps_$q/" 2>/dev/null
        grep -v -E '^(INFO|WARNING)' "$OUT/memcaps_$q.txt" | grep -v '^{' | tail -14
      done ;;
    emulated)
      # The GPU tests and the decode/throughput/TTFT table once per emulated consumer card (bench/emulated_paths.sh:
      # CARDS, FORMATS, TEST_T, BENCH_T, METRICS choose; its table checks batch-8 <= 1.3 x batch-1 and fp8 <= bf16).
      stage "emulated consumer cards: ${CARDS:-native sm80 sm86 sm89} x ${FORMATS:-bf16 fp8 awq}"
      timeout "${EMU_T:-570}" bash bench/emulated_paths.sh; echo "rc=$?" ;;
    tp)
      # Needs TP_SIZE GPUs (nvidia-h200-x2 for 2): the TP GPU tests, then TP=TP_SIZE against TP=1 on this host.
      stage "tensor parallelism: GPU tests and TP=${TP_SIZE:-2} against TP=1"
      timeout "${TPT_T:-300}" python3 -m pytest -m gpu tests/test_gpu_tp.py -q -p no:cacheprovider \
        > "$OUT/tp_tests.txt" 2>&1; echo "rc=$?"; grep -v '^INFO' "$OUT/tp_tests.txt" | tail -15
      python3 bench/synthetic_model.py /tmp/q8 > /dev/null
      timeout "${TPB_T:-480}" python3 bench/tp_compare.py --model /tmp/q8 --tp "${TP_SIZE:-2}" \
        --out "$OUT/tp_compare.json" > "$OUT/tp_compare.txt" 2>&1; echo "rc=$?"
      grep -E 'Tensor parallel size|Memory profile|Captured|Error|error' "$OUT/tp_compare.txt" | head
      grep -E '^\| ' "$OUT/tp_compare.txt" | tail -6 ;;
    spec)
      # Speculative decoding: the GPU exactness tests, then a k-token verify step against a one-token decode step
      # at each batch of SPEC_BATCHES, per weight format (QUANTS), at the 8B shapes. With OLD_TREE (e.g. .old from
      # `git archive BASE engine`), that tree's verify steps too, timed by this tree's script in turns.
      stage "speculative decoding: GPU tests"
      timeout "${SPEC_TEST_T:-150}" python3 -m pytest -m gpu tests/test_gpu_spec_decode.py tests/test_gpu_spec_eagle3.py \
        -q -p no:cacheprovider > "$OUT/spec_tests.txt" 2>&1; echo "rc=$?"; grep -v '^INFO' "$OUT/spec_tests.txt" | tail -6
      for q in ${QUANTS:-none awq fp8}; do
        stage "verify step against decode step, weights: $q"
        dir=/tmp/q8-$q
        if [ "$q" = none ]; then python3 bench/synthetic_model.py $dir > /dev/null
        else python3 bench/synthetic_model.py $dir --quantization $q > /dev/null; fi
        timeout "${SPEC_T:-150}" python3 bench/spec_verify_cost.py --model $dir --load-format dummy \
          --batches ${SPEC_BATCHES:-1 4} ${SPEC_ARGS:-} --json "$OUT/spec_verify_$q.json" > "$OUT/spec_verify_$q.txt" 2>&1
        echo "rc=$?"; grep -v -E '^(INFO|WARNING)' "$OUT/spec_verify_$q.txt" | tail -12
        if [ -n "${OLD_TREE:-}" ]; then
          stage "verify step of the tree before ($OLD_TREE), weights: $q"
          script=$PWD/bench/spec_verify_cost.py
          (cd "$OLD_TREE" && PYTHONPATH=$PWD timeout "${SPEC_T:-150}" python3 "$script" --model $dir --load-format dummy \
            --sides spec --batches ${SPEC_BATCHES:-1 4} ${SPEC_ARGS:-} --json "$OUT/spec_verify_${q}_old.json" \
            > "$OUT/spec_verify_${q}_old.txt" 2>&1)
          echo "rc=$?"; grep -v -E '^(INFO|WARNING)' "$OUT/spec_verify_${q}_old.txt" | tail -9
        fi
      done ;;
    video)
      # TTFT of a 10 s and a 60 s 1280x720 H.264 clip over HTTP, then its parts in-process against their floors.
      # Needs PyAV: carry its cp312 manylinux wheel in .whl/ (pip download av ...; installed above).
      stage "video TTFT (HTTP, then host decode / vision encoder / prefill against floors)"
      python3 bench/synthetic_model.py /tmp/q8 > /dev/null
      timeout "${VIDEO_T:-540}" python3 bench/video_ttft.py --model /tmp/q8 --out "$OUT/video_ttft.json" \
        --server-log "$OUT/video_server.log" ${VIDEO_ARGS:-} > "$OUT/video_ttft.txt" 2>&1
      echo "rc=$?"; grep -v -E '^(INFO|WARNING)' "$OUT/video_ttft.txt" | tail -12 ;;
    serve)
      stage "serving benchmark over HTTP"
      python3 bench/synthetic_model.py /tmp/q8 > /dev/null
      python3 -m engine --model /tmp/q8 --load-format dummy --port 3001 --max-model-len 10240 \
        --gpu-memory-utilization 0.85 --disable-log-requests > "$OUT/server.log" 2>&1 &
      spid=$!
      for _ in $(seq 120); do curl -sf localhost:3001/health > /dev/null && break; sleep 1; done
      timeout "${SERVE_T:-240}" python3 bench/serve.py --out "$OUT/serve.json" ${SERVE_ARGS:-} > "$OUT/serve.txt" 2>&1
      echo "rc=$?"; tail -9 "$OUT/serve.txt"; kill $spid; wait $spid 2>/dev/null ;;
  esac
done
stage done
(cd "$OUT" && tar czf logs.tgz --exclude logs.tgz ./* && find . -type f ! -name logs.tgz -delete)
