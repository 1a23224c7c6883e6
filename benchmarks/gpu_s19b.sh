#!/usr/bin/env bash
# Session 19's second device plan: what the session built on the CPU, on the H200.
#   BUDGET=420 bash benchmarks/gpu_s19b.sh a   GPU tests: draft-model speculation (graphs), grammars,
#                                              encoders in 16 bits, the LoRA kernels (slot grid),
#                                              the MLA decode plan (bound merge), int4 (AWQ / GPTQ)
#   BUDGET=440 bash benchmarks/gpu_s19b.sh b   timings: LoRA kernels, slot grid against the slot loop
#                                              (run 161's mixed tiles); an 8B-shaped 1-layer draft
#                                              model; V2-Lite's mixed step (run 160: 13.78 ms);
#                                              encoders beside transformers; the int4 GEMM
# Results under $OUT.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 160)" $PT -m gpu -rf tests/engine/test_draft_model.py tests/engine/test_spec_decode.py \
    tests/engine/test_structured_grammar.py tests/encoder tests/kernels/test_lora_kernels.py \
    2>&1 | tee "$OUT/gpu_tests.txt" | tail -n 12
  timeout "$(left 80)" $PT -m gpu tests/kernels/test_mla_decode.py tests/kernels/test_mla_decode_wgmma.py \
    -k "plan_serves or many_calls or mla_decode_gpu" 2>&1 | tee "$OUT/gpu_mla_tests.txt" | tail -n 3
  bash benchmarks/gpu_int4.sh tests
  echo "part a done at ${SECONDS}s" ;;
b)
  timeout "$(left 80)" python3 benchmarks/lora.py --kernels --max-loras 4 --rank 16 \
    --json-out "$OUT/lora_kernels.json" > "$OUT/lora_kernels.txt" 2>&1
  grep -E "T +(16|64|256) +mixed" "$OUT/lora_kernels.txt"
  timeout "$(left 160)" python3 benchmarks/spec_decode.py --config llama-3-8b --batch-sizes 1 8 --ks 4 \
    --draft-layers 1 --json-out "$OUT/spec_draft.json" 2>&1 | grep -E "^batch|Error|Traceback"
  mkdir -p "$OUT/mixed"
  timeout "$(left 70)" python3 benchmarks/profile_ttft.py --config deepseek-v2-lite --iters 10 \
    --decodes 16 --input-len 16 --out "$OUT/mixed" > "$OUT/profile_v2lite_mixed.log" 2>&1
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('mixed', r['request_ms_median'], 'ms for', r['gpu_kernel_ms'], 'ms of kernels')" \
    "$OUT/mixed/profile_ttft.json"
  timeout "$(left 60)" python3 benchmarks/encoder.py --shape bge-base --lengths 128 512 --num-prompts 1024 \
    --json-out "$OUT/enc_bge_bf16.json" 2>&1 | tail -n 3
  INT4_ROWS=1,16,64,256,1024 bash benchmarks/gpu_int4.sh bench
  echo "part b done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-b)"; exit 2 ;;
esac
