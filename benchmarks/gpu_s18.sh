#!/usr/bin/env bash
# Session 18's device plan (written at the end of session 17).
#   BUDGET=400 bash benchmarks/gpu_s18.sh a   the fp8 GPU checks now held to the exact emulation's bounds
#                                             (tests/models/test_fp8_weights.py: never run on a GPU with
#                                             them), the whole fp8 kernel file, spec decoding's GPU tests
#                                             (logprobs on drafted tokens), then benchmarks/gemv.py --fp8
#                                             (the e4m3 GEMV's tiles: 72% of its weight-read limit in
#                                             run 141 against bf16's 95%)
#   BUDGET=560 bash benchmarks/gpu_s18.sh b   serving with speculative decoding (bench serve, 8B, run 129's
#                                             light load) on and off: what a loaded server pays for
#                                             synchronous steps when drafts rarely hit (random weights).
#                                             Carry [".whl"]
#   BUDGET=300 bash benchmarks/gpu_s18.sh c   the structured-outputs test with drafts on a head_dim-64
#                                             checkpoint (run 149 ran it on head_dim 16: refused), then
#                                             a sweep of one-row tiles over e4m3 weights (qkv, o_proj, down)
# Results under $OUT; each step cut to what is left of BUDGET (default 400) seconds.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 200)" $PT -m gpu tests/models/test_fp8_weights.py tests/kernels/test_gemv_fp8.py \
    tests/engine/test_spec_decode.py -rf 2>&1 | tee "$OUT/gpu_tests.txt" | tail -n 4
  timeout "$(left 150)" python3 benchmarks/gemv.py --fp8 --only shapes --out "$OUT" 2>&1 \
    | tee "$OUT/gemv_fp8.txt" | tail -n 30
  echo "part a done at ${SECONDS}s" ;;
b)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site || exit 1
  for spec in "" '{"method": "ngram", "num_speculative_tokens": 3}'; do
    name=$([ -n "$spec" ] && echo ngram || echo plain)
    timeout "$(left 200)" python3 -m flashpage bench serve --config llama-3-8b --request-rate 2 \
      --num-prompts 60 --input-len 256 --output-len 64 ${spec:+--speculative-config "$spec"} \
      --json-out "$OUT/serve_$name.json" > "$OUT/serve_$name.txt" 2>&1
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r['completed'], r['ttft_ms'], r['itl_ms'])" \
      "$OUT/serve_$name.json" "$name"
  done
  echo "part b done at ${SECONDS}s" ;;
c)
  timeout "$(left 120)" $PT -m gpu tests/engine/test_spec_decode.py -k structured -rf 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -n 3
  TILES=n4k4096w4,n8k4096w8,n8k4096w4,n2k4096w2,n2k4096w4,n1k4096w1,n1k4096w2,n16k4096w16
  TILES=$TILES,n8k512w4,n16k512w4,n16k512w8,n32k512w8,n32k512w16,n16k256w4,n32k256w4,n32k256w8
  TILES=$TILES,n64k256w8,n64k128w8,n8k1024w4,n8k1024w8,n4k1024w4,n4k2048w4,n4k2048w8,n16k1024w16
  timeout "$(left 30)" python3 benchmarks/gemv.py --fp8 --only shapes --kinds qkv,o_proj,down \
    --pdl 1 --tiles "$TILES" --out "$OUT" > "$OUT/gemv_fp8_sweep.txt" 2>&1
  for kind in qkv o_proj down; do grep "^$kind" "$OUT/gemv_fp8_sweep.txt" | sort -k4 -n | head -n 4; done
  echo "part c done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-c)"; exit 2 ;;
esac
