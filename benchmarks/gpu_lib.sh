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
