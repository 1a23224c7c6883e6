#!/usr/bin/env bash
# Session 13's device plan: the wgmma MLA decode's first run (kernels/mla_decode_wgmma.py, written in
# session 12 without a GPU), then its speed beside the mma.sync kernels at issue 4's shapes.
#   bash benchmarks/gpu_s13.sh a    on a FRESH machine: its GPU tests (-x under a timeout: a wrong
#                                   mbarrier phase hangs), then benchmarks/mla_decode_gluon.py with
#                                   triton, gluon_all and wgmma (page 64), all six shapes
#   bash benchmarks/gpu_s13.sh b    Nsight Compute on it and on gluon_all at 8 x 32768
#   bash benchmarks/gpu_s13.sh c    end to end: the engine GPU test through it; V2-Lite with
#                                   FLASHPAGE_MLA_GLUON=0 / 1 / wgmma
#   bash benchmarks/gpu_s13.sh d    issue 6: the bf16 decode forms beside cuDNN, medians of 5 rounds
#   bash benchmarks/gpu_s13.sh e    the wgmma MLA decode with a producer warpgroup: tests, the six
#                                   shapes beside the inline form, Nsight Compute
#   bash benchmarks/gpu_s13.sh f    the same over a ring of 25 slabs (beside 18), a call's kernels
#   bash benchmarks/gpu_s13.sh g    two consumer warpgroups splitting the columns (consumers=2)
# Results under $OUT; each step cut to what is left of BUDGET (default 400) seconds.
# Parts a, b, e, f and g timed forms of the wgmma kernel since removed (one warpgroup: bench
# variant "wgmma" then; one consumer: "wgmma_ws", "wgmma_ws18"; ncu cases mla_wgmma_ws*): they
# run as written at commit 0d3b918. "wgmma" and "wgmma_ws2" are now both the kernel's one form.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 60)" $PT -x -m gpu tests/kernels/test_mla_decode_wgmma.py -k "one_key and default" -rf 2>&1 \
    | tee "$OUT/wgmma_smoke.txt" | tail -n 3
  timeout "$(left 150)" $PT -x -m gpu tests/kernels/test_mla_decode_wgmma.py -rf 2>&1 \
    | tee "$OUT/wgmma_tests.txt" | tail -n 4
  echo "tests done at ${SECONDS}s"
  timeout "$(left 150)" python3 benchmarks/mla_decode_gluon.py --out "$OUT" --variants triton gluon_all wgmma --rounds 3 2>&1 \
    | tee "$OUT/mla_wgmma.txt" | tail -n 9
  echo "part a done at ${SECONDS}s" ;;
b)
  # Nsight Compute on the wgmma kernel beside the mma.sync one at 8 x 32768 (~120 s)
  NCU_CASES="mla_wgmma_8x32k mla_gluon_8x32k" timeout "$(left 200)" bash benchmarks/gpu_s12_ncu.sh
  echo "part b done at ${SECONDS}s" ;;
c)
  # end to end: the engine GPU test through both Gluon MLA kernels, then V2-Lite with the Triton MLA
  # decode, the mma.sync Gluon one and the wgmma one (FLASHPAGE_MLA_GLUON=0 / 1 / wgmma), same call
  timeout "$(left 150)" $PT -m gpu tests/engine/test_mla_gluon_switch.py -rf 2>&1 | tee "$OUT/mla_switch_tests.txt" | tail -n 3
  for g in 0 1 wgmma; do
    FLASHPAGE_MLA_GLUON=$g timeout "$(left 90)" python3 -m flashpage bench throughput --config deepseek-v2-lite \
      --gpu-memory-utilization 0.75 --num-requests 64 --no-hf --json-out "$OUT/throughput_v2lite_mla_$g.json" \
      2>&1 | grep -E "output_tok_per_s|Error"
  done
  echo "part c done at ${SECONDS}s" ;;
d)
  # issue 6 with medians: the bf16 decode forms and cuDNN in turn, five rounds a shape (~2 min)
  timeout "$(left 200)" python3 benchmarks/decode_gluon_knobs.py --set bf16 --rounds 5 --out "$OUT" \
    --variants "P2 s2" "P2 s2 bal" "P3 s2" 2>&1 | tee "$OUT/decode_bf16_rounds.txt" | tail -n 9
  echo "part d done at ${SECONDS}s" ;;
