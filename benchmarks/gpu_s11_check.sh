#!/usr/bin/env bash
# Session 11's closing device call: the defaults landed from runs 88-89 (Gluon bf16 decode, the
# gather producer under 128-token blocks, the MLA Gluon entry's tile-loop knobs) in the engine:
#   bash benchmarks/gpu_s11_check.sh
# 1. the engine's and models' GPU tests under the new defaults;
# 2. 8B bf16 end to end with the defaults, then with FLASHPAGE_PREFILL_GLUON=0 and
#    FLASHPAGE_DECODE_GLUON_BF16=0 (the Triton kernels: the session's baseline) in the same run;
# 3. V2-Lite with FLASHPAGE_MLA_GLUON=1 (peel + lean + lazy, the merge kernel past 4 splits).
# Each step cut to what is left of BUDGET (default 300) seconds. Results under $OUT.
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/flashpage_gpu}; mkdir -p "$OUT"
B=${BUDGET:-300}
left() { local t=$((B - SECONDS)); [ "$1" -lt "$t" ] && t=$1; [ "$t" -lt 1 ] && t=1; echo $t; }
FP="python3 -m flashpage"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "$(left 150)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine tests/models -rf 2>&1 \
  | tee "$OUT/engine_gpu_tests.txt" | tail -n 3
echo "tests done at ${SECONDS}s"
timeout "$(left 60)" $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --no-hf \
  --json-out "$OUT/throughput_8b_bf16_defaults.json" 2>&1 | grep -E "output_tok_per_s|Error"
FLASHPAGE_PREFILL_GLUON=0 FLASHPAGE_DECODE_GLUON_BF16=0 timeout "$(left 60)" $FP bench throughput --config llama-3-8b \
  --gpu-memory-utilization 0.75 --no-hf --json-out "$OUT/throughput_8b_bf16_triton.json" 2>&1 | grep -E "output_tok_per_s|Error"
FLASHPAGE_MLA_GLUON=1 timeout "$(left 60)" $FP bench throughput --config deepseek-v2-lite --gpu-memory-utilization 0.75 \
  --num-requests 64 --no-hf --json-out "$OUT/throughput_v2lite_mla_gluon1.json" 2>&1 | grep -E "output_tok_per_s|Error"
echo "done at ${SECONDS}s"
