#!/usr/bin/env bash
# A record of past sessions' device calls (BENCHMARKS.md cites its parts). Parts that name the fp8 Gluon
# decode's removed forms (dims_m, keys_m2, warp_specialize, the non-persistent kernel) run at 16f5823 only.
# The GPU work of one session, in parts small enough for one device call each:
#   bash benchmarks/gpu_final.sh engine    GPU tests of the engine, a decode-step breakdown,
#                                          8B-shape throughput and latency beside HF
#   bash benchmarks/gpu_final.sh kernels   kernel GPU tests and the kernel benchmarks
#   bash benchmarks/gpu_final.sh serve     flex throughput, then bench serve on the 8B shape (needs the .whl carry:
#                                          fastapi==0.115.12, starlette==0.46.2, pydantic, ...)
#   bash benchmarks/gpu_final.sh deepseek  the DeepSeek-V2-Lite shape (MLA + MoE) end to end
#   bash benchmarks/gpu_final.sh final     changed GPU tests, serve, V2-Lite, flex in one call
#   bash benchmarks/gpu_final.sh final2    decode GEMM tests, 8B latency + throughput, decode
#                                          and MLA kernels old vs new (helpers' final scripts)
#   bash benchmarks/gpu_final.sh next-a    fused MoE tests + benchmark, V2-Lite with it off/on
#   bash benchmarks/gpu_final.sh next-b    8B throughput twice (spread), prefill kernel table, flex
#   (next-c, next-d: session 3's PDL / L2-prefetch A/Bs, see git history before commit "Drop the L2")
#   bash benchmarks/gpu_final.sh next-e    GPU tests, PDL modes A/B: decode kernel, 8B latency, 8B throughput
#   bash benchmarks/gpu_final.sh next-f    8B latency + throughput beside transformers, then warm and PDL off
#   bash benchmarks/gpu_final.sh next-g    fresh machine: prefill one-compile test, 8B throughput cold then warm
#   bash benchmarks/gpu_final.sh next-l    fp16 dots over an fp8 cache: fp8 GPU tests, decode + MLA kernels
#   bash benchmarks/gpu_final.sh next-m    paged decode over NHD vs HND caches beside SDPA cuDNN
#   bash benchmarks/gpu_final.sh next-n    fp8 decode default: GPU tests, kernels, 8B throughput bf16 vs fp8 cache
#   bash benchmarks/gpu_final.sh next-o    8B step kernel tables (bf16, fp8 caches); V2-Lite over bf16 vs fp8 latents
#   bash benchmarks/gpu_final.sh ncu       decode + MLA GPU tests, then Nsight Compute on each benchmarks/ncu_cases.py case
#   bash benchmarks/gpu_final.sh tiles2    fp8 register caps: decode tests, tiles, ncu of the fp8 default, 8B bf16 vs fp8
#                                          (the engine from .cur: a clean export of HEAD, carried)
#   bash benchmarks/gpu_final.sh pipe      prefill candidates of run 32 (pipelined q.k: commit c025ffe) + GPU tests,
#                                          MLA split counts, 8B throughput over fp8 with the 64-key default
#   bash benchmarks/gpu_final.sh sampler   one-pass sampling kernel: tests + benchmark, prefill candidate tests,
#                                          8B throughput bf16 and fp8, fp8 again with FLASHPAGE_SAMPLER_KERNEL=0
#   bash benchmarks/gpu_final.sh gemv      one-row GEMV (kernels/gemv.py gemv_row): tests, benchmarks/gemv.py, 8B one
#                                          sequence cuBLAS vs ours (decode_ab), batch-1 kernel tables
#   bash benchmarks/gpu_final.sh gemv2     whole-row GEMV, norms in its prologue: tests, benchmark, one-sequence A/B,
#                                          engine GPU tests with FLASHPAGE_GEMV=1
#   bash benchmarks/gpu_final.sh gemv3     GEMV default on: tests, one-sequence A/B (cuBLAS, ours, + fused merge),
#                                          8B latency beside transformers, 8B throughput, engine GPU tests
#   bash benchmarks/gpu_final.sh gemv4     whole rows up to 16384 (down): tests, chain, one-sequence A/B
#   bash benchmarks/gpu_final.sh gemv5     looped GEMV with x a tile ahead: tests, chain, one-sequence A/B
#   bash benchmarks/gpu_final.sh final6    early loads before the PDL wait vs the commit before (.old carried), 8B latency
#                                          beside transformers, 8B throughput
#   bash benchmarks/gpu_final.sh final6-tests  kernel + engine GPU tests, V2-Lite one sequence
#   bash benchmarks/gpu_final.sh profile6  one-sequence kernel tables, 8B and V2-Lite, PDL off
#   bash benchmarks/gpu_final.sh align6    moe_align tiles sized to the work: fused MoE GPU tests, V2-Lite one sequence
#   bash benchmarks/gpu_final.sh next7     router kernel + merged shared experts (GPU tests, V2-Lite A/B)
#   (vlayout: session 7's keys-inner value cache A/B, run 49; its code is in commit cc19bc6)
#   (mla7: session 7's keys-major MLA decode A/B, runs 50-51; its code is in commit df825ce)
#   (absorb7: session 7's absorbed-projection kernels A/B, run 52; its code is in commit 0c745ff)
#   (rows7: session 7's multi-row gemv_row A/B, run 53; its code is in commit c3ba8c6)
#   bash benchmarks/gpu_final.sh flex7     flex vs triton throughput (64 requests, 100-512), then triton's default workload
#   bash benchmarks/gpu_final.sh flex7b    flex with batched one-query decodes: GPU test, the 64-request throughput
#   bash benchmarks/gpu_final.sh wsplit7   warp-split paged decode: decode GPU tests, attention_decode.py --warp-split
#   bash benchmarks/gpu_final.sh fp8t7     8B throughput over an fp8 cache, warp-split decode off then on
#   bash benchmarks/gpu_final.sh next8     next session: fp8 throughput with GPU ms per step (split off/on), batch-256
#                                          kernel tables (split off/on), the --warp-split table (128-register cap too)
#   bash benchmarks/gpu_final.sh next8b    decode configs at the engine's ragged batches (--engine-shapes); MLA --chunks-ab
#   bash benchmarks/gpu_final.sh next8c    decodes longest first: GPU tests, 8B throughput fp8/bf16, --engine-shapes
#   bash benchmarks/gpu_final.sh next8d    prefill --candidates-ab (pv_overlap, code in e1e44d7, reverted); GPU tests
#   bash benchmarks/gpu_final.sh next8e    session 8's close: engine GPU tests; 8B bf16 (with HF) and fp8, V2-Lite throughput
#   bash benchmarks/gpu_final.sh next8f    Nsight Compute: fp8 decode at 256 x 1024 and 128 x 2048, MLA at 8 x 32768
#   bash benchmarks/gpu_final.sh next9     next session, first call: MLA fixed cost per call (--overhead); the Gluon
#                                          decode branch (gluon-decode) has its own part there
#   bash benchmarks/gpu_final.sh check5    engine + model GPU tests with session 5's defaults, V2-Lite throughput
#   bash benchmarks/gpu_final.sh tiles     block ids carried a tile ahead: decode GPU tests, tile candidates over bf16
#                                          and fp8 beside cuDNN, and the previous commit's defaults (.old carried)
#   bash benchmarks/gpu_final.sh next-p    V prefetched in registers: decode GPU tests, fp8 tile candidates
#   bash benchmarks/gpu_final.sh next-q    MLA latent prefetched in registers: MLA GPU tests, MLA + decode candidates
#   bash benchmarks/gpu_final.sh next-r    fp8 GPU tests; V2-Lite and 8B throughput over bf16 vs fp8 caches
#   bash benchmarks/gpu_final.sh variants  the persistent fp8 decode's variants dims_m / keys_m / keys_m2: tests, knobs
#   bash benchmarks/gpu_final.sh prefill-paged    paged Gluon prefill: its GPU tests (static first), benchmark columns
#   bash benchmarks/gpu_final.sh prefill-paged-b  contiguous Gluon + Triton prefill GPU tests (regression)
#   bash benchmarks/gpu_final.sh mla10     branch mla-gluon, first GPU run of the persistent Gluon MLA decode: its GPU
#                                          tests (-x, -v, under a timeout: a ring phase error would hang), then its
#                                          benchmark beside the Triton default (pages 64 and 16), under 400 s in all
#   bash benchmarks/gpu_final.sh s10a      session 10, first call: the decode variants' and the paged Gluon prefill's tests, then
#                                          their benchmarks, each step's timeout cut to what is left of 570 s
#   bash benchmarks/gpu_final.sh s10b      keys_m at 4 an SM as paged_decode's Gluon form: decode GPU tests, 8B fp8 throughput
#                                          (keys_m twice, Triton and keys_m2 once, in turn)
#   bash benchmarks/gpu_final.sh s10c      engine + model GPU tests under the keys_m default; 8B fp8 throughput with transformers
#                                          in the same run (the issue's two figures in one run)
#   bash benchmarks/gpu_final.sh prefill10         Gluon prefill GPU tests (paged static, paged, contiguous; -x -v) then its
#                                                  benchmark (--variants gluon --causal-only), within ~390 s
#   bash benchmarks/gpu_final.sh prefill10-engine  engine + model GPU tests with FLASHPAGE_PREFILL_GLUON=1 (timeout 300)
#   bash benchmarks/gpu_final.sh s10d      8B fp8 throughput with transformers (16 requests) in the same run; the Gluon
#                                          prefill's GPU tests (schedule fix, TMA map cache), the engine's with it on, its benchmark
#   bash benchmarks/gpu_final.sh s10e      8B fp8 throughput without then with transformers (is run 82's slow prompt phase a
#                                          first-run effect?), then the Gluon MLA decode's GPU tests in what is left
#   bash benchmarks/gpu_final.sh s11a      next session's FIRST command on a fresh machine: 8B fp8 throughput (the warm-up's
#                                          full-budget prompt step: prompt steps ~181 ms in a first process? jit_compiles),
#                                          8B bf16 with the Gluon paged prefill off / on, the engine's Gluon GPU tests,
#                                          V2-Lite with the Gluon MLA decode off / on (then the gpu_s11_*.sh scripts)
# Results under $OUT; the last lines of each step are printed.
set -u
PART=${1:-engine}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/flashpage_gpu}; mkdir -p "$OUT"/k
FP="python3 -m flashpage"
PT="python3 -m pytest -q -p no:cacheprovider"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
case "$PART" in
engine)
  timeout 150 $PT -m gpu tests/engine tests/models -rf 2>&1 | tee "$OUT/engine_gpu_tests.txt" | tail -n 12
  timeout 130 python3 benchmarks/profile_engine_step.py --batch 1 256 --context 1024 --steps 30 --kernel-table 2>&1 \
    | grep -v Warning | tail -n 50 | tee "$OUT/profile.txt"
  timeout 240 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 \
    --hf-requests 16 --hf-batch-size 16 --json-out "$OUT/throughput_8b.json" 2>&1 | grep -E "tok_per_s|speedup|seconds|Error"
  timeout 80 $FP bench latency --config llama-3-8b --gpu-memory-utilization 0.6 --max-num-seqs 64 \
    --json-out "$OUT/latency_8b.json" 2>&1 | grep -E "tok_per_s|speedup|fraction|Error" ;;
