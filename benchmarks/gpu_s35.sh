#!/usr/bin/env bash
# Session 35's device plan:
#   BUDGET=560 bash benchmarks/gpu_s35.sh a   the GPU tests of CTESTS (merged Qwen3-VL, LLaVA-OneVision),
#                                             Gemma-3-4B's decode steps on the host (the KV groups' fast
#                                             path), then benchmarks/vlm.py on each of VLMCONFIG beside
#                                             transformers
#   BUDGET=500 bash benchmarks/gpu_s35.sh b   the GPU tests of CTESTS, then vlm.py on each of VLMCONFIG
# Results under $OUT (summaries only); logs in /tmp.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
tests() {
  timeout "$(left "$1")" $PT -rfE -s -m gpu ${CTESTS:?CTESTS: the test files} 2>&1 \
    | tee "$OUT/gpu_session35_tests_$PART.txt" | grep -E "agreement|passed|failed|Error|assert" | tail -n 16
}
vlms() {
  for c in ${VLMCONFIG:-}; do
    timeout "$(left "$1")" python3 benchmarks/vlm.py --config "$c" --json-out "$OUT/vlm_$c.json" 2>&1 \
      | grep -v "^INFO" | grep -v -i warn | tail -n 8
  done
}
case "$PART" in
a)
  tests 240
  timeout "$(left 150)" python3 benchmarks/profile_engine_step.py --config gemma-3-4b-it --batch 64 256 \
    --context 512 --steps 20 2>&1 | grep -v "^INFO" | tee "$OUT/profile_gemma3_steps.txt" | tail -n 24
  vlms 200
  echo "part a done at ${SECONDS}s" ;;
b)
  tests 300
  vlms 200
  echo "part b done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-b)"; exit 2 ;;
esac
