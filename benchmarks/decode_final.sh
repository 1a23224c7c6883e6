#!/usr/bin/env bash
# Issue 6's remaining targets in one device call (~70-100 s on an H200), everything under $OUT:
#   1. untimed, in parallel: the bf16 GPU tests of tests/kernels/test_paged_decode.py and
#      tests/kernels/test_fused_ops.py (pytest-xdist), while the benchmark kernels compile;
#   2. paged decode, old default (split merge kernel) vs new (in-kernel merge) and variants,
#      rows 1x32768, 32x4096, 128x2048, 8x32768, SDPA cuDNN and the copy in the same run
#      (compare.md / compare.json);
#   3. write_kv_cache, old tile kernel vs the row kernel and its variants, do_bench and
#      graph-rotated, with a same-size copy and the 4 GiB copy in the same run
#      (kv_write.md / kv_write.json).
# Nothing is timed while anything else runs on the GPU. Each benchmark times the copy
# itself (outside a graph, warmed up).
#   bash benchmarks/decode_final.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/decode_final}; mkdir -p "$OUT"
LOG="$OUT/run.log"
T0=$(date +%s)
stamp() { echo "== $(( $(date +%s) - T0 )) s: $*" | tee -a "$LOG"; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader >>"$LOG" 2>&1
stamp "untimed: GPU tests (bf16) + benchmark kernels compile, in parallel"
# Timeouts bound the whole script to ~100 s (52 + 25 + 22); expected ~75-85 s.
PT="python3 -m pytest -v -rfE -p no:cacheprovider"  # -n: pytest-xdist (on the device image); -v: results even if killed
timeout 45 python3 benchmarks/attention_decode.py --precompile 5 --compare >"$OUT/precompile_decode.txt" 2>&1 &
timeout 45 python3 benchmarks/fused_ops.py --only kv_write --precompile >"$OUT/precompile_kv.txt" 2>&1 &
# paged decode: the gpu-marked tests (bf16, every candidate config, fused merge, graphs, 2^31 pool);
# fused ops: the gpu-marked ones plus the cache-write tests, which run in bf16 on a GPU.
timeout 52 $PT -n 10 -m gpu tests/kernels/test_paged_decode.py >"$OUT/tests_decode.txt" 2>&1 &
timeout 52 $PT -n 2 -k "write_kv or pool" tests/kernels/test_fused_ops.py >"$OUT/tests_fused.txt" 2>&1 &
wait
tail -n 2 "$OUT/precompile_decode.txt" "$OUT/precompile_kv.txt" | tee -a "$LOG"
for f in tests_decode tests_fused; do
    echo "$f: $(grep -E "passed|failed|error" "$OUT/$f.txt" | tail -n 1)" | tee -a "$LOG"
    grep -E "^(FAILED|ERROR) " "$OUT/$f.txt" | head -n 20 | tee -a "$LOG"
done

stamp "paged decode: old vs new default"
timeout 25 python3 benchmarks/attention_decode.py --compare --out "$OUT" >>"$LOG" 2>&1
cat "$OUT/compare.md" 2>/dev/null

stamp "write_kv_cache: old vs new"
timeout 22 python3 benchmarks/fused_ops.py --only kv_write --out "$OUT" >>"$LOG" 2>&1
cat "$OUT/kv_write.md" 2>/dev/null
stamp "done"
