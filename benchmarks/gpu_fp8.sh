#!/usr/bin/env bash
# FP8 weights (quantization="fp8", layers/quant.py) on the GPU: bf16 against fp8, 8B shape, random weights.
#   BUDGET=570 bash benchmarks/gpu_fp8.sh a   the fp8 GPU tests first (kernels: gemv_row / skinny over e4m3,
#                                             the per-token quantizer, _scaled_mm against its emulation;
#                                             engine: bf16 logits vs fp8 with CUDA graphs, 8B-shaped layers),
#                                             then batch-1 decode latency: bf16, fp8 (our GEMV, W8A16), and
#                                             fp8 with FLASHPAGE_GEMV=0 (W8A8 _scaled_mm at one row)
#   BUDGET=570 bash benchmarks/gpu_fp8.sh b   offline throughput (bench throughput's default workload: 256
#                                             requests, 100-1024 in / out): bf16, fp8, fp8 + fp8 KV cache
#   BUDGET=570 bash benchmarks/gpu_fp8.sh c   decode batch 8 latency, fp8 with the skinny GEMM tuned (default)
#                                             and off (FLASHPAGE_SKINNY_GEMM=0: W8A8 at 8 rows), then the
#                                             one-row GEMV kernel table over e4m3 weights (benchmarks/gemv.py --fp8)
# Results under $OUT (latency_*.json, throughput_*.json, *_tests.txt, gemv_fp8.*); each step cut to what
# is left of BUDGET (default 400) seconds. No carry needed (random weights; configs in benchmarks/configs).
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 200)" $PT -m gpu tests/kernels/test_gemv_fp8.py tests/models/test_fp8_weights.py \
    tests/kernels/test_gemv.py -rf 2>&1 | tee "$OUT/fp8_gpu_tests.txt" | tail -n 6
  latency bf16
  latency fp8 --quantization fp8
  FLASHPAGE_GEMV=0 latency fp8_w8a8_row --quantization fp8
  echo "part a done at ${SECONDS}s" ;;
b)
  throughput bf16
  throughput fp8 --quantization fp8
  throughput fp8_kv8 --quantization fp8 --kv-cache-dtype fp8
  echo "part b done at ${SECONDS}s" ;;
c)
  latency fp8_b8 --quantization fp8 --batch-size 8
  FLASHPAGE_SKINNY_GEMM=0 latency fp8_b8_w8a8 --quantization fp8 --batch-size 8
  latency bf16_b8 --batch-size 8
  timeout "$(left 150)" python3 benchmarks/gemv.py --fp8 --only shapes --out "$OUT" 2>&1 \
    | tee "$OUT/gemv_fp8.txt" | tail -n 40
  echo "part c done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-c)"; exit 2 ;;
esac
