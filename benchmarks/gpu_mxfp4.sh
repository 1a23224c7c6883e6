#!/usr/bin/env bash
# Device plan for GPT-OSS's MXFP4 experts kept in 4 bits (kernels/fused_moe.fused_moe_mxfp4):
#   BUDGET=560 bash benchmarks/gpu_mxfp4.sh check   the MXFP4 GPU tests (bf16 decode of every
#                                                   byte at every scale, gpt-oss-20b's expert
#                                                   shape against dequantize + the bf16 kernel,
#                                                   a CUDA graph; the tiny model's kept experts
#                                                   end to end), then benchmarks/fused_moe.py
#                                                   --model gpt-oss-20b (`fused mxfp4` rows)
#   BUDGET=560 bash benchmarks/gpu_mxfp4.sh e2e     gpt-oss-20b's shape end to end, random
#                                                   weights: bf16 experts, then MXFP4 experts
#                                                   (quantization_config through hf_overrides);
#                                                   then gpt-oss-120b's (MXFP4: ~61 GiB of
#                                                   weights) on the one GPU
# Results under $OUT. Every step under `timeout "$(left N)"` (gpu_lib.sh).
PART=${1:-check}
source "$(dirname "$0")/gpu_lib.sh"
MXFP4='{"quantization_config": {"quant_method": "mxfp4"}}'
case "$PART" in
check)
  timeout "$(left 240)" $PT -rf -m gpu tests/kernels/test_fused_moe_mxfp4.py tests/models/test_gpt_oss.py \
    2>&1 | tee "$OUT/gpu_mxfp4_tests.txt" | tail -n 6
  timeout "$(left 150)" python3 benchmarks/fused_moe.py --model gpt-oss-20b --out "$OUT" > "$OUT/fused_moe.txt" 2>&1
  tail -n 5 "$OUT/fused_moe.txt"; grep -E "mxfp4|fused \(" "$OUT/fused_moe_gpt-oss-20b.md"
  echo "part check done at ${SECONDS}s" ;;
e2e)
  for mx in 0 1; do
    extra=(); [ "$mx" = 1 ] && extra=(--hf-overrides "$MXFP4")
    timeout "$(left 170)" python3 -m flashpage bench throughput --config gpt-oss-20b \
      --gpu-memory-utilization 0.85 --num-requests 64 --no-hf ${extra[@]+"${extra[@]}"} \
      --json-out "$OUT/throughput_gptoss20b_mxfp4$mx.json" > "$OUT/throughput_gptoss20b_mxfp4$mx.txt" 2>&1
    tail -n 8 "$OUT/throughput_gptoss20b_mxfp4$mx.txt"
  done
  timeout "$(left 200)" python3 -m flashpage bench throughput --config gpt-oss-120b \
    --gpu-memory-utilization 0.9 --num-requests 32 --no-hf \
    --json-out "$OUT/throughput_gptoss120b.json" > "$OUT/throughput_gptoss120b.txt" 2>&1
  tail -n 8 "$OUT/throughput_gptoss120b.txt"
  echo "part e2e done at ${SECONDS}s" ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
