#!/usr/bin/env bash
# Session 21's device plan.
#   BUDGET=560 bash benchmarks/gpu_s21.sh check   what session 20 left unverified: the int4 GPU tests
#                                                 after the run-175 defaults, the pooled read-back's
#                                                 GPU test, then the 8B's batch-1 / 8 latency int4
#                                                 beside bf16
#   BUDGET=300 bash benchmarks/gpu_s21.sh chain   the int4 GEMV's FFMA chains (chain=True, 'c' tiles) beside
#                                                 the default at 1 / 2 / 4 rows; their GPU tests
#   BUDGET=420 bash benchmarks/gpu_s21.sh chain2  the chains as the one-row default: the int4 GPU tests, the
#                                                 down projection fused with SiLU·mul or not, the 8B's
#                                                 batch-1 latency int4 beside bf16
#   BUDGET=560 bash benchmarks/gpu_s21.sh final   the int4 chains with fp32 x, the norm prologue and PDL (GPU tests,
#                                                 the 8B batch-1 latency beside bf16); the helpers' GPU tests:
#                                                 block-scaled fp8 kept fp8, the MoE families, Gemma and the
#                                                 softcapped kernels; then the fp8 block GEMM and softcap benchmarks
# Results under $OUT.
PART=${1:-check}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
check)
  timeout "$(left 260)" $PT -rfs tests/kernels/test_int4_gemv.py tests/models/test_int4_online.py \
    tests/models/test_int4_checkpoints.py 2>&1 | tee "$OUT/gpu_int4_tests.txt" | tail -n 8
  timeout "$(left 60)" $PT -m gpu -rf tests/engine/test_embeddings.py 2>&1 | tee "$OUT/gpu_embed_tests.txt" | tail -n 4
  for bs in 1 8; do
    latency int4_bs$bs --batch-size $bs --quantization int4
    latency bf16_bs$bs --batch-size $bs
  done
  (cd "$OUT" && tar -czf latency.tgz latency_* && rm -f latency_*)  # few files come back
  echo "part check done at ${SECONDS}s" ;;
chain)
  C=fn64k128s0w4st1p2,cn64k128s0w4st1p2,cn64k128s0w4st1p1,cn64k128s0w4st1p3,cn128k128s0w8st1p2
  C=$C,cn64k128s4w4st1p2,cn64k128s8w4st1p2,cn64k128s0w4st3p0,cn64k128s0w4st4p0,cn32k128s0w4st1p2
  C=$C,cn64k128s0w2st1p2,cn32k128s0w2st1p2,an64k128s0w4st3p0
  timeout "$(left 200)" python3 benchmarks/int4_gemv.py --rows 1,2,4 --configs $C \
    --json-out "$OUT/int4_chain.json" > "$OUT/int4_chain.txt" 2>&1
  grep -A30 "best GEMV tile" "$OUT/int4_chain.txt" | head -30
  grep -E "m=1 .*(gemv:c|gemv:f|bf16)" "$OUT/int4_chain.txt" | head -60
  timeout "$(left 90)" $PT -rf tests/kernels/test_int4_gemv.py -k "gpu" 2>&1 | tee "$OUT/gpu_chain_tests.txt" | tail -n 4
  echo "part chain done at ${SECONDS}s" ;;
chain2)
  timeout "$(left 230)" $PT -rf tests/kernels/test_int4_gemv.py tests/models/test_int4_online.py \
    2>&1 | tee "$OUT/gpu_int4_tests.txt" | tail -n 4
  timeout "$(left 60)" python3 benchmarks/int4_gemv.py --rows 1 --configs cn32k128s0w2st1p2,fn64k128s0w4st1p2 \
    --json-out "$OUT/int4_chain2.json" > "$OUT/int4_chain2.txt" 2>&1
  grep -A6 "best GEMV tile" "$OUT/int4_chain2.txt"; grep -A2 "SiLU" "$OUT/int4_chain2.txt"
  latency int4_bs1 --batch-size 1 --quantization int4
  latency bf16_bs1 --batch-size 1
  (cd "$OUT" && tar -czf latency.tgz latency_* && rm -f latency_*)
  echo "part chain2 done at ${SECONDS}s" ;;
final)
  timeout "$(left 100)" $PT -rf tests/kernels/test_int4_gemv.py tests/models/test_int4_online.py \
    tests/models/test_int4_checkpoints.py -k "matches_reference or silu_mul_matches or round_trip or norm or on_the_gpu" \
    2>&1 | tee "$OUT/gpu_int4_tests.txt" | tail -n 4
  latency int4_bs1 --batch-size 1 --quantization int4
  latency bf16_bs1 --batch-size 1
  timeout "$(left 90)" $PT -m gpu -rf tests/kernels/test_fp8_block_gemm.py tests/models/test_fp8_checkpoints.py \
    tests/kernels/test_gemv_fp8.py 2>&1 | tee "$OUT/gpu_fp8blk_tests.txt" | tail -n 4
  timeout "$(left 80)" $PT -m gpu -rf tests/models/test_moe_families.py tests/kernels/test_moe_router.py \
    tests/kernels/test_fused_moe.py 2>&1 | tee "$OUT/gpu_moe_tests.txt" | tail -n 4
  timeout "$(left 90)" $PT -rf tests/models/test_gemma.py tests/kernels/test_paged_decode.py \
    tests/kernels/test_flash_prefill.py -k "gpu" 2>&1 | tee "$OUT/gpu_gemma_tests.txt" | tail -n 4
  timeout "$(left 70)" python3 benchmarks/fp8_block_gemm.py --json-out "$OUT/fp8_block_gemm.json" \
    > "$OUT/fp8_block_gemm.txt" 2>&1; tail -n 30 "$OUT/fp8_block_gemm.txt"
  timeout "$(left 50)" python3 benchmarks/attention_softcap.py --out "$OUT" > "$OUT/softcap.txt" 2>&1
  tail -n 12 "$OUT/softcap.txt"
  (cd "$OUT" && tar -czf tests_and_latency.tgz gpu_*_tests.txt latency_* && rm -f gpu_*_tests.txt latency_*)
  echo "part final done at ${SECONDS}s" ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
