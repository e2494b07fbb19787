#!/usr/bin/env bash
# One call on a lent GPU machine (docs/layers.md, "The MQAR study"): the Zoology MQAR study, one
# shard per GPU, each starting configurations until LIMIT seconds have passed; with `fla` also
# the in-process comparison of fla's models and ours (scripts/gpu_fla_compare.py) on the last GPU.
# Carry .whl (fla-core, flash-linear-attention, optax, absl-py wheels). Results: every shard's
# JSON and log, the merged table and plot in $OUT/mqar_run.tgz (the device tool returns only a few
# files a call), the table also as $OUT/mqar_study.md.
#
#   bash scripts/gpu_mqar_study.sh [fla] [-- extra bench.mqar_study arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:?set OUT (the device tool does)}"
limit="${LIMIT:-400}"
with_fla=0
if [[ "${1:-}" == "fla" ]]; then with_fla=1; shift; fi
[[ "${1:-}" == "--" ]] && shift
export PYTHONPATH="$PWD" JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install --no-deps -q .whl/*.whl > "$out/pip.log" 2>&1
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpus.txt"
mkdir -p "$out/mqar"
pids=()
for ((i = 0; i < gpus; i++)); do
  CUDA_VISIBLE_DEVICES=$i timeout "${HARD_LIMIT:-560}" python3 -m bench.mqar_study --out "$out/mqar" --shard "$i/$gpus" \
    --time-limit "$limit" "$@" > "$out/mqar/shard$i.log" 2>&1 &
  pids+=($!)
done
if ((with_fla)); then
  CUDA_VISIBLE_DEVICES=$((gpus - 1)) TRITON_CACHE_DIR="$PWD/_triton_cache" timeout "${FLA_LIMIT:-500}" python3 scripts/gpu_fla_compare.py \
    "$out/fla_compare" > "$out/fla_compare.log" 2>&1
  echo "fla compare: rc=$?" >> "$out/gpus.txt"
fi
for pid in "${pids[@]}"; do wait "$pid"; done
python3 -m bench.mqar_study --merge "$out/mqar" > "$out/mqar/merge.log" 2>&1
grep -h "Error\|error" "$out"/mqar/shard*.log | head -20
cp "$out/mqar/mqar_study.md" "$out/" 2>/dev/null
tar czf "$out/mqar_run.tgz" -C "$out" --remove-files mqar $(cd "$out" && ls fla_compare.log 2>/dev/null)
tail -n 60 "$out/mqar_study.md"
