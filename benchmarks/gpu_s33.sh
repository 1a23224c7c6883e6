#!/usr/bin/env bash
# Session 33's device plan:
#   BUDGET=240 bash benchmarks/gpu_s33.sh a   the Pixtral and Qwen2-VL GPU tests with their agreement rates
#                                             printed (Pixtral over 256 tokens)
#   BUDGET=560 bash benchmarks/gpu_s33.sh b   the GPU tests of the session's image / video work (CTESTS: the
#                                             files), then benchmarks/vlm.py on Gemma 3 (VLMCONFIG)
# Results under $OUT (summaries only: the device returns ~8 files); logs in /tmp.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 230)" $PT -rfE -s -m gpu tests/engine/test_pixtral_engine.py tests/engine/test_qwen2_vl_engine.py \
    2>&1 | tee "$OUT/gpu_session33_tests_a.txt" | grep -E "agreement|passed|failed|Error|assert" | tail -n 14
  echo "part a done at ${SECONDS}s" ;;
b)
  timeout "$(left 330)" $PT -rfE -s -m gpu ${CTESTS:?CTESTS: the test files} 2>&1 \
    | tee "$OUT/gpu_session33_tests_b.txt" | grep -E "agreement|passed|failed|Error|assert" | tail -n 16
  for c in ${VLMCONFIG:-}; do
    timeout "$(left 200)" python3 benchmarks/vlm.py --config "$c" --json-out "$OUT/vlm_$c.json" 2>&1 \
      | grep -v "^INFO" | tail -n 4
  done
  echo "part b done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-b)"; exit 2 ;;
esac