kernels)
  timeout 200 $PT -n 12 -m gpu tests/kernels 2>&1 | tail -n 15 | tee "$OUT/kernel_gpu_tests.txt"
  timeout 60 python3 benchmarks/attention_decode.py --out "$OUT/k" 2>&1 | tail -n 12
  timeout 60 python3 benchmarks/fused_ops.py --out "$OUT/k" 2>&1 | tail -n 12
  timeout 80 python3 benchmarks/mla_decode.py --out "$OUT/k/mla.jsonl" 2>&1 | tail -n 14
  timeout 200 python3 benchmarks/attention_prefill.py --jobs 12 --out "$OUT/k" 2>&1 | tail -n 16 ;;
serve)
  timeout 200 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --attention-backend flex \
    --no-hf --json-out "$OUT/throughput_8b_flex.json" 2>&1 | grep -E "tok_per_s|Error"
  timeout 240 $FP bench serve --config llama-3-8b --num-prompts 300 --request-rate 16 \
    --input-len 512 --output-len 128 --json-out "$OUT/serve_8b.json" 2>&1 | grep -v "INFO:" | tail -n 40 ;;
deepseek)
  timeout 300 $FP bench throughput --config deepseek-v2-lite --gpu-memory-utilization 0.75 \
    --num-requests 64 --hf-requests 8 --hf-batch-size 8 --json-out "$OUT/throughput_v2lite.json" 2>&1 \
    | grep -E "tok_per_s|speedup|seconds|Error"
  timeout 120 $FP bench latency --config deepseek-v2-lite --gpu-memory-utilization 0.6 --max-num-seqs 8 \
    --json-out "$OUT/latency_v2lite.json" 2>&1 | grep -E "tok_per_s|speedup|fraction|Error" ;;
final)  # session 2's closing call: changed tests, serve, V2-Lite, flex (needs the .whl carry)
  timeout 150 $PT -n 8 -m gpu tests/engine tests/models tests/kernels -rf 2>&1 | tee "$OUT/gpu_tests.txt" | tail -n 8
  timeout 140 $FP bench serve --config llama-3-8b --num-prompts 300 --request-rate 16 \
    --input-len 512 --output-len 128 --json-out "$OUT/serve_8b.json" 2>&1 | grep -v "INFO:" | tail -n 25
  timeout 180 $FP bench throughput --config deepseek-v2-lite --gpu-memory-utilization 0.5 \
    --num-requests 64 --hf-requests 4 --hf-batch-size 4 --json-out "$OUT/throughput_v2lite.json" 2>&1 \
    | grep -E "tok_per_s|speedup|seconds|Error"
  timeout 90 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --attention-backend flex \
    --num-requests 64 --no-hf --json-out "$OUT/throughput_8b_flex.json" 2>&1 | grep -E "tok_per_s|Error" ;;
final2)  # session 2's last call: decode GEMM, engine, decode and MLA kernels (old vs new)
  F=/tmp/final; mkdir -p $F/engine
  timeout 50 $PT -m gpu tests/kernels/test_gemv.py tests/engine/test_triton_backend.py -rf 2>&1 \
    | tee $F/engine/tests.txt | tail -n 4
  timeout 110 $FP bench latency --config llama-3-8b --gpu-memory-utilization 0.6 --max-num-seqs 64 \
    --json-out "$OUT/latency_8b.json" 2>&1 | grep -E "decode GEMM|tok_per_s|speedup|fraction|Error"
  timeout 165 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 \
    --hf-requests 8 --hf-batch-size 8 --json-out "$OUT/throughput_8b.json" 2>&1 \
    | grep -E "tok_per_s|speedup|seconds|Error"
  OUT=$F/decode timeout 95 bash benchmarks/decode_final.sh 2>&1 | tail -n 30
  OUT=$F/mla timeout 95 bash benchmarks/mla_final.sh 2>&1 | tail -n 30
  tar czf "$OUT/final_kernels.tgz" -C $F . ;;
next-a)  # session 3, call 1: fused MoE correctness + speed, then V2-Lite with it on and off
  timeout 120 $PT tests/kernels/test_fused_moe.py tests/models/test_moe.py -rf 2>&1 \
    | tee "$OUT/fused_moe_tests.txt" | tail -n 4
  timeout 120 python3 benchmarks/fused_moe.py --sweep --out "$OUT" 2>&1 | tail -n 20
  for m in 0 1; do FLASHPAGE_FUSED_MOE=$m timeout 150 $FP bench throughput --config deepseek-v2-lite \
    --gpu-memory-utilization 0.5 --num-requests 64 --no-hf --json-out "$OUT/v2lite_fused_moe$m.json" 2>&1 \
    | grep -E "output_tok_per_s|Error" | sed "s/^/fused_moe=$m /"; done ;;
next-b)  # session 3, call 2: run-to-run spread of the 8B figures, where prompt steps go, flex
  for i in 1 2; do timeout 110 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 \
    --no-hf --json-out "$OUT/throughput_8b_rep$i.json" 2>&1 | grep -E "output_tok_per_s|Error"; done
  timeout 120 python3 benchmarks/profile_engine_step.py --batch 1 256 --context 1024 --steps 20 \
    --kernel-table --prefill-table 8192 2>&1 | grep -v Warning | tail -n 70 | tee "$OUT/profile.txt"
  timeout 200 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --attention-backend flex \
    --num-requests 64 --no-hf --json-out "$OUT/throughput_8b_flex.json" 2>&1 | grep -E "tok_per_s|Error" ;;
