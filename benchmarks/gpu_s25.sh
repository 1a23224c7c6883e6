#!/usr/bin/env bash
# Session 25's device plan.
#   BUDGET=520 bash benchmarks/gpu_s25.sh verify   GPT-OSS's GPU test at the default swiglu_limit (run 187
#                                                  found the GPU image's transformers 5.17 ignores the
#                                                  config's), Llama 4's GPU tests run 187 cut short, then
#                                                  the attention-variant / head-dim benchmarks timed through
#                                                  CUDA-graph replays (gpu_timing.graph_ms)
#   BUDGET=560 bash benchmarks/gpu_s25.sh moe      GPT-OSS's experts on the fused MoE kernel (tests, then
#                                                  benchmarks/moe_*.py's GPT-OSS shape), text-only
#                                                  multimodal checkpoints' GPU tests
# Results under $OUT. Every step under `timeout "$(left N)"` (gpu_lib.sh).
PART=${1:-verify}
source "$(dirname "$0")/gpu_lib.sh"
gpu_tests() {  # name, timeout, then pytest arguments
  local name=$1 t=$2; shift 2
  timeout "$(left "$t")" $PT -rf "$@" 2>&1 | tee "$OUT/gpu_${name}_tests.txt" | tail -n 4
}
bench() {  # script name, timeout
  timeout "$(left "$2")" python3 "benchmarks/$1.py" --out "$OUT" > "$OUT/$1.txt" 2>&1
  tail -n 30 "$OUT/$1.txt"
}
case "$PART" in
verify)
  gpu_tests gptoss 120 -m gpu tests/models/test_gpt_oss.py
  gpu_tests llama4 150 -m gpu tests/models/test_llama4.py -k "not torch_native"
  bench attention_sinks 70
  bench attention_alibi 70
  bench attention_head_dims 90
  (cd "$OUT" && tar -czf verify.tgz gpu_*_tests.txt attention_*.txt && rm -f gpu_*_tests.txt attention_*.txt)
  echo "part verify done at ${SECONDS}s" ;;
moe)
  gpu_tests moe 200 -m gpu tests/kernels/test_fused_moe*.py tests/models/test_gpt_oss.py
  echo "part moe done at ${SECONDS}s" ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
