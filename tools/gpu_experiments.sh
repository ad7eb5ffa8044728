#!/usr/bin/env bash
# A/B runs on the GPU machine after tools/gpu_check.sh has built the extension (same $OUT):
#   * prefill with the -inf fill fused into the kernel vs the separate pass (DI_MQA_FUSED_CLEAN)
#   * an experimental kernel variant compiled with extra flags (DI_JIT_EXTRA_FLAGS)
#   * `bench --compare deep_indexer.baseline` (the plain-PyTorch stand-in) on a few shapes
# Every run measures the ceilings first, which also brings the GPU to its working clocks (a run that
# starts cold measured up to 12% slower). Tables go to $OUT/gpu.log; only the comparison writes JSON.
# env: AB_SHAPES (default "P1 P2 P4"), EXP_FLAGS (default -DDI_MQA_SNAKE=0), EXP_SHAPES (default "P1 P2"),
#      COMPARE_SHAPES (default "P1 D1 D2 D3"); an empty value skips that part.
set -uo pipefail
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DI_JIT_CACHE_DIR=${DI_JIT_CACHE_DIR:-/tmp/di_cache}
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
log() { echo "== $(date +%T) $*" | tee -a "$OUT/gpu.log"; }
bench() { python3 -m deep_indexer bench --png '' "$@" 2>&1 | grep -v '^\[' | tee -a "$OUT/gpu.log"; }

AB_SHAPES=${AB_SHAPES-P1 P2 P4}
if [ -n "$AB_SHAPES" ]; then
  for f in 0 1; do
    log "DI_MQA_FUSED_CLEAN=$f: $AB_SHAPES"
    DI_MQA_FUSED_CLEAN=$f bench --shapes $AB_SHAPES --json ""
  done
fi
EXP_FLAGS=${EXP_FLAGS--DDI_MQA_SNAKE=0}
EXP_SHAPES=${EXP_SHAPES-P1 P2}
if [ -n "$EXP_FLAGS" ] && [ -n "$EXP_SHAPES" ]; then
  log "DI_JIT_EXTRA_FLAGS='$EXP_FLAGS': $EXP_SHAPES"
  DI_JIT_EXTRA_FLAGS="$EXP_FLAGS" bench --shapes $EXP_SHAPES --json ""
fi
COMPARE_SHAPES=${COMPARE_SHAPES-P1 D1 D2 D3}
if [ -n "$COMPARE_SHAPES" ]; then
  log "compare with deep_indexer.baseline: $COMPARE_SHAPES"
  bench --shapes $COMPARE_SHAPES --iters 10 --compare deep_indexer.baseline --json "$OUT/compare.json"
fi
log "experiments done"