next-e)  # session 3, call 4: GPU tests with the new defaults, PDL modes A/B (kernel, 8B one
         # sequence, 8B throughput)
  K=$OUT/k; mkdir -p "$K"
  timeout 150 $PT -n 8 -m gpu tests/engine tests/models tests/kernels/test_pdl.py \
    tests/kernels/test_fused_moe.py -rf 2>&1 | tee "$K/gpu_tests.txt" | tail -n 5
  timeout 100 python3 benchmarks/attention_decode.py --pdl-ab --out "$K/decode_pdl" 2>&1 | tail -n 8
  timeout 150 python3 benchmarks/decode_ab.py --config llama-3-8b --gpu-memory-utilization 0.6 \
    --max-num-seqs 8 --no-hf --rounds 2 --iters 3 --setting off=FLASHPAGE_PDL=0 \
    --setting auto= --setting all=FLASHPAGE_PDL=1 --json-out "$K/decode_ab.json" 2>&1 \
    | grep -E "round|median|Error|error"
  for m in auto 0; do FLASHPAGE_PDL=$m timeout 110 $FP bench throughput --config llama-3-8b \
    --gpu-memory-utilization 0.75 --no-hf --json-out "$K/throughput_8b_pdl_$m.json" 2>&1 \
    | grep -E "output_tok_per_s|Error" | sed "s/^/pdl=$m /"; done
  tar czf "$OUT/k.tgz" -C "$OUT" k ;;
next-f)  # session 3, call 5: the headline figures with today's defaults, beside transformers; then
         # the 8B throughput again (warm Triton cache) and with FLASHPAGE_PDL=0
  timeout 85 $FP bench latency --config llama-3-8b --gpu-memory-utilization 0.6 --max-num-seqs 64 \
    --json-out "$OUT/latency_8b.json" 2>&1 | grep -E "tok_per_s|speedup|fraction|Error"
  timeout 220 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 \
    --hf-requests 16 --hf-batch-size 16 --json-out "$OUT/throughput_8b.json" 2>&1 \
    | grep -E "tok_per_s|speedup|seconds|Error"
  for m in auto 0; do FLASHPAGE_PDL=$m timeout 105 $FP bench throughput --config llama-3-8b \
    --gpu-memory-utilization 0.75 --no-hf --json-out "$OUT/throughput_8b_warm_pdl_$m.json" 2>&1 \
    | grep -E "output_tok_per_s|Error" | sed "s/^/pdl=$m /"; done ;;
next-g)  # session 3, call 6: on a fresh machine (cold Triton cache), the one-compile test, then
         # the 8B throughput cold and warm
  timeout 90 $PT -m gpu tests/kernels/test_flash_prefill.py -k "slice_offset or paged_gpu" -rf 2>&1 | tail -n 3
  for i in cold warm; do timeout 110 $FP bench throughput --config llama-3-8b \
    --gpu-memory-utilization 0.75 --no-hf --json-out "$OUT/throughput_8b_$i.json" 2>&1 \
    | grep -E "output_tok_per_s|Error" | sed "s/^/$i /"; done ;;
next-i)  # session 3, last call: the fp8 KV cache on the GPU (bf16 tests), then the 8B throughput with it
  timeout 75 $PT -n 8 -m gpu tests/kernels/test_fp8_kv.py tests/engine/test_fp8_kv_cache.py -rf 2>&1 \
    | tee "$OUT/fp8_tests.txt" | tail -n 6
  timeout 110 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --no-hf \
    --kv-cache-dtype fp8 --json-out "$OUT/throughput_8b_fp8.json" 2>&1 | grep -E "output_tok_per_s|Error" ;;
next-j)  # next session: the fp8 MLA GPU tests, an fp8 default for paged decode, then the 8B
         # throughput bf16 vs fp8 cache
  # the MLA write's unit logic and the kernels' fp8 checks changed after the last GPU run:
  # the bf16 MLA and decode paths' GPU tests too
  timeout 200 $PT -n 8 -m gpu tests/kernels/test_mla_fp8.py tests/kernels/test_mla_cache_write.py \
    tests/kernels/test_mla_decode.py tests/kernels/test_paged_decode.py tests/models tests/engine -rf 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -n 6
  timeout 150 python3 benchmarks/attention_decode.py --kv-dtype fp8 --out "$OUT" 2>&1 | tail -n 9
  timeout 90 python3 benchmarks/mla_decode.py --kv-dtype fp8 --out "$OUT/mla_kv_dtype.jsonl" 2>&1 | tail -n 8 ;;
next-k)  # next session, after next-j: the 8B throughput over a bf16 and an fp8 cache
  for d in auto fp8; do timeout 110 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 \
    --no-hf --kv-cache-dtype $d --json-out "$OUT/throughput_8b_kv_$d.json" 2>&1 \
    | grep -E "output_tok_per_s|Error" | sed "s/^/kv=$d /"; done ;;
next-l)  # session 4: fp16 dots over an fp8 cache (kernels/kv_dtype.py f16_dots): GPU tests, then
         # the decode and MLA kernels over bf16 and fp8 caches with fp8 tile candidates
  timeout 150 $PT -n 8 -m gpu tests/kernels/test_fp8_kv.py tests/kernels/test_mla_fp8.py \
    tests/engine/test_fp8_kv_cache.py tests/models/test_deepseek_fp8.py -rf 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -n 4
  timeout 150 python3 benchmarks/attention_decode.py --kv-dtype fp8 --out "$OUT" 2>&1 | tail -n 9
  timeout 120 python3 benchmarks/mla_decode.py --kv-dtype fp8 --out "$OUT/mla_kv_dtype.jsonl" 2>&1 | tail -n 10 ;;
next-m)  # session 4: the cache's memory order, NHD vs HND (a head's page contiguous), beside cuDNN
  timeout 300 python3 benchmarks/attention_decode.py --layout-ab --out "$OUT" 2>&1 | tail -n 9 ;;
next-n)  # session 4: the fp8 decode default (128-key tiles): its GPU tests, the kernels, then the 8B
         # throughput over a bf16 and an fp8 cache
  timeout 120 $PT -n 8 -m gpu tests/kernels/test_fp8_kv.py tests/engine/test_fp8_kv_cache.py -rf 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -n 3
  timeout 120 python3 benchmarks/attention_decode.py --kv-dtype fp8 --out "$OUT" 2>&1 | tail -n 8
  for d in auto fp8; do timeout 120 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 \
    --no-hf --kv-cache-dtype $d --json-out "$OUT/throughput_8b_kv_$d.json" 2>&1 \
    | grep -E "output_tok_per_s|Error" | sed "s/^/kv=$d /"; done ;;
next-o)  # session 4: where the 8B decode step goes now (kernel tables at batch 1 and 256, bf16 and fp8
         # caches), then the DeepSeek-V2-Lite shape over a bf16 and an fp8 latent cache
  for d in auto fp8; do timeout 150 python3 benchmarks/profile_engine_step.py --batch 1 256 --context 1024 \
    --steps 30 --kernel-table --kv-cache-dtype $d 2>&1 | grep -v Warning | tail -n 50 > "$OUT/profile_kv_$d.txt"
    grep -E "kernels at|step median" "$OUT/profile_kv_$d.txt" | sed "s/^/kv=$d /"; done
  for d in auto fp8; do timeout 150 $FP bench throughput --config deepseek-v2-lite --gpu-memory-utilization 0.5 \
    --num-requests 64 --no-hf --kv-cache-dtype $d --json-out "$OUT/throughput_v2lite_kv_$d.json" 2>&1 \
    | grep -E "output_tok_per_s|Error" | sed "s/^/kv=$d /"; done ;;
next-p)  # session 4: V prefetched into registers (DecodeConfig.prefetch_v): GPU tests, fp8 candidates
  timeout 150 $PT -n 8 -m gpu tests/kernels/test_fp8_kv.py tests/kernels/test_paged_decode.py -rf 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -n 3
  timeout 150 python3 benchmarks/attention_decode.py --kv-dtype fp8 --out "$OUT" 2>&1 | tail -n 8 ;;
next-q)  # session 4: MLA latent tiles prefetched into registers (MLADecodeConfig.prefetch): GPU tests,
         # MLA over bf16 and fp8 with candidates, paged decode fp8 candidates (rows kernel too)
  timeout 150 $PT -n 8 -m gpu tests/kernels/test_mla_decode.py tests/kernels/test_mla_fp8.py -rf 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -n 3
  timeout 150 python3 benchmarks/mla_decode.py --kv-dtype fp8 --out "$OUT/mla_kv_dtype.jsonl" 2>&1 | tail -n 12
  timeout 120 python3 benchmarks/attention_decode.py --kv-dtype fp8 --out "$OUT" 2>&1 | tail -n 7 ;;
