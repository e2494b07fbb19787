"""The pair-level Mosaic GPU GLA kernels (per-key gates, Hopper) one by one: a check against the
XLA backend, each kernel timed alone, forward and forward+backward through ops.gla, and a mode
that runs each kernel once for a profiler (ncu). GPU only.

    python3 bench/gpu_gla_pair_levels.py --shape 4,4096,16,128,128 --gates fla,strong --out OUT
    python3 bench/gpu_gla_pair_levels.py --shape 8,2048,4,256,512 \
        --sizes "default;mosaic_group_sums=float32;mosaic_block_v=32"
    ncu --kernel-name regex:gla_ --launch-count 6 python3 bench/gpu_gla_pair_levels.py --once
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench.gpu_side_by_side import GATES, Context, fwd_bwd, gla_inputs, ours_gla, record, \
    rel_err, time_jax, versions, write_outputs
from bench.harness import environment
from gla_tpu.ops.common.flops import gla_flops
from gla_tpu.ops.gla.pallas_gpu import kernels_mosaic_grads, kernels_mosaic_levels, \
    kernels_mosaic_state, vjp
from gla_tpu.ops.gla.pallas_gpu.plan import BlockSizes, chunk_geometry


def kernel_stages(geo):
    """name -> (function, names of its arguments), in the order the forward and backward run,
    for a call of plan.ChunkGeometry `geo` (its key groups as virtual heads and its state-pass
    settings, as ops.gla runs them)."""
    scale, groups = geo.scale, geo.key_groups
    sp = kernels_mosaic_state.state_pass
    inference, training, reversed_ = vjp.state_passes(geo)
    parts = ("h_hi", "h_lo")[:reversed_.term_parts]
    return {
        "prep": (lambda q, k, g: kernels_mosaic_levels.prep(q, k, g, scale=scale, interpret=False),
                 ("q", "k", "g")),
        "state_inference": (lambda kd, v, last, qd, a: sp(kd, v, last, None, w=qd, a=a,
                                                          p=inference, interpret=False),
                            ("kd", "v", "last", "qd", "a")),
        "state_training": (lambda kd, v, last, qd, a: sp(kd, v, last, None, w=qd, a=a,
                                                         p=training, interpret=False),
                           ("kd", "v", "last", "qd", "a")),
        "state_reversed": (lambda qd, do, last, kd, a, *h_parts: sp(
            qd, do, last, None, w=kd, a=a, h_parts=h_parts, p=reversed_, interpret=False),
            ("qd", "do", "last", "kd", "a") + parts),
        "grads": (lambda q, k, v, do, g, last, h_hi, dh, term: kernels_mosaic_grads.chunk_grads(
            q, k, v, do, g, last, h_hi, dh, term, scale=scale, interpret=False, groups=groups),
            ("q", "k", "v", "do", "g", "last", "h_hi", "dh", "term")),
    }


def kernel_operands(shape, gate, seed=0, sizes=None):
    """Every operand the stages take, from one draw (q, k, v, do ~ N(0, 1), g from GATES); K
    above 128 as groups of 128 keys, virtual heads (q, k and g reshaped, as ops.gla does)."""
    b_, t, h, kd, vd = shape
    geo = chunk_geometry(t, kd, vd, scale=kd ** -0.5, has_segments=False, exact_inter=False,
                         mosaic_chunk=True, batch=b_, heads=h,
                         block_sizes=BlockSizes(chunk_kernel="mosaic_gpu", **(sizes or {})))
    groups = geo.key_groups
    rng = np.random.default_rng(seed)
    q, k, v, g, _ = gla_inputs(rng, b_, t, h, kd, vd, gate=gate)
    q, k, g = (x.reshape(b_, t, h * groups, kd // groups) for x in (q, k, g))
    env = {"q": jnp.asarray(q, jnp.bfloat16), "k": jnp.asarray(k, jnp.bfloat16),
           "v": jnp.asarray(v, jnp.bfloat16), "g": jnp.asarray(g),
           "do": jnp.asarray(rng.standard_normal(v.shape, np.float32), jnp.bfloat16)}
    stages = kernel_stages(geo)
    env["a"], env["qd"], env["kd"], env["last"] = jax.jit(stages["prep"][0])(
        env["q"], env["k"], env["g"])
    _, *h_parts, _ = jax.jit(stages["state_training"][0])(
        *(env[x] for x in stages["state_training"][1]))
    env.update(zip(("h_hi", "h_lo"), h_parts))
    _, env["dh"], env["term"], _ = jax.jit(stages["state_reversed"][0])(
        *(env[x] for x in stages["state_reversed"][1]))
    return env, stages


def _sizes_tag(sizes):
    """A record's impl suffix for BlockSizes fields set (none: the defaults)."""
    return "".join(f"/{name}={value}" for name, value in (sizes or {}).items())


