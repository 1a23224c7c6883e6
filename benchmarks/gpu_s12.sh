#!/usr/bin/env bash
# Session 12's device plan (session 11's retry had no device time left): three calls, ~25 min (the fp8 decode's
# pruned forms are checked by their GPU tests and identical SASS, no end-to-end run).
# Results under $OUT; each step cut to what is left of BUDGET (default 560) seconds.
#   bash benchmarks/gpu_s12.sh a   on a FRESH machine: (1) the GPU tests of the fp8 Gluon decode after
#                                  its unused forms were pruned (SASS of the kept forms identical on
#                                  the CPU) and of the bf16 one; (2) the MLA Gluon tests, then the
#                                  fewer_barriers forms' first run; (3) the bf16 decode knobs (P2 s2,
#                                  the balanced grid) beside cuDNN at issue 6's shapes
#   BUDGET=590 bash benchmarks/gpu_s12.sh b   the MLA key-split sweep at issue 4's short-batch shapes
#                                  (with all_fb, all_pdl), then Nsight Compute on the three gaps (gpu_s12_ncu.sh)
#   bash benchmarks/gpu_s12.sh c   the one-warp TMA prefill producer's first tests (producer="tma1"), the
#                                  paged prefill by producer (tma1, gather, TMA boxes, and the register
#                                  split both ways: is gather's gap the consumers' 224 registers?); end to
#                                  end: 8B bf16 with the defaults (set from parts a-b first), V2-Lite with
#                                  the MLA Gluon decode off / on. PAGED_VARIANTS without gluon_paged_tma1 if
#                                  its tests hang.
set -u
PART=${1:-a}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/flashpage_gpu}; mkdir -p "$OUT"
B=${BUDGET:-560}
left() { local t=$((B - SECONDS)); [ "$1" -lt "$t" ] && t=$1; [ "$t" -lt 1 ] && t=1; echo $t; }
FP="python3 -m flashpage"
PT="python3 -m pytest -q -p no:cacheprovider"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
case "$PART" in
a)
  timeout "$(left 120)" $PT -m gpu tests/kernels/test_paged_decode_gluon.py tests/kernels/test_paged_decode_gluon_bf16.py \
    tests/kernels/test_fp8_kv.py -rf 2>&1 | tee "$OUT/decode_gluon_tests.txt" | tail -n 4
  echo "decode tests done at ${SECONDS}s"
  timeout "$(left 140)" $PT -m gpu tests/kernels/test_mla_decode_gluon.py -k "not fb" -rf 2>&1 \
    | tee "$OUT/mla_tests.txt" | tail -n 4
  echo "MLA tests done at ${SECONDS}s"
  # fewer_barriers' first run: a wrong mbarrier phase hangs (the timeout ends it) rather than fails
  timeout "$(left 110)" $PT -x -m gpu tests/kernels/test_mla_decode_gluon.py -k fb -rf 2>&1 \
    | tee "$OUT/mla_fb_tests.txt" | tail -n 4
  echo "MLA fb tests done at ${SECONDS}s"
  timeout "$(left 100)" python3 benchmarks/decode_gluon_knobs.py --set bf16 --out "$OUT" 2>&1 \
    | tee "$OUT/decode_bf16_knobs.txt" | tail -n 10
  echo "part a done at ${SECONDS}s" ;;
b)
  # MLA_VARIANTS="triton gluon_all" if part a's fb tests did not pass
  timeout "$(left 180)" python3 benchmarks/mla_decode_gluon.py --out "$OUT" \
    --variants ${MLA_VARIANTS:-triton gluon_all gluon_all_fb gluon_all_pdl} --shapes 8x32768 16x16384 --splits 0 8 16 24 66 \
    2>&1 | tee "$OUT/mla_splits.txt" | tail -n 8
  echo "MLA sweep done at ${SECONDS}s"
  bash benchmarks/gpu_s12_ncu.sh  # ~250 s (8 cases, 60 s at most each)
  echo "part b done at ${SECONDS}s" ;;
c)
  # the one-warp TMA producer's first run (producer="tma1"): a hang is the risk, hence -x and its own timeout
  timeout "$(left 90)" $PT -x -m gpu tests/kernels/test_paged_prefill_gather.py -k tma1 -rf 2>&1 \
    | tee "$OUT/tma1_tests.txt" | tail -n 4
  echo "tma1 tests done at ${SECONDS}s"
  timeout "$(left 170)" python3 benchmarks/prefill_gluon.py --out "$OUT" --variants gluon --causal-only \
    --paged-variants ${PAGED_VARIANTS:-gluon_paged,gluon_paged_r224,gluon_paged_gather,gluon_paged_gather_r232,gluon_paged_tma1} \
    --budget 150 2>&1 | tee "$OUT/prefill_producers.txt" | tail -n 8
  echo "prefill done at ${SECONDS}s"
  timeout "$(left 90)" $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --no-hf \
    --json-out "$OUT/throughput_8b_bf16.json" 2>&1 | grep -E "output_tok_per_s|Error"
  for g in 0 1; do
    FLASHPAGE_MLA_GLUON=$g timeout "$(left 90)" $FP bench throughput --config deepseek-v2-lite \
      --gpu-memory-utilization 0.75 --num-requests 64 --no-hf --json-out "$OUT/throughput_v2lite_mla_gluon$g.json" \
      2>&1 | grep -E "output_tok_per_s|Error"
  done
  echo "part c done at ${SECONDS}s" ;;
