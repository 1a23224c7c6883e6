#!/usr/bin/env bash
# Session 17's device plan (written at the end of session 16).
#   bash benchmarks/gpu_s17.sh a    what session 16 changed after its last GPU run (137): the prefill
#                                   plan's one-q descriptor memo (test_plans' weakref check; prompt-only
#                                   capture MiB back near run 132's 168), embeddings with graphs, the
#                                   structured-outputs and sampling tests on CUDA (unmarked: by file),
#                                   then ttft_graphs.py (8B: capture lines, mixed steps vs replanned)
#   bash benchmarks/gpu_s17.sh b    serving with the plans (bench serve, 8B): run 129's loads (16 req/s
#                                   512/128, 2 req/s 256/64), graphs on and off. Carry [".whl"]
#   bash benchmarks/gpu_s17.sh c    the decode / prefill kernel GPU files after the bound launches, whole
#                                   (run 137 ran 123 of them before its limit, none failed)
# Results under $OUT; each step cut to what is left of BUDGET (default 400) seconds.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 150)" $PT -m gpu tests/kernels/test_plans.py tests/engine/test_embeddings.py \
    tests/engine/test_prefill_graphs.py tests/engine/test_triton_backend.py -rf 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -n 3
  timeout "$(left 100)" $PT tests/engine/test_structured_outputs.py tests/engine/test_sampling_extras.py \
    tests/engine/test_sampler.py -rf 2>&1 | tee "$OUT/sampling_tests.txt" | tail -n 3
  timeout "$(left 160)" python3 benchmarks/ttft_graphs.py --config llama-3-8b --input-lens 16 128 --batches 1 \
    --iters 5 --decodes 16 64 --mixed-lens 16 128 512 --out "$OUT" 2>&1 \
    | tee "$OUT/ttft_graphs.txt" | grep -i "captured\|tokens x\|decodes +" | tail -n 12
  echo "part a done at ${SECONDS}s" ;;
b)
  serve_graph_loads
  echo "part b done at ${SECONDS}s" ;;
c)
  timeout "$(left 300)" $PT -m gpu tests/kernels/test_paged_decode.py tests/kernels/test_paged_decode_gluon_bf16.py \
    tests/kernels/test_flash_prefill_gluon.py tests/kernels/test_fast_launch.py tests/kernels/test_fp8_kv.py -rf 2>&1 \
    | tee "$OUT/kernel_gpu_tests.txt" | tail -n 3
  echo "part c done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-c)"; exit 2 ;;
esac
