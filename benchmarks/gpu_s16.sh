#!/usr/bin/env bash
# Session 16's device plan (written at the end of session 15).
#   bash benchmarks/gpu_s16.sh a    what session 15 changed after its last GPU run: the engine's and
#                                   models' GPU tests (prompt and piecewise graphs under the
#                                   split(run, inputs, out_shape) protocol, the graph classes'
#                                   shared inputs), the sampler and sampling-extras tests on the GPU
#                                   (unmarked: selected by file, not by -m gpu), then ttft_graphs.py
#                                   (16 / 128 tokens; mixed steps) with the engine's capture lines
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
*) echo "unknown part $PART (a)"; exit 2 ;;
esac
