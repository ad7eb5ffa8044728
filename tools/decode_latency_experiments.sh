#!/usr/bin/env bash
# Small-batch decode latency experiments on the GPU machine (after tools/gpu_check.sh has built the
# extension into the same environment, or with BUILD=1):
#   * kernel timelines (tools/kernel_trace.py) of each flag set in TRACE_VARIANTS (';'-separated)
#   * event-timed bench of BENCH_SHAPES under each flag set in BENCH_VARIANTS (';'-separated)
# Logs go to $OUT/latency.log.
set -uo pipefail
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DI_JIT_CACHE_DIR=${DI_JIT_CACHE_DIR:-/tmp/di_cache}
if [ "${BUILD:-0}" = 1 ]; then  # wheels + build only (no precompile, tests or bench)
  PRECOMPILE=0 bash tools/gpu_check.sh build || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
LOG="$OUT/latency.log"
log() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
TRACE_SHAPES=${TRACE_SHAPES-D1 D2}
IFS=';' read -ra TV <<<"${TRACE_VARIANTS-}"
for v in "${TV[@]}"; do
  log "trace [$v]: $TRACE_SHAPES"
  DI_JIT_EXTRA_FLAGS="$v" python3 tools/kernel_trace.py $TRACE_SHAPES 2>&1 | tee -a "$LOG"
done
BENCH_SHAPES=${BENCH_SHAPES-D1 D2 D5}
IFS=';' read -ra BV <<<"${BENCH_VARIANTS-}"
for v in "${BV[@]}"; do
  log "bench [$v]: $BENCH_SHAPES"
  DI_JIT_EXTRA_FLAGS="$v" python3 -m deep_indexer bench --shapes $BENCH_SHAPES --json "" --png "" 2>&1 | grep -v '^\[' | tee -a "$LOG"
done
log "done"
