#!/usr/bin/env bash
# Session 18's device plan (written at the end of session 17).
#   BUDGET=400 bash benchmarks/gpu_s18.sh a   the fp8 GPU checks now held to the exact emulation's bounds
#                                             (tests/models/test_fp8_weights.py: never run on a GPU with
#                                             them), the whole fp8 kernel file, spec decoding's GPU tests
#                                             (logprobs on drafted tokens), then benchmarks/gemv.py --fp8
#                                             (the e4m3 GEMV's tiles: 72% of its weight-read limit in
#                                             run 141 against bf16's 95%)
#   BUDGET=560 bash benchmarks/gpu_s18.sh b   serving with speculative decoding (bench serve, 8B, run 129's
#                                             light load) on and off: what a loaded server pays for
#                                             synchronous steps when drafts rarely hit (random weights).
#                                             Carry [".whl"]
# Parts d-f and h ran kernels since dropped (RowConfig.ahead, commit 80c00cf; RowConfig.group, the
# commit after 88ba6b6; gemv_row(x_rows=), the commit before this note): they name tiles (a2, g16) and flags (--x-rows) today's gemv.py no longer has.
#   BUDGET=300 bash benchmarks/gpu_s18.sh c   the structured-outputs test with drafts on a head_dim-64
#                                             checkpoint (run 149 ran it on head_dim 16: refused), then
#                                             a sweep of one-row tiles over e4m3 weights (qkv, o_proj, down)
# Results under $OUT; each step cut to what is left of BUDGET (default 400) seconds.
PART=${1:-a}
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  timeout "$(left 200)" $PT -m gpu tests/models/test_fp8_weights.py tests/kernels/test_gemv_fp8.py \
    tests/engine/test_spec_decode.py -rf 2>&1 | tee "$OUT/gpu_tests.txt" | tail -n 4
  timeout "$(left 150)" python3 benchmarks/gemv.py --fp8 --only shapes --out "$OUT" 2>&1 \
    | tee "$OUT/gemv_fp8.txt" | tail -n 30
  echo "part a done at ${SECONDS}s" ;;
b)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site || exit 1
  for spec in "" '{"method": "ngram", "num_speculative_tokens": 3}'; do
    name=$([ -n "$spec" ] && echo ngram || echo plain)
    timeout "$(left 200)" python3 -m flashpage bench serve --config llama-3-8b --request-rate 2 \
      --num-prompts 60 --input-len 256 --output-len 64 ${spec:+--speculative-config "$spec"} \
      --json-out "$OUT/serve_$name.json" > "$OUT/serve_$name.txt" 2>&1
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r['completed'], r['ttft_ms'], r['itl_ms'])" \
      "$OUT/serve_$name.json" "$name"
  done
  echo "part b done at ${SECONDS}s" ;;
c)
  timeout "$(left 120)" $PT -m gpu tests/engine/test_spec_decode.py -k structured -rf 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -n 3
  # run 150 (qkv, o_proj: whole rows and loops) cut short after the first down tiles: whole
  # rows of 14336 (4096-wide tiles looped) spill; the down projection's looped tiles here
  TILES=n8k512w4,n16k512w4,n16k512w8,n32k512w8,n32k512w16,n16k256w4,n32k256w4,n32k256w8
  TILES=$TILES,n64k256w8,n8k1024w4,n8k1024w8,n4k1024w4,n4k2048w4,n4k2048w8,n16k1024w16
  TILES=$TILES,n8k256w2,n16k256w8,n8k512w8,n4k512w2,n2k1024w2,n2k2048w4,n4k512w4,n2k512w2
  timeout "$(left 400)" python3 benchmarks/gemv.py --fp8 --only shapes --kinds down \
    --pdl 1 --tiles "$TILES" --out "$OUT" > "$OUT/gemv_fp8_sweep.txt" 2>&1
  for kind in down; do grep "^$kind" "$OUT/gemv_fp8_sweep.txt" | sort -k4 -n | head -n 6; done
  echo "part c done at ${SECONDS}s" ;;
