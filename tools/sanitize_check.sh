#!/usr/bin/env bash
# compute-sanitizer memcheck, racecheck and synccheck over one tiny case of every op (tools/sanitize_cases.py:
# prefill logits incl. compressed and bf16, metadata, decode logits incl. 2-D context lens, next_n > 1 and varlen,
# clean_logits, every top-k form, the fused logits -> top-k calls, every training kernel). One line per tool and
# case (clean / N reports); exits 1 on any report not in sanitize_cases.SUPPRESSIONS, or on a case that did not
# finish. Run from the repo root on the GPU machine:
#   tools/sanitize_check.sh                      (installs the carried .whl wheels and builds, unless BUILD=0)
# env: TOOLS="memcheck racecheck synccheck", CASES="name ..." (tools/sanitize_cases.py --list), TOOL_TIMEOUT=s
set -uo pipefail
export OUT=${OUT:-$PWD/.out} PYTHONUNBUFFERED=1 DI_JIT_CACHE_DIR=${DI_JIT_CACHE_DIR:-/tmp/di_cache}
mkdir -p "$OUT"
if [ "${BUILD:-1}" = 1 ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  CC=/usr/bin/gcc CXX=/usr/bin/g++ python3 -m pip install -e . --no-build-isolation --no-deps >"$OUT/build.log" 2>&1 \
    || { tail -20 "$OUT/build.log"; exit 1; }
fi
ONLY=${CASES:+--only $CASES}
# Compile the cases' kernels outside the sanitizer (in parallel where precompile knows them; the plain run
# compiles the rest and shows the cases run at all).
t0=$SECONDS
python3 tools/sanitize_cases.py --precompile "$(nproc)" 2>&1 | tee "$OUT/sanitize_precompile.log"
echo "precompile: $((SECONDS - t0)) s"
t0=$SECONDS
python3 tools/sanitize_cases.py $ONLY >"$OUT/sanitize_plain.log" 2>&1 || { tail -30 "$OUT/sanitize_plain.log"; exit 1; }
echo "plain run: $((SECONDS - t0)) s"
rc=0
for tool in ${TOOLS:-memcheck racecheck synccheck}; do
  t0=$SECONDS
  timeout "${TOOL_TIMEOUT:-400}" compute-sanitizer --tool "$tool" --target-processes application-only --print-limit 200 \
    python3 tools/sanitize_cases.py $ONLY >"$OUT/sanitize_$tool.log" 2>&1
  trc=$?
  echo "== $tool: $((SECONDS - t0)) s (exit $trc)"
  python3 tools/sanitize_cases.py --parse "$OUT/sanitize_$tool.log" --tool "$tool" | tee "$OUT/sanitize_$tool.txt" || rc=1
  [ "$trc" = 124 ] && { echo "$tool: timed out"; rc=1; }
done
echo "sanitize: $([ $rc = 0 ] && echo clean || echo REPORTS) (logs: $OUT/sanitize_*.log)"
exit $rc