next-r)  # session 4's last call: fp8 GPU tests with the new MLA default, then V2-Lite and the 8B over
         # bf16 and fp8 caches
  timeout 150 $PT -n 8 -m gpu tests/kernels/test_mla_fp8.py tests/models/test_deepseek_fp8.py \
    tests/engine/test_fp8_kv_cache.py tests/kernels/test_fp8_kv.py -rf 2>&1 | tee "$OUT/gpu_tests.txt" | tail -n 3
  for d in auto fp8; do timeout 150 $FP bench throughput --config deepseek-v2-lite --gpu-memory-utilization 0.5 \
    --num-requests 64 --no-hf --kv-cache-dtype $d --json-out "$OUT/throughput_v2lite_kv_$d.json" 2>&1 \
    | grep -E "output_tok_per_s|Error" | sed "s/^/v2lite kv=$d /"; done
  for d in auto fp8; do timeout 120 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 \
    --no-hf --kv-cache-dtype $d --json-out "$OUT/throughput_8b_kv_$d.json" 2>&1 \
    | grep -E "output_tok_per_s|Error" | sed "s/^/8b kv=$d /"; done ;;
next-s)  # session 4: V2-Lite prompt steps over bf16 vs fp8 latents (kernel tables), then fp8 throughput
         # with the byte-view gather (attention/torch_native.gather_paged)
  for d in auto fp8; do timeout 120 python3 benchmarks/profile_engine_step.py --config deepseek-v2-lite \
    --batch 1 --steps 5 --context 1024 --prefill-table 8192 --gpu-memory-utilization 0.5 --kv-cache-dtype $d 2>&1 \
    | grep -v Warning | tail -n 25 > "$OUT/prefill_v2lite_kv_$d.txt"; grep -E "kernels at|prefill of" "$OUT/prefill_v2lite_kv_$d.txt" | sed "s/^/kv=$d /"; done
  timeout 120 $FP bench throughput --config deepseek-v2-lite --gpu-memory-utilization 0.5 \
    --num-requests 64 --no-hf --kv-cache-dtype fp8 --json-out "$OUT/throughput_v2lite_kv_fp8.json" 2>&1 \
    | grep -E "output_tok_per_s|Error" | sed "s/^/v2lite kv=fp8 /" ;;
ncu)  # session 5: decode and MLA GPU tests, then where each kernel's warps stall (Nsight Compute)
  timeout 200 $PT -n 8 -m gpu tests/kernels/test_paged_decode.py tests/kernels/test_fp8_kv.py \
    tests/kernels/test_mla_decode.py tests/kernels/test_mla_fp8.py -rf 2>&1 | tee "$OUT/gpu_tests.txt" | tail -n 3
  bash "$0" ncu-only ;;
tiles)  # session 5: paged decode with the block ids carried one tile ahead (K/V buffered num_stages - 1 deep)
  timeout 200 $PT -n 8 -m gpu tests/kernels/test_paged_decode.py tests/kernels/test_fp8_kv.py -rf 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -n 3
  timeout 150 python3 benchmarks/attention_decode.py --precompile 12 --tiles 2>&1 | tail -n 2
  timeout 240 python3 benchmarks/attention_decode.py --out "$OUT" --tiles 2>&1 | tail -n 16
  if [ -d .old/flashpage ]; then mkdir -p "$OUT/old"; PYTHONPATH=$PWD/.old timeout 120 python3 \
    benchmarks/attention_decode.py --out "$OUT/old" --kv-dtype fp8 2>&1 | tail -n 7; fi ;;
tiles2)  # session 5: fp8 decode register caps; ncu of the new fp8 default; the 8B end to end bf16 vs fp8
  timeout 200 $PT -n 8 -m gpu tests/kernels/test_paged_decode.py tests/kernels/test_fp8_kv.py -rf \
    -k "decode" 2>&1 | tee "$OUT/gpu_tests.txt" | tail -n 3
  timeout 150 python3 benchmarks/attention_decode.py --precompile 12 --tiles 2>&1 | tail -n 1
  timeout 240 python3 benchmarks/attention_decode.py --out "$OUT" --tiles 2>&1 | tail -n 14
  NCU_CASES=decode_fp8 bash "$0" ncu-only
  E=${ENGINE:-$PWD}; for d in auto fp8; do PYTHONPATH=$E timeout 150 $FP bench throughput --config llama-3-8b \
    --gpu-memory-utilization 0.75 --no-hf --kv-cache-dtype $d --json-out "$OUT/throughput_8b_kv_$d.json" 2>&1 \
    | grep -E "output_tok_per_s|Error" | sed "s/^/8b kv=$d /"; done ;;
ncu-only)  # Nsight Compute on $NCU_CASES (default: every ncu_cases.py case): summaries, raw metrics and
          # per-instruction stalls (benchmarks/ncu_stalls.py reads them) into ncu.tgz
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -n 1); mkdir -p "$OUT/ncu"
  for c in ${NCU_CASES:-decode_bf16 decode_fp8 mla_bf16_32x4k mla_bf16_8x32k mla_fp8_32x4k prefill_causal prefill_paged16 prefill_paged128}; do
    case $c in decode*) k=_paged_decode ;;  # the Triton kernel or, over fp8 on Hopper, the Gluon one
    mla*) k=_mla_decode_kernel ;; gemv*) k=_gemv_row ;; prefill_gluon*) k=_flash_prefill_gluon ;; *) k=_prefill_fwd ;; esac
    timeout 150 "$NCU" --clock-control none --set full --import-source yes -k "regex:^$k" --launch-skip 2 \
      --launch-count 1 -f -o "$OUT/ncu/$c" python3 benchmarks/ncu_cases.py $c > "$OUT/ncu/$c.log" 2>&1
    "$NCU" --import "$OUT/ncu/$c.ncu-rep" --page details > "$OUT/ncu/$c.details.txt" 2>&1
    "$NCU" --import "$OUT/ncu/$c.ncu-rep" --page raw --csv > "$OUT/ncu/$c.raw.csv" 2>&1
    "$NCU" --import "$OUT/ncu/$c.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu/$c.sass.csv" 2>&1
    rm -f "$OUT/ncu/$c.ncu-rep"; echo "$c: $(grep -E '^ +Duration' "$OUT/ncu/$c.details.txt" | head -n 1)"
  done
  tar czf "$OUT/ncu.tgz" -C "$OUT" ncu && rm -rf "$OUT/ncu" ;;
pipe)  # session 5, run 32: prefill candidates (the pipelined q.k of commit c025ffe, removed since) and 2-CTA tiles; MLA splits; 8B fp8
  mkdir -p "$OUT/prefill"
  timeout 200 python3 benchmarks/attention_prefill.py --tune --paged-all --jobs 12 --dims 128 --causal-only \
    --no-flex --out "$OUT/prefill" > "$OUT/prefill.log" 2>&1; echo "prefill bench rc=$?"; cat "$OUT/prefill/prefill.md"
  timeout 160 $PT -n 8 -m gpu tests/kernels/test_flash_prefill.py -rf 2>&1 | tee "$OUT/gpu_tests.txt" | tail -n 3
  timeout 100 python3 benchmarks/mla_decode.py --splits-ab --out "$OUT/mla_splits.jsonl" 2>&1 | tail -n 5
  timeout 150 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --no-hf --kv-cache-dtype fp8 \
    --json-out "$OUT/throughput_8b_kv_fp8.json" 2>&1 | grep -E "output_tok_per_s|Error" | sed "s/^/8b kv=fp8 /" ;;
sampler)  # session 5's last call: the one-pass sampler (kernels/sampling.py), then the 8B end to end
  timeout 120 $PT -n 4 tests/kernels/test_sampling.py tests/engine/test_sampler.py -rf 2>&1 \
    | tee "$OUT/sampler_tests.txt" | tail -n 3
  timeout 100 python3 benchmarks/sampler.py --out "$OUT" 2>&1 | tail -n 16
  timeout 60 $PT -n 4 -m gpu tests/kernels/test_flash_prefill.py -k hopper_candidates -rf 2>&1 \
    | tee "$OUT/prefill_tests.txt" | tail -n 2
  for d in auto fp8; do timeout 100 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 \
    --no-hf --kv-cache-dtype $d --json-out "$OUT/throughput_8b_kv_$d.json" 2>&1 \
    | grep -E "output_tok_per_s|Error" | sed "s/^/8b kv=$d /"; done
  FLASHPAGE_SAMPLER_KERNEL=0 timeout 100 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 \
    --no-hf --kv-cache-dtype fp8 --json-out "$OUT/throughput_8b_kv_fp8_torch_sampler.json" 2>&1 \
    | grep -E "output_tok_per_s|Error" | sed "s/^/8b kv=fp8 torch sampler /" ;;
