#!/usr/bin/env bash
# Session 24's device plan: what session 23 built and could not run on the GPU (its 30
# minutes went to run 180-183), then the A/Bs and benchmarks left from session 22's plan.
#   BUDGET=560 bash benchmarks/gpu_s24.sh verify   the GPU tests never run: ALiBi (kernels in bf16, Bloom /
#                                                  MPT / Falcon-RW fp32 graphs + bf16), head dims 80 / 96
#                                                  (kernels, Phi-2 / NeoX on triton), session 23's new
#                                                  families (test_families4.py), and what run 182 cut
#                                                  short (Phi-3 bf16, Cohere, StarCoder2)
#   BUDGET=560 bash benchmarks/gpu_s24.sh rest     what runs 180 / 182 cut short: int4, block fp8, the
#                                                  quantized-checkpoint families
#   BUDGET=420 bash benchmarks/gpu_s24.sh bench    ALiBi's cost in our kernels, head dims 80 / 96 against
#                                                  SDPA, then session 22's int4 / W8A8 A/Bs (gpu_s23.sh ab)
#   BUDGET=560 bash benchmarks/gpu_s24.sh new      session 24's own work: KV cache groups (graphs), GPT-OSS
#                                                  (sinks kernels, model bf16), the Phi-3 checkpoints, ALiBi's
#                                                  tile bias and sinks against the Triton loops
# Results under $OUT. Every step under `timeout "$(left N)"` (gpu_lib.sh).
PART=${1:-verify}
source "$(dirname "$0")/gpu_lib.sh"
gpu_tests() {  # name, timeout, then pytest arguments
  local name=$1 t=$2; shift 2
  timeout "$(left "$t")" $PT -rf "$@" 2>&1 | tee "$OUT/gpu_${name}_tests.txt" | tail -n 4
}
case "$PART" in
verify)
  gpu_tests alibi 130 -m gpu tests/kernels/test_alibi_kernels.py tests/models/test_alibi_families.py
  gpu_tests headdim 130 -m gpu tests/kernels/test_head_dims.py tests/models/test_neox_phi.py
  gpu_tests fam4 120 -m gpu tests/models/test_families4.py
  gpu_tests s22rest 170 -m "gpu and not slow" tests/models/test_more_families.py \
    tests/models/test_cohere_starcoder.py -k "phi3 or cohere or starcoder"
  (cd "$OUT" && tar -czf verify.tgz gpu_*_tests.txt && rm -f gpu_*_tests.txt)
  echo "part verify done at ${SECONDS}s" ;;
rest)
  gpu_tests quantfam 200 -m gpu tests/models/test_quant_families.py
  gpu_tests int4 200 -m gpu tests/kernels/test_int4_gemv.py tests/models/test_int4_online.py \
    tests/models/test_int4_checkpoints.py
  gpu_tests fp8blk 150 -m gpu tests/kernels/test_fp8_block_gemm.py tests/models/test_fp8_checkpoints.py
  (cd "$OUT" && tar -czf rest.tgz gpu_*_tests.txt && rm -f gpu_*_tests.txt)
  echo "part rest done at ${SECONDS}s" ;;
bench)
  timeout "$(left 90)" python3 benchmarks/attention_alibi.py --out "$OUT" > "$OUT/alibi.txt" 2>&1
  tail -n 20 "$OUT/alibi.txt"
  timeout "$(left 150)" python3 benchmarks/attention_head_dims.py --out "$OUT" > "$OUT/head_dims.txt" 2>&1
  tail -n 40 "$OUT/head_dims.txt"
  BUDGET=$((B - SECONDS)) bash "$(dirname "$0")/gpu_s23.sh" ab
  echo "part bench done at ${SECONDS}s" ;;
new)  # what session 24 built: KV cache groups, GPT-OSS's sinks, the Phi-3 checkpoints, ALiBi's tile bias
  gpu_tests new 250 -m gpu tests/engine/test_hybrid_kv_groups.py tests/kernels/test_attention_sinks.py \
    tests/models/test_gpt_oss.py tests/engine/test_sliding_window_release.py tests/kernels/test_alibi_kernels.py
  gpu_tests glm 90 -m "gpu and not slow" tests/models/test_glm_families.py tests/models/test_llama4.py
  gpu_tests phi3 100 -m "gpu and not slow" tests/models/test_more_families.py -k phi3
  timeout "$(left 60)" python3 benchmarks/attention_alibi.py --out "$OUT" > "$OUT/alibi.txt" 2>&1
  tail -n 16 "$OUT/alibi.txt"
  timeout "$(left 60)" python3 benchmarks/attention_sinks.py --out "$OUT" > "$OUT/sinks.txt" 2>&1
  tail -n 16 "$OUT/sinks.txt"
  (cd "$OUT" && tar -czf new.tgz gpu_*_tests.txt && rm -f gpu_*_tests.txt)
  echo "part new done at ${SECONDS}s" ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
