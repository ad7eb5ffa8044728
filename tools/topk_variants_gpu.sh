#!/usr/bin/env bash
# Top-k kernel variants on the GPU machine (repo root, through the device tool): build, the in-process
# A/B of the variants (tools/ab.py, read flush; the variants must return identical indices), then the
# top-k GPU tests and the debug checks with TEST_FLAGS (the candidate's compile flags). Logs to $OUT.
#   OUT=... VARIANTS="flags;flags;..." TEST_FLAGS="-D..." bash tools/topk_variants_gpu.sh [SHAPES...]
set -uo pipefail
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DI_JIT_CACHE_DIR=${DI_JIT_CACHE_DIR:-/tmp/di_cache}
PRECOMPILE=0 bash tools/gpu_check.sh build
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
V=""
IFS=';' read -ra parts <<<"$VARIANTS"
for f in "${parts[@]}"; do V+="${V:+;}DI_JIT_EXTRA_FLAGS=$f"; done
SHAPES=("$@")
[ ${#SHAPES[@]} = 0 ] && SHAPES=(K-P2 K-P3 K-P5 K-D1 K-D2 K-D5 K-D8)
echo "== $(date +%T) A/B: $V" | tee -a "$OUT/gpu.log"
timeout ${AB_TIMEOUT:-260} python3 tools/ab.py --variants "$V" --rounds ${ROUNDS:-3} --iters 20 "${SHAPES[@]}" 2>&1 | tee -a "$OUT/gpu.log"
if [ -n "${TEST_FLAGS:-}" ]; then
  echo "== $(date +%T) tests with $TEST_FLAGS" | tee -a "$OUT/gpu.log"
  DI_JIT_EXTRA_FLAGS="$TEST_FLAGS" timeout ${TEST_TIMEOUT:-200} python3 -m pytest tests/test_topk.py -q -p no:cacheprovider \
    --maxfail=10 -rf --tb=line 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -15 | tee -a "$OUT/gpu.log"
  echo "== $(date +%T) debug checks with $TEST_FLAGS" | tee -a "$OUT/gpu.log"
  DI_JIT_EXTRA_FLAGS="$TEST_FLAGS -DDI_TOPK_DEBUG" timeout 120 python3 -m pytest tests/test_topk.py -q -p no:cacheprovider -x --tb=line \
    -k "fallback or forced_clusters or (adversarial and 20000) or long_rows" 2>&1 | tail -4 | tee -a "$OUT/gpu.log"
fi
echo "== $(date +%T) done" | tee -a "$OUT/gpu.log"
