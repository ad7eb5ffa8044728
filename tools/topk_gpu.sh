#!/usr/bin/env bash
# Top-k on the GPU machine (repo root, through the device tool): build, the top-k GPU tests, the
# same tests' edge cases with device-side invariant checks (-DDI_TOPK_DEBUG), the K-* and KF-*
# bench, then (FUSED_CHUNKS=1) the fused prefill on one stream against two, then the cluster-size variants.
# Logs to $OUT.
#   OUT=... DI_BENCH_COMMIT=... [FUSED_CHUNKS=1] bash tools/topk_gpu.sh [VARIANTS...]
set -uo pipefail
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DI_JIT_CACHE_DIR=${DI_JIT_CACHE_DIR:-/tmp/di_cache}
PRECOMPILE=0 TESTS=tests/test_topk.py TEST_TIMEOUT=${TEST_TIMEOUT:-200} MAXFAIL=10 bash tools/gpu_check.sh tests
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
echo "== $(date +%T) debug checks" | tee -a "$OUT/gpu.log"
DI_JIT_EXTRA_FLAGS=-DDI_TOPK_DEBUG timeout 150 python3 -m pytest tests/test_topk.py -q -p no:cacheprovider -x --tb=line \
  -k "fallback or forced_clusters or (adversarial and 20000) or long_rows" 2>&1 | tail -4 | tee -a "$OUT/gpu.log"
B=(python3 -m deep_indexer bench --png "" --no-kernel-time --iters "${ITERS:-20}")
echo "== $(date +%T) bench" | tee -a "$OUT/gpu.log"
DI_JIT_DEBUG=1 timeout 200 "${B[@]}" --json "$OUT/bench-topk.json" --shapes topk fused_topk 2>&1 | grep -E "K-|KF-|heuristic topk|rror|ceiling" | tee -a "$OUT/gpu.log"
if [ "${FUSED_CHUNKS:-0}" = 1 ]; then
  echo "== $(date +%T) fused prefill: chunks on one stream / two streams" | tee -a "$OUT/gpu.log"
  timeout 200 python3 tools/fused_prefill_chunks.py P2 P3 P5 --k 2048 512 --chunks 0 --overlap 0 1 --rounds 5 --iters 5 \
    2>&1 | tee -a "$OUT/gpu.log"
fi
for v in "$@"; do
  echo "== $(date +%T) DI_TOPK_CLUSTER=$v" | tee -a "$OUT/gpu.log"
  DI_TOPK_CLUSTER=$v timeout 60 "${B[@]}" --no-ceilings --json "$OUT/bench-cluster$v.json" --shapes K-D1 K-D2 K-D3 2>&1 | grep -E "K-|rror" | tee -a "$OUT/gpu.log"
done
echo "== $(date +%T) done" | tee -a "$OUT/gpu.log"