check5)  # session 5's closing check: engine/model GPU tests (sampler kernel on), V2-Lite end to end
  timeout 300 $PT -m gpu tests/engine tests/models -rf 2>&1 | tee "$OUT/engine_gpu_tests.txt" | tail -n 4
  timeout 150 $FP bench throughput --config deepseek-v2-lite --gpu-memory-utilization 0.5 --num-requests 64 \
    --no-hf --json-out "$OUT/throughput_v2lite.json" 2>&1 | grep -E "output_tok_per_s|Error" | sed "s/^/v2lite /" ;;
gemv)  # session 6: one-row GEMV with weights requested before the PDL wait: tests, alone and chained, 8B one sequence
  timeout 200 $PT -n 8 -m gpu tests/kernels/test_gemv.py -rf 2>&1 | tee "$OUT/gemv_tests.txt" | tail -n 3
  timeout 200 python3 benchmarks/gemv.py --out "$OUT" 2>&1 | tail -n 30
  timeout 200 python3 benchmarks/decode_ab.py --config llama-3-8b --gpu-memory-utilization 0.6 --max-num-seqs 8 \
    --rounds 2 --iters 3 --setting cublas= --setting gemv=FLASHPAGE_GEMV=1 \
    --setting gemv_nopdl="FLASHPAGE_GEMV=1;FLASHPAGE_PDL=0" --json-out "$OUT/decode_ab.json" 2>&1 | tail -n 8
  FLASHPAGE_GEMV=1 timeout 100 python3 benchmarks/profile_engine_step.py --batch 1 --context 256 --steps 10 \
    --kernel-table --gpu-memory-utilization 0.5 2>&1 | grep -v Warning | tail -n 40 > "$OUT/profile_b1_gemv.txt"
  FLASHPAGE_PDL=0 FLASHPAGE_GEMV=1 timeout 100 python3 benchmarks/profile_engine_step.py --batch 1 --context 256 \
    --steps 10 --kernel-table --gpu-memory-utilization 0.5 2>&1 | grep -v Warning | tail -n 40 > "$OUT/profile_b1_gemv_pdl0.txt"
  tail -n 25 "$OUT/profile_b1_gemv_pdl0.txt" ;;
gemv2)  # session 6: whole-row GEMV + RMSNorm in its prologue: tests, benchmark, 8B one sequence A/B, engine GPU tests
  timeout 200 $PT -n 8 -m gpu tests/kernels/test_gemv.py -rf 2>&1 | tee "$OUT/gemv_tests.txt" | tail -n 3
  timeout 200 python3 benchmarks/gemv.py --out "$OUT" 2>&1 | grep chain
  timeout 200 python3 benchmarks/decode_ab.py --config llama-3-8b --gpu-memory-utilization 0.6 --max-num-seqs 8 \
    --rounds 2 --iters 3 --setting cublas= --setting gemv=FLASHPAGE_GEMV=1 \
    --setting gemv_nopdl="FLASHPAGE_GEMV=1;FLASHPAGE_PDL=0" --json-out "$OUT/decode_ab.json" 2>&1 | tail -n 4
  FLASHPAGE_PDL=0 FLASHPAGE_GEMV=1 timeout 100 python3 benchmarks/profile_engine_step.py --batch 1 --context 256 \
    --steps 10 --kernel-table --gpu-memory-utilization 0.5 2>&1 | grep -v Warning | tail -n 40 > "$OUT/profile_b1_gemv_pdl0.txt"
  head -n 12 "$OUT/profile_b1_gemv_pdl0.txt"
  FLASHPAGE_GEMV=1 timeout 200 $PT -m gpu tests/engine tests/models -rf 2>&1 | tee "$OUT/engine_gpu_tests.txt" | tail -n 4 ;;
gemv3)  # session 6: gemv_row on by default, o_proj looped: tests, one-sequence A/B (+ fused merge), 8B latency and throughput
  timeout 100 $PT -n 8 -m gpu tests/kernels/test_gemv.py tests/kernels/test_paged_decode.py -rf 2>&1 \
    | tee "$OUT/kernel_gpu_tests.txt" | tail -n 2
  timeout 200 python3 benchmarks/decode_ab.py --config llama-3-8b --gpu-memory-utilization 0.6 --max-num-seqs 8 \
    --rounds 2 --iters 3 --setting cublas=FLASHPAGE_GEMV=0 --setting gemv= \
    --setting gemv_fused_merge=FLASHPAGE_FUSED_MERGE=1 --json-out "$OUT/decode_ab.json" 2>&1 | tail -n 3
  timeout 120 $FP bench latency --config llama-3-8b --gpu-memory-utilization 0.6 --max-num-seqs 64 \
    --json-out "$OUT/latency_8b.json" 2>&1 | grep -E "tok_per_s|speedup|fraction|Error"
  timeout 150 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --no-hf \
    --json-out "$OUT/throughput_8b.json" 2>&1 | grep -E "output_tok_per_s|Error"
  timeout 150 $PT -m gpu tests/engine tests/models -rf 2>&1 | tee "$OUT/engine_gpu_tests.txt" | tail -n 2 ;;
gemv4)  # session 6: whole rows up to 16384 (the down projection): tests, chain, one-sequence A/B
  timeout 120 $PT -n 8 -m gpu tests/kernels/test_gemv.py -rf 2>&1 | tee "$OUT/gemv_tests.txt" | tail -n 2
  timeout 200 python3 benchmarks/gemv.py --out "$OUT" 2>&1 | grep -E "chain|down"
  timeout 240 python3 benchmarks/decode_ab.py --config llama-3-8b --gpu-memory-utilization 0.6 --max-num-seqs 8 \
    --rounds 2 --iters 3 --setting cublas=FLASHPAGE_GEMV=0 --setting gemv= \
    --setting gemv_whole16k=FLASHPAGE_GEMV_WHOLE_ROW=16384 --json-out "$OUT/decode_ab.json" 2>&1 | tail -n 3 ;;
gemv5)  # session 6: looped GEMV with x loaded a tile ahead (down): tests, chain, one-sequence A/B
  timeout 120 $PT -n 8 -m gpu tests/kernels/test_gemv.py -rf 2>&1 | tee "$OUT/gemv_tests.txt" | tail -n 2
  timeout 200 python3 benchmarks/gemv.py --out "$OUT" 2>&1 | grep -E "chain|down|o_proj"
  timeout 240 python3 benchmarks/decode_ab.py --config llama-3-8b --gpu-memory-utilization 0.6 --max-num-seqs 8 \
    --rounds 2 --iters 3 --setting cublas=FLASHPAGE_GEMV=0 --setting gemv= \
    --json-out "$OUT/decode_ab.json" 2>&1 | tail -n 3 ;;
final6)  # session 6, closing A/B and figures: early loads (HEAD) vs .old (HEAD~1, carried), 8B latency beside HF, throughput
  i=0
  for code in new old new old; do
    i=$((i + 1)); if [ $code = old ]; then ROOT=$PWD/.old; else ROOT=$PWD; fi
    PYTHONPATH=$ROOT timeout 150 python3 $ROOT/benchmarks/decode_ab.py --config llama-3-8b \
      --gpu-memory-utilization 0.6 --max-num-seqs 8 --rounds 1 --iters 3 --setting cublas=FLASHPAGE_GEMV=0 \
      --setting gemv= --json-out "$OUT/decode_ab_${i}_$code.json" 2>&1 | grep median | sed "s/^/$code /"
  done
  timeout 120 $FP bench latency --config llama-3-8b --gpu-memory-utilization 0.6 --max-num-seqs 64 \
    --json-out "$OUT/latency_8b.json" 2>&1 | grep -E "decode_tok_per_s|fraction|speedup|Error"
  timeout 150 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --no-hf \
    --json-out "$OUT/throughput_8b.json" 2>&1 | grep -E "output_tok_per_s|Error" ;;
