#!/usr/bin/env bash
# Session 27's device plan:
#   BUDGET=420 bash benchmarks/gpu_s27.sh a   session 26's untested GPU work: EAGLE-1 / EAGLE-3's
#                                             GPU tests (CUDA graphs, heads of 32 / 64), the
#                                             kept-MXFP4 GPT-OSS model test (graphs, against
#                                             transformers on the dequantized weights), the MTP
#                                             layer's GPU tests
# Results under $OUT (summaries only: the device returns ~8 files); logs in /tmp.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 150)" $PT -rf -m gpu tests/engine/test_eagle_draft.py 2>&1 | tee "$OUT/gpu_eagle_tests.txt" | tail -n 6
  timeout "$(left 200)" $PT -rf -m gpu tests/models/test_gpt_oss.py 2>&1 \
    | tee "$OUT/gpu_gpt_oss_tests.txt" | tail -n 6
  timeout "$(left 100)" $PT -rf -m gpu tests/engine/test_mtp_graphs.py tests/engine/test_mtp_draft.py 2>&1 \
    | tee "$OUT/gpu_mtp_tests.txt" | tail -n 4
  echo "part a done at ${SECONDS}s" ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
