#!/usr/bin/env bash
# Session 34's device plan:
#   BUDGET=560 bash benchmarks/gpu_s34.sh a   the GPU tests of CTESTS (files; agreement rates printed),
#                                             then benchmarks/vlm.py on each of VLMCONFIG
#   BUDGET=500 bash benchmarks/gpu_s34.sh b   the SigLIP tower's forms (benchmarks/siglip_tower.py, Gemma 3's),
#                                             the Gemma 3 GPU test, vlm.py on Gemma 3 with a profile
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
b)
  timeout "$(left 150)" python3 benchmarks/siglip_tower.py --config gemma-3-4b-it --batch 16 \
    --json-out "$OUT/siglip_tower.json" 2>&1 | grep -v "^INFO" | head -n 30
  timeout "$(left 120)" $PT -rfE -s -m gpu tests/engine/test_gemma3_engine.py 2>&1 \
    | tee "$OUT/gpu_session34_tests_b.txt" | grep -E "agreement|passed|failed|Error|assert" | tail -n 8
  timeout "$(left 240)" python3 benchmarks/vlm.py --config gemma-3-4b-it --profile 64 --profile-out "$OUT/gemma_profile.txt" \
    --json-out "$OUT/vlm_gemma.json" 2>&1 | grep -v "^INFO" | grep -v -i warn | tail -n 8
  echo "part b done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-b)"; exit 2 ;;
esac