def parse_sizes(text):
    """'default;mosaic_block_v=32;...' -> a list of dicts of BlockSizes fields."""
    variants = []
    for variant in text.split(";"):
        fields = {}
        for item in variant.split(","):
            if item and item != "default":
                name, value = item.split("=")
                fields[name] = int(value) if value.isdigit() else value
        variants.append(fields)
    return variants


def bench_kernels(ctx, shape, gate, once=False, sizes=None):
    env, stages = kernel_operands(shape, gate, sizes=sizes)
    for name, (fn, arg_names) in stages.items():
        args = tuple(env[x] for x in arg_names)
        if once:
            jax.block_until_ready(jax.jit(fn)(*args))
            continue
        record(ctx, op="gla_pair_kernel", impl=name + _sizes_tag(sizes), shape=shape,
               mode="fwd", gate=gate, timing=time_jax(fn, *args))


def check(ctx, shape, gate, sizes=None):
    """Outputs and every gradient of the pair-level path against the XLA backend on the same
    bfloat16 inputs (float32 arithmetic there): relative errors, recorded as notes."""
    from gla_tpu import ops

    b_, t, h, kd, vd = shape
    rng = np.random.default_rng(ctx.seed + 1)
    q, k, v, g, _ = gla_inputs(rng, b_, t, h, kd, vd, gate=gate)
    jq, jk, jv = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    jg = jnp.asarray(g)
    ct = jnp.asarray(rng.standard_normal(v.shape, np.float32))

    def xla(q, k, v, g):
        o, _ = ops.gla(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), g,
                       mode="chunk", backend="xla")
        return o

    fn = ours_gla("chunk", chunk_kernel="mosaic_gpu", **(sizes or {}))
    got = jax.jit(fwd_bwd(fn, ct))(jq, jk, jv, jg)
    want = jax.jit(fwd_bwd(xla, ct))(jq, jk, jv, jg)
    errs = {name: rel_err(a, b) for name, a, b in zip(("dq", "dk", "dv", "dg"), got, want)}
    o = jax.jit(fn)(jq, jk, jv, jg)
    errs["o"] = rel_err(o, jax.jit(xla)(jq, jk, jv, jg))
    note = " ".join(f"{n} {e:.1e}" for n, e in errs.items())
    bad = [n for n, e in errs.items() if not e < 2e-2]
    record(ctx, op="gla_pair_check", impl="pair_levels" + _sizes_tag(sizes), shape=shape,
           mode="fwd+bwd", gate=gate,
           note=note, error=f"rel err above 2e-2: {bad}" if bad else None)


def timing_inputs(seed, shape, gate, per_head=False):
    """(q, k, v bfloat16 and g float32 on the device, a float32 output cotangent) for timing
    forward and forward+backward: q, k, v ~ N(0, 1), g from GATES."""
    b_, t, h, kd, vd = shape
    rng = np.random.default_rng(seed)
    q, k, v, g, _ = gla_inputs(rng, b_, t, h, kd, vd, gate=gate, per_head=per_head)
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)] + [jnp.asarray(g)]
    return args, jnp.asarray(rng.standard_normal(v.shape, np.float32))


