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
#   bash benchmarks/gpu_s15.sh e    run 129: serving (bench serve, 8B) with the prompt graphs on and off
#                                   (FLASHPAGE_PREFILL_GRAPHS / FLASHPAGE_PIECEWISE_GRAPHS=0): run 5's load (16
#                                   req/s, 512 in, 128 out) and a light one (2 req/s, 256 in, 64 out).
#                                   Needs fastapi, pydantic, starlette, uvicorn as wheels in .whl (carry)
#   bash benchmarks/gpu_s15.sh f    run 130: the 8B offline throughput workload with the prompt graphs on / off
#   bash benchmarks/gpu_s15.sh g    run 131: the graph capture as one engine method (time and memory of each
#                                   kind logged), TMA maps remembered up to 1024: the engine's and models' GPU
#                                   tests, the TMA-map tests, ttft_graphs.py (16 / 128 tokens, mixed steps)
# Results under $OUT; each step cut to what is left of BUDGET (default 400) seconds.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
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
e)
  serve_graph_loads
  echo "part e done at ${SECONDS}s" ;;
f)
  for g in 1 0; do
    FLASHPAGE_PREFILL_GRAPHS=$g FLASHPAGE_PIECEWISE_GRAPHS=$g timeout "$(left 200)" python3 -m flashpage \
      bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --no-hf \
      --json-out "$OUT/throughput_graphs$g.json" 2>&1 | grep -i "tok/s\|error\|captured" | tail -n 4
  done
  echo "part f done at ${SECONDS}s" ;;
g)
  timeout "$(left 170)" $PT -m gpu tests/engine tests/models -rf 2>&1 | tee "$OUT/engine_gpu_tests.txt" | tail -n 3
  timeout "$(left 60)" $PT -m gpu tests/kernels/test_flash_prefill_gluon.py tests/kernels/test_fast_launch.py \
    -k "tma_map or fast_launch" -rf 2>&1 | tee "$OUT/tma_tests.txt" | tail -n 2
  timeout "$(left 150)" python3 benchmarks/ttft_graphs.py --config llama-3-8b --input-lens 16 128 --batches 1 \
    --out "$OUT" 2>&1 | tee "$OUT/ttft_graphs.txt" | grep -i "captured\|tokens\|decodes" | tail -n 14
  echo "part g done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-g)"; exit 2 ;;
esac