final6-tests)  # session 6, closing: changed kernels' + engine GPU tests, V2-Lite one sequence, paged decode new vs .old
  timeout 200 $PT -n 8 -m gpu tests/kernels/test_gemv.py tests/kernels/test_pdl.py tests/kernels/test_fused_ops.py \
    tests/kernels/test_paged_decode.py tests/kernels/test_fp8_kv.py -rf 2>&1 | tee "$OUT/kernel_gpu_tests.txt" | tail -n 2
  timeout 200 $PT -m gpu tests/engine tests/models -rf 2>&1 | tee "$OUT/engine_gpu_tests.txt" | tail -n 2
  timeout 100 $FP bench latency --config deepseek-v2-lite --gpu-memory-utilization 0.5 --max-num-seqs 8 --no-hf \
    --json-out "$OUT/latency_v2lite.json" 2>&1 | grep -E "decode_tok_per_s|fraction|Error"
  timeout 90 python3 benchmarks/attention_decode.py --out "$OUT/dec_new" 2>&1 | tail -n 9
  PYTHONPATH=$PWD/.old timeout 90 python3 .old/benchmarks/attention_decode.py --out "$OUT/dec_old" 2>&1 | tail -n 9 ;;
dec-ab6)  # session 6: paged decode with its early loads (HEAD) vs .old, alternating twice (split shapes vary most)
  for code in new old new old; do
    if [ $code = old ]; then ROOT=$PWD/.old; else ROOT=$PWD; fi
    PYTHONPATH=$ROOT timeout 90 python3 $ROOT/benchmarks/attention_decode.py --out "$OUT/dec" 2>&1 \
      | grep -E "^\| (1|2|8|16|32) × (32768|131072|4096|16384) " | sed "s/^/$code /"
  done ;;
profile6)  # session 6, last call: where a one-sequence step goes now (8B and V2-Lite kernel tables, PDL off)
  for cfg in llama-3-8b deepseek-v2-lite; do
    FLASHPAGE_PDL=0 timeout 120 python3 benchmarks/profile_engine_step.py --config $cfg --batch 1 --context 256 \
      --steps 10 --kernel-table --gpu-memory-utilization 0.5 2>&1 | grep -v Warning | tail -n 45 > "$OUT/profile_b1_$cfg.txt"
    head -n 22 "$OUT/profile_b1_$cfg.txt"
  done ;;
align6)  # session 6: moe_align with tiles sized to the work: its GPU tests, V2-Lite one sequence
  timeout 80 $PT -n 4 -m gpu tests/kernels/test_fused_moe.py -rf 2>&1 | tee "$OUT/fused_moe_gpu_tests.txt" | tail -n 2
  timeout 100 $FP bench latency --config deepseek-v2-lite --gpu-memory-utilization 0.5 --max-num-seqs 8 --no-hf \
    --json-out "$OUT/latency_v2lite.json" 2>&1 | grep -E "decode_tok_per_s|fraction|Error" ;;
next7)  # next session, first call: what session 6 wrote without a GPU: the router kernel and the merged shared
        # experts (GPU tests, then V2-Lite one sequence with the router off / on, in one process)
  timeout 150 $PT -n 8 tests/kernels/test_moe_router.py tests/kernels/test_fused_moe.py tests/models/test_moe.py \
    tests/models/test_deepseek.py -rf 2>&1 | tee "$OUT/moe_gpu_tests.txt" | tail -n 2
  timeout 200 python3 benchmarks/decode_ab.py --config deepseek-v2-lite --gpu-memory-utilization 0.5 --max-num-seqs 8 \
    --rounds 2 --iters 3 --setting base= --setting router=FLASHPAGE_FUSED_ROUTER=1 \
    --json-out "$OUT/decode_ab_v2lite.json" 2>&1 | tail -n 3
  timeout 150 $FP bench throughput --config deepseek-v2-lite --gpu-memory-utilization 0.5 --num-requests 64 \
    --no-hf --json-out "$OUT/throughput_v2lite.json" 2>&1 | grep -E "output_tok_per_s|Error" ;;
flex7)  # session 7: the flex backend's throughput beside ours on a smaller workload, then ours on the default one
  for be in flex triton; do
    timeout 240 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --attention-backend $be \
      --num-requests 64 --input-len 100 512 --output-len 100 512 --no-hf \
      --json-out "$OUT/throughput_8b_64_$be.json" 2>&1 | grep -E "output_tok_per_s|Error|error" | head -n 3
  done
  timeout 200 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --no-hf \
    --json-out "$OUT/throughput_8b.json" 2>&1 | grep -E "output_tok_per_s|Error" ;;
flex7b)  # session 7: flex decodes as a batch of one-query entries: GPU test, then the 64-request throughput
  timeout 150 $PT -m gpu tests/engine/test_flex_backend.py -rf 2>&1 | tee "$OUT/flex_gpu_tests.txt" | tail -n 2
  timeout 300 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --attention-backend flex \
    --num-requests 64 --input-len 100 512 --output-len 100 512 --no-hf \
    --json-out "$OUT/throughput_8b_64_flex.json" 2>&1 | grep -E "output_tok_per_s|Error|error" | head -n 3 ;;
wsplit7)  # session 7: warp-split paged decode (each warp its own 16-key piece and softmax state)
  timeout 150 $PT -n 12 -m gpu tests/kernels/test_paged_decode.py tests/kernels/test_fp8_kv.py -k "decode" -rf 2>&1 \
    | tee "$OUT/decode_gpu_tests.txt" | tail -n 2
  timeout 300 python3 benchmarks/attention_decode.py --warp-split --out "$OUT/k" 2>&1 | tail -n 15 ;;
fp8t7)  # session 7: 8B throughput over an fp8 cache, warp-split decode off, then on (the new default)
  timeout 70 $PT -n 8 -m gpu tests/kernels/test_fp8_kv.py -k "decode_fp8_gpu" -rf 2>&1 | tee "$OUT/fp8_gpu_tests.txt" | tail -n 1
  for ws in 0 1; do
    FLASHPAGE_DECODE_WARP_SPLIT=$ws timeout 150 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 \
      --kv-cache-dtype fp8 --no-hf --json-out "$OUT/throughput_8b_fp8_ws$ws.json" 2>&1 | grep -E "output_tok_per_s|Error"
  done ;;
next8)  # next session, first call: where the warp-split fp8 decode's kernel gain goes end to end
  for ws in 0 1; do  # per step kind: wall ms and the GPU's own ms (bench throughput's event pairs)
    FLASHPAGE_DECODE_WARP_SPLIT=$ws timeout 150 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 \
      --kv-cache-dtype fp8 --no-hf --json-out "$OUT/throughput_8b_fp8_ws$ws.json" 2>&1 | grep -E "output_tok_per_s|Error"
  done
  for ws in 0 1; do  # the batch-256 step's kernels, split off / on
    FLASHPAGE_DECODE_WARP_SPLIT=$ws timeout 120 python3 benchmarks/profile_engine_step.py --batch 256 --context 1024 \
      --steps 20 --kernel-table --kv-cache-dtype fp8 2>&1 | grep -v Warning | tail -n 24 | tee "$OUT/profile_fp8_b256_ws$ws.txt"
  done
  timeout 200 python3 benchmarks/attention_decode.py --warp-split --out "$OUT/k" 2>&1 | tail -n 14 ;;
next8b)  # session 8, second call: the decode configs at the engine's ragged batches; MLA 16-bit partials
  timeout 120 $PT -m gpu tests/kernels/test_paged_decode.py -k "warp_split or heads_fastest" 2>&1 | tail -n 3
  timeout 240 python3 benchmarks/attention_decode.py --engine-shapes --out "$OUT/k" 2>&1 | tail -n 14
  timeout 150 python3 benchmarks/mla_decode.py --precompile 8 --chunks-ab 2>&1 | tail -n 2
  timeout 200 python3 benchmarks/mla_decode.py --chunks-ab --out "$OUT/k/mla_chunks_ab.jsonl" 2>&1 | tail -n 12 ;;
next8c)  # session 8, third call: decodes longest first (engine + decode GPU tests, 8B throughput fp8 / bf16)
  timeout 200 $PT -m gpu tests/engine tests/models tests/kernels/test_paged_decode.py -rf 2>&1 | tee "$OUT/gpu_tests.txt" | tail -n 6
  for kv in fp8 auto; do
    timeout 150 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --kv-cache-dtype $kv \
      --no-hf --json-out "$OUT/throughput_8b_$kv.json" 2>&1 | grep -E "output_tok_per_s|Error"
  done
  timeout 200 python3 benchmarks/attention_decode.py --engine-shapes --out "$OUT/k" 2>&1 | tail -n 14 ;;
