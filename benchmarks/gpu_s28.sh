#!/usr/bin/env bash
# Session 28's device plan:
#   BUDGET=330 bash benchmarks/gpu_s28.sh a   the int4 MoE "swap" form (kernels/fused_moe_int4_swap.py:
#                                             wgmma A from registers, PTX nibble decode; the default
#                                             to 16 pairs an expert, untimed): its GPU tests and the
#                                             old form's, then --int4 timed (swap and dot tiles, bf16)
#   BUDGET=560 bash benchmarks/gpu_s28.sh b   the int4 "fragment" W4A16 tiles (kernels/int4_fragment.py:
#                                             decoded weights in wgmma's A registers) and the kernels
#                                             the shared grouped_tile / wgmma_a_rows touched: GPU tests;
#                                             --sweep at 64-256 rows in bf16 (DTYPES="bf16 fp16": both) beside the
#                                             current tiles, dequant + cuBLAS and bf16
#   BUDGET=480 bash benchmarks/gpu_s28.sh c   online --quantization fp8 / int4 of routed MoE experts
#                                             (layers/quant.quantize_model): its GPU tests with the fp8 /
#                                             int4 MoE model tests (part a's); DeepSeek-V2-Lite end to
#                                             end (random weights) in bf16 and fp8 (experts e4m3); with
#                                             QUANTS="bf16 fp8 fp8lin" also fp8 linears only
#                                             (FLASHPAGE_FP8_MOE=dequant: before)
#   BUDGET=230 bash benchmarks/gpu_s28.sh d   the swapped block-fp8 MoE form (native e4m3 wgmma, the
#                                             default to 16 pairs an expert, untimed): the fp8 MoE
#                                             kernel's GPU tests, then --fp8 timed
#   BUDGET=420 bash benchmarks/gpu_s28.sh e   after runs 200-203: the int4 fragment tiles' GPU tests (bf16
#                                             the default; fp16 and the 256-row per-weight bits
#                                             expected to fail: xfails), the every-candidate test
#                                             skipping what a fragment tile cannot run, the fp8
#                                             swap GPU test's new bound; the 8B's decode at batch
#                                             128 in bf16 and int4 (the fragment tile at 128 rows;
#                                             run 199: 19,920 / 16,925 tok/s)
#   BUDGET=290 bash benchmarks/gpu_s28.sh f   which int4 GEMM decode path is wrong under fp16 x
#                                             (benchmarks/int4_check.py --tiles); DeepSeek-V2-Lite end
#                                             to end with int4 experts (the MoE "swap" form) and fp8
#                                             linears only (QUANTS of part c)
# Results under $OUT (summaries only: the device returns ~8 files); logs in /tmp.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 150)" $PT -rf -m gpu tests/kernels/test_fused_moe_int4_swap.py tests/kernels/test_fused_moe_int4.py 2>&1 \
    | tee "$OUT/gpu_int4_moe_swap_tests.txt" | tail -n 6
  timeout "$(left 170)" python3 benchmarks/fused_moe.py --int4 --out /tmp/moe > /tmp/int4_moe_bench.txt 2>&1
  tail -n 2 /tmp/int4_moe_bench.txt; cp /tmp/moe/fused_moe_int4.json "$OUT/"; grep "^| " /tmp/moe/fused_moe_int4.md | cut -c1-170
  echo "part a done at ${SECONDS}s" ;;
b)
  timeout "$(left 200)" $PT -rf -m gpu tests/kernels/test_int4_fragment_gemm.py tests/kernels/test_int4_swap_gemm.py \
    tests/kernels/test_int4_gemm.py tests/kernels/test_fp8_block_gemm.py tests/kernels/test_fused_moe_mxfp4_swap.py \
    tests/models/test_int4_checkpoints.py 2>&1 | tee "$OUT/gpu_int4_fragment_tests.txt" | tail -n 6
  for dt in ${DTYPES:-bf16}; do
    timeout "$(left 150)" python3 benchmarks/int4_gemm.py --sweep --rows 64,100,128,256 --dtype $dt \
      --json-out "$OUT/int4_fragment_sweep_$dt.json" > /tmp/int4_fragment_sweep_$dt.txt 2>&1
    tail -n 40 /tmp/int4_fragment_sweep_$dt.txt | cut -c1-200
  done
  cat /tmp/int4_fragment_sweep_*.txt > "$OUT/int4_fragment_sweep.txt"
  echo "part b done at ${SECONDS}s" ;;
c)
  [ -z "${SKIP_TESTS:-}" ] && timeout "$(left 150)" $PT -rf -m gpu tests/models/test_moe_online_quant.py tests/models/test_fp8_moe_experts.py \
    tests/models/test_int4_moe_experts.py 2>&1 | tee "$OUT/gpu_moe_quant_tests.txt" | tail -n 6
  for q in ${QUANTS:-bf16 fp8}; do
    extra=(); [ "$q" != bf16 ] && extra=(--quantization fp8); [ "$q" = int4 ] && extra=(--quantization int4)
    FLASHPAGE_FP8_MOE=$([ "$q" = fp8lin ] && echo dequant || echo auto) timeout "$(left 120)" python3 -m flashpage \
      bench throughput --config deepseek-v2-lite --gpu-memory-utilization 0.75 --num-requests 64 --no-hf \
      --json-out /tmp/tp_v2lite_$q.json ${extra[@]+"${extra[@]}"} > /tmp/tp_v2lite_$q.txt 2>&1
    grep -i "experts\|quantiz" /tmp/tp_v2lite_$q.txt | head -n 3
    tp_summary /tmp/tp_v2lite_$q.json $q
  done
  python3 -c "import json,sys; json.dump({f: json.load(open(f)) for f in sys.argv[1:]}, open('$OUT/throughput_v2lite_moequant.json','w'))" \
    /tmp/tp_v2lite_*.json
  echo "part c done at ${SECONDS}s" ;;
d)
  timeout "$(left 110)" $PT -rf -m gpu tests/kernels/test_fused_moe_fp8.py 2>&1 | tee "$OUT/gpu_fp8_moe_swap_tests.txt" | tail -n 6
  timeout "$(left 160)" python3 benchmarks/fused_moe.py --fp8 --out /tmp/moe > /tmp/fp8_moe_bench.txt 2>&1
  tail -n 2 /tmp/fp8_moe_bench.txt; cp /tmp/moe/fused_moe_fp8.json "$OUT/"; grep "^| " /tmp/moe/fused_moe_fp8.md | cut -c1-170
  echo "part d done at ${SECONDS}s" ;;
e)
  timeout "$(left 150)" $PT -rf -m gpu tests/kernels/test_int4_fragment_gemm.py tests/kernels/test_int4_swap_gemm.py \
    tests/kernels/test_fused_moe_fp8.py 2>&1 | tee "$OUT/gpu_int4_fp8_tests.txt" | tail -n 8
  latency_bs128_bf16_int4 120
  echo "part e done at ${SECONDS}s" ;;
f)
  timeout "$(left 90)" python3 benchmarks/int4_check.py --tiles 2>&1 | tee "$OUT/int4_check_tiles.txt" | cut -c1-200
  SKIP_TESTS=1 QUANTS="int4 fp8lin" BUDGET=$((B - SECONDS)) bash "$0" c
  echo "part f done at ${SECONDS}s" ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
