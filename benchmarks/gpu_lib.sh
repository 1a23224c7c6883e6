# Sourced by a session's device plan (benchmarks/gpu_sNN.sh): the environment, $OUT, the
# budget helper and the GPU's name. Each step of a plan runs under `timeout "$(left N)"`:
# N seconds, or what is left of BUDGET (default 400) if less.
set -u
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/flashpage_gpu}; mkdir -p "$OUT"
B=${BUDGET:-400}
left() { local t=$((B - SECONDS)); [ "$1" -lt "$t" ] && t=$1; [ "$t" -lt 1 ] && t=1; echo $t; }
PT="python3 -m pytest -q -p no:cacheprovider"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

# The server's wheels the GPU image lacks (fastapi, pydantic, uvicorn, ...: .whl, carried) into
# /tmp/site, then `bench serve` on the 8B at run 129's loads (16 req/s 512/128, 2 req/s 256/64)
# with the prompt graphs on (1) and off (0); each run's figures printed, its files under $OUT.
serve_graph_loads() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site || return 1
  local g load
  for g in 1 0; do
    for load in "16 300 512 128" "2 60 256 64"; do
      set -- $load
      FLASHPAGE_PREFILL_GRAPHS=$g FLASHPAGE_PIECEWISE_GRAPHS=$g timeout "$(left 150)" python3 -m flashpage \
        bench serve --config llama-3-8b --request-rate $1 --num-prompts $2 --input-len $3 --output-len $4 \
        --json-out "$OUT/serve_graphs${g}_rate$1.json" > "$OUT/serve_graphs${g}_rate$1.txt" 2>&1
      python3 - "$OUT/serve_graphs${g}_rate$1.json" "$g" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
keys = [k for k in r if any(w in k for w in ("ttft", "itl", "throughput", "failed", "completed"))]
print("graphs", sys.argv[2], {k: r[k] for k in keys})
PY
    done
  done
}

# bench latency / throughput on the 8B shape (random weights), one summary line per run; used by
# gpu_fp8.sh and gpu_s17b.sh
FP="python3 -m flashpage"
# one line per run: the figures that answer "what did fp8 buy"
summary() {
  python3 - "$@" <<'PY'
import json, sys
for path in sys.argv[1:]:
    try:
        r = json.load(open(path))
    except (OSError, ValueError) as e:
        print(path, "missing:", e); continue
    f = r["flashpage"]
    keys = ("decode_tok_per_s", "ttft_s", "output_tok_per_s", "total_tok_per_s", "seconds")
    extra = {k: r[k] for k in ("weight_read_limit_tok_per_s", "fraction_of_limit") if k in r}
    if "roofline" in r:
        extra["weight_bytes"] = r["roofline"].get("weight_bytes")
    print(path.rsplit("/", 1)[-1], {k: round(f[k], 4) for k in keys if k in f}, extra,
          "decode_gemm:", r.get("decode_gemm"))
PY
}
latency() {  # name, then extra flags
  local name=$1; shift
  timeout "$(left 120)" $FP bench latency --config llama-3-8b --gpu-memory-utilization 0.6 --max-num-seqs 64 \
    --no-hf --json-out "$OUT/latency_$name.json" "$@" > "$OUT/latency_$name.txt" 2>&1
  summary "$OUT/latency_$name.json"
}
throughput() {
  local name=$1; shift
  timeout "$(left 190)" $FP bench throughput --config llama-3-8b --gpu-memory-utilization 0.75 --no-hf \
    --json-out "$OUT/throughput_$name.json" "$@" > "$OUT/throughput_$name.txt" 2>&1
  summary "$OUT/throughput_$name.json"
}

# one line per `bench throughput` JSON: a tag, its totals and its step kinds' counts / ms
tp_summary() {
  python3 - "$@" <<'PY'
import json, sys
path, tag = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
r = json.load(open(path))["flashpage"]
print(tag, {k: r[k] for k in ("seconds", "output_tok_per_s", "total_tok_per_s", "kv_blocks") if k in r},
      {k: (v["steps"], v["ms_per_step"]) for k, v in r["steps"].items()})
PY
}

# The 8B's decode at batch 128 in bf16 and int4 (random weights), each step given up to $1
# seconds: a summary line each, both JSONs in $OUT/latency_bs128.json
latency_bs128_bf16_int4() {
  local q extra
  for q in bf16 int4; do
    extra=(); [ "$q" = int4 ] && extra=(--quantization int4)
    timeout "$(left "$1")" $FP bench latency --config llama-3-8b --gpu-memory-utilization 0.6 --max-num-seqs 128 \
      --batch-size 128 --no-hf --json-out /tmp/latency_bs128_$q.json ${extra[@]+"${extra[@]}"} > /tmp/latency_bs128_$q.txt 2>&1
    summary /tmp/latency_bs128_$q.json
  done
  python3 -c "import json,sys; json.dump({f: json.load(open(f)) for f in sys.argv[1:]}, open('$OUT/latency_bs128.json','w'))" \
    /tmp/latency_bs128_bf16.json /tmp/latency_bs128_int4.json
}

# DeepSeek-V2-Lite's prompt (128 tokens) and mixed (16 decodes + a 16-token prompt) steps as
# run 160 timed them (profile_ttft.py: the request's ms beside its kernels'), then
# ttft_graphs.py's prompt / decode / mixed steps; used by gpu_s19.sh and gpu_mla_host.sh
v2lite_step_profiles() {
  local mode extra
  for mode in prompt mixed; do
    mkdir -p "$OUT/$mode"
    extra=$([ $mode = mixed ] && echo "--decodes 16 --input-len 16" || echo "--input-len 128")
    timeout "$(left 90)" python3 benchmarks/profile_ttft.py --config deepseek-v2-lite --iters 10 \
      $extra --out "$OUT/$mode" > "$OUT/profile_v2lite_$mode.log" 2>&1
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r['request_ms_median'], 'ms for', r['gpu_kernel_ms'], 'ms of kernels')" \
      "$OUT/$mode/profile_ttft.json" $mode
  done
  timeout "$(left 150)" python3 benchmarks/ttft_graphs.py --config deepseek-v2-lite --input-lens 16 128 \
    --batches 1 4 --decodes 16 64 --mixed-lens 16 128 --out "$OUT" 2>&1 | tail -n 14
}

# A session plan's GPU tests and VLM runs (gpu_s35.sh, gpu_s36.sh): the pytest files of CTESTS
# with -m gpu, their log as $OUT/gpu_session${SESSION}_tests_$PART.txt, the summary lines
# printed; then benchmarks/vlm.py on each config of VLMCONFIG beside transformers.
tests() {
  timeout "$(left "$1")" $PT -rfE -s -m gpu ${CTESTS:?CTESTS: the test files} 2>&1 \
    | tee "$OUT/gpu_session${SESSION:?}_tests_${PART:?}.txt" | grep -E "agreement|passed|failed|Error|assert" \
    | tail -n 24
}
vlms() {
  for c in ${VLMCONFIG:-}; do
    timeout "$(left "$1")" python3 benchmarks/vlm.py --config "$c" --json-out "$OUT/vlm_$c.json" 2>&1 \
      | grep -v "^INFO" | grep -v -i warn | tail -n 8
  done
}