next8d)  # session 8, fourth call: prefill pv_overlap candidates; GPU tests with decodes longest first
  timeout 200 python3 benchmarks/attention_prefill.py --candidates-ab --jobs 12 --out "$OUT/k" 2>&1 | tail -n 16  # (e1e44d7)
  timeout 100 $PT -m gpu tests/kernels/test_flash_prefill.py -k "hopper_candidates and pvo" 2>&1 | tail -n 3
  timeout 200 $PT -m gpu tests/engine tests/models -rf 2>&1 | tee "$OUT/gpu_tests_engine.txt" | tail -n 4
  timeout 200 $PT -m gpu tests/kernels/test_paged_decode.py tests/kernels/test_fp8_kv.py -rf 2>&1 \
    | tee "$OUT/gpu_tests_decode.txt" | tail -n 4 ;;
next8e)  # session 8, last call: the engine as committed (decodes longest first, logits used in place)
  timeout 180 $PT -m gpu tests/engine tests/models -rf 2>&1 | tee "$OUT/gpu_tests_engine.txt" | tail -n 3
  timeout 240 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 \
    --hf-requests 16 --hf-batch-size 16 --json-out "$OUT/throughput_8b.json" 2>&1 | grep -E "tok_per_s|speedup|Error"
  timeout 150 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --kv-cache-dtype fp8 \
    --no-hf --json-out "$OUT/throughput_8b_fp8.json" 2>&1 | grep -E "output_tok_per_s|Error"
  timeout 200 $FP bench throughput --config deepseek-v2-lite --gpu-memory-utilization 0.75 \
    --num-requests 64 --no-hf --json-out "$OUT/throughput_v2lite.json" 2>&1 | grep -E "output_tok_per_s|Error" ;;
next8f)  # session 8, spare minutes: where the fp8 decode warps stall at 256 x 1024 (63% of copy) vs
         # 128 x 2048 (71-74%), and the MLA kernel at 8 x 32768 (80%)
  NCU_CASES="decode_fp8_256x1k decode_fp8_128x2k mla_bf16_8x32k" bash "$0" ncu-only ;;
next9)  # next session, first call: where the MLA short ranges' fixed ~11-16 us per call go
  timeout 150 python3 benchmarks/mla_decode.py --overhead --out "$OUT/mla_overhead.jsonl" 2>&1 | tail -n 6 ;;
gluon)  # branch gluon-decode: the Gluon fp8 decode prototype's first GPU run (tests under a timeout: a barrier
        # phase error would hang), then its benchmark beside the Triton default
  timeout 240 $PT -m gpu tests/kernels/test_paged_decode_gluon.py -rf -x 2>&1 | tee "$OUT/gluon_gpu_tests.txt" | tail -n 8
  timeout 150 python3 benchmarks/decode_gluon.py --out "$OUT" 2>&1 | tail -n 10 ;;
s9a)  # session 9: the Gluon fp8 decode as the engine's default (tests, 8B fp8 on / off), MLA per-kernel split
  timeout 120 $PT -n 8 -m gpu tests/kernels/test_fp8_kv.py tests/kernels/test_paged_decode_gluon.py -rf 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -n 4
  timeout 120 $PT -m gpu tests/engine/test_fp8_kv_cache.py -rf 2>&1 | tee "$OUT/gpu_tests_engine.txt" | tail -n 4
  for g in 1 0; do
    FLASHPAGE_DECODE_GLUON=$g timeout 150 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 \
      --kv-cache-dtype fp8 --no-hf --json-out "$OUT/throughput_8b_fp8_gluon$g.json" 2>&1 | grep -E "output_tok_per_s|Error"
  done
  timeout 120 python3 benchmarks/mla_decode.py --overhead --out "$OUT/mla_overhead.jsonl" 2>&1 | tail -n 4 ;;
s9b)  # session 9: the persistent Gluon decode as the default (tests, engine tests, 8B fp8 twice and Triton once, knobs)
  timeout 100 $PT -n 4 -m gpu tests/kernels/test_paged_decode_gluon.py -rf 2>&1 | tee "$OUT/gluon_tests.txt" | tail -n 2
  timeout 100 $PT -n 8 -m gpu tests/kernels/test_fp8_kv.py -k decode -rf 2>&1 | tee "$OUT/fp8_tests.txt" | tail -n 2
  timeout 200 $PT -m gpu tests/engine tests/models -rf 2>&1 | tee "$OUT/engine_tests.txt" | tail -n 3
  for g in 1 0 1; do
    FLASHPAGE_DECODE_GLUON=$g timeout 120 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 \
      --kv-cache-dtype fp8 --no-hf --json-out "$OUT/k/throughput_8b_fp8_gluon$g.$RANDOM.json" 2>&1 | grep -E "output_tok_per_s|Error"
  done
  timeout 100 python3 benchmarks/decode_gluon_knobs.py --set persistent --out "$OUT/k" 2>&1 | tail -n 7 ;;
variants)  # branch decode-fewer-instr: the persistent decode's variants dims_m / keys_m / keys_m2, first GPU run (their
           # tests first, under a timeout and -x: a ring phase error would hang), all Gluon decode tests, then knobs
  timeout 150 $PT -m gpu tests/kernels/test_paged_decode_gluon.py -k "dims_m or keys_m" -rf -x 2>&1 \
    | tee "$OUT/variant_tests.txt" | tail -n 8
  timeout 200 $PT -m gpu tests/kernels/test_paged_decode_gluon.py -rf 2>&1 | tee "$OUT/gluon_tests.txt" | tail -n 3
  timeout 240 python3 benchmarks/decode_gluon_knobs.py --set variants --out "$OUT" 2>&1 | tail -n 11 ;;
prefill-paged)  # branch prefill-paged-gluon, first GPU run of paged_prefill_gluon (tests under timeouts, in
                # file order, -v into the log: a barrier phase error would hang; static schedules first), then
                # its benchmark columns (block 16 and 128, 8192 cached + 8192 new) beside contiguous Gluon,
                # Triton paged_prefill and cuDNN
  timeout 120 $PT -v -x -m gpu tests/kernels/test_flash_prefill_gluon.py -k "paged and static" -rf 2>&1 \
    | tee "$OUT/paged_gluon_static_tests.txt" | tail -n 6
  timeout 200 $PT -v -x -m gpu tests/kernels/test_flash_prefill_gluon.py -k "paged and not static" -rf 2>&1 \
    | tee "$OUT/paged_gluon_tests.txt" | tail -n 6
  timeout 240 python3 benchmarks/prefill_gluon.py --out "$OUT" --variants gluon --causal-only 2>&1 \
    | tee "$OUT/prefill_gluon.txt" | tail -n 14 ;;
prefill-paged-b)  # the same branch: the contiguous Gluon prefill's and the Triton prefill's GPU tests (no regression)
  timeout 240 $PT -x -m gpu tests/kernels/test_flash_prefill_gluon.py -k "not paged" -rf 2>&1 \
    | tee "$OUT/gluon_prefill_tests.txt" | tail -n 4
  timeout 200 $PT -m gpu tests/kernels/test_flash_prefill.py tests/engine/test_triton_backend.py -rf 2>&1 \
    | tee "$OUT/prefill_tests.txt" | tail -n 4 ;;
s10a)  # session 10 call 1: the two never-run branches (decode-fewer-instr, prefill-paged-gluon) merged; tests first
  left() { local t=$((570 - SECONDS)); [ "$1" -lt "$t" ] && t=$1; echo $t; }
  timeout "$(left 120)" $PT -m gpu tests/kernels/test_paged_decode_gluon.py -k "dims_m or keys_m" -rf -x 2>&1 \
    | tee "$OUT/variant_tests.txt" | tail -n 4
  timeout "$(left 100)" $PT -v -x -m gpu tests/kernels/test_flash_prefill_gluon.py -k "paged and static" -rf 2>&1 \
    | tee "$OUT/paged_gluon_static_tests.txt" | tail -n 4
  timeout "$(left 150)" $PT -v -x -m gpu tests/kernels/test_flash_prefill_gluon.py -k "paged and not static" -rf 2>&1 \
    | tee "$OUT/paged_gluon_tests.txt" | tail -n 4
  timeout "$(left 200)" python3 benchmarks/decode_gluon_knobs.py --set variants --out "$OUT" 2>&1 | tail -n 11
  timeout "$(left 200)" python3 benchmarks/prefill_gluon.py --out "$OUT" --variants gluon --causal-only 2>&1 \
    | tee "$OUT/prefill_gluon.txt" | tail -n 14 ;;
