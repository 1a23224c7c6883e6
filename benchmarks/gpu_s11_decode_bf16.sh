#!/usr/bin/env bash
# Session 11, issue 6: the persistent Gluon keys_m decode over a 16-bit cache
# (flashpage/kernels/paged_decode_gluon_bf16.py), never run on a GPU before this script. One device call:
#
#   bash benchmarks/gpu_s11_decode_bf16.sh
#
# 1. one GPU test alone (bf16, 3 programs an SM x 2 stages, ragged contexts) under a short timeout: a wrong
#    mbarrier phase hangs, and then nothing else here is worth the device time (exit 3);
# 2. the file's GPU tests, -x (bf16 / fp16, 7 programs-per-SM x stages forms, few programs with many items,
#    padding rows, sharp scores, GQA groups 1/4/8, CUDA-graph replay, paged_decode's routing under
#    FLASHPAGE_DECODE_GLUON_BF16=1);
# 3. benchmarks/decode_gluon_knobs.py --set bf16: Triton default, SDPA cuDNN on contiguous KV and the Gluon
#    kernel at P3 s2 / P2 s3 / P2 s2 / P1 s4 / P1 s6 (programs an SM, 32 KB stages), issue 6's shapes and 256
#    ragged; ratio to cuDNN in each cell.
# Every step's timeout is cut to what is left of 400 s. Results under $OUT (5 files).
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flashpage_gpu}; mkdir -p "$OUT"
PT="python3 -m pytest -p no:cacheprovider"
T=tests/kernels/test_paged_decode_gluon_bf16.py
left() { local t=$((400 - SECONDS)); [ "$1" -lt "$t" ] && t=$1; echo $t; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

timeout "$(left 90)" $PT -x -v -m gpu "$T" -k "test_gluon_bf16_gpu and p3_s2 and ragged and bf16" -rf 2>&1 \
  | tee "$OUT/bf16_smoke_test.txt" | tail -n 4
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "the first Gluon bf16 test timed out (rc $rc): a hang, most likely an mbarrier phase; stopping" | tee -a "$OUT/bf16_smoke_test.txt"
  exit 3
fi

timeout "$(left 170)" $PT -x -q -m gpu "$T" -rf 2>&1 | tee "$OUT/bf16_gpu_tests.txt" | tail -n 6

timeout "$(left 220)" python3 benchmarks/decode_gluon_knobs.py --set bf16 --out "$OUT" 2>&1 \
  | tee "$OUT/decode_gluon_knobs_bf16.txt" | tail -n 12
