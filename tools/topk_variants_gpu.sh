#!/usr/bin/env bash
# Top-k kernel variants on the GPU machine (repo root, through the device tool): build, the in-process
# A/B of the variants (tools/ab.py, read flush; the variants must return identical indices), then
# optionally the top-k GPU tests and debug checks with TEST_FLAGS (TESTS=1), the K-* / KF-* bench
# (BENCH=1) and ncu's per-SASS-instruction counters of one shape (NCU=K-P2). Logs to $OUT.
#   OUT=... VARIANTS="flags;flags;..." ('default': no extra flags) [TESTS=1 TEST_FLAGS="-D..."] [BENCH=1] [NCU=K-P2] \
#     bash tools/topk_variants_gpu.sh [SHAPES...]
set -uo pipefail
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DI_JIT_CACHE_DIR=${DI_JIT_CACHE_DIR:-/tmp/di_cache}
PRECOMPILE=0 bash tools/gpu_check.sh build
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
if [ -n "${VARIANTS:-}" ]; then
  V=""
  IFS=';' read -ra parts <<<"$VARIANTS"
  for f in "${parts[@]}"; do [ "$f" = default ] && f=""; V+="${V:+;}DI_JIT_EXTRA_FLAGS=$f"; done
  SHAPES=("$@")
  [ ${#SHAPES[@]} = 0 ] && SHAPES=(K-P2 K-P3 K-P5 K-D1 K-D2 K-D5 K-D8)
  echo "== $(date +%T) A/B: $V" | tee -a "$OUT/gpu.log"
  timeout ${AB_TIMEOUT:-260} python3 tools/ab.py --variants "$V" --rounds ${ROUNDS:-3} --iters 20 "${SHAPES[@]}" 2>&1 | tee -a "$OUT/gpu.log"
fi
if [ "${TESTS:-0}" = 1 ]; then
  echo "== $(date +%T) tests [${TEST_FLAGS:-}]" | tee -a "$OUT/gpu.log"
  DI_JIT_EXTRA_FLAGS="${TEST_FLAGS:-}" timeout ${TEST_TIMEOUT:-200} python3 -m pytest tests/test_topk.py -q -p no:cacheprovider \
    --maxfail=10 -rf --tb=line 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -15 | tee -a "$OUT/gpu.log"
  echo "== $(date +%T) debug checks [${TEST_FLAGS:-}]" | tee -a "$OUT/gpu.log"
  DI_JIT_EXTRA_FLAGS="${TEST_FLAGS:-} -DDI_TOPK_DEBUG" timeout 120 python3 -m pytest tests/test_topk.py -q -p no:cacheprovider -x \
    --tb=line -k "fallback or forced_clusters or (adversarial and 20000) or long_rows" 2>&1 | tail -2 | tee -a "$OUT/gpu.log"
fi
if [ "${BENCH:-0}" = 1 ]; then
  echo "== $(date +%T) bench" | tee -a "$OUT/gpu.log"
  DI_JIT_DEBUG=1 timeout 200 python3 -m deep_indexer bench --png "" --no-kernel-time --iters 20 --json "$OUT/bench-topk.json" \
    --shapes topk fused_topk 2>&1 | grep -E "K-|KF-|heuristic topk|rror|ceiling" | tee -a "$OUT/gpu.log"
fi
if [ -n "${CHUNKS:-}" ]; then  # e.g. CHUNKS="P2 P3 P5": fused prefill / logits alone, 5 rounds
  echo "== $(date +%T) fused prefill" | tee -a "$OUT/gpu.log"
  timeout 240 python3 tools/fused_prefill_chunks.py $CHUNKS --k 2048 512 --chunks 0 --overlap 1 --rounds 5 --iters 5 2>&1 | tee -a "$OUT/gpu.log"
fi
if [ -n "${NCU:-}" ]; then
  echo "== $(date +%T) ncu $NCU" | tee -a "$OUT/gpu.log"
  python3 tools/profile_shape.py "$NCU" >/dev/null 2>&1  # JIT outside the profiler
  timeout 200 ncu --clock-control none --kernel-name regex:topk_kernel --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --warp-sampling-interval 0 \
    -f -o "$OUT/ncu-$NCU" python3 tools/profile_shape.py "$NCU" >>"$OUT/ncu.log" 2>&1
  ncu -i "$OUT/ncu-$NCU.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu-$NCU-sass.csv" 2>>"$OUT/ncu.log"
  ncu -i "$OUT/ncu-$NCU.ncu-rep" --page details >>"$OUT/ncu.log" 2>&1
  python3 tools/ncu_stalls.py "$OUT/ncu-$NCU-sass.csv" --top 15 2>&1 | tee -a "$OUT/gpu.log"
fi
echo "== $(date +%T) done" | tee -a "$OUT/gpu.log"
