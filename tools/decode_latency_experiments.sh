#!/usr/bin/env bash
# Small-batch decode latency experiments on the GPU machine (after tools/gpu_check.sh has built the
# extension into the same environment, or with BUILD=1):
#   * kernel timelines (tools/kernel_trace.py) of each variant in TRACE_VARIANTS (';'-separated)
#   * event-timed bench of BENCH_SHAPES under each variant in BENCH_VARIANTS (';'-separated)
#   * Nsight Compute reports of the logits kernel for each "SHAPE[:VARIANT]" in NCU_RUNS (';'-separated);
#     NCU_SOURCE=1: warp-state samples per SASS instruction instead ($OUT/ncu-SHAPE*-sass.csv + .ncu-rep)
# A variant is either compiler flags (starts with '-': DI_JIT_EXTRA_FLAGS) or environment
# assignments (e.g. "DI_PAGED_MATH_WGS=4"); an empty variant is the default build.
# Logs go to $OUT/latency.log (ncu: $OUT/ncu.log).
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
# with_variant VARIANT CMD...: runs CMD under the variant's flags or environment
with_variant() {
  local v=$1
  shift
  if [ "${v:0:1}" = "-" ]; then DI_JIT_EXTRA_FLAGS="$v" "$@"; else env $v "$@"; fi
}
TRACE_SHAPES=${TRACE_SHAPES-D1 D2}
IFS=';' read -ra TV <<<"${TRACE_VARIANTS-}"
for v in "${TV[@]}"; do
  log "trace [$v]: $TRACE_SHAPES"
  with_variant "$v" python3 tools/kernel_trace.py $TRACE_SHAPES 2>&1 | tee -a "$LOG"
done
BENCH_SHAPES=${BENCH_SHAPES-D1 D2 D5}
IFS=';' read -ra BV <<<"${BENCH_VARIANTS-}"
for v in "${BV[@]}"; do
  log "bench [$v]: $BENCH_SHAPES"
  with_variant "$v" python3 -m deep_indexer bench --shapes $BENCH_SHAPES --json "" --png "" 2>&1 | grep -v '^\[' | tee -a "$LOG"
done
IFS=';' read -ra NR <<<"${NCU_RUNS-}"
for r in "${NR[@]}"; do
  shape=${r%%:*}
  v=""
  [ "$shape" != "$r" ] && v=${r#*:}
  log "ncu $shape [$v]" | tee -a "$OUT/ncu.log"
  with_variant "$v" python3 tools/profile_shape.py "$shape" >/dev/null 2>&1  # JIT outside the profiler
  if [ "${NCU_SOURCE:-0}" = 1 ]; then  # warp-state samples per SASS instruction, exported as CSV
    rep="$OUT/ncu-$shape${v:+-$(echo "$v" | tr -c 'A-Za-z0-9' '_')}"
    with_variant "$v" ncu --clock-control none --kernel-name regex:paged_mqa_logits_kernel --launch-skip 2 \
      --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SourceCounters \
      --warp-sampling-interval 0 -f -o "$rep" python3 tools/profile_shape.py "$shape" >>"$OUT/ncu.log" 2>&1
    ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >"$rep-sass.csv" 2>>"$OUT/ncu.log"
    ncu -i "$rep.ncu-rep" --page details >>"$OUT/ncu.log" 2>&1
    continue
  fi
  with_variant "$v" ncu --clock-control none --kernel-name regex:paged_mqa_logits_kernel --launch-skip 2 \
    --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats python3 tools/profile_shape.py "$shape" >>"$OUT/ncu.log" 2>&1
done
log "done"
