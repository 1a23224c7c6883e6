#!/usr/bin/env bash
# Session 36's device plan:
#   BUDGET=400 bash benchmarks/gpu_s36.sh a   the GPU tests of CTESTS (the VLM GPU tests after their
#                                             agreement loop became conftest's assert_top_one_agreement)
#   BUDGET=560 bash benchmarks/gpu_s36.sh b   the GPU tests of CTESTS (merged SmolVLM / Idefics3, InternVL
#                                             video, Gemma 3 pan-and-scan), then benchmarks/vlm.py on each
#                                             of VLMCONFIG beside transformers
#   BUDGET=420 bash benchmarks/gpu_s36.sh c   issue 6's table again (attention_decode.py: ours, SDPA cuDNN /
#                                             flash on contiguous K/V, gather + SDPA, copy), then the engine
#                                             form against cuDNN in turn, medians of 3 rounds
# Results under $OUT (summaries only); logs in /tmp.
PART=${1:-a}
SESSION=36
source "$(dirname "$0")/gpu_lib.sh"
case "$PART" in
a)
  tests 380
  echo "part a done at ${SECONDS}s" ;;
b)
  # PyAV (the video-file tests) is not in the GPU image: its wheel, carried in .whl/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/av-*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
  tests 300
  vlms 240
  echo "part b done at ${SECONDS}s" ;;
c)
  timeout "$(left 200)" python3 benchmarks/attention_decode.py --out "$OUT/decode" 2>&1 | tee "$OUT/decode.txt" | tail -n 16
  mkdir -p "$OUT/knobs"; timeout "$(left 200)" python3 benchmarks/decode_gluon_knobs.py --set bf16 --rounds ${ROUNDS:-3} --variants "P2 s2 bal" \
    --out "$OUT/knobs" 2>&1 | tee "$OUT/knobs.txt" | tail -n 12
  echo "part c done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a-c)"; exit 2 ;;
esac
