#!/usr/bin/env bash
# Top-k on the GPU machine (repo root, through the device tool). Logs to $OUT.
#   build; then, each optional:
#   VARIANTS="flags;flags;..." ('default': no extra flags): in-process A/B of compile-flag variants
#       (tools/ab.py, read flush; the variants must return identical indices) on AB_SHAPES
#   TESTS=1 (default): test_topk.py and its edge cases with device-side checks (-DDI_TOPK_DEBUG), both
#       with TEST_FLAGS
#   BENCH=1 (default): the K-* and KF-* bench
#   CHUNKS="P2 P3 P5": fused prefill (two streams, default workspace) against the logits alone, 5 rounds
#   FUSED_CHUNKS=1: the fused prefill on one stream against two (P2 P3 P5)
#   NCU=K-P2: ncu's per-SASS-instruction counters of one shape (tools/ncu_stalls.py summary)
#   TRACE="K-D1 K-P2": per-row phase timelines (tools/kernel_trace.py, a -DDI_KERNEL_TRACE build)
#   positional arguments: DI_TOPK_CLUSTER sizes to time on K-D1 K-D2 K-D3
#   OUT=... [VARIANTS=...] [TESTS=0] [BENCH=0] ... bash tools/topk_gpu.sh [CLUSTER_SIZES...]
set -uo pipefail
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DI_JIT_CACHE_DIR=${DI_JIT_CACHE_DIR:-/tmp/di_cache}
log() { echo "== $(date +%T) $*" | tee -a "$OUT/gpu.log"; }
PRECOMPILE=0 bash tools/gpu_check.sh build || exit 1
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
if [ -n "${VARIANTS:-}" ]; then
  V=""
  IFS=';' read -ra parts <<<"$VARIANTS"
  for f in "${parts[@]}"; do [ "$f" = default ] && f=""; V+="${V:+;}DI_JIT_EXTRA_FLAGS=$f"; done
  read -ra SHAPES <<<"${AB_SHAPES:-K-P2 K-P3 K-P5 K-D1 K-D2 K-D5 K-D8}"
  log "A/B: $V"
  timeout ${AB_TIMEOUT:-260} python3 tools/ab.py --variants "$V" --rounds ${ROUNDS:-3} --iters 20 "${SHAPES[@]}" 2>&1 | tee -a "$OUT/gpu.log"
fi
if [ "${TESTS:-1}" = 1 ]; then
  log "tests [${TEST_FLAGS:-}]"
  DI_JIT_EXTRA_FLAGS="${TEST_FLAGS:-}" timeout ${TEST_TIMEOUT:-200} python3 -m pytest tests/test_topk.py -q -p no:cacheprovider \
    --maxfail=10 -rf --tb=line 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -15 | tee -a "$OUT/gpu.log"
  log "debug checks [${TEST_FLAGS:-}]"
  DI_JIT_EXTRA_FLAGS="${TEST_FLAGS:-} -DDI_TOPK_DEBUG" timeout 150 python3 -m pytest tests/test_topk.py -q -p no:cacheprovider -x \
    --tb=line -k "fallback or forced_clusters or (adversarial and 20000) or long_rows" 2>&1 | tail -2 | tee -a "$OUT/gpu.log"
fi
B=(python3 -m deep_indexer bench --png "" --no-kernel-time --iters "${ITERS:-20}")
if [ "${BENCH:-1}" = 1 ]; then
  log "bench"
  DI_JIT_DEBUG=1 timeout 200 "${B[@]}" --json "$OUT/bench-topk.json" --shapes topk fused_topk 2>&1 \
    | grep -E "K-|KF-|heuristic topk|rror|ceiling" | tee -a "$OUT/gpu.log"
fi
if [ -n "${CHUNKS:-}" ]; then
  log "fused prefill"
  timeout 240 python3 tools/fused_prefill_chunks.py $CHUNKS --k 2048 512 --chunks 0 --overlap 1 --rounds 5 --iters 5 2>&1 | tee -a "$OUT/gpu.log"
fi
if [ "${FUSED_CHUNKS:-0}" = 1 ]; then
  log "fused prefill: chunks on one stream / two streams"
  timeout 200 python3 tools/fused_prefill_chunks.py P2 P3 P5 --k 2048 512 --chunks 0 --overlap 0 1 --rounds 5 --iters 5 \
    2>&1 | tee -a "$OUT/gpu.log"
fi
if [ -n "${NCU:-}" ]; then
  log "ncu $NCU"
  python3 tools/profile_shape.py "$NCU" >/dev/null 2>&1  # JIT outside the profiler
  timeout 200 ncu --clock-control none --kernel-name regex:topk_kernel --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --warp-sampling-interval 0 \
    -f -o "$OUT/ncu-$NCU" python3 tools/profile_shape.py "$NCU" >>"$OUT/ncu.log" 2>&1
  ncu -i "$OUT/ncu-$NCU.ncu-rep" --page source --csv --print-source sass >"$OUT/ncu-$NCU-sass.csv" 2>>"$OUT/ncu.log"
  ncu -i "$OUT/ncu-$NCU.ncu-rep" --page details >>"$OUT/ncu.log" 2>&1
  python3 tools/ncu_stalls.py "$OUT/ncu-$NCU-sass.csv" --top 15 2>&1 | tee -a "$OUT/gpu.log"
fi
if [ -n "${TRACE:-}" ]; then
  log "trace $TRACE"
  timeout 200 python3 tools/kernel_trace.py $TRACE 2>&1 | tee -a "$OUT/gpu.log"
fi
for v in "$@"; do
  log "DI_TOPK_CLUSTER=$v"
  DI_TOPK_CLUSTER=$v timeout 60 "${B[@]}" --no-ceilings --json "$OUT/bench-cluster$v.json" --shapes K-D1 K-D2 K-D3 2>&1 | grep -E "K-|rror" | tee -a "$OUT/gpu.log"
done
log "done"
