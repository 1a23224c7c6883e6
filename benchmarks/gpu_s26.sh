#!/usr/bin/env bash
# Session 26's device plan:
#   BUDGET=440 bash benchmarks/gpu_s26.sh mxfp4   the MXFP4 fused kernel's forms (tile, split,
#                                                 scaled: kernels/fused_moe.MXFP4_FORMS): their
#                                                 GPU tests, then each form at MXFP4_TILES on
#                                                 gpt-oss-20b's expert shape beside the bf16
#                                                 kernel (benchmarks/fused_moe.py --mxfp4-sweep);
#                                                 GPT-OSS's model GPU tests (kept MXFP4 experts in
#                                                 the default form); Llama 4's GPU tests
#   BUDGET=560 bash benchmarks/gpu_s26.sh b       the MXFP4 kernel and GPT-OSS GPU tests (the
#                                                 "scaled" form the bf16 default), its tiles
#                                                 swept (block_m doubled too; T up to 512), then
#                                                 gpt-oss-20b end to end with bf16 and with MXFP4
#                                                 experts, gpt-oss-120b on one H200 (MXFP4 kept:
#                                                 FLASHPAGE_MXFP4=auto, the default now); the
#                                                 MTP layer's graphs' GPU tests before the e2e
#   BUDGET=430 bash benchmarks/gpu_s26.sh c       GPT-OSS's GPU tests; gpt-oss-20b end to end with
#                                                 bf16 and MXFP4 experts, gpt-oss-120b (its MXFP4
#                                                 experts on the fused kernel at every step size
#                                                 now); JSON under $OUT, logs in /tmp (the device
#                                                 returns ~8 files)
#   BUDGET=280 bash benchmarks/gpu_s26.sh d       the fp8 W8A8 block GEMM's candidate tiles timed
#                                                 (benchmarks/fp8_block_gemm.py --sweep), EAGLE's
#                                                 GPU tests, the kept-MXFP4 GPT-OSS GPU test, the
#                                                 W8A8 candidates' GPU test
# Results under $OUT. Every step under `timeout "$(left N)"` (gpu_lib.sh).
PART=${1:-mxfp4}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
mxfp4)
  timeout "$(left 120)" $PT -rf -m gpu tests/kernels/test_fused_moe_mxfp4.py \
    2>&1 | tee "$OUT/gpu_mxfp4_kernel_tests.txt" | tail -n 8
  timeout "$(left 200)" python3 benchmarks/fused_moe.py --model gpt-oss-20b --mxfp4-sweep --out "$OUT" \
    > "$OUT/fused_moe_sweep.txt" 2>&1
  tail -n 3 "$OUT/fused_moe_sweep.txt"; grep -E "mxfp4|fused \(" "$OUT/fused_moe_gpt-oss-20b.md" | cut -c1-150
  timeout "$(left 90)" $PT -rf -m gpu tests/models/test_gpt_oss.py 2>&1 | tee "$OUT/gpu_gpt_oss_tests.txt" | tail -n 6
  timeout "$(left 90)" $PT -rf -m gpu tests/models/test_llama4.py 2>&1 | tee "$OUT/gpu_llama4_tests.txt" | tail -n 6
  echo "part mxfp4 done at ${SECONDS}s" ;;
b)
  timeout "$(left 110)" $PT -rf -m gpu tests/kernels/test_fused_moe_mxfp4.py tests/models/test_gpt_oss.py \
    2>&1 | tee "$OUT/gpu_mxfp4_tests.txt" | tail -n 6
  timeout "$(left 130)" python3 benchmarks/fused_moe.py --model gpt-oss-20b --mxfp4-sweep --out "$OUT" \
    > "$OUT/fused_moe_sweep.txt" 2>&1
  tail -n 2 "$OUT/fused_moe_sweep.txt"; grep -E "fused mxfp4 \(|fused \(" "$OUT/fused_moe_gpt-oss-20b.md" | cut -c1-140
  timeout "$(left 110)" $PT -rf -m gpu tests/engine/test_mtp_graphs.py tests/engine/test_mtp_draft.py \
    2>&1 | tee "$OUT/gpu_mtp_tests.txt" | tail -n 6
  BUDGET=$((B - SECONDS)) bash "$(dirname "$0")/gpu_mxfp4.sh" e2e
  echo "part b done at ${SECONDS}s" ;;
c)
  timeout "$(left 100)" $PT -rf -m gpu tests/models/test_gpt_oss.py 2>&1 | tee "$OUT/gpu_gpt_oss_tests.txt" | tail -n 4
  MXFP4='{"quantization_config": {"quant_method": "mxfp4"}}'
  for run in "20b 0 64" "20b 1 64" "120b 1 32"; do
    set -- $run
    extra=(); [ "$2" = 1 ] && extra=(--hf-overrides "$MXFP4")
    timeout "$(left 150)" python3 -m flashpage bench throughput --config gpt-oss-$1 \
      --gpu-memory-utilization 0.88 --num-requests $3 --no-hf ${extra[@]+"${extra[@]}"} \
      --json-out "$OUT/throughput_gptoss$1_mxfp4$2.json" > "/tmp/throughput_gptoss$1_mxfp4$2.txt" 2>&1
    grep -E "MXFP4 experts|loaded" "/tmp/throughput_gptoss$1_mxfp4$2.txt" | cut -c1-160
    tp_summary "$OUT/throughput_gptoss$1_mxfp4$2.json"
  done
  echo "part c done at ${SECONDS}s" ;;
d)
  timeout "$(left 100)" python3 benchmarks/fp8_block_gemm.py --sweep --json-out "$OUT/fp8_block_sweep.json" \
    > /tmp/fp8_block_sweep.txt 2>&1
  grep " best " /tmp/fp8_block_sweep.txt; tail -n 2 /tmp/fp8_block_sweep.txt
  timeout "$(left 70)" $PT -rf -m gpu tests/engine/test_eagle_draft.py 2>&1 | tee "$OUT/gpu_eagle_tests.txt" | tail -n 4
  timeout "$(left 70)" $PT -rf -m gpu tests/models/test_gpt_oss.py -k mxfp4_experts_kept 2>&1 \
    | tee "$OUT/gpu_gpt_oss_kept_test.txt" | tail -n 4
  timeout "$(left 60)" $PT -rf -m gpu tests/kernels/test_fp8_block_gemm.py -k "w8a8 or fp8_block_linear_paths" \
    2>&1 | tee "$OUT/gpu_fp8_block_tests.txt" | tail -n 4
  echo "part d done at ${SECONDS}s" ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
