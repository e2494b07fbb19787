"""Experiment behind docs/gpu_backend.md: times the chunked GLA's dq/dk/dg kernel and the gate
cumsum under variants (warps, stages, precision of the intra products, the exact-diagonal branch)
at (4, 4096, 16, 128, 128) bf16 on the GPU, to find what its time is made of.

    python3 bench/gpu_gla_variants.py --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_side_by_side import (  # noqa: E402
    Context, environment, gla_inputs, record, time_jax, versions, write_outputs)


@contextlib.contextmanager
def patched(module, **values):
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from gla_tpu.ops.common.gating import chunk_local_cumsum
    from gla_tpu.ops.gla import pallas_gpu
    from gla_tpu.ops.gla import pallas_gpu_kernels as kern

    env = environment()
    env["versions"] = versions()
    ctx = Context(env=env, records=[], path=os.path.join(args.out, "variants.json"),
                  peers_only=False)
    b, t, h, kd, vd = 4, 4096, 16, 128, 128
    shape = (b, t, h, kd, vd)
    rng = np.random.default_rng(0)
    q, k, v, g, _ = gla_inputs(rng, b, t, h, kd, vd)
    jq, jk, jv = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    jg = jnp.asarray(g)
    geo = kern.ChunkGeometry(chunk=64, block_k=64, block_v=64, key_dim=kd, value_dim=vd,
                             num_chunks=t // 64, scale=kd**-0.5, has_segments=False)
    bsum = jax.jit(lambda g: chunk_local_cumsum(g, 64))(jg)
    flags = jax.jit(lambda b: kern.bounded_chunks(b, 64))(bsum)
    states, _ = jax.jit(lambda k, v, b: kern.state_pass(
        k, v, b, None, None, None, geo=geo, reverse=False, interpret=False))(jk, jv, bsum)
    dstates, _ = jax.jit(lambda q, do, b, s: kern.state_pass(
        q, do, b, None, None, s, geo=geo, reverse=True, interpret=False))(
            jq, jv, bsum, states[:, :, -1])

    # gate cumsum: XLA's cumsum vs a triangular product vs an associative scan
    tri = jnp.tril(jnp.ones((64, 64), jnp.float32))

    def cumsum_tri(g):
        gc = g.reshape(b, t // 64, 64, h, kd)
        return jnp.einsum("ts,bnshk->bnthk", tri, gc,
                          precision=lax.Precision.HIGHEST).reshape(g.shape)

    def cumsum_scan(g):
        gc = g.reshape(b, t // 64, 64, h, kd)
        return lax.associative_scan(jnp.add, gc, axis=2).reshape(g.shape)

    for name, fn in (("cumsum_xla", lambda g: chunk_local_cumsum(g, 64)),
                     ("cumsum_tri_highest", cumsum_tri), ("cumsum_assoc_scan", cumsum_scan)):
        try:
            err = float(jnp.max(jnp.abs(jax.jit(fn)(jg) - bsum)))
            record(ctx, op="gla_cumsum", impl=name, shape=shape, mode="fwd",
                   timing=time_jax(fn, jg), note=f"max abs diff {err:.1e}")
        except Exception as e:  # noqa: BLE001
            record(ctx, op="gla_cumsum", impl=name, shape=shape, mode="fwd",
                   error=f"{type(e).__name__}: {str(e)[:200]}")

    def dqk(geo_):
        return lambda q, k, v, do, b, s, ds, f: kern.chunk_dqk(
            q, k, v, do, b, None, None, None, None, s, ds, f, geo=geo_, interpret=False)

    zeros_diag = lambda x_ref, b_ref, b, ks, w, keys: jnp.zeros(b.shape, jnp.float32)  # noqa: E731
    variants = [
        ("baseline_w8_s2", geo, {}),
        ("warps4", dataclasses.replace(geo, num_warps_dqk=4), {}),
        ("stages1", dataclasses.replace(geo, num_stages=1), {}),
        ("no_exact_branch", geo, {"_exact_diagonal": zeros_diag}),
        ("intra_tf32", geo, {"_accurate_precision": lambda dt: lax.Precision.DEFAULT}),
        ("all_default_precision", geo, {"_accurate_precision": lambda dt: lax.Precision.DEFAULT,
                                        "_HIGHEST": lax.Precision.DEFAULT}),
        ("no_exact_tf32_w4", dataclasses.replace(geo, num_warps_dqk=4),
         {"_exact_diagonal": zeros_diag,
          "_accurate_precision": lambda dt: lax.Precision.DEFAULT}),
    ]
    args_ = (jq, jk, jv, jv, bsum, states, dstates, flags)
    for name, geo_, patches in variants:
        try:
            with patched(kern, **patches):
                fn = jax.jit(dqk(geo_))
                record(ctx, op="gla_dqk", impl=name, shape=shape, mode="fwd",
                       timing=time_jax(fn, *args_))
        except Exception as e:  # noqa: BLE001
            record(ctx, op="gla_dqk", impl=name, shape=shape, mode="fwd",
                   error=f"{type(e).__name__}: {str(e)[:300]}")
        write_outputs(ctx, args.out, "variants")
    del pallas_gpu
    print(write_outputs(ctx, args.out, "variants"))


if __name__ == "__main__":
    main()
