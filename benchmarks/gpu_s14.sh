#!/usr/bin/env bash
# Session 14's device plan.
#   bash benchmarks/gpu_s14.sh a    the wgmma MLA decode's GPU tests as session 13 left the module
#                                   (one form kept, the kernel code unchanged; run under -x and
#                                   a timeout: a wrong mbarrier phase hangs), the engine's switch
#                                   test, then issue 4's sweep at page 16 once more
#   bash benchmarks/gpu_s14.sh b    issue 5, decided by pairs: the paged Gluon prefill's forms
#                                   against the contiguous one, graph replays back to back
#                                   (benchmarks/prefill_paired.py), 2 x 4096, 1 x 16384, 8 x 1024
#   bash benchmarks/gpu_s14.sh d    run 113: issue 5's table after the early Q release (contiguous Gluon,
#                                   the engine's paged form, Triton, SDPA cuDNN and flash, 3 rounds);
#                                   the 16-bit decode over shuffled and over ordered block tables
#                                   beside cuDNN (what the page scatter costs: issue 6)
#   bash benchmarks/gpu_s14.sh e    run 114: issue 5's pairs once more on another machine; the 16-bit decode
#                                   with one KV head (4 KB contiguous page pieces, the same items and
#                                   bytes), shuffled and ordered tables, beside cuDNN
#   bash benchmarks/gpu_s14.sh f    run 115: the 16-bit decode beside cuDNN with its blocks shuffled one by
#                                   one, in runs of 4 (a block-64 cache's places) and 16, and in order
#   bash benchmarks/gpu_s14.sh g    run 116: the same with one KV head (4 KB page pieces, contiguous), blocks
#                                   shuffled one by one and in runs of 8 (32 KB: a whole block-16 page of 8
#                                   heads read by one program)
#   bash benchmarks/gpu_s14.sh h    run 117: issue 5's named benchmark with the engine's kernels in it
#                                   (attention_prefill.py: Triton, Gluon, the engine's paged call, SDPA
#                                   flash / cuDNN, flex; head_dim 64 and 128, causal and not)
#   bash benchmarks/gpu_s14.sh i    run 118: host time per prefill call (launch_overhead.py, cProfile of
#                                   the engine's path): attention_prefill.py's do_bench had the Gluon
#                                   paths at 8 x 1024 causal 28-47% under prefill_gluon.py's
#   bash benchmarks/gpu_s14.sh j    run 119: kernels/fast_launch.py's GPU tests and the prefill GPU tests
#                                   it touches, host time per call with it off / on, issue 5's
#                                   benchmark at head_dim 128 causal
#   bash benchmarks/gpu_s14.sh k    run 120: the fast launch's tests again (arg keys by type, the capability
#                                   cached), host time per call, then an 8B prompt's time to first
#                                   token with FLASHPAGE_FAST_LAUNCH=0 / 1 (bench latency, 128 tokens)
#   ORDER="1 0 1 0" SKIP_TESTS=1 bash benchmarks/gpu_s14.sh k    run 121: the latency runs alone, in the
#                                   other order, twice
#   bash benchmarks/gpu_s14.sh l    run 122: where an 8B 128-token prompt's time to first token goes on the
#                                   host (profile_ttft.py: cProfile, kernels' GPU time)
#   bash benchmarks/gpu_s14.sh m    run 123: RMSNorm, rotary (+ cache write) and SiLU-mul through the fast
#                                   launch too: their GPU tests, then profile_ttft.py with it off / on
#   bash benchmarks/gpu_s14.sh n    run 124: the engine's and models' GPU tests with the fast launch on
# Results under $OUT; each step cut to what is left of BUDGET (default 400) seconds.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 150)" $PT -x -m gpu tests/kernels/test_mla_decode_wgmma.py -rf 2>&1 \
    | tee "$OUT/wgmma_tests.txt" | tail -n 3
  timeout "$(left 90)" $PT -m gpu tests/engine/test_mla_gluon_switch.py -rf 2>&1 | tee "$OUT/mla_switch_tests.txt" | tail -n 2
  timeout "$(left 60)" python3 benchmarks/mla_decode_gluon.py --out "$OUT" --page 16 --rounds 3 \
    --shapes 1x1024 1x4096 1x32768 4x8192 8x32768 16x16384 32x4096 64x8192 128x1024 128x2048 128x4096 \
    --variants triton wgmma 2>&1 | tee "$OUT/mla_sweep_page16.txt" | tail -n 14
  echo "part a done at ${SECONDS}s" ;;
b)
  timeout "$(left 240)" python3 benchmarks/prefill_paired.py --out "$OUT" --pairs 200 2>&1 \
    | tee "$OUT/prefill_paired.txt" | tail -n 9
  echo "part b done at ${SECONDS}s" ;;
d)
  timeout "$(left 330)" python3 benchmarks/prefill_gluon.py --out "$OUT" --variants gluon --causal-only \
    --paged-variants gluon_paged_tma1_stages3 --rounds 3 --budget 300 2>&1 | tee "$OUT/prefill_gluon.txt" | tail -n 8
  for o in "" --ordered; do
    timeout "$(left 60)" python3 benchmarks/decode_gluon_knobs.py --set bf16 --rounds 3 --variants "P2 s2 bal" $o \
      --out "$OUT" 2>&1 | tee "$OUT/decode_bf16${o:+_ordered}.txt" | tail -n 9
  done
  echo "part d done at ${SECONDS}s" ;;
