#!/usr/bin/env bash
# Session 27's device plan:
#   BUDGET=420 bash benchmarks/gpu_s27.sh a   session 26's untested GPU work: EAGLE-1 / EAGLE-3's
#                                             GPU tests (CUDA graphs, heads of 32 / 64), the
#                                             kept-MXFP4 GPT-OSS model test (graphs, against
#                                             transformers on the dequantized weights), the MTP
#                                             layer's GPU tests
#   BUDGET=570 bash benchmarks/gpu_s27.sh b   the int4 swapped W4A16 GEMM (kernels/int4_gemm.w4a16_gemm)
#                                             swept at 64-2048 rows on the 8B shapes beside
#                                             dequant + cuBLAS and bf16, its GPU tests; the MXFP4
#                                             "swap" forms' GPU tests (the inline-PTX decode's
#                                             first run) and the MXFP4 tile sweep with them
#   BUDGET=590 bash benchmarks/gpu_s27.sh c   block-fp8 MoE experts kept in e4m3: the kernel's and the
#                                             model's GPU tests, --fp8 timed at Qwen3-30B-A3B's expert
#                                             shape; GPT-OSS's GPU tests on the "swap" default; EAGLE
#                                             over a Qwen3-MoE target on the GPU; the int4 swapped
#                                             GEMM's GPU tests on run 196's defaults
#   BUDGET=300 bash benchmarks/gpu_s27.sh d   an EAGLE-1 head of the 8B's shapes, right and always
#                                             wrong, beside free scripted drafts (spec_decode.py
#                                             --eagle); the fp8 checkpoints' GPU tests (the KV
#                                             budget now measured after empty_cache)
#   BUDGET=540 bash benchmarks/gpu_s27.sh e   end to end on this session's defaults: gpt-oss-20b with
#                                             MXFP4 experts kept ("swap" at decode; run 193: 3,355
#                                             tok/s), the 8B's decode at batch 128 in bf16 and int4
#                                             (the swapped GEMM at 128 rows); the int4 MoE experts'
#                                             GPU tests and --int4 timing
# Results under $OUT (summaries only: the device returns ~8 files); logs in /tmp.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 150)" $PT -rf -m gpu tests/engine/test_eagle_draft.py 2>&1 | tee "$OUT/gpu_eagle_tests.txt" | tail -n 6
  timeout "$(left 200)" $PT -rf -m gpu tests/models/test_gpt_oss.py 2>&1 \
    | tee "$OUT/gpu_gpt_oss_tests.txt" | tail -n 6
  timeout "$(left 100)" $PT -rf -m gpu tests/engine/test_mtp_graphs.py tests/engine/test_mtp_draft.py 2>&1 \
    | tee "$OUT/gpu_mtp_tests.txt" | tail -n 4
  echo "part a done at ${SECONDS}s" ;;
