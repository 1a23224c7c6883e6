#!/usr/bin/env bash
# Session 17's second device plan: speculative decoding (engine/spec_decode.py) and fp8 weights
# (layers/quant.py) on the H200, neither run on a GPU before.
#   BUDGET=560 bash benchmarks/gpu_s17b.sh a   GPU tests (spec decode with graphs; the fp8 kernels and
#                                              engine), then 8B batch-1 latency bf16 vs fp8 (same call)
#   BUDGET=560 bash benchmarks/gpu_s17b.sh b   benchmarks/spec_decode.py on the 8B (plain / ngram / all
#                                              right / all wrong drafts, batch 1 and 8), then offline
#                                              throughput bf16 vs fp8
# Results under $OUT; each step cut to what is left of BUDGET (default 400) seconds.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 90)" $PT -m gpu tests/engine/test_spec_decode.py -rf 2>&1 | tee "$OUT/spec_gpu_tests.txt" | tail -n 3
  timeout "$(left 200)" $PT -m gpu tests/kernels/test_gemv_fp8.py tests/models/test_fp8_weights.py \
    tests/kernels/test_gemv.py -rf 2>&1 | tee "$OUT/fp8_gpu_tests.txt" | tail -n 6
  latency bf16
  latency fp8 --quantization fp8
  echo "part a done at ${SECONDS}s" ;;
b)
  timeout "$(left 200)" python3 benchmarks/spec_decode.py --config llama-3-8b --batch-sizes 1 8 --ks 2 4 \
    --json-out "$OUT/spec_decode.json" 2>&1 | tee "$OUT/spec_decode.txt" | grep "^batch"
  throughput bf16
  throughput fp8 --quantization fp8
  echo "part b done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-b)"; exit 2 ;;
esac
