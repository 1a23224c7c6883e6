#!/usr/bin/env bash
# Session 31's device plan:
#   BUDGET=560 bash benchmarks/gpu_s31.sh a   KV offloading's asynchronous loads: the GPU tests (both
#                                             load forms), the host tier's TTFT table, then 32 decoding
#                                             neighbours' steps while a 4k / 16k prefix loads, async
#                                             (default) and FLASHPAGE_KV_OFFLOAD_ASYNC_LOADS=0 in turn
#   BUDGET=300 bash benchmarks/gpu_s31.sh b   the GPU tests of the helpers' features (CTESTS: the files)
#   BUDGET=240 bash benchmarks/gpu_s31.sh c   sleep / wake_up of the 8B shape with fixed addresses (graphs
#                                             kept) and with FLASHPAGE_SLEEP_FIXED_ADDRESSES=0 (recaptured)
# Results under $OUT (summaries only: the device returns ~8 files); logs in /tmp.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 60)" $PT -rfE -m gpu tests/engine/test_cumem.py 2>&1 | tail -n 15
  timeout "$(left 150)" $PT -rfE -m gpu tests/engine/test_sleep_mode.py tests/engine/test_kv_offload.py 2>&1 | tail -n 15
  timeout "$(left 240)" python3 benchmarks/kv_offload.py --config llama-3-8b --input-lens 1024 4096 16384 \
    --neighbours 32 --iters 2 --json-out "$OUT/kv_offload_async.json" 2>&1 | grep -v "^INFO" | tail -n 8
  FLASHPAGE_KV_OFFLOAD_ASYNC_LOADS=0 timeout "$(left 300)" python3 benchmarks/kv_offload.py --config llama-3-8b \
    --input-lens 4096 16384 --neighbours 32 --iters 1 --json-out "$OUT/kv_offload_sync.json" 2>&1 | grep -v "^INFO" | tail -n 6
  echo "part a done at ${SECONDS}s" ;;
b)
  timeout "$(left 600)" $PT -rfE -m gpu ${CTESTS:?CTESTS: the test files} 2>&1 | tee "$OUT/gpu_session31_tests.txt" | tail -n 14
  echo "part b done at ${SECONDS}s" ;;
c)
  timeout "$(left 130)" python3 benchmarks/sleep_wake.py --config llama-3-8b --json-out "$OUT/sleep_fixed.json" 2>&1 \
    | grep -v "^INFO" | tail -n 5
  FLASHPAGE_SLEEP_FIXED_ADDRESSES=0 timeout "$(left 130)" python3 benchmarks/sleep_wake.py --config llama-3-8b \
    --json-out "$OUT/sleep_recapture.json" 2>&1 | grep -v "^INFO" | tail -n 5
  echo "part c done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-c)"; exit 2 ;;
esac
