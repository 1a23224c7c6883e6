#!/usr/bin/env bash
# Session 11's last two device calls (results under $OUT; each step cut to what is left of the
# part's budget, BUDGET seconds, default 470):
#   bash benchmarks/gpu_s11_final.sh a   on a FRESH machine: 8B fp8 in a first process (block tables
#                                        padded to 16 columns: no compile in the timed run, decode steps
#                                        as run 80?), the MLA Gluon tests and benchmark (the merge kernel
#                                        past 4 splits), 8B bf16 with the Gluon bf16 decode off / on,
#                                        V2-Lite with the Gluon MLA decode off / on
#   bash benchmarks/gpu_s11_final.sh b   the engine's GPU tests (Gluon prefill now the default), the
#                                        gather producer's remaining tests, the prefill table with its columns
set -u
PART=${1:-a}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/flashpage_gpu}; mkdir -p "$OUT"
B=${BUDGET:-470}
left() { local t=$((B - SECONDS)); [ "$1" -lt "$t" ] && t=$1; [ "$t" -lt 1 ] && t=1; echo $t; }
FP="python3 -m flashpage"
PT="python3 -m pytest -q -p no:cacheprovider"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
case "$PART" in
a)
  timeout "$(left 100)" $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --kv-cache-dtype fp8 \
    --no-hf --json-out "$OUT/throughput_8b_fp8_first.json" 2>&1 | grep -E "output_tok_per_s|Error"
  echo "fp8 done at ${SECONDS}s"
  timeout "$(left 170)" $PT -x -m gpu tests/kernels/test_mla_decode_gluon.py tests/engine/test_mla_gluon_switch.py -rf \
    2>&1 | tee "$OUT/mla_tests.txt" | tail -n 4
  echo "MLA tests done at ${SECONDS}s"
  timeout "$(left 60)" python3 benchmarks/mla_decode_gluon.py --out "$OUT" 2>&1 | tee "$OUT/mla_gluon_bench.txt" | tail -n 9
  for g in 0 1; do
    FLASHPAGE_DECODE_GLUON_BF16=$g timeout "$(left 80)" $FP bench throughput --config llama-3-8b \
      --gpu-memory-utilization 0.75 --no-hf --json-out "$OUT/throughput_8b_decode_gluon_bf16_$g.json" 2>&1 \
      | grep -E "output_tok_per_s|Error"
  done
  for g in 0 1; do
    FLASHPAGE_MLA_GLUON=$g timeout "$(left 80)" $FP bench throughput --config deepseek-v2-lite \
      --gpu-memory-utilization 0.75 --num-requests 64 --no-hf --json-out "$OUT/throughput_v2lite_mla_gluon$g.json" \
      2>&1 | grep -E "output_tok_per_s|Error"
  done
  echo "part a done at ${SECONDS}s" ;;
b)
  timeout "$(left 170)" $PT -m gpu tests/engine tests/models -rf 2>&1 | tee "$OUT/engine_gpu_tests.txt" | tail -n 6
  echo "engine tests done at ${SECONDS}s"
  timeout "$(left 100)" $PT -x -s -m gpu tests/kernels/test_paged_prefill_gather.py -k "agrees or past_int32" -rf 2>&1 \
    | tee "$OUT/gather_rest_tests.txt" | tail -n 4
  echo "gather tests done at ${SECONDS}s"
  timeout "$(left 175)" python3 benchmarks/prefill_gluon.py --out "$OUT" --variants gluon --causal-only \
    --paged-variants gluon_paged,gluon_paged_b128,gluon_paged_gather,gluon_paged_gather_stages3,gluon_paged_gather_b128 \
    --budget 150 2>&1 | tee "$OUT/prefill_gluon.txt" | tail -n 9
  echo "part b done at ${SECONDS}s" ;;
*) echo "unknown part $PART (a, b)"; exit 2 ;;
esac
