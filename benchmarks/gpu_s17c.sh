#!/usr/bin/env bash
# Session 17's third device plan, after run 142 showed a draft-checking step of the 8B at batch 1
# costing 7.0 ms against 4.0 for a decode step (piecewise graphs, 16-row GEMMs), and random weights'
# greedy tokens flipping on near-ties between the two paths (scripted "right" drafts 2% accepted):
# token buckets 4 and 8, the prompt-step graphs taking steps that check drafts, and
# benchmarks/spec_decode.py's counting weights (o_proj / down_proj zeroed, next token = token + 1).
#   BUDGET=560 bash benchmarks/gpu_s17c.sh    GPU tests (spec decode, prompt graphs, _scaled_mm's
#                                             normwise check), then spec_decode.py on the 8B with the
#                                             skinny GEMM off (default) and on, then ttft_graphs.py for
#                                             4 / 8 / 16-token prompts
# Results under $OUT; each step cut to what is left of BUDGET (default 400) seconds.
source "$(dirname "$0")/gpu_lib.sh"
timeout "$(left 150)" $PT -m gpu tests/engine/test_spec_decode.py tests/engine/test_prefill_graphs.py \
  tests/kernels/test_gemv_fp8.py -k "spec or draft or graph or scaled_mm" -rf 2>&1 \
  | tee "$OUT/gpu_tests.txt" | tail -n 4
for sk in 0 1; do
  FLASHPAGE_SKINNY_GEMM=$sk timeout "$(left 150)" python3 benchmarks/spec_decode.py --config llama-3-8b \
    --batch-sizes 1 8 --ks 2 4 --json-out "$OUT/spec_decode_skinny$sk.json" 2>&1 \
    | tee "$OUT/spec_decode_skinny$sk.txt" | grep "^batch"
done
timeout "$(left 120)" python3 benchmarks/ttft_graphs.py --config llama-3-8b --input-lens 4 8 16 --batches 1 \
  --iters 5 --decodes --out "$OUT" 2>&1 | tee "$OUT/ttft_graphs.txt" | grep -i "captured\|tokens x" | tail -n 8
echo "done at ${SECONDS}s"
