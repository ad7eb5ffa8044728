#!/usr/bin/env bash
# Top-k experiment on the GPU machine (run from the repo root through the device tool): build, the
# top-k GPU tests, the K-* bench, then A/B variants of the tuning switches on a few shapes.
#   OUT=... bash tools/topk_ab.sh [tests|notests]
set -uo pipefail
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DI_JIT_CACHE_DIR=${DI_JIT_CACHE_DIR:-/tmp/di_cache}
if [ "${1:-tests}" = tests ]; then
  PRECOMPILE=0 TESTS=tests/test_topk.py TEST_TIMEOUT=${TEST_TIMEOUT:-150} MAXFAIL=10 bash tools/gpu_check.sh tests
else
  PRECOMPILE=0 TESTS=tests/test_topk.py bash tools/gpu_check.sh none
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
B=(python3 -m deep_indexer bench --png "" --no-kernel-time --iters "${ITERS:-20}")
run() {  # name, env..., -- shapes...
  local name=$1 X=${X:-}; shift
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  echo "== $(date +%T) $name ${envs[*]}" | tee -a "$OUT/ab.log"
  env "${envs[@]}" timeout 120 "${B[@]}" $X --json "$OUT/topk-$name.json" --shapes "$@" 2>&1 | grep -E "K-|heuristic topk|rror" | tee -a "$OUT/ab.log"
}
X= run all DI_JIT_DEBUG=1 -- topk
X=--no-ceilings

for v in ${VARIANTS:-base}; do
  case $v in
    base) run base -- K-D1 K-D2 K-D5 K-D8 K-P2 K-P3 K-P5 ;;
    cluster1) run cluster1 DI_TOPK_CLUSTER=1 -- K-D1 K-D2 K-D3 ;;
    cluster2) run cluster2 DI_TOPK_CLUSTER=2 -- K-D1 K-D2 K-D3 ;;
    cluster4) run cluster4 DI_TOPK_CLUSTER=4 -- K-D1 K-D2 ;;
    cluster8) run cluster8 DI_TOPK_CLUSTER=8 -- K-D1 ;;
  esac
done
