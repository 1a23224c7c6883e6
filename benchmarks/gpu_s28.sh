#!/usr/bin/env bash
# Session 28's device plan:
#   BUDGET=330 bash benchmarks/gpu_s28.sh a   the fp8 / int4 MoE model GPU tests after session 27's
#                                             shared assert_kept_experts_follow_the_twin (not re-run
#                                             since); the int4 MoE kernel timed on its default
#                                             (64-row k64 past 16 pairs an expert: 512 tokens untimed)
# Results under $OUT (summaries only: the device returns ~8 files); logs in /tmp.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 110)" $PT -rf -m gpu tests/models/test_fp8_moe_experts.py tests/models/test_int4_moe_experts.py 2>&1 \
    | tee "$OUT/gpu_moe_model_tests.txt" | tail -n 4
  timeout "$(left 150)" python3 benchmarks/fused_moe.py --int4 --out /tmp/moe > /tmp/int4_moe_bench.txt 2>&1
  tail -n 2 /tmp/int4_moe_bench.txt; cp /tmp/moe/fused_moe_int4.json "$OUT/"; grep "^| " /tmp/moe/fused_moe_int4.md | cut -c1-170
  echo "part a done at ${SECONDS}s" ;;
*) echo "unknown part $PART"; exit 2 ;;
esac