d)
  # parts a-c's follow-up (run 94): tma1's two tests part c's 90 s cut off; the MLA L2 prefetch's
  # first run (tests, then beside Triton and gluon_all); issue 6's own table with the new form
  timeout "$(left 120)" $PT -m gpu tests/kernels/test_paged_prefill_gather.py -k "tma1 and agrees" -rf 2>&1 \
    | tee "$OUT/tma1_agree_tests.txt" | tail -n 3
  timeout "$(left 120)" $PT -x -m gpu tests/kernels/test_mla_decode_gluon.py -k pf4 -rf 2>&1 \
    | tee "$OUT/mla_pf_tests.txt" | tail -n 3
  echo "tests done at ${SECONDS}s"
  timeout "$(left 150)" python3 benchmarks/mla_decode_gluon.py --out "$OUT" \
    --variants triton gluon_all gluon_all_pf2 gluon_all_pf4 gluon_all_pf8 2>&1 | tee "$OUT/mla_pf.txt" | tail -n 9
  echo "MLA done at ${SECONDS}s"
  timeout "$(left 170)" python3 benchmarks/attention_decode.py --out "$OUT" 2>&1 | tee "$OUT/decode.txt" | tail -n 22
  echo "part d done at ${SECONDS}s" ;;
e)
  # the paged prefill by producer, twice (run-to-run spread), a 3-deep ring for tma1; 8B bf16 end to end
  timeout "$(left 230)" python3 benchmarks/prefill_gluon.py --out "$OUT" --variants gluon --causal-only --rounds 2 \
    --paged-variants ${PAGED_VARIANTS:-gluon_paged_gather,gluon_paged_tma1,gluon_paged_tma1_stages3} \
    --budget 200 2>&1 | tee "$OUT/prefill_producers.txt" | tail -n 8
  echo "prefill done at ${SECONDS}s"
  timeout "$(left 100)" $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --no-hf \
    --json-out "$OUT/throughput_8b_bf16.json" 2>&1 | grep -E "output_tok_per_s|Error"
  echo "part e done at ${SECONDS}s" ;;
f)
  # the session's closing call (run 97), after engine_options (tma1, 3 deep, under 128-token blocks)
  # and the bf16 decode's balanced 2 x 2: the engine form's kernel tests, the engine's and models'
  # GPU tests, 8B bf16 end to end with it and with FLASHPAGE_PREFILL_PRODUCER=gather (the form it
  # replaced) in the same run, then the paged prefill over five rounds
  timeout "$(left 150)" $PT -x -m gpu tests/kernels/test_paged_prefill_gather.py -k engine_options -rf 2>&1 \
    | tee "$OUT/engine_options_tests.txt" | tail -n 3
  timeout "$(left 150)" $PT -m gpu tests/engine tests/models -rf 2>&1 | tee "$OUT/engine_gpu_tests.txt" | tail -n 3
  echo "tests done at ${SECONDS}s"
  for pr in "" gather; do
    FLASHPAGE_PREFILL_PRODUCER=$pr timeout "$(left 90)" $FP bench throughput --config llama-3-8b \
      --gpu-memory-utilization 0.75 --no-hf --json-out "$OUT/throughput_8b_bf16_producer_${pr:-default}.json" 2>&1 \
      | grep -E "output_tok_per_s|Error"
  done
  timeout "$(left 90)" python3 benchmarks/prefill_gluon.py --out "$OUT" --variants gluon --causal-only --rounds 5 \
    --paged-variants gluon_paged_gather,gluon_paged_tma1_stages3 --budget 80 2>&1 | tee "$OUT/prefill_rounds5.txt" | tail -n 7
  echo "part f done at ${SECONDS}s" ;;
g)
  # run 98 (the pdl knob it timed was reverted after it, d845ce8; 8b38221 has it): the bf16 Gluon
  # decode launched with PDL (its tests; the knobs beside cuDNN; issue 6's
  # table with FLASHPAGE_PDL=auto (PDL off for it) and =all (on), in turn twice); then Nsight
  # Compute on the engine's paged prefill form (tma1, 3 deep) at 1 x 16384 and, beside
  # contiguous, at 8 x 1024
  timeout "$(left 100)" $PT -x -m gpu tests/kernels/test_paged_decode_gluon_bf16.py -k pdl -rf 2>&1 \
    | tee "$OUT/decode_pdl_tests.txt" | tail -n 3
  timeout "$(left 100)" python3 benchmarks/decode_gluon_knobs.py --set bf16 --out "$OUT" 2>&1 \
    | tee "$OUT/decode_bf16_knobs.txt" | tail -n 9
  for r in 1 2; do for m in auto all; do
    FLASHPAGE_PDL=$m timeout "$(left 60)" python3 benchmarks/attention_decode.py --out "$OUT/pdl_$m$r" 2>&1 \
      | grep -E "^\| (32|64|128) " | cut -d"|" -f1-5 | sed "s/^/$m$r /"
  done; done
  echo "decode done at ${SECONDS}s"
  NCU_CASES="prefill_gluon_paged16_tma1s3 prefill_gluon_8x1k prefill_gluon_paged16_tma1s3_8x1k" \
    timeout "$(left 200)" bash benchmarks/gpu_s12_ncu.sh
  echo "part g done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-g)"; exit 2 ;;
esac
