#!/usr/bin/env bash
# Session 19's device plan (written at the end of session 18). Each step runs under
# `timeout "$(left N)"` (at most N seconds, at most what is left of BUDGET); NOTE left N is a
# cap, not a reserve: give a step the seconds it may take.
#   BUDGET=420 bash benchmarks/gpu_s19.sh a   MLA plans (session 18, CPU-tested only): the wgmma plan
#                                             over three layers, VarlenPlan in bf16 (TMA and MLA's
#                                             pointer path), the MLA kernel / engine GPU tests; then
#                                             V2-Lite's piecewise steps by profile_ttft.py (run 156:
#                                             prompt 14.5 ms / mixed 18.4 ms for 11.9 / 10.8 ms of
#                                             kernels) and ttft_graphs.py (run 133's table)
#   BUDGET=500 bash benchmarks/gpu_s19.sh b   LoRA's gathered kernels (kernels/lora.py) and pre-quantized fp8
#                                             checkpoints (models/fp8_checkpoint.py): their GPU tests, the
#                                             kernels against the dense path, then the 8B engine with
#                                             enable_lora, kernels on / off (run 159: 0.62-0.65x base)
#   BUDGET=450 bash benchmarks/gpu_s19.sh c   n-gram drafting's back-off (SpecBackoff): spec_decode.py on
#                                             the 8B counting weights (run 143's table, now with
#                                             wrong+bo and async scheduling), then bench serve at run
#                                             155's light load, drafts on (backoff on / off). Carry [".whl"]
#   BUDGET=200 bash benchmarks/gpu_s19.sh d   the e4m3 GEMV on the tensor cores (benchmarks/gemv_fp8_dot.py:
#                                             f16 tiles x x replicated in 16 columns, wgmma, cp.async
#                                             stages per the sm_90 compile) against gemv_row, 4 shapes
# Results under $OUT.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 150)" $PT -m gpu -x tests/kernels/test_mla_decode_wgmma.py tests/kernels/test_mla_decode.py \
    tests/kernels/test_flash_prefill.py -k "plan_serves or many_calls or varlen_gpu or mla_decode_gpu" 2>&1 | tee "$OUT/gpu_kernel_tests.txt" | tail -n 3
  timeout "$(left 150)" $PT -m gpu tests/engine/test_mla_triton.py tests/engine/test_mla_gluon_switch.py \
    tests/models/test_deepseek.py -rf 2>&1 | tee "$OUT/gpu_engine_tests.txt" | tail -n 3
  v2lite_step_profiles
  echo "part a done at ${SECONDS}s" ;;
b)
  timeout "$(left 200)" $PT -m gpu tests/kernels/test_lora_kernels.py tests/engine/test_lora.py \
    tests/models/test_fp8_checkpoints.py -rf 2>&1 | tee "$OUT/gpu_tests_b.txt" | tail -n 3
  timeout "$(left 60)" python3 benchmarks/lora.py --kernels --max-loras 4 --rank 16 \
    --json-out "$OUT/lora_kernels.json" 2>&1 | tee "$OUT/lora_kernels.txt" | tail -n 30
  for k in auto 0; do
    FLASHPAGE_LORA_KERNELS=$k timeout "$(left 120)" python3 benchmarks/lora.py --config llama-3-8b \
      --batch-sizes 1 16 --max-loras 4 --rank 16 --output-len 64 --iters 2 \
      --json-out "$OUT/lora_8b_kernels_$k.json" > "$OUT/lora_8b_kernels_$k.txt" 2>&1
    echo "== kernels=$k"; tail -n 8 "$OUT/lora_8b_kernels_$k.txt"
  done
  echo "part b done at ${SECONDS}s" ;;
c)
  timeout "$(left 150)" python3 benchmarks/spec_decode.py --config llama-3-8b --batch-sizes 1 8 --ks 4 \
    --json-out "$OUT/spec_backoff.json" 2>&1 | grep "^batch"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site || exit 1
  for bo in true false; do
    timeout "$(left 140)" python3 -m flashpage bench serve --config llama-3-8b --request-rate 2 \
      --num-prompts 60 --input-len 256 --output-len 64 \
      --speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": 3, \"backoff\": $bo}" \
      --json-out "$OUT/serve_ngram_backoff_$bo.json" > "$OUT/serve_ngram_backoff_$bo.txt" 2>&1
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r['completed'], r['ttft_ms'], r['itl_ms'])" \
      "$OUT/serve_ngram_backoff_$bo.json" "backoff=$bo"
  done
  echo "part c done at ${SECONDS}s" ;;
d)
  timeout "$(left 180)" python3 benchmarks/gemv_fp8_dot.py --out "$OUT" 2>&1 | tee "$OUT/gemv_fp8_dot.txt" | tail -n 30
  echo "part d done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-d)"; exit 2 ;;
esac
