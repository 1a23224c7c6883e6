#!/usr/bin/env bash
# Session 32's device plan:
#   BUDGET=420 bash benchmarks/gpu_s32.sh a   image requests: the LLaVA GPU test (the text before an image
#                                             now shared), benchmarks/vlm.py on the LLaVA-1.5-7B shape
#                                             against transformers, then the recapturing sleep form's
#                                             token changes measured (logprob margins where they differ)
#   BUDGET=600 bash benchmarks/gpu_s32.sh b   the recapturing sleep form again after the TMA descriptor fix,
#                                             the GPU tests of the helpers' features (CTESTS: the files), then
#                                             vlm.py's text twin on LLaVA-1.5-7B and Qwen2.5-VL-7B (ours)
#   BUDGET=480 bash benchmarks/gpu_s32.sh c   Qwen2.5-VL-7B's images after the device-side preprocessing (the
#                                             tower's share timed), the VLM GPU tests (CTESTS), LLaVA's share
#   BUDGET=560 bash benchmarks/gpu_s32.sh d   the VLM GPU tests (CTESTS), the Qwen2.5-VL tower with our kernels,
#                                             the Qwen2.5-VL-7B workload again
# Results under $OUT (summaries only: the device returns ~8 files); logs in /tmp.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 90)" $PT -rfE -m gpu tests/engine/test_llava_engine.py 2>&1 | tail -n 6
  timeout "$(left 300)" python3 benchmarks/vlm.py --json-out "$OUT/vlm.json" 2>&1 | grep -v "^INFO" | tail -n 6
  FLASHPAGE_SLEEP_FIXED_ADDRESSES=0 timeout "$(left 150)" python3 benchmarks/sleep_wake.py --config llama-3-8b \
    --cycles 2 --json-out "$OUT/sleep_recapture.json" 2>&1 | grep -v "^INFO" | tail -n 4
  echo "part a done at ${SECONDS}s" ;;
b)
  FLASHPAGE_SLEEP_FIXED_ADDRESSES=0 timeout "$(left 150)" python3 benchmarks/sleep_wake.py --config llama-3-8b \
    --cycles 2 --json-out "$OUT/sleep_recapture_fixed.json" 2>&1 | grep -v "^INFO" | tail -n 3
  timeout "$(left 300)" $PT -rfE -m gpu ${CTESTS:?CTESTS: the test files} 2>&1 | tee "$OUT/gpu_session32_tests.txt" | tail -n 14
  timeout "$(left 150)" python3 benchmarks/vlm.py --hf-requests 0 --json-out "$OUT/vlm_twin.json" 2>&1 \
    | grep -v "^INFO" | tail -n 3
  timeout "$(left 200)" python3 benchmarks/vlm.py --config qwen2.5-vl-7b --json-out "$OUT/vlm_qwen.json" 2>&1 \
    | grep -v "^INFO" | tail -n 4
  echo "part b done at ${SECONDS}s" ;;
c)
  timeout "$(left 200)" python3 benchmarks/vlm.py --config qwen2.5-vl-7b --json-out "$OUT/vlm_qwen_c.json" 2>&1 \
    | grep -v "^INFO" | tail -n 3
  timeout "$(left 300)" $PT -rfE -m gpu ${CTESTS:?CTESTS: the test files} 2>&1 | tee "$OUT/gpu_session32_tests_c.txt" | tail -n 14
  timeout "$(left 150)" python3 benchmarks/vlm.py --hf-requests 0 --json-out "$OUT/vlm_llava_c.json" 2>&1 \
    | grep -v "^INFO" | tail -n 3
  echo "part c done at ${SECONDS}s" ;;
d)
  timeout "$(left 300)" $PT -rfE -m gpu ${CTESTS:?CTESTS: the test files} 2>&1 | tee "$OUT/gpu_session32_tests_d.txt" \
    | grep -E "passed|failed|Error|assert" | tail -n 12
  timeout "$(left 120)" python3 benchmarks/vision_tower.py --config qwen2.5-vl-7b --images 26 \
    --json-out "$OUT/tower_d.json" 2>&1 | grep -v -i warn | tail -n 2
  timeout "$(left 200)" python3 benchmarks/vlm.py --config qwen2.5-vl-7b --json-out "$OUT/vlm_qwen_e.json" 2>&1 \
    | grep -v "^INFO" | tail -n 2
  echo "part d done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-d)"; exit 2 ;;
esac
