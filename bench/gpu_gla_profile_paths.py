"""One GLA forward+backward of ours ("auto", fla's gate draw), run twice (compile, then the
profiled run), for Nsight Compute's per-kernel summary. GPU only:

    ncu --metrics gpu__time_duration.sum --print-summary per-kernel \
        python3 bench/gpu_gla_profile_paths.py k256|per_head|per_key
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.gpu_side_by_side import fwd_bwd, gla_inputs, ours_gla

# k256: (8, 2048, 4, 256, 512) per-key; per_head and per_key: (4, 4096, 16, 128, 128)
PROBLEMS = {"k256": ((8, 2048, 4, 256, 512), False),
            "per_head": ((4, 4096, 16, 128, 128), True),
            "per_key": ((4, 4096, 16, 128, 128), False)}


def main(which: str):
    (b, t, h, kd, vd), per_head = PROBLEMS[which]
    rng = np.random.default_rng(0)
    q, k, v, g, _ = gla_inputs(rng, b, t, h, kd, vd, gate="fla", per_head=per_head)
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)] + [jnp.asarray(g)]
    ct = jnp.asarray(rng.standard_normal((b, t, h, vd), np.float32))
    f = jax.jit(fwd_bwd(ours_gla("chunk"), ct))
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    print("done", which, (b, t, h, kd, vd))


if __name__ == "__main__":
    main(sys.argv[1])
