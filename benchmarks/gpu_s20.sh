#!/usr/bin/env bash
# Session 20's device plan: what the session built on the CPU, on the H200.
#   BUDGET=300 bash benchmarks/gpu_s20.sh draft   the draft model's decode graphs: GPU tests, then
#                                                 an 8B-shaped 1-layer draft with graphs and eager
#                                                 (run 165: 11.0 ms a step eager at batch 1)
#   BUDGET=300 bash benchmarks/gpu_s20.sh int4    the int4 GEMV (1-16 rows): GPU tests, then its tiles
#                                                 beside the tl.dot kernel, dequantize + cuBLAS, bf16
#   BUDGET=420 bash benchmarks/gpu_s20.sh enc     encoders after the host work was cut: GPU tests,
#                                                 bge-base / reranker beside transformers (async
#                                                 read-back on and off, host only); the int4 GEMV's
#                                                 new defaults (run 171's sweep) timed again
#   BUDGET=300 bash benchmarks/gpu_s20.sh int4e2e quantization="int4": its GPU test, then the 8B shape's
#                                                 batch-1 and batch-8 latency, bf16 / int4 / fp8 in turn
#   BUDGET=420 bash benchmarks/gpu_s20.sh check   the int4 GEMV at the tiny models' shapes (run 173's failed
#                                                 online-int4 GPU test), the int4 GPU tests; the draft's
#                                                 catch-up graphs: GPU tests, then graphed vs eager
#   BUDGET=480 bash benchmarks/gpu_s20.sh final   the int4 GEMV after the pipelined form, fused SiLU·mul,
#                                                 16-byte word loads and 17-64 rows: GPU tests, the
#                                                 sweep at 1 / 8 / 16 / 32 / 64 rows, then the 8B's
#                                                 batch-1 / 8 latency int4 beside bf16
# Results under $OUT.
PART=${1:-draft}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
draft)
  timeout "$(left 170)" $PT -m gpu -rf tests/engine/test_draft_graphs.py tests/engine/test_draft_model.py \
    tests/engine/test_prefill_graphs.py 2>&1 | tee "$OUT/gpu_draft_tests.txt" | tail -n 12
  timeout "$(left 200)" python3 benchmarks/spec_decode.py --config llama-3-8b --batch-sizes 1 8 --ks 4 \
    --draft-layers 1 --draft-eager --json-out "$OUT/spec_draft_graphs.json" 2>&1 \
    | tee "$OUT/spec_draft_graphs.txt" | grep -E "^batch|draft|Error|Traceback" | head -40
  echo "part draft done at ${SECONDS}s" ;;
int4)
  timeout "$(left 150)" $PT -rfs tests/kernels/test_int4_gemv.py tests/kernels/test_int4_gemm.py \
    tests/models/test_int4_checkpoints.py 2>&1 | tee "$OUT/gpu_int4_tests.txt" | tail -n 12
  timeout "$(left 240)" python3 benchmarks/int4_gemv.py --json-out "$OUT/int4_gemv.json" > "$OUT/int4_gemv.txt" 2>&1
  tail -n 40 "$OUT/int4_gemv.txt"
  echo "part int4 done at ${SECONDS}s" ;;
enc)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site  # the server's wheels (carry .whl)
  timeout "$(left 120)" $PT -rf tests/encoder tests/server/test_encoder_server.py \
    tests/server/test_embeddings_endpoint.py 2>&1 | tee "$OUT/gpu_enc_tests.txt" | tail -n 6
  E="python3 benchmarks/encoder.py --num-prompts 1024"
  timeout "$(left 60)" $E --shape bge-base --lengths 128 512 --json-out "$OUT/enc_bge_bf16.json" 2>&1 | tail -n 3
  timeout "$(left 60)" $E --shape bge-base --lengths 128 512 --no-async-scheduling \
    --json-out "$OUT/enc_bge_bf16_sync.json" 2>&1 | tail -n 3
  timeout "$(left 60)" $E --shape bge-reranker-base --lengths 256 --json-out "$OUT/enc_rerank.json" 2>&1 | tail -n 2
  timeout "$(left 40)" $E --shape bge-base --lengths 128 --host-only --repeat 5 \
    --json-out "$OUT/enc_bge_host.json" 2>&1 | tail -n 2
  timeout "$(left 150)" python3 benchmarks/int4_gemv.py --json-out "$OUT/int4_gemv.json" > "$OUT/int4_gemv.txt" 2>&1
  tail -n 22 "$OUT/int4_gemv.txt"
  echo "part enc done at ${SECONDS}s" ;;
int4e2e)
  timeout "$(left 90)" $PT -m gpu -rf tests/models/test_int4_online.py 2>&1 | tee "$OUT/gpu_int4_online.txt" | tail -n 3
  for bs in 1 8; do
    latency bf16_bs$bs --batch-size $bs
    latency int4_bs$bs --batch-size $bs --quantization int4
    latency fp8_bs$bs --batch-size $bs --quantization fp8
  done
  echo "part int4e2e done at ${SECONDS}s" ;;
check)
  timeout "$(left 60)" python3 benchmarks/int4_gemv_check.py > "$OUT/int4_gemv_check.txt" 2>&1
  grep -E "worst|Error|Traceback" "$OUT/int4_gemv_check.txt"; grep -E "K=  128 G=128 m= (1|8) " "$OUT/int4_gemv_check.txt"
  timeout "$(left 120)" $PT -m gpu -rf tests/models/test_int4_online.py tests/models/test_int4_checkpoints.py \
    2>&1 | tee "$OUT/gpu_int4_tests.txt" | tail -n 4
  timeout "$(left 150)" $PT -m gpu -rf tests/engine/test_draft_graphs.py tests/engine/test_draft_model.py \
    tests/engine/test_prefill_graphs.py tests/engine/test_spec_decode.py 2>&1 | tee "$OUT/gpu_draft_tests.txt" | tail -n 6
  timeout "$(left 200)" python3 benchmarks/spec_decode.py --config llama-3-8b --batch-sizes 1 8 --ks 4 \
    --draft-layers 1 --draft-eager --json-out "$OUT/spec_draft_catchup.json" 2>&1 \
    | tee "$OUT/spec_draft_catchup.txt" | grep -E "^batch|Error|Traceback" | head -40
  echo "part check done at ${SECONDS}s" ;;
final)
  timeout "$(left 130)" $PT -rf tests/kernels/test_int4_gemv.py tests/models/test_int4_online.py \
    tests/models/test_int4_checkpoints.py 2>&1 | tee "$OUT/gpu_int4_tests.txt" | tail -n 4
  timeout "$(left 230)" python3 benchmarks/int4_gemv.py --rows 1,8,16,32,64 --json-out "$OUT/int4_gemv.json" \
    > "$OUT/int4_gemv.txt" 2>&1
  grep -A60 "best GEMV tile" "$OUT/int4_gemv.txt" | head -60
  grep -E "silu|fused" "$OUT/int4_gemv.txt" | tail -n 12
  for bs in 1 8; do
    latency int4_bs$bs --batch-size $bs --quantization int4
    latency bf16_bs$bs --batch-size $bs
  done
  (cd "$OUT" && tar -czf latency.tgz latency_* && rm -f latency_*)  # few files come back
  echo "part final done at ${SECONDS}s" ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