b)
  timeout "$(left 150)" python3 benchmarks/int4_gemm.py --sweep --shapes qkv,o_proj --json-out /tmp/int4_sweep_a.json \
    > /tmp/int4_sweep_a.txt 2>&1; tail -n 14 /tmp/int4_sweep_a.txt
  timeout "$(left 150)" python3 benchmarks/int4_gemm.py --sweep --shapes gate_up,down --json-out /tmp/int4_sweep_b.json \
    > /tmp/int4_sweep_b.txt 2>&1; tail -n 14 /tmp/int4_sweep_b.txt
  cat /tmp/int4_sweep_a.txt /tmp/int4_sweep_b.txt > "$OUT/int4_sweep.txt"
  python3 -c "import json,sys; json.dump([json.load(open(f)) for f in sys.argv[1:]], open('$OUT/int4_sweep.json','w'))" \
    /tmp/int4_sweep_a.json /tmp/int4_sweep_b.json
  timeout "$(left 100)" $PT -rf -m gpu -x tests/kernels/test_int4_swap_gemm.py 2>&1 | tee "$OUT/gpu_int4_swap_tests.txt" | tail -n 4
  timeout "$(left 90)" $PT -rf -m gpu tests/kernels/test_fused_moe_mxfp4_swap.py tests/kernels/test_fused_moe_mxfp4.py 2>&1 \
    | tee "$OUT/gpu_mxfp4_swap_tests.txt" | tail -n 6
  timeout "$(left 150)" python3 benchmarks/fused_moe.py --model gpt-oss-20b --mxfp4-sweep --out /tmp/moe \
    > "$OUT/fused_moe_sweep.txt" 2>&1; tail -n 3 "$OUT/fused_moe_sweep.txt"; cp /tmp/moe/*.json "$OUT/" 2>/dev/null
  echo "part b done at ${SECONDS}s" ;;
c)
  timeout "$(left 120)" $PT -rf -m gpu tests/kernels/test_fused_moe_fp8.py 2>&1 | tee "$OUT/gpu_fp8_moe_kernel_tests.txt" | tail -n 4
  timeout "$(left 100)" $PT -rf -m gpu tests/models/test_fp8_moe_experts.py 2>&1 | tee "$OUT/gpu_fp8_moe_model_tests.txt" | tail -n 4
  timeout "$(left 120)" python3 benchmarks/fused_moe.py --fp8 --out /tmp/moe > /tmp/fp8_moe_bench.txt 2>&1
  tail -n 2 /tmp/fp8_moe_bench.txt; cp /tmp/moe/fused_moe_fp8.json "$OUT/"; cat /tmp/moe/fused_moe_fp8.md 2>/dev/null | head -40
  timeout "$(left 110)" $PT -rf -m gpu tests/models/test_gpt_oss.py 2>&1 | tee "$OUT/gpu_gpt_oss_tests.txt" | tail -n 4
  timeout "$(left 70)" $PT -rf -m gpu tests/engine/test_eagle_targets.py 2>&1 | tee "$OUT/gpu_eagle_moe_tests.txt" | tail -n 4
  timeout "$(left 40)" $PT -rf -m gpu tests/kernels/test_int4_swap_gemm.py 2>&1 | tee "$OUT/gpu_int4_swap_tests.txt" | tail -n 4
  echo "part c done at ${SECONDS}s" ;;
d)
  timeout "$(left 200)" python3 benchmarks/spec_decode.py --config llama-3-8b --batch-sizes 1 8 32 --ks 3 --eagle \
    --iters 2 --json-out "$OUT/spec_eagle.json" > /tmp/spec_eagle.txt 2>&1; grep -E "^batch|Error" /tmp/spec_eagle.txt | tee "$OUT/spec_eagle.txt"
  timeout "$(left 90)" $PT -rf -m gpu tests/models/test_fp8_checkpoints.py 2>&1 | tee "$OUT/gpu_fp8_ckpt_tests.txt" | tail -n 4
  echo "part d done at ${SECONDS}s" ;;
e)
  timeout "$(left 80)" $PT -rf -m gpu tests/kernels/test_fused_moe_int4.py 2>&1 | tee "$OUT/gpu_int4_moe_kernel_tests.txt" | tail -n 4
  timeout "$(left 110)" $PT -rf -m gpu tests/models/test_int4_moe_experts.py 2>&1 | tee "$OUT/gpu_int4_moe_model_tests.txt" | tail -n 4
  timeout "$(left 90)" python3 benchmarks/fused_moe.py --int4 --out /tmp/moe > /tmp/int4_moe_bench.txt 2>&1
  tail -n 2 /tmp/int4_moe_bench.txt; cp /tmp/moe/fused_moe_int4.json "$OUT/"; grep "^| " /tmp/moe/fused_moe_int4.md | cut -c1-170
  MXFP4='{"quantization_config": {"quant_method": "mxfp4"}}'
  timeout "$(left 150)" python3 -m flashpage bench throughput --config gpt-oss-20b --gpu-memory-utilization 0.88 \
    --num-requests 64 --no-hf --hf-overrides "$MXFP4" --json-out "$OUT/throughput_gptoss20b_mxfp4.json" \
    > /tmp/throughput_gptoss20b.txt 2>&1
  tp_summary "$OUT/throughput_gptoss20b_mxfp4.json"
  latency_bs128_bf16_int4 110
  echo "part e done at ${SECONDS}s" ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
