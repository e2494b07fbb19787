"""The delta rule on one GPU, in one process: ours ("pallas_gpu" and "xla"), jax-linear-attention's
Mosaic GPU kernels and fla's Triton kernels, forward and forward+backward.

    python3 bench/gpu_delta_rule.py --out OUT [--shapes 0,4] [--gates peer,kimi,strong]
        [--betas sigmoid,2sigmoid] [--modes fwd,fwd+bwd] [--ours-only] [--no-xla] [--parts]
        [--tag NAME]
    python3 bench/gpu_delta_rule.py --out OUT --decode      # one decode step, DECODE_SHAPES

Inputs, as fla's op benchmarks draw them: q, k, v ~ N(0, 1) in bfloat16, q and k l2-normalized
inside each op (fla's use_qk_l2norm_in_kernel, jla's and our use_qk_l2norm); beta and the log
gates (float32) from BETAS and GATES, named in every record. Each peer's forward output is checked
against ours (relative RMS <= 2e-2) before it is timed; one that fails or refuses is recorded with
its error. Timing: bench/gpu_side_by_side.py's (JAX: 50 calls per sync, median of 7 repeats after
warm-up; torch: triton.testing.do_bench). The first call of each timed program is recorded too
(first_call_s: tracing and compiling; for fla, triton's compiles and its autotuning), the
compile time a user waits for at each new shape. Writes OUT/<tag>.json (after every record)
and .md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.gpu_side_by_side import (MATCH_TOLERANCE, _error, fwd_bwd, rel_err,  # noqa: E402
                                    time_jax, time_torch, versions)
from bench.harness import environment, format_table, write_json  # noqa: E402

# (variant, B, T, H, HV, K, V): fla README's Gated DeltaNet shapes scaled to one GPU, Qwen3-Next's
# GDN (grouped value heads), KDA, DeltaNet, and K = V = 64.
SHAPES = [
    ("gdn", 1, 8192, 96, 96, 128, 128),
    ("gdn", 2, 16384, 16, 16, 128, 128),
    ("gdn", 4, 4096, 64, 64, 128, 128),
    ("gdn", 8, 2048, 32, 32, 256, 256),
    ("gdn", 2, 8192, 16, 32, 128, 128),
    ("kda", 2, 8192, 32, 32, 128, 128),
    ("deltanet", 4, 4096, 16, 16, 128, 128),
    ("gdn", 8, 2048, 16, 16, 64, 64),
]
JLA_KIND = {"gdn": "gated_deltanet", "kda": "kda", "deltanet": "deltanet"}
# The decode step (T = 1 from a given state) at the shapes: (variant, B, 1, H, HV, K, V).
DECODE_SHAPES = [
    ("gdn", 64, 1, 16, 16, 128, 128),
    ("gdn", 256, 1, 32, 32, 64, 64),
]


def _logsigmoid(x):
    return -np.logaddexp(0.0, -x)


def _softplus(x):
    return np.logaddexp(0.0, x)


def _kimi(rng, shape):
    """Kimi Linear's g = -exp(A_log) softplus(x + dt_bias), A_log = log U(1, 16) per head,
    dt_bias ~ N(0, 1) per head (and key), x ~ N(0, 1)."""
    heads = shape[2]
    a_log = np.log(rng.uniform(1.0, 16.0, (heads,) + (1,) * (len(shape) - 3)))
    dt_bias = rng.standard_normal(shape[2:])
    return -np.exp(a_log) * _softplus(rng.standard_normal(shape) + dt_bias)


# Log-gate draws by the name a record carries: "peer" is fla's and jla's benchmark draw; "kimi"
# Kimi Linear's parameterization; "strong" decays of up to 1e3 a step.
GATES = {
    "peer": ("logsigmoid(N(0,1))", lambda rng, shape: _logsigmoid(rng.standard_normal(shape))),
    "kimi": ("-exp(A_log)*softplus(x+dt_bias), A_log=log U(1,16)", _kimi),
    "strong": ("-1e3*sigmoid(N(0,1))",
               lambda rng, shape: -1e3 / (1.0 + np.exp(-rng.standard_normal(shape)))),
}
BETAS = {
    "sigmoid": ("sigmoid(N(0,1))", lambda x: 1.0 / (1.0 + np.exp(-x))),
    "2sigmoid": ("2*sigmoid(N(0,1))", lambda x: 2.0 / (1.0 + np.exp(-x))),
}


def inputs(seed, shape, gate, beta_law):
    """numpy (q, k, v float32, beta float32, g float32 or None, output cotangent float32)."""
    variant, b, t, h, hv, kd, vd = shape
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((b, t, h, kd), np.float32) for _ in range(2))
    v = rng.standard_normal((b, t, hv, vd), np.float32)
    beta = BETAS[beta_law][1](rng.standard_normal((b, t, hv))).astype(np.float32)
    g = None
    if variant != "deltanet":
        g_shape = (b, t, hv, kd) if variant == "kda" else (b, t, hv)
        g = GATES[gate][1](rng, g_shape).astype(np.float32)
    ct = rng.standard_normal((b, t, hv, vd), np.float32)
    return q, k, v, beta, g, ct


def device_args(q, k, v, beta, g):
    """`inputs`' arrays as the op takes them on the device: q, k, v bfloat16, beta and g float32,
    g left out where it is None (DeltaNet; call `gate_free(fn)`)."""
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)] + [jnp.asarray(beta)]
    return args if g is None else [*args, jnp.asarray(g)]


def gate_free(fn):
    """fn(q, k, v, beta, g) as fn(q, k, v, beta) with g = None (DeltaNet), so that grad takes
    every argument."""
    return functools.partial(lambda q, k, v, beta, fn: fn(q, k, v, beta, None), fn=fn)


def ours(backend):
    from gla_tpu import ops

    def fn(q, k, v, beta, g):
        return ops.delta_rule(q, k, v, beta, g, use_qk_l2norm=True, mode="chunk",
                              backend=backend)[0]
    return fn


def _grouped(q, k, v, beta, g):
    """(problem, grouped inputs) as the "pallas_gpu" chunk path sees them."""
    from gla_tpu.ops.delta_rule import xla
    from gla_tpu.ops.delta_rule.pallas_gpu import entry, operands
    from gla_tpu.ops.delta_rule.validation import validate_delta_rule

    problem, _, _ = validate_delta_rule(q, k, v, beta, g, scale=None, initial_state=None,
                                        output_final_state=False, segment_ids=None,
                                        use_qk_l2norm=True, mode="chunk", chunk_size=None)
    problem = problem.with_chunk_size(entry.CHUNK)
    return problem, xla.grouped_inputs(q, k, v, beta, g, None, problem)


def training_parts(bench, shape, gate, beta, args):
    """Where "pallas_gpu"'s forward+backward goes: the XLA WY operands (forward, and forward +
    backward against random cotangents), the state passes on them (forward + backward), and of
    those the training forward, the reversed pass and the per-chunk cotangents; with per-head
    gates or none also the kernel's operands with their own backward (what the op runs)."""
    from gla_tpu.ops.delta_rule.pallas_gpu import entry, vjp

    rec = functools.partial(bench.record, shape=shape, gate=gate, beta=beta)
    g = args[4] if len(args) > 4 else None
    problem, grouped = _grouped(*args[:4], g)

    def operands(*grouped):
        ops_, _ = entry.kernel_operands(*grouped, None, problem=problem)
        return [x for x in ops_ if isinstance(x, jax.Array)]

    rng = np.random.default_rng(2)
    cts = [jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
           for x in jax.eval_shape(operands, *grouped)]
    differentiable = [x for x in grouped if x is not None]

    def operands_loss(*xs):
        it = iter(xs)
        full = [None if x is None else next(it) for x in grouped]
        return sum(jnp.sum(o * jax.lax.optimization_barrier(c))
                   for o, c in zip(operands(*full), cts))

    ops_, passes = entry.kernel_operands(*grouped, None, problem=problem)
    k_out, u0, last, _, q_in, scores, w_neg, dtype = ops_
    ct = jnp.asarray(rng.standard_normal((shape[1], q_in.shape[1], shape[4], u0.shape[-1])),
                     jnp.float32)

    def passes_loss(k_out, u0, last, q_in, scores, w_neg):
        o, _ = vjp.state_passes(k_out, u0, last, None, q_in, scores, w_neg, dtype, passes, False)
        return jnp.sum(o.astype(jnp.float32) * jax.lax.optimization_barrier(ct))

    def training_forward(k_out, u0, last, q_in, scores, w_neg):
        return vjp.training_forward(k_out, u0, last, None, q_in, scores, w_neg, dtype, passes,
                                    False)

    state_args = (k_out, u0, last, q_in, scores, w_neg)
    _, residuals = jax.jit(training_forward)(*state_args)
    do = ct.astype(dtype)
    reversed_out = jax.jit(lambda r, do: vjp.reversed_pass(r, do, None, passes, False))(
        residuals, do)
    du, dh_hi, dh_lo, term, _ = reversed_out
    hi, lo = residuals[7:]
    timed = [
        ("ours_part_xla_operands", "fwd", lambda *xs: operands(*grouped), ()),
        ("ours_part_xla_operands", "fwd+bwd",
         jax.grad(operands_loss, argnums=tuple(range(len(differentiable)))), differentiable),
        ("ours_part_state_passes", "fwd+bwd", jax.grad(passes_loss, argnums=tuple(range(6))),
         state_args),
        ("ours_part_state_pass_training", "fwd", training_forward, state_args),
        ("ours_part_state_pass_reversed", "bwd",
         lambda r, do: vjp.reversed_pass(r, do, None, passes, False), (residuals, do)),
        ("ours_part_chunk_cotangents", "bwd",
         lambda *xs: vjp.chunk_cotangents(*xs[:3], xs[3:5], xs[5:7], *xs[7:], interpret=False,
                                            kernel=passes.cotangents_kernel),
         (do, residuals[6], du, hi, lo, dh_hi, dh_lo, last, term)),
    ]
    if problem.gate_kind != "key" and entry.kernel_operands_take(problem):
        from gla_tpu.ops.delta_rule.pallas_gpu import operands as wy

        def kernel_operands_loss(*xs):
            it = iter(xs)
            full = [None if x is None else next(it) for x in grouped]
            outs = wy.wy_operands(*full, problem=problem, interpret=False)
            return sum(jnp.sum(o.astype(jnp.float32) * jax.lax.optimization_barrier(
                jnp.ones(o.shape, jnp.float32))) for o in outs)

        timed.append(("ours_part_kernel_operands", "fwd+bwd",
                      jax.grad(kernel_operands_loss, argnums=tuple(range(len(differentiable)))),
                      differentiable))
    for impl, mode, fn, xs in timed:
        try:
            rec(impl=impl, mode=mode, timing=time_jax(fn, *xs),
                note="a part of ours_pallas_gpu's forward+backward")
        except Exception as e:
            rec(impl=impl, mode=mode, error=_error(e))