e)
  # the wgmma MLA decode with a producer warpgroup (producer="warp"): its GPU tests (-x: a wrong
  # phase hangs), the six shapes beside the inline form, then Nsight Compute on it
  timeout "$(left 200)" $PT -x -m gpu tests/kernels/test_mla_decode_wgmma.py -k warp -rf 2>&1 \
    | tee "$OUT/wgmma_ws_tests.txt" | tail -n 4
  timeout "$(left 150)" python3 benchmarks/mla_decode_gluon.py --out "$OUT" --variants triton gluon_all wgmma wgmma_ws \
    --rounds 3 2>&1 | tee "$OUT/mla_wgmma_ws.txt" | tail -n 9
  NCU_CASES="mla_wgmma_ws_8x32k" timeout "$(left 100)" bash benchmarks/gpu_s12_ncu.sh
  echo "part e done at ${SECONDS}s" ;;
f)
  # producer="warp" over a ring of 25 slabs (a third tile's first 7 slabs in flight): tests,
  # the six shapes beside 18 slabs (2 whole tiles) and the inline form, a call's kernels, ncu
  timeout "$(left 200)" $PT -x -m gpu tests/kernels/test_mla_decode_wgmma.py -k warp -rf 2>&1 \
    | tee "$OUT/wgmma_ws_tests.txt" | tail -n 4
  timeout "$(left 150)" python3 benchmarks/mla_decode_gluon.py --out "$OUT" \
    --variants triton wgmma wgmma_ws18 wgmma_ws --rounds 3 2>&1 | tee "$OUT/mla_wgmma_ws.txt" | tail -n 9
  (cd benchmarks && timeout "$(left 60)" python3 mla_kernel_times.py --out "$OUT" --variants wgmma_ws wgmma triton \
    2>&1 | tail -n 3)
  NCU_CASES="mla_wgmma_ws_8x32k" timeout "$(left 100)" bash benchmarks/gpu_s12_ncu.sh
  echo "part f done at ${SECONDS}s" ;;
g)
  # two consumer warpgroups (consumers=2): tests, the six shapes (graphs >= 1 GiB now), kernels, ncu
  timeout "$(left 200)" $PT -x -m gpu tests/kernels/test_mla_decode_wgmma.py -k warp2 -rf 2>&1 \
    | tee "$OUT/wgmma_ws2_tests.txt" | tail -n 4
  timeout "$(left 200)" python3 benchmarks/mla_decode_gluon.py --out "$OUT" \
    --variants triton gluon_all wgmma_ws wgmma_ws2 wgmma_ws2_18 --rounds 3 2>&1 | tee "$OUT/mla_wgmma_ws2.txt" | tail -n 9
  (cd benchmarks && timeout "$(left 60)" python3 mla_kernel_times.py --out "$OUT" --variants wgmma_ws2 wgmma_ws triton \
    2>&1 | tail -n 3)
  NCU_CASES="mla_wgmma_ws2_8x32k" timeout "$(left 100)" bash benchmarks/gpu_s12_ncu.sh
  echo "part g done at ${SECONDS}s" ;;
h)
  # before routing the engine to it: 16-key pages (the engine's block size), 128 heads, the
  # engine GPU test and V2-Lite end to end with the Triton MLA decode and with it
  timeout "$(left 100)" python3 benchmarks/mla_decode_gluon.py --out "$OUT" --page 16 \
    --variants triton gluon_all wgmma_ws2 --rounds 3 2>&1 | tee "$OUT/mla_page16.txt" | tail -n 9
  mv "$OUT/mla_decode_gluon.json" "$OUT/mla_decode_gluon_page16.json"
  timeout "$(left 100)" python3 benchmarks/mla_decode_gluon.py --out "$OUT" --heads 128 \
    --shapes 8x32768 32x4096 128x4096 8x4096 --variants triton wgmma_ws2 --rounds 2 2>&1 \
    | tee "$OUT/mla_heads128.txt" | tail -n 7
  mv "$OUT/mla_decode_gluon.json" "$OUT/mla_decode_gluon_heads128.json"
  timeout "$(left 120)" $PT -m gpu tests/engine/test_mla_gluon_switch.py -rf 2>&1 | tee "$OUT/mla_switch_tests.txt" | tail -n 3
  for g in 0 wgmma; do
    FLASHPAGE_MLA_GLUON=$g timeout "$(left 100)" python3 -m flashpage bench throughput --config deepseek-v2-lite \
      --gpu-memory-utilization 0.75 --num-requests 64 --no-hf --json-out "$OUT/throughput_v2lite_mla_$g.json" \
      2>&1 | grep -E "output_tok_per_s|Error"
  done
  echo "part h done at ${SECONDS}s" ;;
