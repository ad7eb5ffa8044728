#!/usr/bin/env bash
# compute-sanitizer memcheck over edge-case GPU tests of the decode (next_n 5-8, one q slot, varlen),
# compressed prefill and top-k kernels. Run from the repo root on the GPU machine (carried .whl wheels).
set -uo pipefail
export OUT=${OUT:-$PWD/.out} PYTHONUNBUFFERED=1 DI_JIT_CACHE_DIR=/tmp/di_cache
mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
CC=/usr/bin/gcc CXX=/usr/bin/g++ python3 -m pip install -e . --no-build-isolation --no-deps >$OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
python3 -m deep_indexer precompile --quiet --jobs 16 --ops topk paged_mqa_logits paged_mqa_logits_metadata mqa_logits clean_logits \
  --heads 64 128 --head-dims 128 --next-n 1 5 8 --block-kv 64 2>&1 | tail -1
T="tests/test_attention.py::test_paged_varlen[False-64-128-64-mixed] tests/test_attention.py::test_paged_varlen[True-64-128-64-long_run]
tests/test_attention.py::test_paged_long_mtp_all_configs[True-8-64-128-64] tests/test_attention.py::test_paged_long_mtp_all_configs[False-8-128-128-64]
tests/test_attention.py::test_paged_long_mtp_all_configs[False-5-64-128-64] tests/test_attention.py::test_mqa_logits_compressed_edge_cases"
timeout 140 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 python3 -m pytest -q -p no:cacheprovider -x $T 2>&1 | tee $OUT/sanitizer_attention.log | tail -6
echo "rc attention: ${PIPESTATUS[0]}"
timeout 140 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 python3 -m pytest -q -p no:cacheprovider -x tests/test_topk.py -k "long_rows or decode_grouping" 2>&1 | tee $OUT/sanitizer_topk.log | tail -6
echo "rc topk: ${PIPESTATUS[0]}"
