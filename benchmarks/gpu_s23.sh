#!/usr/bin/env bash
# Session 23's device plan (session 22 had no device time): what sessions 21-22 left unverified
# on the GPU, then two A/Bs.
#   BUDGET=560 bash benchmarks/gpu_s23.sh verify  the GPU tests run 179 did not finish or that changed
#                                                 after it: int4 (chains, fp32 x, norm prologue), block
#                                                 fp8 kept fp8 (16-wide blocks now w8a16), the MoE
#                                                 families, Gemma (1 + w in fp32, teacher-forced bf16),
#                                                 Phi-3 / Granite / OLMo2 / Cohere / Starcoder2, and the
#                                                 draft model drafting guided requests
#   BUDGET=420 bash benchmarks/gpu_s23.sh ab      the 8B int4 batch-1 decode: neither / the norm prologue
#                                                 alone / PDL alone (run 179: both together -15%); then
#                                                 the block-fp8 W8A8 GEMM's tiles at 256 / 2048 rows
#   BUDGET=600 bash benchmarks/gpu_s23.sh families  session 22's: the fused LayerNorm kernel (tests, then
#                                                 GB/s beside torch and copy), Cohere2 / OLMo (1),
#                                                 OLMoE / Granite MoE, GPT-2 / GPT-BigCode, GPT-NeoX /
#                                                 Phi-1/1.5/2, GPT-J / Falcon, OPT (fp32 kernels +
#                                                 graphs = transformers' tokens, bf16 teacher-forced,
#                                                 the slow greedy runs), then the fp8 / int4
#                                                 checkpoints of the Llama-variant families
# Results under $OUT.
PART=${1:-verify}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
verify)
  timeout "$(left 230)" $PT -rf tests/kernels/test_int4_gemv.py tests/models/test_int4_online.py \
    tests/models/test_int4_checkpoints.py 2>&1 | tee "$OUT/gpu_int4_tests.txt" | tail -n 4
  timeout "$(left 90)" $PT -m gpu -rf tests/kernels/test_fp8_block_gemm.py tests/models/test_fp8_checkpoints.py \
    2>&1 | tee "$OUT/gpu_fp8blk_tests.txt" | tail -n 4
  timeout "$(left 150)" $PT -m gpu -rf tests/models/test_moe_families.py tests/kernels/test_moe_router.py \
    tests/kernels/test_fused_moe.py 2>&1 | tee "$OUT/gpu_moe_tests.txt" | tail -n 4
  timeout "$(left 150)" $PT -m gpu -rf tests/models/test_gemma.py tests/models/test_more_families.py \
    tests/models/test_cohere_starcoder.py tests/engine/test_draft_guided.py 2>&1 \
    | tee "$OUT/gpu_family_tests.txt" | tail -n 4
  (cd "$OUT" && tar -czf tests.tgz gpu_*_tests.txt && rm -f gpu_*_tests.txt)
  echo "part verify done at ${SECONDS}s" ;;
ab)
  latency int4_bs1 --batch-size 1 --quantization int4
  FLASHPAGE_INT4_FUSED_NORM=1 latency int4_norm_bs1 --batch-size 1 --quantization int4
  FLASHPAGE_PDL=all latency int4_pdlall_bs1 --batch-size 1 --quantization int4
  latency bf16_bs1 --batch-size 1
  timeout "$(left 150)" python3 benchmarks/fp8_block_gemm.py --rows 256,2048 --no-deq \
    --configs m128n256s1w8st3g8,m128n128s1w4st4g8,m64n256s1w4st4g8,m128n128s1w8st4g8,m256n128s1w8st3g8 \
    --json-out "$OUT/fp8_block_w8a8.json" > "$OUT/fp8_block_w8a8.txt" 2>&1; tail -n 40 "$OUT/fp8_block_w8a8.txt"
  (cd "$OUT" && tar -czf latency.tgz latency_* && rm -f latency_*)
  echo "part ab done at ${SECONDS}s" ;;
families)
  timeout "$(left 90)" $PT -rf tests/kernels/test_layer_norm_kernel.py tests/kernels/test_pdl.py 2>&1 \
    | tee "$OUT/gpu_lnorm_tests.txt" | tail -n 4
  timeout "$(left 90)" python3 benchmarks/fused_ops.py --only norm --out "$OUT" > "$OUT/fused_norm.txt" 2>&1
  tail -n 20 "$OUT/fused_norm.txt"
  timeout "$(left 330)" $PT -m "gpu or slow" -rf tests/models/test_cohere2_olmo.py \
    tests/models/test_olmoe_granitemoe.py tests/models/test_gpt2_bigcode.py tests/models/test_neox_phi.py \
    tests/models/test_gptj_falcon.py tests/models/test_opt.py 2>&1 | tee "$OUT/gpu_newfam_tests.txt" | tail -n 6
  timeout "$(left 150)" $PT -m gpu -rf tests/models/test_quant_families.py 2>&1 \
    | tee "$OUT/gpu_quantfam_tests.txt" | tail -n 4
  (cd "$OUT" && tar -czf families.tgz gpu_*_tests.txt fused_norm.txt && rm -f gpu_*_tests.txt fused_norm.txt)
  echo "part families done at ${SECONDS}s" ;;
window)  # session 23's second call: the window release on the GPU, the LayerNorm kernel, the new
  # families' fp32 graphs (gpu, not slow: run 180's verify part showed whole files do not fit)
  timeout "$(left 90)" $PT -m gpu -rf tests/engine/test_sliding_window_release.py 2>&1 \
    | tee "$OUT/gpu_window_tests.txt" | tail -n 4
  timeout "$(left 100)" $PT -rf tests/kernels/test_layer_norm_kernel.py 2>&1 \
    | tee "$OUT/gpu_lnorm_tests.txt" | tail -n 4
  timeout "$(left 90)" python3 benchmarks/fused_ops.py --only norm --out "$OUT" > "$OUT/fused_norm.txt" 2>&1
  tail -n 20 "$OUT/fused_norm.txt"
  timeout "$(left 300)" $PT -m "gpu and not slow" -rf tests/models/test_cohere2_olmo.py \
    tests/models/test_gpt2_bigcode.py tests/models/test_neox_phi.py tests/models/test_gptj_falcon.py \
    tests/models/test_opt.py tests/models/test_olmoe_granitemoe.py 2>&1 | tee "$OUT/gpu_newfam_tests.txt" | tail -n 6
  (cd "$OUT" && tar -czf window.tgz gpu_*_tests.txt fused_norm.txt && rm -f gpu_*_tests.txt fused_norm.txt)
  echo "part window done at ${SECONDS}s" ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