i)
  # the engine's new MLA default (wgmma for 16 heads): the MLA engine GPU tests, then issue 4's
  # sweep (batch 1-128, contexts 1k-32k) with it beside Triton's at pages 16 and 64
  timeout "$(left 150)" $PT -m gpu tests/engine/test_mla_triton.py tests/engine/test_mla_gluon_switch.py \
    tests/kernels/test_mla_decode.py -x -rf 2>&1 | tee "$OUT/mla_engine_tests.txt" | tail -n 3
  for page in 16 64; do
    timeout "$(left 120)" python3 benchmarks/mla_decode_gluon.py --out "$OUT" --page $page --rounds 2 \
      --shapes 1x1024 1x4096 1x32768 4x8192 8x32768 16x16384 32x4096 64x8192 128x1024 128x2048 128x4096 \
      --variants triton wgmma_ws2 2>&1 | tee "$OUT/mla_sweep_page$page.txt" | tail -n 13
    mv "$OUT/mla_decode_gluon.json" "$OUT/mla_sweep_page$page.json"
  done
  echo "part i done at ${SECONDS}s" ;;
j)
  # the wgmma kernel's splits for few short sequences: 512 (default), 256, 128, 64 keys at least
  timeout "$(left 150)" python3 benchmarks/mla_decode_gluon.py --out "$OUT" --page 16 --rounds 3 \
    --shapes 1x1024 1x4096 1x32768 4x8192 8x4096 32x4096 128x1024 2x16384 \
    --variants triton wgmma_ws2 wgmma_ws2_m256 wgmma_ws2_m128 wgmma_ws2_m64 2>&1 | tee "$OUT/mla_splits.txt" | tail -n 10
  echo "part j done at ${SECONDS}s" ;;
k)
  # the wgmma kernel's final split rule (>= 64 keys, no empty split): its GPU tests and the
  # engine's, issue 4's sweep at pages 16 and 64, V2-Lite end to end with Triton's MLA decode
  # (FLASHPAGE_MLA_GLUON=0) and the default (the wgmma kernel for 16 heads)
  timeout "$(left 110)" $PT -x -m gpu tests/kernels/test_mla_decode_wgmma.py -k warp2 -rf 2>&1 \
    | tee "$OUT/wgmma_ws2_tests.txt" | tail -n 2
  timeout "$(left 80)" $PT -m gpu tests/engine/test_mla_gluon_switch.py -rf 2>&1 | tee "$OUT/mla_switch_tests.txt" | tail -n 2
  for page in 16 64; do
    timeout "$(left 60)" python3 benchmarks/mla_decode_gluon.py --out "$OUT" --page $page --rounds 3 \
      --shapes 1x1024 1x4096 1x32768 4x8192 8x32768 16x16384 32x4096 64x8192 128x1024 128x2048 128x4096 \
      --variants triton wgmma_ws2 2>&1 | tee "$OUT/mla_sweep_page$page.txt" | tail -n 14
    mv "$OUT/mla_decode_gluon.json" "$OUT/mla_sweep_page$page.json"
  done
  for g in 0 default; do
    [ $g = default ] && unset FLASHPAGE_MLA_GLUON || export FLASHPAGE_MLA_GLUON=$g
    timeout "$(left 80)" python3 -m flashpage bench throughput --config deepseek-v2-lite \
      --gpu-memory-utilization 0.75 --num-requests 64 --no-hf --json-out "$OUT/throughput_v2lite_mla_$g.json" \
      2>&1 | grep -E "output_tok_per_s|Error"
  done
  echo "part k done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-k)"; exit 2 ;;
esac
