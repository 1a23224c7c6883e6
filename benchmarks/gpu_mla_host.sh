#!/usr/bin/env bash
# The mlahost branch's device plan: MLA's latents' expansion as planned Triton kernels
# (kernels/mla_expand.py) on the H200.
#   BUDGET=400 bash benchmarks/gpu_mla_host.sh a   GPU tests: the expansion kernels (bf16, V2-Lite's
#                                                 shape, fp8 cache), the MLA decode plans, the MLA
#                                                 engine / DeepSeek model tests
#   BUDGET=420 bash benchmarks/gpu_mla_host.sh b   timings: the expansion against the torch path;
#                                                 V2-Lite's prompt and mixed steps as run 160 timed
#                                                 them (run 160: 15.01 / 13.78 ms; run 165 mixed 13.37)
# Results under $OUT.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 120)" $PT -m gpu -rf tests/kernels/test_mla_expand.py tests/kernels/test_mla_decode.py \
    tests/kernels/test_mla_decode_wgmma.py -k "expand or plan_serves or many_calls or mla_decode_gpu" \
    2>&1 | tee "$OUT/gpu_mla_kernel_tests.txt" | tail -n 3
  timeout "$(left 200)" $PT -m gpu -rf tests/engine/test_mla_triton.py tests/engine/test_mla_gluon_switch.py \
    tests/models/test_deepseek.py tests/models/test_deepseek_fp8.py 2>&1 | tee "$OUT/gpu_mla_engine_tests.txt" | tail -n 3
  echo "part a done at ${SECONDS}s" ;;
b)
  timeout "$(left 90)" python3 benchmarks/mla_expand.py --out "$OUT" 2>&1 | tee "$OUT/mla_expand.txt"
  v2lite_step_profiles
  echo "part b done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-b)"; exit 2 ;;
esac
