#!/usr/bin/env bash
# Session 37's device plan:
#   BUDGET=420 bash benchmarks/gpu_s37.sh a   the GPU tests of CTESTS (the 16-bit Gluon decode with
#                                             FIRST_TOGETHER; SmolVLM2 video), then the engine form with and
#                                             without FIRST_TOGETHER against SDPA cuDNN in turn, ROUNDS rounds
#   BUDGET=420 bash benchmarks/gpu_s37.sh b   issue 6's table (attention_decode.py) twice
#   BUDGET=420 bash benchmarks/gpu_s37.sh c   the GPU tests of CTESTS alone (Qwen2-Audio, GLM-4.1V / 4.5V, and
#                                             the Qwen-VL families whose encoder code GLM-4.1V now shares)
#   BUDGET=480 bash benchmarks/gpu_s37.sh d   benchmarks/vlm.py on the families it drives since this session
#                                             (GLM-4.1V, Qwen2-Audio, SmolVLM2), each beside transformers
# Results under $OUT (summaries only); logs in /tmp.
PART=${1:-a}
SESSION=37
source "$(dirname "$0")/gpu_lib.sh"
knobs() {
  mkdir -p "$OUT/knobs"; timeout "$(left "$1")" python3 benchmarks/decode_gluon_knobs.py --set bf16 --rounds ${ROUNDS:-9} \
    --variants "P2 s2 bal" "P2 s2 bal first" --out "$OUT/knobs" 2>&1 | tee "$OUT/knobs.txt" | tail -n 12
}
case "$PART" in
a)
  tests 300
  knobs 100
  echo "part a done at ${SECONDS}s" ;;
b)
  for i in 1 2; do
    timeout "$(left 200)" python3 benchmarks/attention_decode.py --out "$OUT/decode$i" 2>&1 | tee "$OUT/decode$i.txt" | tail -n 16
  done
  knobs 100
  echo "part b done at ${SECONDS}s" ;;
c)
  tests 400
  echo "part c done at ${SECONDS}s" ;;
d)
  VLMCONFIG=${VLMCONFIG:-"glm-4.1v-9b-thinking qwen2-audio-7b-instruct smolvlm2-500m-video-instruct"} vlms 150
  echo "part d done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-d)"; exit 2 ;;
esac
