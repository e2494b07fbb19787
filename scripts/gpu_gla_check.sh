#!/usr/bin/env bash
# One call on the lent GPU machine (docs/gpu_gla.md, "Commands"): the GPU tests of the GLA
# files, then each pair-level kernel alone and ours forward and forward+backward at the four
# GLA_SHAPES of bench/gpu_side_by_side.py, then the side by side with jax-linear-attention and
# fla. Everything goes into ONE archive, $OUT/gla_check.tgz (the device tool returns at most 8
# files), plus its summary, $OUT/gla_check.txt. Each step has its own time limit, so a slow one
# cannot eat the rest.
#
#   bash scripts/gpu_gla_check.sh tests      # about 5 minutes
#   bash scripts/gpu_gla_check.sh kernels    # 4 shapes, up to 130 s each
#   bash scripts/gpu_gla_check.sh side_k256  # K = 256 against fla's forward and backward
#   bash scripts/gpu_gla_check.sh side_jla   # the three shapes jla runs, fla's forward beside
#   bash scripts/gpu_gla_check.sh side       # both, 290 s each (with fla's autotuning cached)
#   bash scripts/gpu_gla_check.sh options    # the other mosaic_group_sums / _block_v / _state_parts
#                                            # / _output_parts
#                                            # (options_k256, options_k128: its two halves)
#
# One part per call: a command may run 10 minutes. Without a cache fla's autotuning alone took
# the 300 s the K = 256 half once had (2026-11-27), so each half gets a call of its own.
# Expects the peers' wheels in .whl/ (pip download --no-deps fla-core jax-linear-attention) and
# $OUT from the device tool. fla's autotune results are cached in _tc/ and come back in the
# archive's tc/ (its backward at K = 256 tunes for longer than a call: bring them back in _tc/).
set -uo pipefail
cd "$(dirname "$0")/.."
parts="${1:?name the parts: tests, kernels, options, side_k256, side_jla or side (comma-separated)}"
source scripts/_gpu_check.sh
gpu_check_setup gla_check peers

if [[ ",$parts," == *",tests,"* ]]; then
  step tests 540 python3 -m pytest tests/backends/test_pallas_gpu_gla.py \
    tests/backends/test_pallas_gpu_gla_pair_levels.py -m gpu -p no:benchmark -q -n 4
  tail -n 3 "$work/tests.log" >> "$summary"
fi
if [[ ",$parts," == *",kernels,"* ]]; then
  for index in 0 1 2 3; do
    step "kernels_$index" 130 python3 bench/gpu_side_by_side.py --part breakdown_pair_levels \
      --part gla --ours-only --gla-shapes "$index" --gates fla --out "$work" \
      --tag "kernels_$index"
  done
fi
# the BlockSizes options that are not the default, each checked against and timed beside ours as
# shipped; "default" again last, to see the drift. OPTION_PARTS, SIZES_K256, SIZES_K128 override
# what runs (bench/gpu_side_by_side.py's --part values, comma-separated, and --gla-sizes)
option_list="${OPTION_PARTS:-gla}"
option_parts=()
for part in ${option_list//,/ }; do option_parts+=(--part "$part"); done
sizes_k256="${SIZES_K256:-mosaic_group_sums=float32;mosaic_state_parts=2;mosaic_output_parts=2;default}"
sizes_k128="${SIZES_K128:-mosaic_block_v=32;mosaic_state_parts=2;mosaic_output_parts=2}"
if [[ ",$parts," == *",options,"* || ",$parts," == *",options_k256,"* ]]; then
  step options_k256 330 python3 bench/gpu_side_by_side.py "${option_parts[@]}" --ours-only \
    --gla-shapes 1 --gates fla --out "$work" --tag options_k256 --gla-sizes "$sizes_k256"
fi
if [[ ",$parts," == *",options,"* || ",$parts," == *",options_k128,"* ]]; then
  for index in 0 3; do
    step "options_$index" 130 python3 bench/gpu_side_by_side.py "${option_parts[@]}" \
      --ours-only --gla-shapes "$index" --gates fla --out "$work" --tag "options_$index" \
      --gla-sizes "$sizes_k128"
  done
fi
# "side" runs both halves in one call, which fits only once fla's autotuning is cached (_tc/);
# without it each half takes its own call
side_limit=$([[ ",$parts," == *",side,"* ]] && echo 290 || echo 570)
if [[ ",$parts," == *",side,"* || ",$parts," == *",side_k256,"* ]]; then
  step side_k256 "$side_limit" python3 bench/gpu_side_by_side.py --part gla --gla-shapes 1 \
    --gates fla,fla/16 --no-fla-recurrent --out "$work" --tag side_k256
fi
if [[ ",$parts," == *",side,"* || ",$parts," == *",side_jla,"* ]]; then
  step side_jla "$side_limit" python3 bench/gpu_side_by_side.py --part gla --gla-shapes 0,2,3 \
    --gates fla,fla/16 --no-fla-recurrent --fla-modes fwd --out "$work" --tag side_jla
fi
for table in "$work"/*.md; do
  [ -e "$table" ] && { echo "== $(basename "$table")"; sed -n '/^```$/,/^```$/p' "$table"; } \
    >> "$summary"
done
# fla's autotune results (tc/ mirrors _tc/), for the next call: copy tc/ to _tc/, carry _tc
mkdir -p "$work/tc" && (cd _tc && find . -name '*.autotune.json' -exec cp --parents {} "$work/tc/" \;) 2>/dev/null
gpu_check_finish gla_check
