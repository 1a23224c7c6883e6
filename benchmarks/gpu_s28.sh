#!/usr/bin/env bash
# Session 28's device plan:
#   BUDGET=330 bash benchmarks/gpu_s28.sh a   the fp8 / int4 MoE model GPU tests after session 27's
#                                             shared assert_kept_experts_follow_the_twin (not re-run
#                                             since); the int4 MoE kernel timed on its default
#                                             (64-row k64 past 16 pairs an expert: 512 tokens untimed)
#   BUDGET=560 bash benchmarks/gpu_s28.sh b   the int4 "fragment" W4A16 tiles (kernels/int4_fragment.py:
#                                             decoded weights in wgmma's A registers) and the kernels
#                                             the shared grouped_tile / wgmma_a_rows touched: GPU tests;
#                                             --sweep at 64-256 rows in bf16 and fp16 beside the
#                                             current tiles, dequant + cuBLAS and bf16
# Results under $OUT (summaries only: the device returns ~8 files); logs in /tmp.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 110)" $PT -rf -m gpu tests/models/test_fp8_moe_experts.py tests/models/test_int4_moe_experts.py 2>&1 \
    | tee "$OUT/gpu_moe_model_tests.txt" | tail -n 4
  timeout "$(left 150)" python3 benchmarks/fused_moe.py --int4 --out /tmp/moe > /tmp/int4_moe_bench.txt 2>&1
  tail -n 2 /tmp/int4_moe_bench.txt; cp /tmp/moe/fused_moe_int4.json "$OUT/"; grep "^| " /tmp/moe/fused_moe_int4.md | cut -c1-170
  echo "part a done at ${SECONDS}s" ;;
b)
  timeout "$(left 200)" $PT -rf -m gpu tests/kernels/test_int4_fragment_gemm.py tests/kernels/test_int4_swap_gemm.py \
    tests/kernels/test_int4_gemm.py tests/kernels/test_fp8_block_gemm.py tests/kernels/test_fused_moe_mxfp4_swap.py \
    tests/models/test_int4_checkpoints.py 2>&1 | tee "$OUT/gpu_int4_fragment_tests.txt" | tail -n 6
  for dt in bf16 fp16; do
    timeout "$(left 150)" python3 benchmarks/int4_gemm.py --sweep --rows 64,100,128,256 --dtype $dt \
      --json-out "$OUT/int4_fragment_sweep_$dt.json" > /tmp/int4_fragment_sweep_$dt.txt 2>&1
    tail -n 40 /tmp/int4_fragment_sweep_$dt.txt | cut -c1-200
  done
  cat /tmp/int4_fragment_sweep_*.txt > "$OUT/int4_fragment_sweep.txt"
  echo "part b done at ${SECONDS}s" ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