s10b)  # session 10 call 2: paged_decode's Gluon form now keys_m at 4 programs an SM (run 79's knobs)
  left() { local t=$((570 - SECONDS)); [ "$1" -lt "$t" ] && t=$1; echo $t; }
  timeout "$(left 120)" $PT -n 4 -m gpu tests/kernels/test_paged_decode_gluon.py -rf 2>&1 | tee "$OUT/gluon_tests.txt" | tail -n 2
  timeout "$(left 100)" $PT -n 8 -m gpu tests/kernels/test_fp8_kv.py -k decode -rf 2>&1 | tee "$OUT/fp8_tests.txt" | tail -n 2
  for g in 1 0 1 keys_m2; do
    FLASHPAGE_DECODE_GLUON=$g timeout "$(left 110)" $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 \
      --kv-cache-dtype fp8 --no-hf --json-out "$OUT/k/throughput_8b_fp8_gluon$g.$RANDOM.json" 2>&1 | grep -E "output_tok_per_s|Error"
  done ;;
s10c)  # session 10 call 3: the engine under keys_m; the 8B fp8 run with transformers beside it
  timeout 200 $PT -m gpu tests/engine tests/models -rf 2>&1 | tee "$OUT/engine_tests.txt" | tail -n 3
  timeout 330 $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --kv-cache-dtype fp8 \
    --hf-requests 16 --hf-batch-size 16 --json-out "$OUT/throughput_8b_fp8_hf.json" 2>&1 | grep -E "output_tok_per_s|speedup|Error" ;;
prefill10)  # branch prefill-gluon-2: the Gluon prefill's GPU tests (paged static first, then the rest of the paged
            # ones, then the contiguous ones; -x -v under timeouts: a barrier phase error hangs), then its benchmark
  left() { local t=$((390 - SECONDS)); [ "$1" -lt "$t" ] && t=$1; echo $t; }
  timeout "$(left 80)" $PT -v -x -m gpu tests/kernels/test_flash_prefill_gluon.py -k "paged and static" -rf 2>&1 \
    | tee "$OUT/paged_gluon_static_tests.txt" | tail -n 4
  timeout "$(left 110)" $PT -v -x -m gpu tests/kernels/test_flash_prefill_gluon.py -k "paged and not static" -rf 2>&1 \
    | tee "$OUT/paged_gluon_tests.txt" | tail -n 4
  timeout "$(left 110)" $PT -v -x -m gpu tests/kernels/test_flash_prefill_gluon.py -k "not paged" -rf 2>&1 \
    | tee "$OUT/gluon_prefill_tests.txt" | tail -n 4
  timeout "$(left 150)" python3 benchmarks/prefill_gluon.py --out "$OUT" --variants gluon --causal-only 2>&1 \
    | tee "$OUT/prefill_gluon.txt" | tail -n 14 ;;
prefill10-engine)  # the same branch: the engine's and models' GPU tests with the Gluon paged prefill switched on
  FLASHPAGE_PREFILL_GLUON=1 timeout 300 python3 -m pytest -q -m gpu tests/engine tests/models -rf 2>&1 \
    | tee "$OUT/engine_gluon_prefill_tests.txt" | tail -n 12 ;;
s10d)  # session 10 call 4 (run 82)
  left() { local t=$((570 - SECONDS)); [ "$1" -lt "$t" ] && t=$1; echo $t; }
  timeout "$(left 220)" $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --kv-cache-dtype fp8 \
    --hf-requests 16 --hf-batch-size 16 --json-out "$OUT/throughput_8b_fp8_hf.json" 2>&1 | grep -E "tok_per_s|speedup|Error"
  timeout "$(left 60)" $PT -x -m gpu tests/kernels/test_flash_prefill_gluon.py -k "paged and static" -rf 2>&1 \
    | tee "$OUT/paged_gluon_static_tests.txt" | tail -n 2
  timeout "$(left 100)" $PT -x -m gpu tests/kernels/test_flash_prefill_gluon.py -k "paged and not static" -rf 2>&1 \
    | tee "$OUT/paged_gluon_tests.txt" | tail -n 4
  timeout "$(left 100)" $PT -x -m gpu tests/kernels/test_flash_prefill_gluon.py -k "not paged" -rf 2>&1 \
    | tee "$OUT/gluon_prefill_tests.txt" | tail -n 4
  FLASHPAGE_PREFILL_GLUON=1 timeout "$(left 150)" $PT -m gpu tests/engine tests/models -rf 2>&1 \
    | tee "$OUT/engine_gluon_prefill_tests.txt" | tail -n 4
  timeout "$(left 150)" python3 benchmarks/prefill_gluon.py --out "$OUT" --variants gluon --causal-only 2>&1 \
    | tee "$OUT/prefill_gluon.txt" | tail -n 8 ;;
mla10)  # branch mla-gluon: kernels/mla_decode_gluon.py's first GPU run; the tests first (graph replays and the
        # many-calls merge race last in the file), then benchmarks/mla_decode_gluon.py at page 64, then page 16
  timeout 150 python3 -m pytest -x -v -p no:cacheprovider -m gpu tests/kernels/test_mla_decode_gluon.py -rf 2>&1 \
    | tee "$OUT/mla_gluon_tests.txt" | tail -n 8
  timeout 150 python3 benchmarks/mla_decode_gluon.py --out "$OUT" 2>&1 | tee "$OUT/mla_gluon_bench.txt" | tail -n 12
  mkdir -p "$OUT/p16"
  timeout 80 python3 benchmarks/mla_decode_gluon.py --out "$OUT/p16" --page 16 --variants triton gluon \
    --shapes 8x32768 32x4096 128x4096 2>&1 | tee "$OUT/p16/mla_gluon_bench.txt" | tail -n 7 ;;
s10e)  # session 10 call 5 (run 83), ~350 s of device time left
  left() { local t=$((330 - SECONDS)); [ "$1" -lt "$t" ] && t=$1; echo $t; }
  timeout "$(left 90)" $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --kv-cache-dtype fp8 \
    --no-hf --json-out "$OUT/throughput_8b_fp8_a.json" 2>&1 | grep -E "output_tok_per_s|Error"
  timeout "$(left 160)" $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --kv-cache-dtype fp8 \
    --hf-requests 16 --hf-batch-size 16 --json-out "$OUT/throughput_8b_fp8_hf.json" 2>&1 | grep -E "tok_per_s|speedup|Error"
  timeout "$(left 150)" python3 -m pytest -x -v -p no:cacheprovider -m gpu tests/kernels/test_mla_decode_gluon.py -rf 2>&1 \
    | tee "$OUT/mla_gluon_tests.txt" | tail -n 8 ;;
s11a)  # session 11 call 1, on a fresh machine (the first process matters: runs 82-83)
  left() { local t=$((560 - SECONDS)); [ "$1" -lt "$t" ] && t=$1; echo $t; }
  timeout "$(left 100)" $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --kv-cache-dtype fp8 \
    --no-hf --json-out "$OUT/throughput_8b_fp8_first.json" 2>&1 | grep -E "output_tok_per_s|Error"
  for g in 0 1; do
    FLASHPAGE_PREFILL_GLUON=$g timeout "$(left 100)" $FP bench throughput --config llama-3-8b \
      --gpu-memory-utilization 0.75 --no-hf --json-out "$OUT/k/throughput_8b_prefill_gluon$g.$RANDOM.json" 2>&1 \
      | grep -E "output_tok_per_s|Error"
  done
  timeout "$(left 120)" $PT -m gpu tests/engine/test_mla_gluon_switch.py tests/engine/test_triton_backend.py -k gluon \
    -rf 2>&1 | tee "$OUT/engine_gluon_tests.txt" | tail -n 3
  for g in 0 1; do
    FLASHPAGE_MLA_GLUON=$g timeout "$(left 120)" $FP bench throughput --config deepseek-v2-lite \
      --gpu-memory-utilization 0.75 --num-requests 64 --no-hf --json-out "$OUT/k/throughput_v2lite_mla_gluon$g.json" \
      2>&1 | grep -E "output_tok_per_s|Error"
  done ;;  # the MLA Gluon kernel's knobs and tests: benchmarks/gpu_s11_mla.sh (its own call)
*) echo "unknown part $PART (engine, kernels, serve, deepseek)"; exit 2 ;;
esac
