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
