"""Side-by-side GPU benchmark: our Pallas GPU kernels vs cuDNN, XLA, JAX's Pallas GPU
attention, jax-linear-attention (Mosaic GPU) and flash-linear-attention (torch + triton), in one
process on one GPU, bfloat16, forward and forward+backward.

Inputs are drawn once in numpy (float32, rounded to bfloat16 by each framework the same way);
before timing, each peer's forward output is compared with ours (relative RMS error), and a peer
that disagrees is reported, not timed. jax code is timed with bench/harness.py's time_jitted,
torch code with triton.testing.do_bench (median).

Usage (on the GPU machine):
  python bench/gpu_side_by_side.py --part attention --out results/
  python bench/gpu_side_by_side.py --part gla --part crossover --out results/
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import json
import os
import sys
import traceback
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from gla_tpu.ops.common.flops import attention_flops, gla_flops  # noqa: E402
from bench.harness import environment, format_table, time_jitted, write_json  # noqa: E402

ATTENTION_SHAPES = [  # (B, H, T, D, causal)
    (4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (4, 16, 4096, 64, False),
    (4, 16, 4096, 64, True), (2, 16, 4096, 256, False), (2, 16, 4096, 256, True),
    (1, 5, 16384, 128, False), (1, 5, 16384, 128, True), (16, 16, 1024, 128, False),
    (16, 16, 1024, 128, True),
    # Issue 16's additions: T between the two forwards' crossover, D = 64 at long T, a length
    # that is no multiple of the blocks, and short T.
    (4, 16, 2048, 128, False), (4, 16, 2048, 128, True), (2, 16, 8192, 64, False),
    (2, 16, 8192, 64, True), (4, 16, 4000, 128, True), (32, 16, 512, 128, False),
]
GLA_SHAPES = [(4, 4096, 16, 128, 128), (8, 2048, 4, 256, 512), (8, 2048, 16, 64, 64),
              (2, 16384, 8, 128, 128)]
CROSSOVER_T = [512, 1024, 2048, 4096, 8192, 16384, 32768]
MATCH_TOLERANCE = 2e-2  # relative RMS error between two bfloat16 implementations


def _logsigmoid(x):
    return -np.logaddexp(0.0, -x)


# Log-gate distributions, by the name a record carries. "fla" is fla's and jla's op-benchmark
# draw and the default; "fla/16" fla's GLA layer default (gate_logit_normalizer 16); "weak" the
# draw this script used before 2026-11-22 (about -0.05 a step); "minus3" about -3 a step; "strong"
# decays of up to 1e3 a step. The last two are the inputs slowest for a kernel with a
# data-dependent exact path.
GATES = {
    "fla": ("logsigmoid(N(0,1))", lambda x: _logsigmoid(x)),
    "fla/16": ("logsigmoid(N(0,1))/16", lambda x: _logsigmoid(x) / 16.0),
    "weak": ("logsigmoid(N(0,1)+3)", lambda x: _logsigmoid(x + 3.0)),
    "minus3": ("logsigmoid(N(0,1)-3)", lambda x: _logsigmoid(x - 3.0)),
    "strong": ("-1e3*sigmoid(N(0,1))", lambda x: -1e3 / (1.0 + np.exp(-x))),
}
DEFAULT_GATES = ("fla", "fla/16")


def versions() -> dict:
    out = {"jax": jax.__version__}
    for name in ("jaxlib", "torch", "triton", "fla-core", "jax-linear-attention"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


@dataclasses.dataclass
class Context:
    env: dict
    records: list
    seed: int = 0
    path: str | None = None  # JSON rewritten after every record, so a cut-off run keeps its data
    peers_only: bool = False  # GLA: time the peers only (ours still runs once, for the check)
    with_triton: bool = False  # GLA: also time our chunked Triton kernels


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def record(ctx, *, op, impl, shape, mode, timing=None, flops=None, ms=None, error=None,
           note=None, gate=None):
    rec = dict(op=op, impl=impl, shape=list(shape), mode=mode, dtype="bfloat16",
               device=ctx.env["device"], date=ctx.env["date"], versions=ctx.env["versions"])
    if gate is not None:
        rec["gate"] = GATES[gate][0]
    if timing is not None:
        rec.update(ms_median=timing[0], ms_min=timing[1], ms_max=timing[2])
        rec["tflops"] = flops / (timing[0] * 1e-3) / 1e12 if flops else None
    else:
        rec.update(ms_median=None, ms_min=None, ms_max=None, tflops=None)
    if error is not None:
        rec["error"] = error
    if note is not None:
        rec["note"] = note
    ctx.records.append(rec)
    if ctx.path:
        write_json(ctx.path, ctx.records)
    print(f"{op:10s} {impl:22s} {str(shape):32s} {mode:8s} {gate or '':7s} "
          f"{'-' if rec['ms_median'] is None else f'{rec['ms_median']:.3f} ms'}"
          f"{'' if rec['tflops'] is None else f'  {rec['tflops']:.0f} TF/s'}"
          f"{'' if error is None else '  ' + error[:120]}", flush=True)


def time_jax(fn, *args):
    # 50 calls per sync: a 0.1-0.3 ms forward would otherwise be timed with the host's dispatch
    # and the launch latency in it (2026-11-23: medians of 10-call repeats spread by 2x)
    t = time_jitted(fn, *args, warmup=3, iters=50, repeats=7)
    return t.median_ms, t.min_ms, t.max_ms


def time_torch(fn):
    import triton.testing

    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="all")
    return float(np.median(ms)), float(np.min(ms)), float(np.max(ms))


def fwd_bwd(fn, ct):
    """jax function of (q, k, v, ...) -> the gradients of sum(fn(...) * ct) w.r.t. every input."""

    def loss(*args):
        return jnp.sum(fn(*args).astype(jnp.float32) * ct)

    def grads(*args):
        return jax.grad(loss, argnums=tuple(range(len(args))))(*args)

    return grads


# Softmax.


def attention_impls(causal, d):
    """name -> jax function (q, k, v) -> o, all in [B, T, H, D]."""
    from gla_tpu import ops
    from gla_tpu.ops.attention.pallas_gpu import default_block_sizes

    # ours as shipped (on Hopper: the Mosaic GPU forward and backward at D 64 / 128 / 256), with the Triton forward forced (timed forward only) and with the
    # Triton backward forced (timed forward+backward only), to show what each kernel brings
    defaults = default_block_sizes(d, jnp.bfloat16)
    triton_forward = dataclasses.replace(defaults, forward_kernel="triton")
    triton_backward = dataclasses.replace(defaults, backward_kernel="triton")
    impls = {
        "ours_pallas_gpu": lambda q, k, v: ops.flash_attention(q, k, v, causal=causal,
                                                               backend="pallas_gpu"),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                              implementation="cudnn"),
        "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                            implementation="xla"),
    }
    if d in (64, 128):  # elsewhere ours is the Triton forward already
        impls["ours_triton_forward"] = lambda q, k, v: ops.flash_attention(
            q, k, v, causal=causal, backend="pallas_gpu", block_sizes=triton_forward)
        impls["ours_triton_backward"] = lambda q, k, v: ops.flash_attention(
            q, k, v, causal=causal, backend="pallas_gpu", block_sizes=triton_backward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as jax_pallas
    impls["jax_pallas_triton"] = lambda q, k, v: jax_pallas.mha(
        q, k, v, None, sm_scale=d**-0.5, causal=causal)
    if causal and d in (64, 128):
        try:
            from jla.ops.mosaic_gpu.attention import flash_attention as jla_fa
        except ImportError:  # jax-linear-attention is not installed on every GPU machine
            jla_fa = None
        if jla_fa is not None:
            impls["jla_mosaic_fa3"] = lambda q, k, v: jla_fa(q, k, v)
    return impls


def bench_attention(ctx, shapes, modes):
    rng = np.random.default_rng(ctx.seed)
    for b, h, t, d, causal in shapes:
        shape = (b, h, t, d, "causal" if causal else "full")
        arrs = [jnp.asarray(rng.standard_normal((b, t, h, d), np.float32), jnp.bfloat16)
                for _ in range(3)]
        ct = jnp.asarray(rng.standard_normal((b, t, h, d), np.float32))
        _time_attention_impls(ctx, attention_impls(causal, d), arrs, ct, modes, shape,
                              (b, t, h, d, causal),
                              skip=(("fwd+bwd", "ours_triton_forward"),
                                    ("fwd", "ours_triton_backward")))


def _time_attention_impls(ctx, impls, arrs, ct, modes, shape, dims, skip=(), note=""):
    """Times each of `impls` (name -> jax function of q, k, v) in each mode, after checking its
    output against the first's; (mode, name) pairs in `skip` are left out. dims: (B, T, H, D,
    causal) for the flop count."""
    b, t, h, d, causal = dims
    ours = None
    for name, fn in impls.items():
        try:
            out = jax.block_until_ready(jax.jit(fn)(*arrs))
            ours = out if ours is None else ours
            err = rel_err(out, ours)
            if err > MATCH_TOLERANCE:
                record(ctx, op="softmax", impl=name, shape=shape, mode="fwd",
                       error=f"output differs from ours: rel err {err:.2e}")
                continue
            for mode in modes:
                if (mode, name) in skip:
                    continue
                f = fn if mode == "fwd" else fwd_bwd(fn, ct)
                flops = attention_flops(b, t, t, h, d, causal=causal, backward=mode == "fwd+bwd")
                record(ctx, op="softmax", impl=name, shape=shape, mode=mode,
                       timing=time_jax(f, *arrs), flops=flops,
                       note=f"{note}rel err vs ours {err:.1e}")
        except Exception as e:  # a peer that cannot take a shape is reported, not fatal
            record(ctx, op="softmax", impl=name, shape=shape, mode="fwd",
                   error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


# Segment ids: documents packed in each row (a new id after each token with probability 1 / 1024,
# about four documents per 4096 tokens). Every block is masked with segment ids, in both our
# kernels, so the time does not depend on where the documents end. cuDNN through
# jax.nn.dot_product_attention takes sequence lengths, not segment ids: the peers are our kernels
# before they took segment ids on Mosaic GPU (Triton forced) and our XLA backend.
SEGMENT_SHAPES = [(4, 16, 4096, 128, True), (4, 16, 4096, 128, False), (4, 16, 4096, 64, True),
                  (2, 16, 4096, 256, True)]


def bench_attention_segments(ctx, shapes, modes):
    from gla_tpu import ops
    from gla_tpu.ops.attention.pallas_gpu import default_block_sizes

    rng = np.random.default_rng(ctx.seed)
    for b, h, t, d, causal in shapes:
        shape = (b, h, t, d, ("causal" if causal else "full") + "+segments")
        arrs = [jnp.asarray(rng.standard_normal((b, t, h, d), np.float32), jnp.bfloat16)
                for _ in range(3)]
        ids = jnp.asarray(np.cumsum(rng.random((b, t)) < 1 / 1024, axis=1), jnp.int32)
        ct = jnp.asarray(rng.standard_normal((b, t, h, d), np.float32))
        triton = dataclasses.replace(default_block_sizes(d, jnp.bfloat16),
                                     forward_kernel="triton", backward_kernel="triton")
        kinds = {
            "ours_pallas_gpu": dict(backend="pallas_gpu"),
            "ours_triton": dict(backend="pallas_gpu", block_sizes=triton),
            "ours_xla": dict(backend="xla"),
        }
        impls = {name: functools.partial(ops.flash_attention, causal=causal, segment_ids=ids,
                                         **kwargs)
                 for name, kwargs in kinds.items()}
        _time_attention_impls(ctx, impls, arrs, ct, modes, shape, (b, t, h, d, causal),
                              note=f"segment ids: {int(ids[0, -1]) + 1} documents in row 0; ")


# GLA.


def gla_inputs(rng, b, t, h, kd, vd, with_state=False, gate="fla", per_head=False):
    """q, k, v ~ N(0, 1); log gates g from GATES[gate], [B, T, H, K] (per_head: [B, T, H])."""
    q = rng.standard_normal((b, t, h, kd), np.float32)
    k = rng.standard_normal((b, t, h, kd), np.float32)
    v = rng.standard_normal((b, t, h, vd), np.float32)
    g = GATES[gate][1](rng.standard_normal((b, t, h) if per_head else (b, t, h, kd), np.float32))
    s0 = rng.standard_normal((b, h, kd, vd), np.float32) if with_state else None
    return q, k, v, g.astype(np.float32), s0


def ours_gla(mode, with_state=False, forward_kernel="auto", chunk_kernel="auto",
             segment_ids=None, **block_sizes):
    """ops.gla on the GPU backend as a function of (q, k, v, g[, s0]) -> o; block_sizes: more
    BlockSizes fields."""
    from gla_tpu import ops
    from gla_tpu.ops.gla.pallas_gpu import BlockSizes

    sizes = BlockSizes(forward_kernel=forward_kernel, chunk_kernel=chunk_kernel, **block_sizes)

    def fn(q, k, v, g, *s0):
        o, _ = ops.gla(q, k, v, g, initial_state=s0[0] if s0 else None, mode=mode,
                       segment_ids=segment_ids, backend="pallas_gpu", block_sizes=sizes)
        return o

    return fn


def jla_gla(q, k, v, g):
    import jla.ops

    o, _ = jla.ops.linear_attention("gla", q, k, v, g=g, impl="mosaic_gpu")
    return o


def bench_gla_shape(ctx, b, t, h, kd, vd, modes, *, op="gla", fla_recurrent=True, gate="fla",
                    per_head=False, fla_modes=None):
    """One GLA shape and gate distribution: ours, jla and fla (per_head: [B, T, H] gates against
    fla's chunk_simple_gla); fla in `fla_modes` (default: `modes`)."""
    import torch
    from fla.ops.gla import chunk_gla, fused_recurrent_gla

    if per_head:
        op = "gla_per_head"
    rng = np.random.default_rng(ctx.seed)
    q, k, v, g, _ = gla_inputs(rng, b, t, h, kd, vd, gate=gate, per_head=per_head)
    jq, jk, jv = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    jg = jnp.asarray(g)
    jct = jnp.asarray(rng.standard_normal((b, t, h, vd), np.float32))
    shape = (b, t, h, kd, vd)
    ours = jax.block_until_ready(jax.jit(ours_gla("chunk"))(jq, jk, jv, jg))

    def jax_impl(name, fn, modes=modes):
        try:
            out = jax.block_until_ready(jax.jit(fn)(jq, jk, jv, jg))
            err = rel_err(out, ours)
            if err > MATCH_TOLERANCE:
                record(ctx, op=op, impl=name, shape=shape, mode="fwd", gate=gate,
                       error=f"output differs from ours: rel err {err:.2e}")
                return
            for mode in modes:
                f = fn if mode == "fwd" else fwd_bwd(fn, jct)
                flops = gla_flops(b, t, h, kd, vd, backward=mode == "fwd+bwd")
                record(ctx, op=op, impl=name, shape=shape, mode=mode, gate=gate,
                       timing=time_jax(f, jq, jk, jv, jg), flops=flops,
                       note=f"rel err vs ours {err:.1e}")
        except Exception as e:
            record(ctx, op=op, impl=name, shape=shape, mode="fwd", gate=gate,
                   error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    if not ctx.peers_only:
        jax_impl("ours_chunk", ours_gla("chunk"))
        if per_head:  # "auto" takes the Mosaic GPU forward on Hopper; Triton's for comparison
            jax_impl("ours_chunk_triton_fwd", ours_gla("chunk", forward_kernel="triton"),
                     modes=[m for m in modes if m == "fwd"])
        if ctx.with_triton:  # "auto" runs the pair-level Mosaic GPU kernels on Hopper
            jax_impl("ours_chunk_triton", ours_gla("chunk", chunk_kernel="triton"))
    if op == "gla":  # jla's GLA takes per-key gates only
        jax_impl("jla_mosaic_gpu", jla_gla)

    dev = "cuda"
    tq, tk, tv = (torch.from_numpy(x).to(dev).to(torch.bfloat16).requires_grad_() for x in (q, k, v))
    tg = torch.from_numpy(g).to(dev).requires_grad_()
    tct = torch.from_numpy(np.asarray(jct)).to(dev).to(torch.bfloat16)
    if per_head:
        from fla.ops.simple_gla import chunk_simple_gla

        peers = [("fla_chunk_simple_gla", lambda: chunk_simple_gla(tq, tk, tv, tg)[0])]
    else:
        peers = [("fla_chunk_gla", lambda: chunk_gla(tq, tk, tv, tg)[0])]
    if fla_recurrent and op == "gla":
        peers.append(("fla_fused_recurrent_gla", lambda: fused_recurrent_gla(tq, tk, tv, tg)[0]))
    for name, fn in peers:
        try:
            with torch.no_grad():
                out = fn().float().cpu().numpy()
            err = rel_err(out, ours)
            if err > MATCH_TOLERANCE:
                record(ctx, op=op, impl=name, shape=shape, mode="fwd", gate=gate,
                       error=f"output differs from ours: rel err {err:.2e}")
                continue
            for mode in (modes if fla_modes is None else fla_modes):
                if mode == "fwd":
                    def run():
                        with torch.no_grad():
                            fn()
                else:
                    def run():
                        fn().backward(tct)
                timing = time_torch(run)
                flops = gla_flops(b, t, h, kd, vd, backward=mode == "fwd+bwd")
                record(ctx, op=op, impl=name, shape=shape, mode=mode, gate=gate, timing=timing,
                       flops=flops, note=f"rel err vs ours {err:.1e}")
        except Exception as e:
            record(ctx, op=op, impl=name, shape=shape, mode="fwd", gate=gate,
                   error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def bench_decode(ctx, b=64, h=16, kd=128, vd=128):
    """One token with a state: ours (mode fused_recurrent) vs fla's fused_recurrent_gla, fwd."""
    import torch
    from fla.ops.gla import fused_recurrent_gla

    rng = np.random.default_rng(ctx.seed)
    q, k, v, g, s0 = gla_inputs(rng, b, 1, h, kd, vd, with_state=True)
    jargs = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)] + [jnp.asarray(g), jnp.asarray(s0)]
    shape = (b, 1, h, kd, vd)
    fn = ours_gla("fused_recurrent")
    ours = np.asarray(jax.jit(fn)(*jargs), np.float32)
    record(ctx, op="gla_decode", impl="ours_fused_recurrent", shape=shape, mode="fwd", gate="fla",
           timing=time_jax(fn, *jargs))
    tq, tk, tv = (torch.from_numpy(x).cuda().to(torch.bfloat16) for x in (q, k, v))
    tg, ts0 = torch.from_numpy(g).cuda(), torch.from_numpy(s0).cuda()
    out = fused_recurrent_gla(tq, tk, tv, tg, initial_state=ts0)[0].float().cpu().numpy()
    err = rel_err(out, ours)
    if err > MATCH_TOLERANCE:
        record(ctx, op="gla_decode", impl="fla_fused_recurrent_gla", shape=shape, mode="fwd",
               gate="fla", error=f"output differs from ours: rel err {err:.2e}")
        return

    def run():
        with torch.no_grad():
            fused_recurrent_gla(tq, tk, tv, tg, initial_state=ts0, output_final_state=True)

    record(ctx, op="gla_decode", impl="fla_fused_recurrent_gla", shape=shape, mode="fwd",
           gate="fla", timing=time_torch(run), note=f"rel err vs ours {err:.1e}")


def bench_gla_breakdown(ctx, b=4, t=4096, h=16, kd=128, vd=128):
    """Times each kernel of our chunked GLA alone (forward: state pass, intra scores, output;
    backward: reversed state pass, dA, dq/dk/dg, dv), to show where the time goes."""
    from gla_tpu.ops.common.chunk_cumsum import chunk_local_cumsum
    from gla_tpu.ops.gla.pallas_gpu import kernels_intra, kernels_output, kernels_state, plan

    rng = np.random.default_rng(ctx.seed)
    q, k, v, g, _ = gla_inputs(rng, b, t, h, kd, vd)
    jq, jk, jv = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    geo = plan.chunk_geometry(t, kd, vd, scale=kd**-0.5, has_segments=False,
                              exact_inter=False)  # mode "chunk"
    do = jv
    stages = {
        "gate_cumsum": lambda g: chunk_local_cumsum(g, geo.chunk, method="triangular"),
        "state_pass_fwd": lambda k, v, b: kernels_state.state_pass(
            k, v, b, None, None, None, geo=geo, reverse=False, interpret=False),
        "bounded_flags": lambda b: kernels_intra.bounded_chunks(b, geo.chunk),
        "intra_scores": lambda q, k, b, f: kernels_intra.intra_scores(q, k, b, None, f, geo=geo,
                                                                     interpret=False),
        "chunk_output": lambda q, b, a, v, s: kernels_output.chunk_output(q, b, None, a, v, s, geo=geo,
                                                                interpret=False),
        "state_pass_rev": lambda q, do, b, s: kernels_state.state_pass(
            q, do, b, None, None, s, geo=geo, reverse=True, interpret=False),
        "chunk_da": lambda do, v: kernels_intra.chunk_da(do, v, None, geo=geo, interpret=False),
        "chunk_dqk": lambda q, k, v, do, b, da, s, ds, f: kernels_intra.chunk_dqk(
            q, k, v, do, b, *da, None, None, None, None, s, ds, f, geo=geo, interpret=False),
        "chunk_dv": lambda k, b, a, do, ds: kernels_output.chunk_dv(k, b, None, a, do, ds, geo=geo,
                                                          interpret=False),
    }
    run = {name: jax.jit(fn) for name, fn in stages.items()}
    bsum = run["gate_cumsum"](jnp.asarray(g))
    states, final = run["state_pass_fwd"](jk, jv, bsum)
    bounded = run["bounded_flags"](bsum)
    a = run["intra_scores"](jq, jk, bsum, bounded)
    dstates, _ = run["state_pass_rev"](jq, do, bsum, final)
    da = run["chunk_da"](do, jv)
    args = {
        "gate_cumsum": (jnp.asarray(g),), "state_pass_fwd": (jk, jv, bsum),
        "bounded_flags": (bsum,), "intra_scores": (jq, jk, bsum, bounded),
        "chunk_output": (jq, bsum, a, jv, states), "state_pass_rev": (jq, do, bsum, final),
        "chunk_da": (do, jv), "chunk_dqk": (jq, jk, jv, do, bsum, da, states, dstates, bounded),
        "chunk_dv": (jk, bsum, a, do, dstates),
    }
    for name, fn in run.items():
        try:
            record(ctx, op="gla_kernel", impl=name, shape=(b, t, h, kd, vd), mode="fwd", gate="fla",
                   timing=time_jax(fn, *args[name]))
        except Exception as e:
            message = str(e).splitlines()[0] if str(e) else ""
            record(ctx, op="gla_kernel", impl=name, shape=(b, t, h, kd, vd), mode="fwd", gate="fla",
                   error=f"{type(e).__name__}: {message}")


def bench_crossover(ctx, lengths):
    """GLA chunk (K = V = 128) vs our causal flash attention (D = 128), B2 H16, fwd+bwd."""
    rng = np.random.default_rng(ctx.seed)
    from gla_tpu import ops

    for t in lengths:
        b, h, d = 2, 16, 128
        q, k, v = (jnp.asarray(rng.standard_normal((b, t, h, d), np.float32), jnp.bfloat16)
                   for _ in range(3))
        g = jnp.asarray(gla_inputs(rng, b, t, h, d, d)[3])
        ct = jnp.asarray(rng.standard_normal((b, t, h, d), np.float32))
        att = lambda q, k, v: ops.flash_attention(q, k, v, causal=True, backend="pallas_gpu")  # noqa: E731
        record(ctx, op="crossover", impl="ours_flash_causal", shape=(b, h, t, d), mode="fwd+bwd",
               timing=time_jax(fwd_bwd(att, ct), q, k, v),
               flops=attention_flops(b, t, t, h, d, causal=True, backward=True))
        record(ctx, op="crossover", impl="ours_gla_chunk", shape=(b, h, t, d), mode="fwd+bwd",
               gate="fla", timing=time_jax(fwd_bwd(ours_gla("chunk"), ct), q, k, v, g),
               flops=gla_flops(b, t, h, d, d, backward=True))


def write_outputs(ctx, out_dir, tag):
    os.makedirs(out_dir, exist_ok=True)
    write_json(os.path.join(out_dir, f"{tag}.json"), ctx.records)
    rows = [dict(r, shape=str(tuple(r["shape"]))) for r in ctx.records]
    table = format_table(rows, ["op", "impl", "shape", "mode", "gate", "ms_median", "ms_min",
                                "ms_max", "tflops", "error"])
    with open(os.path.join(out_dir, f"{tag}.md"), "w") as f:
        f.write(f"device {ctx.env['device']}, date {ctx.env['date']}, versions "
                f"{json.dumps(ctx.env['versions'])}\n\n```\n{table}\n```\n")
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", action="append",
                        choices=["attention", "attention_segments", "gla", "gla_per_head",
                                 "decode", "crossover", "breakdown"],
                        required=True)
    parser.add_argument("--gates", default=",".join(DEFAULT_GATES),
                        help=f"GLA: comma-separated log-gate distributions from {sorted(GATES)} "
                             "(each shape is timed with each)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="gpu_side_by_side")
    parser.add_argument("--quick", action="store_true", help="first shape of each list only")
    parser.add_argument("--attention-shapes", default=None,
                        help="comma-separated indices into ATTENTION_SHAPES (default: all)")
    parser.add_argument("--gla-shapes", default=None,
                        help="comma-separated indices into GLA_SHAPES (default: all)")
    parser.add_argument("--crossover-t", default=None,
                        help="comma-separated T values for the crossover (default: CROSSOVER_T)")
    parser.add_argument("--peers-only", action="store_true",
                        help="GLA: time only the peers (ours runs once for the numerics check)")
    parser.add_argument("--with-triton", action="store_true",
                        help="GLA: also time our chunked Triton kernels (chunk_kernel='triton')")
    parser.add_argument("--no-fla-recurrent", action="store_true",
                        help="GLA: leave out fla's fused_recurrent_gla (50-100 ms a step)")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--fla-modes", default=None,
                        help="GLA: fla's modes where not --modes (its backward autotunes for "
                             "minutes at some shapes)")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    fla_modes = None if args.fla_modes is None else args.fla_modes.split(",")
    gates = args.gates.split(",")
    for gate in gates:
        if gate not in GATES:
            parser.error(f"--gates: unknown distribution {gate!r}; choose from {sorted(GATES)}")
    env = environment()
    env["versions"] = versions()
    ctx = Context(env=env, records=[], path=os.path.join(args.out, f"{args.tag}.json"),
                  peers_only=args.peers_only, with_triton=args.with_triton)
    for part in args.part:
        try:
            if part == "attention":
                shapes = ATTENTION_SHAPES[:2] if args.quick else ATTENTION_SHAPES
                if args.attention_shapes:
                    shapes = [ATTENTION_SHAPES[int(i)] for i in args.attention_shapes.split(",")]
                bench_attention(ctx, shapes, modes)
            elif part == "attention_segments":
                bench_attention_segments(ctx, SEGMENT_SHAPES[:1] if args.quick else SEGMENT_SHAPES,
                                         modes)
            elif part in ("gla", "gla_per_head"):
                shapes = GLA_SHAPES[:1] if args.quick else GLA_SHAPES
                if args.gla_shapes:
                    shapes = [GLA_SHAPES[int(i)] for i in args.gla_shapes.split(",")]
                for shape in shapes:
                    for gate in gates:
                        bench_gla_shape(ctx, *shape, modes, gate=gate,
                                        per_head=part == "gla_per_head",
                                        fla_recurrent=not args.no_fla_recurrent,
                                        fla_modes=fla_modes)
            elif part == "decode":
                bench_decode(ctx)
            elif part == "breakdown":
                for index in (args.gla_shapes or "0").split(","):
                    bench_gla_breakdown(ctx, *GLA_SHAPES[int(index)])
            else:
                lengths = CROSSOVER_T[:3] if args.quick else CROSSOVER_T
                if args.crossover_t:
                    lengths = [int(x) for x in args.crossover_t.split(",")]
                bench_crossover(ctx, lengths)
        except Exception:
            traceback.print_exc()
        write_outputs(ctx, args.out, args.tag)
    print(write_outputs(ctx, args.out, args.tag))


if __name__ == "__main__":
    main()
