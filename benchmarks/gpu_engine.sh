#!/usr/bin/env bash
# The engine on the GPU, in one call of the device tool (results under $OUT):
#   GPU tests of the engine, then latency and throughput of the Llama-3-8B shape
#   beside transformers in the same run.
# Usage (repo root): OUT=/tmp/out bash benchmarks/gpu_engine.sh [quick]
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/flashpage_gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
if python3 -m pytest --version >/dev/null 2>&1; then
  timeout 240 python3 -m pytest -q -x -m gpu tests/engine -p no:cacheprovider 2>&1 | tail -n 30 | tee "$OUT/engine_gpu_tests.txt"
fi
FP="python3 -m flashpage"
timeout 200 $FP bench latency --config llama-3-8b --gpu-memory-utilization 0.6 --max-num-seqs 64 \
  --json-out "$OUT/latency_8b.json" 2>&1 | tail -n 25
[ "${1:-}" = quick ] && exit 0
timeout 400 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 \
  --hf-requests 32 --hf-batch-size 32 --json-out "$OUT/throughput_8b.json" 2>&1 | grep -v "it/s\]$" | tail -n 45