def bench_total(ctx, shape, gate, sizes=None):
    b_, t, h, kd, vd = shape
    args, ct = timing_inputs(ctx.seed, shape, gate)
    fn = ours_gla("chunk", chunk_kernel="mosaic_gpu", **(sizes or {}))
    for mode, f in (("fwd", fn), ("fwd+bwd", fwd_bwd(fn, ct))):
        record(ctx, op="gla", impl="ours_chunk_pair_levels" + _sizes_tag(sizes), shape=shape,
               mode=mode, gate=gate,
               timing=time_jax(f, *args),
               flops=gla_flops(b_, t, h, kd, vd, backward=mode == "fwd+bwd"))


SEGMENT_MEAN_LEN = 512  # documents packed into a row: segment lengths geometric, this mean


def bench_segments(ctx, shape, gate):
    """Forward and forward+backward with segment_ids (random_segment_ids, mean length
    SEGMENT_MEAN_LEN): the pair-level kernels (segment starts as reset gates) against the Triton
    kernels, and the pair-level kernels without segments, on the same draw."""
    from gla_tpu.testing.problems import random_segment_ids

    b_, t, h, kd, vd = shape
    args, ct = timing_inputs(ctx.seed, shape, gate)
    seg = random_segment_ids(jax.random.key(ctx.seed), b_, t, mean_len=SEGMENT_MEAN_LEN)
    # the Triton kernels' forward only (their backward's autotuning takes minutes)
    for impl, kernel, segments, modes in (
            ("ours_chunk_pair_levels_segments", "mosaic_gpu", seg, ("fwd", "fwd+bwd")),
            ("ours_chunk_triton_segments", "triton", seg, ("fwd",)),
            ("ours_chunk_pair_levels", "mosaic_gpu", None, ("fwd", "fwd+bwd"))):
        fn = ours_gla("chunk", chunk_kernel=kernel, segment_ids=segments)
        for mode in modes:
            f = fn if mode == "fwd" else fwd_bwd(fn, ct)
            record(ctx, op="gla", impl=impl, shape=shape, mode=mode, gate=gate,
                   timing=time_jax(f, *args),
                   flops=gla_flops(b_, t, h, kd, vd, backward=mode == "fwd+bwd"),
                   note=(f"segment_ids: random_segment_ids mean length {SEGMENT_MEAN_LEN}"
                         if segments is not None else "no segment_ids"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4,4096,16,128,128", help="B,T,H,K,V")
    parser.add_argument("--gates", default="fla", help=f"comma list of {sorted(GATES)}")
    parser.add_argument("--parts", default="check,kernels,total",
                        help="comma list of check, kernels, total, segments")
    parser.add_argument("--sizes", default="default",
                        help="';'-separated variants of BlockSizes fields, each 'default' or "
                             "'field=value,...' (mosaic_group_sums, mosaic_block_v, "
                             "mosaic_state_parts, mosaic_output_parts)")
    parser.add_argument("--once", action="store_true", help="run each kernel once (profilers)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="gla_pair_levels")
    args = parser.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    env = environment()
    env["versions"] = versions()
    ctx = Context(env=env, records=[],
                  path=None if args.once else os.path.join(args.out, f"{args.tag}.json"))
    for gate in args.gates.split(","):
        if args.once:
            bench_kernels(ctx, shape, gate, once=True)
            continue
        parts = args.parts.split(",")
        for sizes in parse_sizes(args.sizes):  # each variant in turn, per gate draw
            if "check" in parts:
                check(ctx, shape, gate, sizes)
            if "kernels" in parts:
                bench_kernels(ctx, shape, gate, sizes=sizes)
            if "total" in parts:
                bench_total(ctx, shape, gate, sizes)
        if "segments" in parts:
            bench_segments(ctx, shape, gate)
    if not args.once:
        write_outputs(ctx, args.out, args.tag)


if __name__ == "__main__":
    main()
