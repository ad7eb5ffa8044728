#!/bin/bash
# One device call: build, the training GPU tests, per-kernel times and the training bench; logs into $OUT.
# KT_TOKENS: the kernel-times sizes (default 16384), KT_ARGS: their extra arguments (--logits-only).
# Run from the repository root (the device's working copy); expects PYTHONPATH with the carried wheels.
set -u
export PYTHONUNBUFFERED=1 DI_JIT_CACHE_DIR=/tmp/di_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
commit=$(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null); export DI_BENCH_COMMIT=$commit
echo "commit $commit" | tee "$OUT/summary.log"
t0=$(date +%s)
CC=/usr/bin/gcc CXX=/usr/bin/g++ python3 -m pip install -q -e . --no-build-isolation --no-deps > "$OUT/build.log" 2>&1 \
  || { echo "BUILD FAILED"; tail -30 "$OUT/build.log"; exit 1; }
echo "build $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.log"
python3 -m deep_indexer precompile --ops training_target training_logits_stats training_indexer_dk training_indexer_dq \
  training_logits training_per_head_rows training_per_head_dk > "$OUT/precompile.log" 2>&1; tail -2 "$OUT/precompile.log" | tee -a "$OUT/summary.log"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/test_training_sm90.py tests/test_training.py -q -rf \
  -p no:cacheprovider ${PYTEST_ARGS:-} > "$OUT/tests.log" 2>&1; echo "tests rc $?" | tee -a "$OUT/summary.log"
tail -25 "$OUT/tests.log" | tee -a "$OUT/summary.log"
: > "$OUT/kernels.log"
for kt in ${KT_TOKENS:-16384}; do
  timeout ${KT_TIMEOUT:-120} python3 tools/training_kernel_times.py --tokens $kt ${KT_ARGS:-} >> "$OUT/kernels.log" 2>&1
  echo "kernel times $kt rc $?" | tee -a "$OUT/summary.log"
done
tail -24 "$OUT/kernels.log" | tee -a "$OUT/summary.log"
timeout ${BENCH_TIMEOUT:-200} python3 -m deep_indexer.training.bench --case mean logits ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
echo "bench rc $?" | tee -a "$OUT/summary.log"; tail -14 "$OUT/bench.log" | tee -a "$OUT/summary.log"
echo "total $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.log"
