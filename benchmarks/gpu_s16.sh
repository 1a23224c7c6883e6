#!/usr/bin/env bash
# Session 16's device plan (written at the end of session 15).
#   bash benchmarks/gpu_s16.sh a    what session 15 changed after its last GPU run: the engine's and
#                                   models' GPU tests (prompt and piecewise graphs under the
#                                   split(run, inputs, out_shape) protocol, the graph classes'
#                                   shared inputs), the sampler and sampling-extras tests on the GPU
#                                   (unmarked: selected by file, not by -m gpu), then ttft_graphs.py
#                                   (16 / 128 tokens; mixed steps) with the engine's capture lines
#   bash benchmarks/gpu_s16.sh b    DeepSeek's piecewise graphs (built in session 15, off until this):
#                                   FLASHPAGE_PIECEWISE_GRAPHS=all for the DeepSeek GPU tests, then
#                                   ttft_graphs.py on V2-Lite (piecewise against eager; up to 512 tokens)
# Results under $OUT; each step cut to what is left of BUDGET (default 400) seconds.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 170)" $PT -m gpu tests/engine tests/models -rf 2>&1 | tee "$OUT/engine_gpu_tests.txt" | tail -n 3
  timeout "$(left 90)" $PT tests/engine/test_sampler.py tests/engine/test_sampling_extras.py -rf 2>&1 \
    | tee "$OUT/sampler_gpu_tests.txt" | tail -n 2
  timeout "$(left 150)" python3 benchmarks/ttft_graphs.py --config llama-3-8b --input-lens 16 128 --batches 1 \
    --out "$OUT" 2>&1 | tee "$OUT/ttft_graphs.txt" | grep -i "captured\|off\|tokens\|decodes" | tail -n 14
  echo "part a done at ${SECONDS}s" ;;
b)
  FLASHPAGE_PIECEWISE_GRAPHS=all timeout "$(left 200)" $PT -m gpu tests/models/test_deepseek.py \
    tests/models/test_deepseek_fp8.py tests/engine/test_mla_triton.py -rf 2>&1 | tee "$OUT/deepseek_gpu_tests.txt" | tail -n 3
  FLASHPAGE_PIECEWISE_GRAPHS=all timeout "$(left 200)" python3 benchmarks/ttft_graphs.py --config deepseek-v2-lite \
    --input-lens 16 128 --batches 1 4 --decodes 16 64 --mixed-lens 16 128 --out "$OUT" 2>&1 \
    | tee "$OUT/ttft_graphs_v2lite.txt" | grep -i "captured\|off\|tokens\|decodes" | tail -n 14
  echo "part b done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-b)"; exit 2 ;;
esac