def ours_operands_only(q, k, v, beta, g):
    """What the "pallas_gpu" forward computes before its state pass (the WY operands: the Mosaic
    GPU kernel where it takes the problem, else XLA; their layout): the state pass's share is
    ours minus this."""
    from gla_tpu.ops.delta_rule.pallas_gpu import entry, operands

    problem, (q, k, v, beta, gates) = _grouped(q, k, v, beta, g)
    if not entry.kernel_operands_take(problem):
        operands, _ = entry.kernel_operands(q, k, v, beta, gates, None, problem=problem)
        return [x for x in operands if isinstance(x, jax.Array)]
    return list(operands.kernel_operands(q, k, v, beta, gates, problem=problem, interpret=False))


def jla(kind):
    def fn(q, k, v, beta, g):
        import jla.ops

        gates = dict(beta=beta) if g is None else dict(g=g, beta=beta)
        return jla.ops.linear_attention(kind, q, k, v, impl="mosaic_gpu", use_qk_l2norm=True,
                                        **gates)[0]
    return fn


def fla_function(variant, q, k, v, beta, g):
    """fla's chunked op on torch tensors -> a function returning o (the caller repeats q, k to
    the value heads, as fla's layers do for grouped value heads)."""
    if variant == "deltanet":
        from fla.ops.delta_rule import chunk_delta_rule

        return lambda: chunk_delta_rule(q, k, v, beta, use_qk_l2norm_in_kernel=True)[0]
    if variant == "kda":
        from fla.ops.kda import chunk_kda

        return lambda: chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return lambda: chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]


