#!/usr/bin/env bash
# One device call (~90 s on an H200, compiles included) for issue 4's MLA decode and issue
# 6's MLA cache write, everything under $OUT:
#   1. at once: the bf16 GPU tests of tests/kernels/test_mla_decode.py,
#      test_mla_cache_write.py and test_fused_ops.py, spread over 8 pytest processes by
#      node id (round robin, so the slow compiles spread too), and the compile of the
#      benchmark's kernels in 5 more processes (Triton's cache is shared on disk);
#   2. then, with the GPU to itself: benchmarks/mla_decode.py --final (old vs new MLA
#      decode at 16 heads, then the MLA cache write; copy bandwidth at start and end).
#   bash benchmarks/mla_final.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mla_final}; mkdir -p "$OUT"
LOG="$OUT/run.log"
T0=$(date +%s)
stamp() { echo "== $(( $(date +%s) - T0 )) s: $*" | tee -a "$LOG"; }
TESTS="tests/kernels/test_mla_decode.py tests/kernels/test_mla_cache_write.py tests/kernels/test_fused_ops.py"
PT="python3 -m pytest -q -p no:cacheprovider -m gpu"
N=8

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader >>"$LOG" 2>&1
stamp "GPU tests (bf16) in $N processes + benchmark precompile"
timeout 55 python3 benchmarks/mla_decode.py --final --precompile 5 >"$OUT/precompile.log" 2>&1 &
# shellcheck disable=SC2086
$PT --collect-only $TESTS 2>/dev/null | grep "::" >"$OUT/gpu_test_ids.txt"
mapfile -t IDS <"$OUT/gpu_test_ids.txt"
for i in $(seq 0 $((N - 1))); do
    chunk=()
    for j in "${!IDS[@]}"; do (( j % N == i )) && chunk+=("${IDS[j]}"); done
    (( ${#chunk[@]} )) && timeout 55 $PT "${chunk[@]}" >"$OUT/tests_$i.txt" 2>&1 &
done
wait
stamp "tests done (${#IDS[@]} collected)"
grep -hE "passed|failed|error" "$OUT"/tests_*.txt | tee -a "$LOG"
grep -hE "^(FAILED|ERROR)" "$OUT"/tests_*.txt | tee -a "$LOG"
tail -n 1 "$OUT/precompile.log" | tee -a "$LOG"

stamp "MLA decode old vs new + MLA cache write"
timeout 40 python3 benchmarks/mla_decode.py --final --budget-s 25 --out "$OUT/mla_final.jsonl" 2>&1 \
    | tee "$OUT/mla_final.txt"
stamp "done"
