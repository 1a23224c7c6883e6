#!/usr/bin/env bash
# The int4 (AWQ / GPTQ) work's device plan (written on a CPU-only machine: nothing of it has
# run on a GPU yet). Each step runs under `timeout "$(left N)"` (gpu_lib.sh).
#   BUDGET=240 bash benchmarks/gpu_int4.sh [all|tests|bench]   (tests: 1 and 3; bench: 2)
# 1. tests/kernels/test_int4_gemm.py on CUDA (bf16 where the CPU runs fp16; 8B shapes at
#    1-300 rows against the torch reference; the dequantizing kernel to the bit)
# 2. benchmarks/int4_gemm.py: ours against torch's dequantize + matmul and the bf16 GEMM, 8B
#    shapes; the summary prints, per shape and rows, ours / bf16 time and ours' weight GB/s
# 3. tests/models/test_int4_checkpoints.py on CUDA: the bf16 engine with graphs over AWQ and
#    GPTQ checkpoints against the bf16 engine over their dequantized twins (-m gpu), and the
#    CPU tests (the loaded layout through our kernel on CUDA)
# Results under $OUT.
WHAT=${1:-all}
source "$(dirname "$0")/gpu_lib.sh"
if [ "$WHAT" != bench ]; then
timeout "$(left 60)" $PT tests/kernels/test_int4_gemm.py -rfs 2>&1 | tee "$OUT/int4_kernel_tests.txt" | tail -n 3
timeout "$(left 120)" $PT tests/models/test_int4_checkpoints.py -rfs 2>&1 | tee "$OUT/int4_engine_tests.txt" | tail -n 3
fi
[ "$WHAT" = tests ] && exit 0
timeout "$(left 110)" python3 benchmarks/int4_gemm.py --rows ${INT4_ROWS:-1,4,16,64,256,1024} \
  --json-out "$OUT/int4_gemm.json" > "$OUT/int4_gemm.txt" 2>&1
grep "max |ours" "$OUT/int4_gemm.txt"
python3 - "$OUT/int4_gemm.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
t = {(r["shape"], r["rows"], r["kernel"]): r for r in rows}
for (shape, m, kernel), r in t.items():
    if kernel != "ours":
        continue
    bf16, deq = t[shape, m, "bf16"], t.get((shape, m, "deq+cublas"))
    best = min((v for (s, mm, _), v in t.items() if s == shape and mm == m and v["kernel"].startswith("ours")),
               key=lambda v: v["us"])
    print(f"{shape:8s} m={m:<5d} ours {r['us']:7.1f} us ({r['weight_gbps']:5.0f} GB/s) best {best['kernel']:26s}"
          f" {best['us']:7.1f}  layer {t[shape, m, 'layer']['us']:7.1f}  deq+cublas {deq['us']:7.1f}"
          f"  bf16 {bf16['us']:7.1f} us  bf16/ours {bf16['us'] / r['us']:.2f}x")
PY
