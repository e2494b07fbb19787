#!/usr/bin/env bash
# One device call (docs/gpu_attention.md, "One-kernel backward"): a smoke test, the one-kernel
# backward GPU tests, then fwd+bwd of ours (two-kernel default and fused_backward=true) and cuDNN.
# Results in $OUT/fused.tgz and $OUT/fused.txt. Run from the repository root.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/_gpu_check.sh
gpu_check_setup fused
export PYTHONUNBUFFERED=1
step smoke "${SMOKE_LIMIT:-150}" python3 -m pytest -m gpu -p no:benchmark -q -x \
  "tests/backends/test_pallas_gpu_attention.py::test_gpu_fused_backward_parity[bfloat16-AttentionCase(batch=1, q_len=4096, kv_len=4096, num_heads=8, num_kv_heads=8, head_dim=64, causal=True, segments='none')]"
tail -n 2 "$work/smoke.log" >> "$summary"
if grep -q " passed" "$work/smoke.log"; then
  step tests "${TESTS_LIMIT:-240}" python3 -m pytest tests/backends/test_pallas_gpu_attention.py -m gpu -p no:benchmark -q -n 4 -k "${TESTS_K:-fused_backward_parity}"
  tail -n 3 "$work/tests.log" >> "$summary"; grep -E "^(FAILED|ERROR)" "$work/tests.log" | head -30 >> "$summary"
  step bench "${BENCH_LIMIT:-300}" python3 bench/gpu_side_by_side.py --part attention --attention-shapes "${SHAPES:-0,1,2,12,6,3}" \
    --modes fwd+bwd --peers cudnn --attention-sizes "${VARIANTS:-fused_backward=true}" --out "$work" --tag one_kernel
  grep -E "softmax" "$work/bench.log" >> "$summary"
fi
gpu_check_finish fused
