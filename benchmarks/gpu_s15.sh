#!/usr/bin/env bash
# Session 15's device plan.
#   bash benchmarks/gpu_s15.sh a    run 125: the prompt-step CUDA graphs (engine/cuda_graph.PrefillGraphs):
#                                   their GPU test, the engine's and models' GPU tests with them on, then
#                                   an 8B prompt's time to first token with them on / off in turn in one
#                                   process (benchmarks/ttft_graphs.py, 1 and 4 requests of 16-2000 tokens)
#   bash benchmarks/gpu_s15.sh b    run 126: the piecewise graphs (all but attention) beside them: the graph
#                                   GPU tests, the engine's and models', then ttft_graphs.py with three
#                                   modes (whole, piecewise, eager) and mixed steps (decodes + a prompt)
#   bash benchmarks/gpu_s15.sh c    run 127: where a mixed step's host time goes with the piecewise graphs
#                                   (profile_ttft.py --decodes 16: cProfile, the kernels' GPU time)
#   bash benchmarks/gpu_s15.sh d    run 128: the Triton paged decode and its merge through the fast launch,
#                                   the SM count and capability cached: their GPU tests, the engine's and
#                                   models', then ttft_graphs.py (16-512 tokens; mixed steps) once more
# Results under $OUT; each step cut to what is left of BUDGET (default 400) seconds.
set -u
PART=${1:-a}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/flashpage_gpu}; mkdir -p "$OUT"
B=${BUDGET:-400}
left() { local t=$((B - SECONDS)); [ "$1" -lt "$t" ] && t=$1; [ "$t" -lt 1 ] && t=1; echo $t; }
PT="python3 -m pytest -q -p no:cacheprovider"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
case "$PART" in
a)
  timeout "$(left 200)" $PT -m gpu tests/engine/test_prefill_graphs.py tests/engine tests/models -rf 2>&1 \
    | tee "$OUT/engine_gpu_tests.txt" | tail -n 6
  timeout "$(left 200)" python3 benchmarks/ttft_graphs.py --config llama-3-8b --out "$OUT" 2>&1 \
    | tee "$OUT/ttft_graphs.txt" | grep -v "^\s*$" | tail -n 16
  echo "part a done at ${SECONDS}s" ;;
b)
  timeout "$(left 220)" $PT -m gpu tests/engine/test_prefill_graphs.py tests/engine tests/models -rf 2>&1 \
    | tee "$OUT/engine_gpu_tests.txt" | tail -n 6
  timeout "$(left 260)" python3 benchmarks/ttft_graphs.py --config llama-3-8b --out "$OUT" 2>&1 \
    | tee "$OUT/ttft_graphs.txt" | grep -v "^\s*$" | grep -iv "warn" | tail -n 22
  echo "part b done at ${SECONDS}s" ;;
c)
  timeout "$(left 150)" python3 benchmarks/profile_ttft.py --config llama-3-8b --decodes 16 --input-len 128 \
    --out "$OUT" 2>&1 | grep -v "^\s*$" | head -n 150
  echo "part c done at ${SECONDS}s" ;;
d)
  timeout "$(left 150)" $PT -m gpu tests/kernels/test_fast_launch.py tests/kernels/test_paged_decode.py \
    tests/kernels/test_pdl.py -rf 2>&1 | tee "$OUT/decode_fast_tests.txt" | tail -n 3
  timeout "$(left 180)" $PT -m gpu tests/engine tests/models -rf 2>&1 | tee "$OUT/engine_gpu_tests.txt" | tail -n 3
  timeout "$(left 220)" python3 benchmarks/ttft_graphs.py --config llama-3-8b --input-lens 16 128 512 \
    --out "$OUT" 2>&1 | tee "$OUT/ttft_graphs.txt" | grep -v "^\s*$" | grep -iv "warn" | tail -n 14
  echo "part d done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-d)"; exit 2 ;;
esac