d)
  # the looped tile with 2-3 tiles in flight (RowConfig.ahead) on the down projection, fp8 then
  # bf16, then the fp8 chain with the best-looking ones as its down tiles
  TILES=n16k512w8,n16k512w8a2,n16k512w8a3,n8k512w4a2,n8k512w4a3,n16k256w4a2,n16k256w4a3
  TILES=$TILES,n32k256w8a2,n32k256w8a3,n16k1024w8a2,n8k1024w4a2,n8k1024w4a3,n4k1024w4a3
  TILES=$TILES,n32k512w16a2,n16k512w4a3,n8k256w2a3,n4k512w2a3,n16k256w8a3,n8k512w8a3
  timeout "$(left 400)" python3 benchmarks/gemv.py --fp8 --only shapes --kinds down \
    --pdl 1 --tiles "$TILES" --out "$OUT" > "$OUT/gemv_fp8_ahead.txt" 2>&1
  grep "^down" "$OUT/gemv_fp8_ahead.txt" | sort -k4 -n | head -n 8
  mkdir -p "$OUT/bf16"
  timeout "$(left 300)" python3 benchmarks/gemv.py --only shapes --kinds down \
    --pdl 1 --tiles "$TILES" --out "$OUT/bf16" > "$OUT/gemv_bf16_ahead.txt" 2>&1
  grep "^down" "$OUT/gemv_bf16_ahead.txt" | sort -k4 -n | head -n 5
  DOWN=$(grep "^down" "$OUT/gemv_fp8_ahead.txt" | grep -v cublas | sort -k4 -n | head -n 4 \
    | awk '{print $2}' | sed 's/^row-//' | grep -v default | paste -sd,)
  echo "chain down tiles: $DOWN"
  timeout "$(left 60)" python3 benchmarks/gemv.py --fp8 --only chain --pdl 1 --tiles "" \
    --down-tiles "$DOWN" --out "$OUT" > "$OUT/gemv_fp8_chain.txt" 2>&1
  grep "^chain" "$OUT/gemv_fp8_chain.txt"
  echo "part d done at ${SECONDS}s" ;;
e)
  # run 152: more tiles in flight made fp8 down slower (60% -> 42%), bf16's at 97% either way:
  # not bytes in flight. Is it the SiLU·mul prologue (exp and divide per column, repeated by
  # every warp holding the column)? The GEMV alone, and our SiLU·mul kernel before it.
  TILES=n16k512w8,n8k512w4,n16k512w4,n32k512w8,n8k1024w4,n16k1024w8,n4k1024w4,n4k2048w4,n32k256w8
  for mode in none separate; do
    mkdir -p "$OUT/$mode"
    timeout "$(left 200)" python3 benchmarks/gemv.py --fp8 --only shapes --kinds down --pdl 1 \
      --tiles "$TILES" --down-silu $mode --out "$OUT/$mode" > "$OUT/gemv_fp8_down_$mode.txt" 2>&1
    echo "== $mode"; grep "^down" "$OUT/gemv_fp8_down_$mode.txt" | sort -k4 -n | head -n 4
  done
  timeout "$(left 60)" python3 benchmarks/gemv.py --fp8 --only chain --pdl 1 --tiles "" \
    --down-silu separate --out "$OUT/separate" > "$OUT/gemv_fp8_chain_separate.txt" 2>&1
  grep "^chain" "$OUT/gemv_fp8_chain_separate.txt"
  echo "part e done at ${SECONDS}s" ;;
f)
  # run 153: fp8 down at 59% without any SiLU·mul too: the looped path itself. Grouped
  # sums (RowConfig.group): an accumulator 1/group of the tile, bigger tiles then affordable
  T=n16k512w8,n16k512w8g16,n16k1024w8g16,n16k2048w8g16,n32k1024w8g16,n8k2048w4g16,n16k1024w4g16
  T=$T,n32k512w8g16,n8k1024w4g16,n4k2048w4g16,n16k512w8g8,n16k1024w8g8,n16k2048w16g16
  T=$T,n32k2048w16g16,n64k512w8g16,n8k4096w8g16,n4k4096w4g16,n16k1024w8g4
  timeout "$(left 400)" python3 benchmarks/gemv.py --fp8 --only shapes --pdl 1 --tiles "$T" \
    --out "$OUT" > "$OUT/gemv_fp8_group.txt" 2>&1
  for kind in qkv o_proj gate_up down lm_head; do
    grep "^$kind" "$OUT/gemv_fp8_group.txt" | sort -k4 -n | head -n 3; done
  mkdir -p "$OUT/bf16"
  timeout "$(left 200)" python3 benchmarks/gemv.py --only shapes --kinds down,o_proj --pdl 1 \
    --tiles n16k512w8,n16k512w8g8,n16k1024w8g8,n16k1024w8g16,n32k1024w8g8 \
    --out "$OUT/bf16" > "$OUT/gemv_bf16_group.txt" 2>&1
  grep "^down\|^o_proj" "$OUT/gemv_bf16_group.txt" | sort -k4 -n
  DOWN=$(grep "^down" "$OUT/gemv_fp8_group.txt" | grep -v "cublas\|default" | sort -k4 -n \
    | head -n 3 | awk '{print $2}' | sed 's/^row-//' | paste -sd,)
  echo "chain down tiles: $DOWN"
  timeout "$(left 60)" python3 benchmarks/gemv.py --fp8 --only chain --pdl 1 --tiles "" \
    --down-tiles "$DOWN" --out "$OUT" > "$OUT/gemv_fp8_chain.txt" 2>&1
  grep "^chain" "$OUT/gemv_fp8_chain.txt"
  echo "part f done at ${SECONDS}s" ;;
