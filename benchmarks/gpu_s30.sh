#!/usr/bin/env bash
# Session 30's device plan:
#   BUDGET=420 bash benchmarks/gpu_s30.sh a   Medusa on the H200 (its GPU test, then its timing beside
#                                             plain decoding and all-right / all-wrong drafts on the 8B
#                                             shape); the int4 fragment sums tiles timed under fp16
#                                             (fp16's default since session 29, untimed there); the fp8
#                                             swapped MoE on fp16 wgmma: how far from the unswapped sums
#   BUDGET=420 bash benchmarks/gpu_s30.sh b   DeepSeek-V2-Lite's prompt and mixed steps after MLA's
#                                             expansion kernels (run 160: 15.0 ms, run 165 mixed 13.4)
#   BUDGET=360 bash benchmarks/gpu_s30.sh c   the GPU tests of this session's features (CTESTS: the files),
#                                             then the host KV tier's TTFT (benchmarks/kv_offload.py)
#   BUDGET=240 bash benchmarks/gpu_s30.sh d   V2-Lite's mixed step (16 decodes + a 16-token prompt,
#                                             profile_ttft.py) in this tree and in older ones unpacked
#                                             from .ab/*.tar (git archive COMMIT), one after another:
#                                             run 213 timed it at 23.0 ms where run 165 had 13.4
# Results under $OUT (summaries only: the device returns ~8 files); logs in /tmp.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 120)" $PT -rfE -m gpu tests/engine/test_spec_medusa.py 2>&1 | tail -n 4
  timeout "$(left 150)" python3 benchmarks/spec_decode.py --config llama-3-8b --batch-sizes 1 8 32 --ks 3 --medusa \
    --json-out "$OUT/spec_medusa.json" > /tmp/spec_medusa.txt 2>&1
  grep -v "^ *$" /tmp/spec_medusa.txt | tail -n 22 | cut -c1-200
  timeout "$(left 100)" python3 benchmarks/int4_gemm.py --sweep --dtype fp16 --rows 64,100,128,256 \
    --json-out "$OUT/int4_sweep_fp16.json" > /tmp/int4_fp16.txt 2>&1
  grep -E "best|FAILED" /tmp/int4_fp16.txt | cut -c1-200 | head -n 40
  timeout "$(left 80)" $PT -rf --runxfail -m gpu tests/kernels/test_fused_moe_fp8.py -k swap_f16 2>&1 | grep -E "^FAILED|passed|failed|Mismatch|Greatest" | cut -c1-200 | head -n 20
  echo "part a done at ${SECONDS}s" ;;
b)
  v2lite_step_profiles
  echo "part b done at ${SECONDS}s" ;;
c)
  timeout "$(left 200)" $PT -rfE -m gpu ${CTESTS:-tests/engine/test_kv_offload.py} 2>&1 \
    | tee "$OUT/gpu_session30_tests.txt" | tail -n 12
  timeout "$(left 150)" python3 benchmarks/kv_offload.py --config llama-3-8b --input-lens 1024 4096 16384 \
    --json-out "$OUT/kv_offload.json" 2>&1 | grep -v "^INFO" | tail -n 6
  echo "part c done at ${SECONDS}s" ;;
d)
  for tree in .ab/*.tar .; do
    dir=$PWD; name=now
    if [ "$tree" != . ]; then name=$(basename "$tree" .tar); dir=/tmp/ab_$name; mkdir -p "$dir"; tar -xf "$tree" -C "$dir"; fi
    (cd "$dir" && PYTHONPATH=$dir timeout "$(left 80)" python3 benchmarks/profile_ttft.py --config deepseek-v2-lite \
      --iters 20 --decodes 16 --input-len 16 --out "/tmp/ab_out_$name" > "/tmp/ab_$name.log" 2>&1)
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r['request_ms_median'], 'ms for', r['gpu_kernel_ms'], 'ms of kernels', r['kernel_launches'], 'launches', r['request_ms_all'])" \
      "/tmp/ab_out_$name/profile_ttft.json" "$name" || tail -n 5 "/tmp/ab_$name.log"
    cp "/tmp/ab_out_$name/profile_ttft.txt" "$OUT/profile_mixed_$name.txt" 2>/dev/null
  done
  echo "part d done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-d)"; exit 2 ;;
esac
