"""Where context-parallel GLA's time goes on one GPU (forward+backward, B1 H16 K=V=128, bf16,
gates logsigmoid(N(0, 1)) per key): the op alone, the op from a given initial state (its gradient
too), the block-state product of context_parallel.zero_state_of_block alone with its gradient
(what the backward cost before it had its own rule) and without, the entering state's cotangent
of context_parallel.entering_cotangent_of_block (what the backward computes instead), the same two
as the backend's states-only kernel passes where it has them (pallas_gpu's pair-level kernels on
Hopper: what a device runs), and the op with the block state."""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.harness import time_jitted  # noqa: E402
from gla_tpu import ops  # noqa: E402
from gla_tpu.ops.common import backends  # noqa: E402
from gla_tpu.ops.gla.context_parallel import (entering_cotangent_of_block,  # noqa: E402
                                               zero_state_of_block)
from gla_tpu.ops.gla.validation import validate_gla  # noqa: E402


def main(n=int(sys.argv[1]) if len(sys.argv) > 1 else 16384):
    b, h, kd = 1, 16, 128
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((b, n, h, kd)), jnp.bfloat16) for _ in range(3))
    g = jnp.asarray(jax.nn.log_sigmoid(rng.standard_normal((b, n, h, kd))), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((b, h, kd, kd)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((b, n, h, kd)), jnp.float32)

    def op(q, k, v, g):
        return jnp.sum(ops.gla(q, k, v, g)[0].astype(jnp.float32) * ct)

    def op_state(q, k, v, g, s0):
        return jnp.sum(ops.gla(q, k, v, g, initial_state=s0)[0].astype(jnp.float32) * ct)

    def block_state(k, v, g):
        s, d, _ = zero_state_of_block(k, v, g, None)
        return jnp.sum(s) + jnp.sum(d)

    def block_state_forward(k, v, g):
        s, d, _ = zero_state_of_block(k, v, g, None)
        return s, d

    def entering_cotangent(q, do, g):
        return entering_cotangent_of_block(q, do, g, None, kd ** -0.5)

    def both(q, k, v, g, s0):
        s, d, _ = zero_state_of_block(k, v, g, None)
        o = ops.gla(q, k, v, g, initial_state=s0 + s * jnp.sum(d))[0]
        return jnp.sum(o.astype(jnp.float32) * ct)

    problem, _, _ = validate_gla(q, k, v, g, scale=None, initial_state=None,
                                 output_final_state=False, segment_ids=None, mode="chunk",
                                 chunk_size=None)
    module, sizes = backends.dispatch("gla", "gla", "auto", problem, None)
    passes = dict(problem=problem.with_chunk_size(64), segment_ids=None, block_sizes=sizes,
                  interpret=False)
    kernel_runs = []
    if hasattr(module, "block_zero_state"):
        kernel_runs = [
            ("zero state pass", lambda k, v, g: module.block_zero_state(k, v, g, **passes),
             (k, v, g)),
            ("entering ct pass", lambda q, do, g: module.block_entering_cotangent(
                q, do, g, **passes), (q, ct.astype(jnp.bfloat16), g))]
    runs = [("op", jax.grad(op, argnums=(0, 1, 2, 3)), (q, k, v, g)),
            ("op from a state", jax.grad(op_state, argnums=(0, 1, 2, 3, 4)), (q, k, v, g, s0)),
            ("block state", jax.grad(block_state, argnums=(0, 1, 2)), (k, v, g)),
            ("block state fwd", block_state_forward, (k, v, g)),
            ("entering ct", entering_cotangent, (q, ct.astype(jnp.bfloat16), g)),
            ("both", jax.grad(both, argnums=(0, 1, 2, 3, 4)), (q, k, v, g, s0))]
    for name, fn, args in runs + kernel_runs:
        t = time_jitted(fn, *args, warmup=2, iters=5, repeats=5)
        print(f"n={n} {name:16s} {t.median_ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