g)
  # where the fp8 down GEMV's warps stall (Nsight Compute; bf16 down and fp8 gate_up beside it),
  # then where DeepSeek-V2-Lite's piecewise steps spend their host time (cProfile; MLA's
  # attention calls are not planned: 14-38 ms steps for 8-16 ms of kernels, run 133)
  NCU_CASES="gemv_fp8_down gemv_bf16_down gemv_fp8_gate_up" timeout "$(left 200)" \
    bash benchmarks/gpu_final.sh ncu-only 2>&1 | tail -n 3
  tar xzf "$OUT/ncu.tgz" -C /tmp && for c in gemv_fp8_down gemv_bf16_down gemv_fp8_gate_up; do
    echo "== $c"; python3 benchmarks/ncu_stalls.py /tmp/ncu/$c.sass.csv 12 2>&1 | head -n 30
    grep -E "Duration|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Issue Slots Busy|Executed Ipc A" /tmp/ncu/$c.details.txt | head -n 9
  done > "$OUT/ncu_gemv_summary.txt" 2>&1
  head -c 5000 "$OUT/ncu_gemv_summary.txt"
  for mode in prompt mixed; do
    mkdir -p "$OUT/$mode"
    extra=$([ $mode = mixed ] && echo "--decodes 16 --input-len 16" || echo "--input-len 128")
    timeout "$(left 100)" python3 benchmarks/profile_ttft.py --config deepseek-v2-lite --iters 10 \
      $extra --out "$OUT/$mode" > "$OUT/profile_v2lite_$mode.log" 2>&1
    echo "== $mode"; head -c 2500 "$OUT/$mode/profile_ttft.txt"
  done
  echo "part g done at ${SECONDS}s" ;;
h)
  # run 156's Nsight Compute: fp8 down's most sampled stall is a barrier around a shared-memory
  # store inside the tile loop (x handed to the warps each step). x_rows: x read as a tile of
  # the weight tile's layout (no conversion in the loop, per the sm_90 TTGIR)
  T=n16k512w8,n8k512w4,n16k1024w8,n8k1024w4,n32k512w8,n4k2048w4,n16k256w4,n32k256w8,n8k2048w8
  for xr in 0 1; do for silu in fused separate; do
    d=$OUT/fp8_x${xr}_$silu; mkdir -p "$d"
    timeout "$(left 60)" python3 benchmarks/gemv.py --fp8 --only shapes --kinds down --pdl 1 \
      --tiles "$T" --x-rows $xr --down-silu $silu --out "$d" > "$d.txt" 2>&1
    echo "== fp8 x_rows=$xr silu=$silu"; grep "^down" "$d.txt" | grep -v cublas | sort -k4 -n | head -n 3
  done; done
  for xr in 0 1; do
    d=$OUT/bf16_x$xr; mkdir -p "$d"
    timeout "$(left 60)" python3 benchmarks/gemv.py --only shapes --kinds down,o_proj --pdl 1 \
      --tiles n16k512w8,n8k1024w4,n16k1024w8 --x-rows $xr --out "$d" > "$d.txt" 2>&1
    echo "== bf16 x_rows=$xr"; grep "^down\|^o_proj" "$d.txt" | grep -v cublas | sort -k4 -n | head -n 6
  done
  for xr in 0 1; do for silu in fused separate; do
    d=$OUT/chain_x${xr}_$silu; mkdir -p "$d"
    timeout "$(left 30)" python3 benchmarks/gemv.py --fp8 --only chain --pdl 1 --tiles "" \
      --x-rows $xr --down-silu $silu --out "$d" > "$d.txt" 2>&1
    echo "== chain x_rows=$xr silu=$silu"; grep "^chain row" "$d.txt"
  done; done
  echo "part h done at ${SECONDS}s" ;;
i)
  # LoRA adapters (session 18's helper): the mixed-adapter GPU test (every graph kind), the
  # engine's other GPU tests around it, then what enable_lora costs on the 8B shape
  timeout "$(left 150)" $PT -m gpu tests/engine/test_lora.py tests/engine/test_spec_decode.py \
    -rf 2>&1 | tee "$OUT/gpu_tests.txt" | tail -n 3
  timeout "$(left 10)" python3 benchmarks/lora.py --config llama-3-8b --batch-sizes 1 16 \
    --max-loras 4 --rank 16 --output-len 64 --iters 2 --json-out "$OUT/lora.json" 2>&1 \
    | tee "$OUT/lora.txt" | tail -n 12
  echo "part i done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-i)"; exit 2 ;;
esac