class Bench:
    def __init__(self, path, env):
        self.path, self.env, self.records = path, env, []

    def record(self, *, impl, shape, mode, gate, beta, timing=None, error=None, note=None,
               first_call_s=None):
        rec = dict(op="delta_rule", variant=shape[0], impl=impl, shape=list(shape[1:]),
                   mode=mode, dtype="bfloat16", gate=gate and GATES[gate][0],
                   beta=BETAS[beta][0], device=self.env["device"], date=self.env["date"],
                   versions=self.env["versions"])
        if timing is not None:
            rec.update(ms_median=timing[0], ms_min=timing[1], ms_max=timing[2])
        if first_call_s is not None:
            rec["first_call_s"] = first_call_s
        if error is not None:
            rec["error"] = error
        if note is not None:
            rec["note"] = note
        self.records.append(rec)
        write_json(self.path, self.records)
        result = f"{timing[0]:.3f} ms" if timing else "-"
        if first_call_s is not None:
            result += f"  (first call {first_call_s:.1f} s)"
        print(f"{shape[0]:8s} {impl:20s} {str(shape[1:]):34s} {mode:8s} {gate or '':6s} "
              f"{beta:8s} {result}{'' if error is None else '  ' + error[:150]}", flush=True)


def bench_shape(bench, shape, gate, beta, modes, ours_only, with_xla=True, parts=False):
    variant = shape[0]
    q, k, v, b_, g, ct = inputs(0, shape, gate, beta)
    args, jct = device_args(q, k, v, b_, g), jnp.asarray(ct)
    gate = None if variant == "deltanet" else gate
    rec = functools.partial(bench.record, shape=shape, gate=gate, beta=beta)
    impls = [("ours_pallas_gpu", ours("pallas_gpu"))]
    if with_xla:
        impls.append(("ours_xla", ours("xla")))
    if not ours_only:
        impls.append(("jla_mosaic_gpu", jla(JLA_KIND[variant])))
    reference = None
    for name, fn in impls:
        if g is None:
            fn = gate_free(fn)
        left = list(modes)
        try:
            start = time.perf_counter()
            out = jax.block_until_ready(jax.jit(fn)(*args))
            first_call = {"fwd": time.perf_counter() - start}
            reference = out if reference is None else reference
            err = rel_err(out, reference)
            if err > MATCH_TOLERANCE or not np.all(np.isfinite(np.asarray(out, np.float32))):
                rec(impl=name, mode="fwd", error=f"output differs from ours: rel err {err:.2e}")
                continue
            while left:
                mode = left[0]
                f = fn if mode == "fwd" else fwd_bwd(fn, jct)
                if mode not in first_call:
                    start = time.perf_counter()
                    jax.block_until_ready(jax.jit(f)(*args))
                    first_call[mode] = time.perf_counter() - start
                rec(impl=name, mode=mode, timing=time_jax(f, *args),
                    note=f"rel err vs ours {err:.1e}", first_call_s=first_call[mode])
                left.pop(0)
        except Exception as e:  # a peer that cannot take a shape is reported, not fatal
            rec(impl=name, mode=left[0] if left else "fwd", error=_error(e))
    try:
        prep = gate_free(ours_operands_only) if g is None else ours_operands_only
        rec(impl="ours_pallas_gpu_operands", mode="fwd", timing=time_jax(prep, *args),
            note="the XLA part of ours_pallas_gpu's forward alone")
    except Exception as e:
        rec(impl="ours_pallas_gpu_operands", mode="fwd", error=_error(e))
    if parts:
        training_parts(bench, shape, gate, beta, args)
    if ours_only or reference is None:
        return
    import torch

    h, hv = shape[3], shape[4]
    tq, tk = (torch.from_numpy(np.repeat(x, hv // h, axis=2)).cuda().to(torch.bfloat16)
              .requires_grad_() for x in (q, k))
    tv = torch.from_numpy(v).cuda().to(torch.bfloat16).requires_grad_()
    tb = torch.from_numpy(b_).cuda().to(torch.bfloat16).requires_grad_()
    tg = None if g is None else torch.from_numpy(g).cuda().requires_grad_()
    tct = torch.from_numpy(ct).cuda().to(torch.bfloat16)
    left = list(modes)
    try:
        fn = fla_function(variant, tq, tk, tv, tb, tg)
        start = time.perf_counter()
        with torch.no_grad():
            out = fn().float().cpu().numpy()
        first_call = {"fwd": time.perf_counter() - start}
        err = rel_err(out, reference)
        if err > MATCH_TOLERANCE:
            rec(impl="fla_chunk", mode="fwd", error=f"output differs from ours: rel err {err:.2e}")
            return
        while left:
            mode = left[0]

            def run(fn=fn, mode=mode):
                if mode == "fwd":
                    with torch.no_grad():
                        fn()
                else:
                    fn().backward(tct)
            note = f"rel err vs ours {err:.1e}" + ("; q, k repeated to HV heads" if hv != h
                                                    else "")
            if mode not in first_call:  # triton's compiles and fla's autotuning
                start = time.perf_counter()
                run()
                torch.cuda.synchronize()
                first_call[mode] = time.perf_counter() - start
            rec(impl="fla_chunk", mode=mode, timing=time_torch(run), note=note,
                first_call_s=first_call[mode])
            left.pop(0)
    except Exception as e:
        rec(impl="fla_chunk", mode=left[0] if left else "fwd", error=_error(e))


def bench_decode(bench, shape, gate, beta):
    """One decode step (T = 1, from a state ~ N(0, 1) float32, final state out): ours ("auto",
    which runs "pallas_gpu"'s token-by-token kernel on Hopper, and "xla"'s token scan) against
    fla's `fused_recurrent_gated_delta_rule`."""
    import warnings

    from gla_tpu import ops

    q, k, v, b_, g, _ = inputs(0, shape, gate, beta)
    _, b, _, h, hv, kd, vd = shape
    state = np.random.default_rng(1).standard_normal((b, hv, kd, vd), np.float32)
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)] + [
        jnp.asarray(b_), jnp.asarray(g), jnp.asarray(state)]
    rec = functools.partial(bench.record, shape=shape, gate=gate, beta=beta)

    def ours_decode(backend):
        def fn(q, k, v, beta, g, s0):
            return ops.delta_rule(q, k, v, beta, g, initial_state=s0, output_final_state=True,
                                  use_qk_l2norm=True, mode="fused_recurrent", backend=backend)
        return fn

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "auto" falling back to "xla" warns once
        ours_o, _ = jax.block_until_ready(jax.jit(ours_decode("auto"))(*args))
        rec(impl="ours_auto", mode="decode", timing=time_jax(ours_decode("auto"), *args),
            note="backend auto: pallas_gpu's token-by-token kernel on Hopper")
        xla_o, _ = jax.block_until_ready(jax.jit(ours_decode("xla"))(*args))
        rec(impl="ours_xla", mode="decode", timing=time_jax(ours_decode("xla"), *args),
            note=f"xla's token scan; rel err vs auto {rel_err(xla_o, ours_o):.1e}")
    try:
        import torch
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        tq, tk, tv = (torch.from_numpy(x).cuda().to(torch.bfloat16) for x in (q, k, v))
        tb = torch.from_numpy(b_).cuda().to(torch.bfloat16)
        tg, ts = torch.from_numpy(g).cuda(), torch.from_numpy(state).cuda()

        def run():
            with torch.no_grad():
                return fused_recurrent_gated_delta_rule(
                    tq, tk, tv, g=tg, beta=tb, initial_state=ts, output_final_state=True,
                    use_qk_l2norm_in_kernel=True)

        err = rel_err(run()[0].float().cpu().numpy(), np.asarray(ours_o, np.float32))
        if err > MATCH_TOLERANCE:
            rec(impl="fla_fused_recurrent", mode="decode",
                error=f"output differs from ours: rel err {err:.2e}")
        else:
            rec(impl="fla_fused_recurrent", mode="decode", timing=time_torch(run),
                note=f"rel err vs ours {err:.1e}")
    except Exception as e:
        rec(impl="fla_fused_recurrent", mode="decode", error=_error(e))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="gpu_delta_rule")
    parser.add_argument("--shapes", default=None, help="comma-separated indices into SHAPES")
    parser.add_argument("--gates", default="peer", help=f"comma-separated from {sorted(GATES)}")
    parser.add_argument("--betas", default="sigmoid", help=f"comma-separated from {sorted(BETAS)}")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--ours-only", action="store_true")
    parser.add_argument("--no-xla", action="store_true", help="leave out our 'xla' backend")
    parser.add_argument("--parts", action="store_true",
                        help="also time the parts of ours' forward+backward (XLA operands, "
                             "state passes)")
    parser.add_argument("--decode", action="store_true",
                        help="time the decode step at DECODE_SHAPES instead (--shapes indexes them)")
    args = parser.parse_args(argv)
    table = DECODE_SHAPES if args.decode else SHAPES
    shapes = (table if args.shapes is None
              else [table[int(i)] for i in args.shapes.split(",")])
    env = environment()
    env["versions"] = versions()
    os.makedirs(args.out, exist_ok=True)
    bench = Bench(os.path.join(args.out, f"{args.tag}.json"), env)
    print(f"device {env['device']}", flush=True)
    for shape in shapes:
        gates = ["peer"] if shape[0] == "deltanet" else args.gates.split(",")
        for gate in gates:
            for beta in args.betas.split(","):
                try:
                    if args.decode:
                        bench_decode(bench, shape, gate, beta)
                        continue
                    bench_shape(bench, shape, gate, beta, args.modes.split(","), args.ours_only,
                                with_xla=not args.no_xla, parts=args.parts)
                except Exception as e:
                    traceback.print_exc()
                    print(f"{shape}: not measured: {_error(e)}", flush=True)
    rows = [dict(r, shape=str(tuple(r["shape"]))) for r in bench.records]
    table = format_table(rows, ["variant", "impl", "shape", "mode", "gate", "beta", "ms_median",
                                "error"])
    with open(os.path.join(args.out, f"{args.tag}.md"), "w") as f:
        f.write(f"device {env['device']}, date {env['date']}, versions "
                f"{json.dumps(env['versions'])}\n\n```\n{table}\n```\n")
    print(table)


if __name__ == "__main__":
    main()
