#!/usr/bin/env bash
# Session 16's second device plan: the attention plans (kernels/plan.py) on the GPU.
#   bash benchmarks/gpu_s16b.sh   the decode / prefill kernel GPU tests (every path now through
#                                 a plan), the engine's graph and backend GPU tests, then
#                                 ttft_graphs.py on the 8B with the host profile of a mixed step
source "$(dirname "$0")/gpu_lib.sh"
timeout "$(left 200)" $PT -m gpu tests/kernels/test_plans.py tests/kernels/test_paged_decode.py \
  tests/kernels/test_paged_decode_gluon_bf16.py tests/kernels/test_flash_prefill_gluon.py \
  tests/kernels/test_paged_prefill_gather.py tests/kernels/test_flash_prefill.py -rf -x 2>&1 \
  | tee "$OUT/kernel_gpu_tests.txt" | tail -n 3
timeout "$(left 150)" $PT -m gpu tests/engine/test_triton_backend.py tests/engine/test_prefill_graphs.py \
  tests/engine/test_mla_triton.py tests/engine/test_generation_vs_hf.py -rf 2>&1 \
  | tee "$OUT/engine_gpu_tests.txt" | tail -n 3
timeout "$(left 220)" python3 benchmarks/ttft_graphs.py --config llama-3-8b --input-lens 16 128 --batches 1 \
  --iters 10 --decodes 16 64 --mixed-lens 16 128 512 --cprofile --out "$OUT" 2>&1 \
  | tee "$OUT/ttft_graphs.txt" | grep -i "captured\|tokens\|decodes" | tail -n 12
head -3 "$OUT/mixed_cprofile.txt"
echo "done at ${SECONDS}s"
