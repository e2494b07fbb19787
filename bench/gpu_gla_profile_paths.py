"""One GLA forward+backward of ours ("auto", fla's gate draw), run twice (compile, then the
profiled run), for Nsight Compute's per-kernel summary. GPU only:

    ncu --metrics gpu__time_duration.sum --print-summary per-kernel \
        python3 bench/gpu_gla_profile_paths.py k256|per_head|per_key
"""
from __future__ import annotations

import sys

import jax

from bench.gpu_gla_pair_levels import timing_inputs
from bench.gpu_side_by_side import fwd_bwd, ours_gla

# k256: (8, 2048, 4, 256, 512) per-key; per_head and per_key: (4, 4096, 16, 128, 128)
PROBLEMS = {"k256": ((8, 2048, 4, 256, 512), False),
            "per_head": ((4, 4096, 16, 128, 128), True),
            "per_key": ((4, 4096, 16, 128, 128), False)}


def main(which: str):
    shape, per_head = PROBLEMS[which]
    args, ct = timing_inputs(0, shape, "fla", per_head=per_head)
    f = jax.jit(fwd_bwd(ours_gla("chunk"), ct))
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    print("done", which, shape)


if __name__ == "__main__":
    main(sys.argv[1])
