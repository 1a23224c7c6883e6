#!/usr/bin/env bash
# One device call: GPU tests (engine, kernels), a decode-step time breakdown, engine
# throughput/latency beside transformers, and the kernel benchmarks, most important first.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/flashpage_gpu}; mkdir -p "$OUT"/k
FP="python3 -m flashpage"
PT="python3 -m pytest -q -p no:cacheprovider"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 90 $PT -x -m gpu tests/engine 2>&1 | tail -n 12 | tee "$OUT/engine_gpu_tests.txt"
timeout 100 python3 benchmarks/profile_engine_step.py --batch 1 256 --context 1024 --steps 30 2>&1 \
  | grep -v Warning | tail -n 16 | tee "$OUT/profile.txt"
timeout 170 $PT -n 12 -m gpu tests/kernels 2>&1 | tail -n 15 | tee "$OUT/kernel_gpu_tests.txt"
timeout 240 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 \
  --hf-requests 32 --hf-batch-size 32 --json-out "$OUT/throughput_8b.json" 2>&1 | grep -E "tok_per_s|speedup|seconds|Error" 
timeout 45 python3 benchmarks/attention_decode.py --out "$OUT/k" 2>&1 | tail -n 12
timeout 45 python3 benchmarks/fused_ops.py --out "$OUT/k" 2>&1 | tail -n 12
timeout 60 python3 benchmarks/mla_decode.py --out "$OUT/k/mla.jsonl" 2>&1 | tail -n 14
timeout 80 $FP bench latency --config llama-3-8b --gpu-memory-utilization 0.6 --max-num-seqs 64 \
  --json-out "$OUT/latency_8b.json" 2>&1 | grep -E "tok_per_s|speedup|fraction|Error"
# The same workload through PyTorch's FlexAttention inside our engine (a peer's kernel).
timeout 200 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --attention-backend flex \
  --no-hf --json-out "$OUT/throughput_8b_flex.json" 2>&1 | grep -E "tok_per_s|Error"
