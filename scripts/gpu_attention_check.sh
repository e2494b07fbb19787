#!/usr/bin/env bash
# One call on the lent GPU machine (docs/gpu_attention.md): the GPU tests of the attention
# backend, then local-window attention against cuDNN. Results go into $OUT/attention_check.tgz
# and its summary $OUT/attention_check.txt; each step has its own time limit.
#
#   bash scripts/gpu_attention_check.sh tests          # the pallas_gpu attention GPU tests (6 min;
#       4 pytest workers share the GPU: on an 80 GB H100 some XLA baselines run out of memory,
#       TEST_WORKERS=2 gives them room)
#   bash scripts/gpu_attention_check.sh window         # bench part attention_window
#   bash scripts/gpu_attention_check.sh tests,window   # both (about 9 minutes)
#   bash scripts/gpu_attention_check.sh persistent     # the persistent forward (the default)
#       beside the per-tile one (VARIANTS: BlockSizes variants, bench/gpu_side_by_side.py's
#       --attention-sizes), cuDNN and jla, forward only, at SHAPES (ATTENTION_SHAPES indices)
#   bash scripts/gpu_attention_check.sh unpadded       # ragged T (4000) without the pad copies
#       (BlockSizes.mosaic_unpadded) beside the padded call and cuDNN, fwd and fwd+bwd
set -uo pipefail
cd "$(dirname "$0")/.."
parts="${1:?name the parts: tests, window, persistent, unpadded (comma-separated)}"
source scripts/_gpu_check.sh
# jla's attention (a peer of part persistent) comes from the wheels in .whl/
gpu_check_setup attention_check "$([[ ",$parts," == *",persistent,"* ]] && echo peers)"

if [[ ",$parts," == *",tests,"* ]]; then
  step tests "${TESTS_LIMIT:-450}" python3 -m pytest tests/backends/test_pallas_gpu_attention.py \
    -m gpu -p no:benchmark -q -n "${TEST_WORKERS:-4}" ${TESTS_K:+-k "$TESTS_K"}
  tail -n 3 "$work/tests.log" >> "$summary"
  grep -E "^(FAILED|ERROR)" "$work/tests.log" | head -20 >> "$summary"
fi
if [[ ",$parts," == *",window,"* ]]; then
  step window "${WINDOW_LIMIT:-240}" python3 bench/gpu_side_by_side.py --part attention_window \
    --out "$work" --tag attention_window
fi
if [[ ",$parts," == *",persistent,"* ]]; then
  step persistent "${PERSISTENT_LIMIT:-300}" python3 bench/gpu_side_by_side.py --part attention \
    --attention-shapes "${SHAPES:-9,8,15,1,0}" --modes fwd --out "$work" --tag attention_persistent \
    --attention-sizes "${VARIANTS:-forward_kernel=mosaic_gpu,mosaic_forward=64x128x2}"
fi
if [[ ",$parts," == *",unpadded,"* ]]; then
  step unpadded "${UNPADDED_LIMIT:-240}" python3 bench/gpu_side_by_side.py --part attention \
    --attention-shapes "${SHAPES:-14,1}" --out "$work" --tag attention_unpadded \
    --attention-sizes "forward_kernel=mosaic_gpu,backward_kernel=mosaic_gpu,mosaic_unpadded=true"
fi
for table in "$work"/*.md; do
  [ -e "$table" ] && { echo "== $(basename "$table")"; sed -n '/^```$/,/^```$/p' "$table"; } \
    >> "$summary"
done
gpu_check_finish attention_check
