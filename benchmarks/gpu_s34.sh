#!/usr/bin/env bash
# Session 34's device plan:
#   BUDGET=560 bash benchmarks/gpu_s34.sh a   the GPU tests of CTESTS (files; agreement rates printed),
#                                             then benchmarks/vlm.py on each of VLMCONFIG
# Results under $OUT (summaries only: the device returns ~8 files); logs in /tmp.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 330)" $PT -rfE -s -m gpu ${CTESTS:?CTESTS: the test files} 2>&1 \
    | tee "$OUT/gpu_session34_tests_a.txt" | grep -E "agreement|passed|failed|Error|assert" | tail -n 16
  for c in ${VLMCONFIG:-}; do
    timeout "$(left 240)" python3 benchmarks/vlm.py --config "$c" --json-out "$OUT/vlm_$c.json" 2>&1 \
      | grep -v "^INFO" | tail -n 6
  done
  echo "part a done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a)"; exit 2 ;;
esac
