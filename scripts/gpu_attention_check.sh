#!/usr/bin/env bash
# One call on the lent GPU machine (docs/gpu_attention.md): the GPU tests of the attention
# backend, then local-window attention against cuDNN. Results go into $OUT/attention_check.tgz
# and its summary $OUT/attention_check.txt; each step has its own time limit.
#
#   bash scripts/gpu_attention_check.sh tests          # the pallas_gpu attention GPU tests
#   bash scripts/gpu_attention_check.sh window         # bench part attention_window
#   bash scripts/gpu_attention_check.sh tests,window   # both (about 8 minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
parts="${1:?name the parts: tests, window (comma-separated)}"
out="${OUT:?set OUT (the device tool does)}"
work="$(mktemp -d)"
export PYTHONPATH="$PWD" JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false
summary="$work/attention_check.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$summary"

step() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$work/$name.log" 2>&1
  echo "$name: rc=$? ($((SECONDS - start)) s)" >> "$summary"
}

if [[ ",$parts," == *",tests,"* ]]; then
  step tests "${TESTS_LIMIT:-330}" python3 -m pytest tests/backends/test_pallas_gpu_attention.py \
    -m gpu -p no:benchmark -q -n 4 ${TESTS_K:+-k "$TESTS_K"}
  tail -n 3 "$work/tests.log" >> "$summary"
  grep -E "^(FAILED|ERROR)" "$work/tests.log" | head -20 >> "$summary"
fi
if [[ ",$parts," == *",window,"* ]]; then
  step window "${WINDOW_LIMIT:-240}" python3 bench/gpu_side_by_side.py --part attention_window \
    --out "$work" --tag attention_window
fi
for table in "$work"/*.md; do
  [ -e "$table" ] && { echo "== $(basename "$table")"; sed -n '/^```$/,/^```$/p' "$table"; } \
    >> "$summary"
done
tar czf "$out/attention_check.tgz" -C "$work" .
cp "$summary" "$out/attention_check.txt"
cat "$summary"
