#!/usr/bin/env bash
# One device call for the decode kernels (issue 6, issue 4 item 1), everything under $OUT:
#   1. compile the paged-decode variants in parallel processes (Triton's cache is shared);
#   2. the bf16 GPU tests of the three kernel test files, in parallel processes, while the
#      MLA variants compile (nothing is timed yet);
#   3. the paged-decode benchmark: default rows, SDPA baselines, then every candidate config
#      at every split count (decode.json / decode.md);
#   4. the fused small ops, cache writes with their tile sweep (fused_ops.json / .md);
#   5. the MLA decode benchmark with its sweep (mla_decode.jsonl).
# Each benchmark measures the copy bandwidth itself (events, outside a graph, warmed up).
#   bash benchmarks/decode_sweep.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/decode_sweep}; mkdir -p "$OUT"
LOG="$OUT/run.log"
T0=$(date +%s)
stamp() { echo "== $(( $(date +%s) - T0 )) s: $*" | tee -a "$LOG"; }
PT="python3 -m pytest -q -p no:cacheprovider -m gpu"

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader >>"$LOG" 2>&1
stamp "precompile paged decode"
timeout 90 python3 benchmarks/attention_decode.py --precompile 14 --sweep >>"$LOG" 2>&1

stamp "GPU tests (bf16) + MLA precompile"
timeout 150 python3 benchmarks/mla_decode.py --precompile 6 --sweep >>"$LOG" 2>&1 &
P=tests/kernels/test_paged_decode.py
timeout 150 $PT $P -k "gpu_bf16 and d64" >/tmp/t1.txt 2>&1 &
timeout 150 $PT $P -k "gpu_bf16 and d128" >/tmp/t2.txt 2>&1 &
timeout 150 $PT $P -k "gpu_bf16 and d256" >/tmp/t3.txt 2>&1 &
timeout 150 $PT $P -k "not gpu_bf16" >/tmp/t4.txt 2>&1 &
timeout 150 $PT tests/kernels/test_mla_decode.py >/tmp/t5.txt 2>&1 &
timeout 150 $PT tests/kernels/test_fused_ops.py >/tmp/t6.txt 2>&1 &
wait
for i in 1 2 3 4 5 6; do echo "--- part $i"; tail -n 25 /tmp/t$i.txt; done >"$OUT/tests.txt"
grep -hE "passed|failed|error" /tmp/t?.txt | tee -a "$LOG"

stamp "paged decode benchmark + sweep"
timeout 150 python3 benchmarks/attention_decode.py --out "$OUT" --sweep --budget-s 90 >>"$LOG" 2>&1
tail -n 20 "$OUT/decode.md" 2>/dev/null

stamp "fused ops"
timeout 75 python3 benchmarks/fused_ops.py --out "$OUT" >>"$LOG" 2>&1
tail -n 30 "$OUT/fused_ops.md" 2>/dev/null

stamp "MLA decode benchmark + sweep"
timeout 100 python3 benchmarks/mla_decode.py --sweep --out "$OUT/mla_decode.jsonl" >>"$LOG" 2>&1
stamp "done"
grep -E "^H16 |^\| 16 " "$LOG" | tail -n 30
