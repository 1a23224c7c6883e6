#!/usr/bin/env bash
# Session 16's third device plan: bound launches and engine-long descriptors in the plans.
#   bash benchmarks/gpu_s16c.sh   plan / fast-launch / decode kernel GPU tests, the engine's
#                                 backend and graph GPU tests, then ttft_graphs.py on the 8B:
#                                 mixed steps piecewise against replanned (every layer) and eager
source "$(dirname "$0")/gpu_lib.sh"
timeout "$(left 130)" $PT -m gpu tests/kernels/test_plans.py tests/kernels/test_fast_launch.py \
  tests/kernels/test_paged_decode_gluon_bf16.py tests/kernels/test_paged_decode.py -rf 2>&1 \
  | tee "$OUT/kernel_gpu_tests.txt" | tail -n 2
timeout "$(left 110)" $PT -m gpu tests/engine/test_triton_backend.py tests/engine/test_prefill_graphs.py \
  tests/engine/test_mla_triton.py -rf 2>&1 | tee "$OUT/engine_gpu_tests.txt" | tail -n 2
timeout "$(left 200)" python3 benchmarks/ttft_graphs.py --config llama-3-8b --input-lens 16 128 --batches 1 \
  --iters 5 --decodes 16 64 --mixed-lens 16 128 512 --cprofile --out "$OUT" 2>&1 \
  | tee "$OUT/ttft_graphs.txt" | grep -i "captured\|tokens x\|decodes +" | tail -n 12
head -1 "$OUT/mixed_cprofile.txt"
echo "done at ${SECONDS}s"
