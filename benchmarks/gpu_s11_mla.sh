#!/usr/bin/env bash
# Session 11, the Gluon MLA decode's tile-loop knobs (kernels/mla_decode_gluon.py: peel, lean,
# lazy; the default unchanged) in one device call of <= 400 s:
#   1. its GPU tests, every form (default, peel, lean, lazy, all) over the same cases, -x -v under
#      a timeout (a wrong mbarrier phase hangs rather than fails);
#   2. benchmarks/mla_decode_gluon.py at page 64: triton, gluon and the four knob forms at the
#      issue-4 shapes, % of copy;
#   3. if >= 70 s are left, the default vs "all" at page 16 on three shapes.
# Each step's timeout is cut to what is left of 400 s. Results under $OUT (<= 7 files):
#   gpu.txt, mla_gluon_tests.txt, mla_gluon_bench.txt, mla_decode_gluon.json, p16/...
#   OUT=/tmp/out bash benchmarks/gpu_s11_mla.sh
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flashpage_gpu}; mkdir -p "$OUT"
left() { local t=$((400 - SECONDS)); [ "$1" -lt "$t" ] && t=$1; [ "$t" -lt 1 ] && t=1; echo $t; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "$(left 190)" python3 -m pytest -x -v -p no:cacheprovider -m gpu tests/kernels/test_mla_decode_gluon.py -rf \
  2>&1 | tee "$OUT/mla_gluon_tests.txt" | tail -n 8
echo "tests done at ${SECONDS}s"
timeout "$(left 380)" python3 benchmarks/mla_decode_gluon.py --out "$OUT" 2>&1 | tee "$OUT/mla_gluon_bench.txt" \
  | tail -n 12
echo "benchmark done at ${SECONDS}s"
if [ $((400 - SECONDS)) -ge 70 ]; then
  mkdir -p "$OUT/p16"
  timeout "$(left 120)" python3 benchmarks/mla_decode_gluon.py --out "$OUT/p16" --page 16 --variants triton gluon \
    gluon_all --shapes 8x32768 32x4096 128x4096 2>&1 | tee "$OUT/p16/mla_gluon_bench.txt" | tail -n 7
fi
