"""Experiment behind the GLA tile choices of docs/gpu_backend.md: our chunked GLA, forward and
forward+backward, at the benchmark's GLA shapes under variants of its ChunkGeometry (V tile,
stored state dtype, warps of the dq/dk kernel, pipeline stages), bfloat16, on the GPU.

    python3 bench/gpu_gla_variants.py --out DIR [--shapes 0,1,2,3]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gla_tpu.ops.common.flops import gla_flops  # noqa: E402
from bench.gpu_side_by_side import (  # noqa: E402
    GLA_SHAPES, Context, environment, fwd_bwd, gla_inputs, ours_gla, record, time_jax, versions,
    write_outputs)

VARIANTS = {  # name -> ChunkGeometry fields replaced
    "default": {},
    "block_v=64": {"block_v": 64},
    "block_v=128": {"block_v": 128},
    # states stored in bfloat16 (cheaper; dg at T = 1 with an initial state fails the rule)
    "states_bf16": {"state_dtype": "bfloat16"},
    "exact_inter": {"exact_inter": True},  # what mode "fused_recurrent" runs
    "dqk_warps=8": {"num_warps_dqk": 8},
    "stages=3": {"num_stages": 3},
}


@contextlib.contextmanager
def geometry_changed(**fields):
    """The GPU GLA entry's chunk_geometry with `fields` replaced, for the duration."""
    from gla_tpu.ops.gla.pallas_gpu import entry

    original = entry.chunk_geometry
    entry.chunk_geometry = lambda *a, **kw: dataclasses.replace(original(*a, **kw), **fields)
    try:
        yield
    finally:
        entry.chunk_geometry = original


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="0,1,2,3", help="indices into GLA_SHAPES")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    args = parser.parse_args(argv)
    from gla_tpu.ops.gla.pallas_gpu import plan

    env = environment()
    env["versions"] = versions()
    ctx = Context(env=env, records=[], path=os.path.join(args.out, "gla_variants.json"))
    for index in args.shapes.split(","):
        b, t, h, kd, vd = shape = GLA_SHAPES[int(index)]
        rng = np.random.default_rng(0)
        q, k, v, g, _ = gla_inputs(rng, b, t, h, kd, vd)
        jq, jk, jv = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
        jg = jnp.asarray(g)
        ct = jnp.asarray(rng.standard_normal((b, t, h, vd), np.float32))
        for name in args.variants.split(","):
            fields = VARIANTS[name]
            if fields.get("block_v", 0) in (vd, plan.value_block(vd)) or (
                    fields.get("block_v", 0) > vd):
                continue  # the default already, or wider than V
            with geometry_changed(**fields):
                fn = ours_gla("chunk")
                for mode in args.modes.split(","):
                    f = fn if mode == "fwd" else fwd_bwd(fn, ct)
                    try:
                        record(ctx, op="gla", impl=name, shape=shape, mode=mode, gate="fla",
                               timing=time_jax(f, jq, jk, jv, jg),
                               flops=gla_flops(b, t, h, kd, vd, backward=mode == "fwd+bwd"))
                    except Exception as e:  # noqa: BLE001
                        record(ctx, op="gla", impl=name, shape=shape, mode=mode, gate="fla",
                               error=f"{type(e).__name__}: {str(e)[:300]}")
            write_outputs(ctx, args.out, "gla_variants")
    print(write_outputs(ctx, args.out, "gla_variants"))


if __name__ == "__main__":
    main()
