#!/usr/bin/env bash
# Next session: where the remaining gaps of issues 4, 5 and 6 go, by Nsight Compute (--set full, PC
# sampling per SASS instruction), one device call of ~250 s:
#   bash benchmarks/gpu_s12_ncu.sh
# issue 5: the Gluon prefill contiguous vs paged block 16 (gather producer, TMA boxes), 1 x 16384 causal;
# issue 6: the Gluon bf16 decode vs SDPA cuDNN at 32 x 4096 (GQA 32/8);
# issue 4: the Gluon MLA decode at 8 x 32768 and 32 x 4096 (and the Triton one at 8 x 32768).
# NCU_CASES="a b ..." runs those ncu_cases.py cases instead. Results: $OUT/ncu.tgz (details, raw metrics, per-instruction stalls: python3 benchmarks/ncu_stalls.py X.sass.csv)
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flashpage_gpu}; mkdir -p "$OUT/ncu"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -n 1)
for c in ${NCU_CASES:-prefill_gluon_1x16k prefill_gluon_paged16_gather prefill_gluon_paged16_tma decode_bf16 \
         decode_bf16_cudnn mla_gluon_8x32k mla_gluon_32x4k mla_bf16_8x32k}; do
  case $c in prefill_gluon*) k=_flash_prefill_gluon ;; decode_bf16_cudnn) k="(cudnn|sdpa|fmha|flash)" ;;
    decode*) k=_paged_decode ;; mla_gluon*) k=_mla_decode_gluon ;; mla_wgmma*) k=_mla_decode_wgmma ;;
    mla*) k=_mla_decode_kernel ;; esac
  timeout 60 "$NCU" --clock-control none --set full --import-source yes -k "regex:$k" --launch-skip 2 \
    --launch-count 1 -f -o "$OUT/ncu/$c" python3 benchmarks/ncu_cases.py $c > "$OUT/ncu/$c.log" 2>&1
  "$NCU" --import "$OUT/ncu/$c.ncu-rep" --page details > "$OUT/ncu/$c.details.txt" 2>&1
  "$NCU" --import "$OUT/ncu/$c.ncu-rep" --page raw --csv > "$OUT/ncu/$c.raw.csv" 2>&1
  "$NCU" --import "$OUT/ncu/$c.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu/$c.sass.csv" 2>&1
  rm -f "$OUT/ncu/$c.ncu-rep"
  echo "$c: $(grep -E '^ +Duration' "$OUT/ncu/$c.details.txt" | head -n 1)"
  python3 benchmarks/ncu_stalls.py "$OUT/ncu/$c.sass.csv" 0 2>/dev/null | head -n 8
done
tar czf "$OUT/ncu.tgz" -C "$OUT" ncu && rm -rf "$OUT/ncu"
