#!/usr/bin/env bash
# One call on the lent GPU machine: the GPU tests of the "pallas_gpu" delta rule, then
# bench/gpu_delta_rule.py (ours, XLA, jax-linear-attention, fla in one process) at the SHAPES
# indices given. Everything goes into ONE archive, $OUT/delta_rule_check.tgz, plus its summary
# $OUT/delta_rule_check.txt. Each step has its own time limit.
#
#   bash scripts/gpu_delta_rule_check.sh tests            # about 2 minutes
#   SHAPES=4,6 GATES=peer BETAS=sigmoid bash scripts/gpu_delta_rule_check.sh bench
#   SHAPES=4,6,7 bash scripts/gpu_delta_rule_check.sh profile   # device time per kernel
#       (bench/kernel_times.py: ours' forward and forward+backward, about a minute a shape)
#
# Expects the peers' wheels in .whl/ (pip download --no-deps fla-core flash-linear-attention
# jax-linear-attention) and $OUT from the device tool; fla's autotuning is cached in _tc/.
set -uo pipefail
cd "$(dirname "$0")/.."
parts="${1:?name the parts: tests, bench, profile (comma-separated)}"
source scripts/_gpu_check.sh
gpu_check_setup delta_rule_check peers

if [[ ",$parts," == *",tests,"* ]]; then
  step tests "${TESTS_LIMIT:-240}" python3 -m pytest tests/backends/test_pallas_gpu_delta_rule.py \
    -m gpu -p no:benchmark -q -n 4
  tail -n 15 "$work/tests.log" >> "$summary"
fi
if [[ ",$parts," == *",bench,"* ]]; then
  step bench "${BENCH_LIMIT:-330}" python3 bench/gpu_delta_rule.py --out "$work" \
    --shapes "${SHAPES:-4,5,6,7}" --gates "${GATES:-peer}" --betas "${BETAS:-sigmoid}" \
    --tag "${TAG:-delta_rule}" ${BENCH_FLAGS:-}
  grep -v "^\s*$" "$work/bench.log" | tail -n 40 >> "$summary"
fi
if [[ ",$parts," == *",profile,"* ]]; then
  step profile "${PROFILE_LIMIT:-240}" python3 bench/kernel_times.py --out "$work" \
    --shapes "${SHAPES:-4,6,7}"
  grep -v "^\s*$" "$work/profile.log" | tail -n 60 >> "$summary"
fi
gpu_check_finish delta_rule_check
