#!/usr/bin/env bash
# The KV path check (benchmarks/kv_path_check.py) on a GPU machine, in one command, under a hard
# timeout: the machine gives 15 minutes in all, one command at most 10. The script's own budget
# (--budget-s, 420 s by default) skips sizes it could not start in time; this timeout is the
# backstop. Writes kv_path_check.json and kv_path_check.log under $OUT when it is set, else
# under benchmarks/results/ (git-ignored). Extra arguments go to the script.
#
#   benchmarks/gpu_check.sh                 # CUDA if torch sees it, else CPU
#   KV_CHECK_TIMEOUT_S=300 benchmarks/gpu_check.sh --blocks 1,16
#
# Needs only python3 with torch and msgpack (no install of pdproxy, no vLLM, no network).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out="${OUT:-benchmarks/results}"
mkdir -p "$out" || exit 2
limit="${KV_CHECK_TIMEOUT_S:-540}"
python="${PYTHON:-python3}"

command -v nvidia-smi >/dev/null && nvidia-smi -L
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout --kill-after=15 "$limit" \
    "$python" benchmarks/kv_path_check.py --json "$out/kv_path_check.json" "$@" \
    2>&1 | tee "$out/kv_path_check.log"
status=${PIPESTATUS[0]}
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    echo "kv_path_check: stopped after ${limit}s (timeout)" | tee -a "$out/kv_path_check.log"
fi
exit "$status"
