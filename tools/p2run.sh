set -u
OUT=${OUT:-$PWD/.out}; export OUT
export PYTHONUNBUFFERED=1 DI_JIT_CACHE_DIR=/tmp/di_cache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee $OUT/gpu.log
CC=/usr/bin/gcc CXX=/usr/bin/g++ python3 -m pip install -e . --no-build-isolation --no-deps >"$OUT/build.log" 2>&1 || { tail -40 $OUT/build.log; exit 1; }
for w in 2 3 4; do for s in 0 1; do DI_MQA_MATH_WGS=$w DI_MQA_SPLIT_RELU=$s python3 -m deep_indexer precompile --quiet --jobs 16 --ops mqa_logits clean_logits 2>&1 | tail -1; done; done
timeout ${TT:-110} python3 -m pytest tests/test_attention.py -q -p no:cacheprovider --maxfail=5 -rf --tb=line -k "${K:-mqa_logits or prefill}" > $OUT/tests.log 2>&1; tail -5 $OUT/tests.log
python3 -m deep_indexer bench --shapes P2 --png '' 2>&1 | tail -8 | tee $OUT/bench.log
python3 tools/ab.py --rounds 5 --iters 30 --variants "$AB" 4096:32768:causal:32:64 4096:32768:causal:32:128 4096:32768:causal:64:64 4096:32768:causal:64:128 4096:32768:causal:16:64 2>&1 | tee $OUT/ab.log