e)
  timeout "$(left 90)" python3 benchmarks/prefill_paired.py --out "$OUT" --pairs 200 --paged engine 2>&1 \
    | tee "$OUT/prefill_paired.txt" | tail -n 4
  for o in "" --ordered; do
    timeout "$(left 60)" python3 benchmarks/decode_gluon_knobs.py --set bf16 --rounds 3 --variants "P2 s2 bal" \
      --kv-heads 1 $o --out "$OUT" 2>&1 | tee "$OUT/decode_bf16_hkv1${o:+_ordered}.txt" | tail -n 9
  done
  echo "part e done at ${SECONDS}s" ;;
f)
  for o in "--runs 1" "--runs 4" "--runs 16" --ordered; do
    timeout "$(left 60)" python3 benchmarks/decode_gluon_knobs.py --set bf16 --rounds 3 --variants "P2 s2 bal" \
      $o --out "$OUT" 2>&1 | tee "$OUT/decode_bf16_${o//[- ]/}.txt" | tail -n 9
  done
  echo "part f done at ${SECONDS}s" ;;
g)
  for o in "--runs 1" "--runs 8" "--runs 64"; do
    timeout "$(left 60)" python3 benchmarks/decode_gluon_knobs.py --set bf16 --rounds 3 --variants "P2 s2 bal" \
      --kv-heads 1 $o --out "$OUT" 2>&1 | tee "$OUT/decode_bf16_hkv1_${o//[- ]/}.txt" | tail -n 9
  done
  echo "part g done at ${SECONDS}s" ;;
h)
  timeout "$(left 540)" python3 benchmarks/attention_prefill.py --jobs 12 --out "$OUT" 2>&1 \
    | tee "$OUT/attention_prefill.txt" | tail -n 20
  echo "part h done at ${SECONDS}s" ;;
i)
  timeout "$(left 200)" python3 benchmarks/launch_overhead.py --out "$OUT" --profile 2>&1 \
    | tee "$OUT/launch_overhead.txt" | tail -n 60
  echo "part i done at ${SECONDS}s" ;;
j)
  timeout "$(left 150)" $PT -x -m gpu tests/kernels/test_fast_launch.py tests/kernels/test_flash_prefill_gluon.py \
    tests/kernels/test_paged_prefill_gather.py -k "fast_launch or cuda_graph or one_compile or tma_map_cache \
    or dispatches or engine_options" -rf 2>&1 | tee "$OUT/fast_launch_tests.txt" | tail -n 3
  timeout "$(left 100)" python3 benchmarks/launch_overhead.py --out "$OUT" --profile 2>&1 \
    | tee "$OUT/launch_overhead.txt" | head -n 40
  timeout "$(left 200)" python3 benchmarks/attention_prefill.py --dims 128 --no-flex --out "$OUT" 2>&1 \
    | tee "$OUT/attention_prefill.txt" | tail -n 12
  echo "part j done at ${SECONDS}s" ;;
k)
  [ -n "${SKIP_TESTS:-}" ] || timeout "$(left 100)" $PT -x -m gpu tests/kernels/test_fast_launch.py tests/kernels/test_flash_prefill_gluon.py \
    -k "fast_launch or cuda_graph or one_compile or dispatches" -rf 2>&1 | tee "$OUT/fast_launch_tests.txt" | tail -n 2
  [ -n "${SKIP_TESTS:-}" ] || timeout "$(left 60)" python3 benchmarks/launch_overhead.py --out "$OUT" 2>&1 | tail -n 32
  i=0
  for f in ${ORDER:-0 1}; do
    i=$((i + 1))
    FLASHPAGE_FAST_LAUNCH=$f timeout "$(left 110)" python3 -m flashpage bench latency --config llama-3-8b \
      --gpu-memory-utilization 0.5 --no-hf --input-len 128 --output-len 2 --iters 20 \
      --json-out "$OUT/latency_fast${f}_$i.json" 2>&1 | grep -i "ttft\|error" | tail -n 3
  done
  echo "part k done at ${SECONDS}s" ;;
l)
  timeout "$(left 200)" python3 benchmarks/profile_ttft.py --config llama-3-8b --out "$OUT" 2>&1 | head -n 120
  echo "part l done at ${SECONDS}s" ;;
m)
  timeout "$(left 120)" $PT -x -m gpu tests/kernels/test_fast_launch.py tests/kernels/test_fused_ops.py \
    tests/kernels/test_pdl.py -rf 2>&1 | tee "$OUT/fused_fast_tests.txt" | tail -n 2
  for f in 0 1; do
    FLASHPAGE_FAST_LAUNCH=$f timeout "$(left 80)" python3 benchmarks/profile_ttft.py --config llama-3-8b \
      --out "$OUT/fast$f" 2>&1 | grep -E "request_ms_median|gpu_kernel_ms|kernel_launches"
  done
  echo "part m done at ${SECONDS}s" ;;
n)
  timeout "$(left 170)" $PT -m gpu tests/engine tests/models -rf 2>&1 | tee "$OUT/engine_gpu_tests.txt" | tail -n 4
  echo "part n done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-n)"; exit 2 ;;
esac
