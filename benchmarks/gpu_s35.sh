#!/usr/bin/env bash
# Session 35's device plan:
#   BUDGET=560 bash benchmarks/gpu_s35.sh a   the GPU tests of CTESTS (merged Qwen3-VL, LLaVA-OneVision),
#                                             Gemma-3-4B's decode steps on the host (the KV groups' fast
#                                             path), then benchmarks/vlm.py on each of VLMCONFIG beside
#                                             transformers
#   BUDGET=580 bash benchmarks/gpu_s35.sh b   the GPU tests of CTESTS (merged Qwen3-VL-MoE / video, InternVL),
#                                             vlm.py on InternVL3-2B and Qwen3-VL-30B-A3B, the encoder
#                                             cache against none, Gemma-3-4B text throughput's steps
#   BUDGET=400 bash benchmarks/gpu_s35.sh c   the GPU tests of CTESTS (Qwen3-VL fp8), InternVL3-2B's tower
#                                             and requests beside transformers' again (fused qkv)
# Results under $OUT (summaries only); logs in /tmp.
PART=${1:-a}
SESSION=35
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  tests 240
  timeout "$(left 150)" python3 benchmarks/profile_engine_step.py --config gemma-3-4b-it --batch 64 256 \
    --context 512 --steps 20 2>&1 | grep -v "^INFO" | tee "$OUT/profile_gemma3_steps.txt" | tail -n 24
  vlms 200
  echo "part a done at ${SECONDS}s" ;;
b)
  tests 240
  # InternVL3-2B beside transformers (one 448 x 448 tile an image), Qwen3-VL-30B-A3B ours only
  # (transformers' copy of 31B would not fit beside ours)
  timeout "$(left 150)" python3 benchmarks/vlm.py --config internvl3-2b-hf --json-out "$OUT/vlm_internvl.json" 2>&1 \
    | grep -v "^INFO" | grep -v -i warn | tail -n 6
  timeout "$(left 200)" python3 benchmarks/vlm.py --config qwen3-vl-30b-a3b --hf-requests 0 \
    --json-out "$OUT/vlm_qwen3moe.json" 2>&1 | grep -v "^INFO" | grep -v -i warn | tail -n 4
  # the encoder cache: 256 requests over 16 images, each request's text before its image (no
  # prefix-cache sharing of the image), with the cache and without
  for n in default 0; do
    extra=(); [ "$n" = 0 ] && extra=(--mm-encoder-cache-tokens 0)
    timeout "$(left 120)" python3 benchmarks/vlm.py --config qwen2.5-vl-7b --hf-requests 0 --no-text-twin \
      --distinct-images 16 --question-first ${extra[@]+"${extra[@]}"} --json-out "$OUT/vlm_enccache_$n.json" 2>&1 \
      | grep -v "^INFO" | grep -v -i warn | tail -n 2
  done
  # Gemma-3-4B text throughput: the steps' wall against GPU ms (is the host still behind?)
  timeout "$(left 150)" python3 -m flashpage bench throughput --config gemma-3-4b-it --no-hf --num-requests 512 \
    --input-len 256 512 --output-len 128 256 --json-out "$OUT/throughput_gemma3.json" > /tmp/tp_gemma3.txt 2>&1
  tp_summary "$OUT/throughput_gemma3.json" gemma-3-4b-it
  echo "part b done at ${SECONDS}s" ;;
c)
  tests 200
  timeout "$(left 150)" python3 benchmarks/vlm.py --config internvl3-2b-hf --json-out "$OUT/vlm_internvl.json" 2>&1 \
    | grep -v "^INFO" | grep -v -i warn | tail -n 6
  echo "part c done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-c)"; exit 2 ;;
esac
