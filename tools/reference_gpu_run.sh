#!/usr/bin/env bash
# Side by side with the reference implementation's prefill kernel on the GPU machine (through the
# device tool, carrying .whl with the wheels and .whl/deepgemm_ref.so; see tools/deepgemm_ref.cu):
# builds, then A/Bs P2 at every H / D in one process and runs the benchmark with --compare.
#   tools/reference_gpu_run.sh [HEADS:DIM ...]   (default: 64:128 32:64 32:128 64:64)
set -uo pipefail
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DI_JIT_CACHE_DIR=${DI_JIT_CACHE_DIR:-/tmp/di_cache}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/tools DI_BENCH_COMMIT=${DI_BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$OUT/gpu.txt"
CC=/usr/bin/gcc CXX=/usr/bin/g++ python3 -m pip install -q -e . --no-build-isolation --no-deps >"$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
HD=${*:-64:128 32:64 32:128 64:64}
specs=""
for hd in $HD; do specs="$specs 4096:32768:causal:$hd"; done
python3 tools/ab.py --compare deepgemm_ref --variants "" --rounds ${ROUNDS:-5} --iters 20 $specs 2>&1 | tee "$OUT/ab_reference.log"
for hd in $HD; do
  python3 -m deep_indexer bench --png "" --compare deepgemm_ref --shapes ${BENCH_SHAPES:-P1 P2 P3 P4 P5} \
    --heads ${hd%:*} --head-dim ${hd#*:} --json "$OUT/bench_reference_h${hd%:*}_d${hd#*:}.json" 2>&1 \
    | grep -v '^\[' | tee "$OUT/bench_reference_h${hd%:*}_d${hd#*:}.log"
done
