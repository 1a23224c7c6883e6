#!/usr/bin/env bash
# Session 11, issue 5 ("paged within 5% of contiguous"): the paged Gluon prefill's cp.async
# gather producer (paged_prefill_gluon(producer="gather"), never run on a GPU before) against
# the TMA-box producer (the default, unchanged) in one run, ~400 s of device time:
#   OUT=/tmp/s11 bash benchmarks/gpu_s11_prefill.sh
# 1. the gather GPU tests, static schedules first (a wrong mbarrier arrival count or phase
#    hangs: timeout, -x), then the dynamic schedule, the knobs and agreement with TMA
# 2. the existing paged tests (the TMA producer through the changed kernel)
# 3. benchmarks/prefill_gluon.py --variants gluon --causal-only with the paged columns to
#    compare (the gather columns left out if step 1 failed, so a hang cannot eat the table)
# Results under $OUT (6 files); the last lines of each step are printed.
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flashpage_gpu}; mkdir -p "$OUT"
PT="python3 -m pytest -q -p no:cacheprovider"
left() { local t=$((400 - SECONDS)); [ "$1" -lt "$t" ] && t=$1; [ "$t" -lt 1 ] && t=1; echo $t; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

timeout "$(left 60)" $PT -x -m gpu tests/kernels/test_paged_prefill_gather.py -k static -rf 2>&1 \
  | tee "$OUT/gather_static_tests.txt" | tail -n 3
ok_static=${PIPESTATUS[0]}
ok_rest=1
if [ "$ok_static" -eq 0 ]; then
  # -s: test_gather_agrees_with_tma prints whether the two producers agree bit for bit
  timeout "$(left 80)" $PT -x -s -m gpu tests/kernels/test_paged_prefill_gather.py -k "not static" -rf 2>&1 \
    | tee "$OUT/gather_tests.txt" | tail -n 6
  ok_rest=${PIPESTATUS[0]}
fi
timeout "$(left 80)" $PT -x -m gpu tests/kernels/test_flash_prefill_gluon.py -k paged -rf 2>&1 \
  | tee "$OUT/paged_tests.txt" | tail -n 3

PAGED=gluon_paged,gluon_paged_b128,gluon_paged_r224
if [ "$ok_static" -eq 0 ] && [ "$ok_rest" -eq 0 ]; then
  PAGED=$PAGED,gluon_paged_gather,gluon_paged_gather_stages3,gluon_paged_gather_b128
else
  echo "gather tests failed (static rc $ok_static, rest rc $ok_rest): no gather columns" | tee -a "$OUT/gather_tests.txt"
fi
timeout "$(left 175)" python3 benchmarks/prefill_gluon.py --out "$OUT" --variants gluon --causal-only \
  --paged-variants "$PAGED" --budget 160 2>&1 | tee "$OUT/prefill_gluon.txt" | tail -n 10
