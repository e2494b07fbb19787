"""Side-by-side GPU benchmark: our Pallas GPU kernels vs cuDNN, XLA, JAX's Pallas GPU
attention, jax-linear-attention (Mosaic GPU) and flash-linear-attention (torch + triton), in one
process on one GPU, bfloat16, forward and forward+backward.

Inputs are drawn once in numpy (float32, rounded to bfloat16 by each framework the same way);
before timing, each peer's forward output is compared with ours (relative RMS error), and a peer
that disagrees is reported, not timed. jax code is timed with bench/harness.py's time_jitted,
torch code with triton.testing.do_bench (median). Each measured program prints one line as it
ends, counted "[n/N]" over the run.

Parts (--part, repeatable):
  attention             softmax attention: ours, cuDNN, XLA, JAX's Pallas, jla's FA3
  attention_segments    attention with segment ids: ours, our Triton kernels, our XLA backend
  attention_window      causal attention under a local window (and a soft cap): ours, cuDNN,
                        and our own causal kernel without a window at the same T
  gla, gla_per_head     GLA (per-key / per-head gates): ours, jla, fla
  gla_segments          GLA with segment ids against the same draw without them
  decode                one token with a state: ours vs fla's fused_recurrent_gla
  breakdown             each chunked Triton GLA kernel alone
  breakdown_pair_levels each pair-level Mosaic GPU GLA kernel alone (Hopper's default path)
  crossover             GLA against causal flash attention over T

--attention-sizes and --gla-sizes time variants of our BlockSizes beside ours as shipped (tile
choices on a new GPU); --profile runs each program twice without timing, for Nsight Compute or
Nsight Systems.

Usage (on the GPU machine):
  python bench/gpu_side_by_side.py --part attention --out results/
  python bench/gpu_side_by_side.py --part gla --part crossover --out results/
  python bench/gpu_side_by_side.py --part attention --attention-shapes 0,1 --ours-only \\
      --attention-sizes "forward_kernel=mosaic_gpu,mosaic_forward=64x64x3" --out results/
  python bench/gpu_side_by_side.py --part attention --attention-shapes 0,1 --ours-only \
      --attention-sizes "forward_kernel=mosaic_gpu,mosaic_forward=64x128x2p" --out results/
  python bench/gpu_side_by_side.py --part breakdown_pair_levels --part gla --ours-only \\
      --gla-shapes 1 --gates fla --gla-sizes "mosaic_group_sums=float32" --out results/
  ncu --metrics gpu__time_duration.sum --print-summary per-kernel \\
      python bench/gpu_side_by_side.py --part gla --ours-only --gla-shapes 1 --gates fla \\
      --modes fwd+bwd --profile --out /tmp/profile
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
from bench.harness import (Progress, environment, format_table, time_jitted,  # noqa: E402
                           write_json)

ATTENTION_SHAPES = [  # (B, H, T, D, causal)
    (4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (4, 16, 4096, 64, False),
    (4, 16, 4096, 64, True), (2, 16, 4096, 256, False), (2, 16, 4096, 256, True),
    (1, 5, 16384, 128, False), (1, 5, 16384, 128, True), (16, 16, 1024, 128, False),
    (16, 16, 1024, 128, True),
    # T between the crossover of the Mosaic GPU and Triton forwards, D = 64 at long T, a length
    # that is no multiple of the blocks, and short T
    (4, 16, 2048, 128, False), (4, 16, 2048, 128, True), (2, 16, 8192, 64, False),
    (2, 16, 8192, 64, True), (4, 16, 4000, 128, True), (32, 16, 512, 128, False),
]
GLA_SHAPES = [(4, 4096, 16, 128, 128), (8, 2048, 4, 256, 512), (8, 2048, 16, 64, 64),
              (2, 16384, 8, 128, 128)]
CROSSOVER_T = [512, 1024, 2048, 4096, 8192, 16384, 32768]
MATCH_TOLERANCE = 2e-2  # relative RMS error between two bfloat16 implementations
PARTS = ["attention", "attention_segments", "attention_window", "gla", "gla_per_head", "gla_segments", "decode",
         "crossover", "breakdown", "breakdown_pair_levels"]


def _logsigmoid(x):
    return -np.logaddexp(0.0, -x)


# Log-gate distributions, by the name a record carries. "fla" is fla's and jla's op-benchmark
# draw and the default; "fla/16" fla's GLA layer default (gate_logit_normalizer 16); "weak" gates
# close to 1 (about -0.05 a step); "minus3" about -3 a step; "strong" decays of up to 1e3 a step.
# The last two are the inputs slowest for a kernel with a data-dependent exact path.
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
    ours_only: bool = False  # time our kernels only (no cuDNN, XLA, JAX's Pallas, jla, fla)
    with_triton: bool = False  # GLA: also time our chunked Triton kernels
    profile: bool = False  # run each program twice instead of timing it
    progress: Progress | None = None  # the "[n/N]" counter of the printed lines


def rel_err(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def record(ctx, *, op, impl, shape, mode, timing=None, flops=None, ms=None, error=None,
           note=None, gate=None, programs=1):
    """Appends one record and prints its line; `programs`: how many planned programs the line
    stands for (a peer refused by the check stands for each of its modes)."""
    rec = dict(op=op, impl=impl, shape=list(shape), mode=mode, dtype="bfloat16",
               device=ctx.env["device"], date=ctx.env["date"], versions=ctx.env["versions"])
    if gate is not None:
        rec["gate"] = GATES[gate][0]
    if timing is not None:
        rec.update(ms_median=timing[0], ms_min=timing[1], ms_max=timing[2])
        rec["tflops"] = flops / (timing[0] * 1e-3) / 1e12 if flops else None
    else:
        rec.update(ms_median=None, ms_min=None, ms_max=None, tflops=None)
    if ctx.profile and error is None:
        note = "run twice for a profiler, not timed" + ("" if note is None else f"; {note}")
    if error is not None:
        rec["error"] = error
    if note is not None:
        rec["note"] = note
    ctx.records.append(rec)
    if ctx.path:
        write_json(ctx.path, ctx.records)
    counter = ctx.progress.step(programs) + " " if ctx.progress else ""
    if rec["ms_median"] is not None:
        result = f"{rec['ms_median']:.3f} ms"
    else:
        result = "ran" if ctx.profile and error is None else "-"
    print(f"{counter}{op:10s} {impl:22s} {str(shape):32s} {mode:8s} {gate or '':7s} {result}"
          f"{'' if rec['tflops'] is None else f'  {rec['tflops']:.0f} TF/s'}"
          f"{'' if error is None else '  ' + error[:120]}", flush=True)


def time_jax(fn, *args):
    # 50 calls per sync: a forward of 0.1-0.3 ms timed in repeats of 10 calls carries the host's
    # dispatch and the launch latency (medians of such repeats spread by 2x)
    t = time_jitted(fn, *args, warmup=3, iters=50, repeats=7)
    return t.median_ms, t.min_ms, t.max_ms


def time_torch(fn):
    import triton.testing

    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="all")
    return float(np.median(ms)), float(np.min(ms)), float(np.max(ms))


def measure_jax(ctx, fn, *args):
    """time_jax's (median, min, max) ms of jax.jit(fn)(*args); with ctx.profile, None after
    two calls (the first warms up, a profiler reads either)."""
    if not ctx.profile:
        return time_jax(fn, *args)
    compiled = jax.jit(fn).lower(*args).compile()
    for _ in range(2):
        jax.block_until_ready(compiled(*args))
    return None


def measure_torch(ctx, fn):
    """time_torch's (median, min, max) ms of fn(); with ctx.profile, None after two calls (the
    first also runs triton's autotuning)."""
    if not ctx.profile:
        return time_torch(fn)
    import torch

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    return None


def fwd_bwd(fn, ct):
    """jax function of (q, k, v, ...) -> the gradients of sum(fn(...) * ct) w.r.t. every input.

    ct is a constant of the compiled program; behind an optimization barrier, so that XLA does
    not fold the output cotangent's casts and transposes into constants at compile time (it did:
    the timed backward then skipped work a training step does, and compiles took longer)."""

    def loss(*args):
        return jnp.sum(fn(*args).astype(jnp.float32) * jax.lax.optimization_barrier(ct))

    def grads(*args):
        return jax.grad(loss, argnums=tuple(range(len(args))))(*args)

    return grads


def parse_sizes(text):
    """'default;field=value,field=value;...' -> a list of dicts of BlockSizes fields, one per
    variant ('default': none; digits become ints, 'true' / 'false' bools, anything else stays a
    string)."""
    variants = []
    for variant in text.split(";"):
        fields = {}
        for item in variant.split(","):
            if item and item != "default":
                name, value = item.split("=")
                booleans = {"true": True, "false": False}
                fields[name] = (int(value) if value.isdigit() else
                                booleans.get(value.lower(), value))
        variants.append(fields)
    return variants


def sizes_tag(sizes):
    """A record's impl suffix for the BlockSizes fields of a variant (none: the defaults)."""
    return "".join(f"/{name}={value}" for name, value in (sizes or {}).items())


def time_jax_impls(ctx, impls, args, ct, *, op, shape, flops, reference=None, gate=None,
                   note=""):
    """Times each of `impls` ([(name, jax function of args, modes)]) in each of its modes, after
    checking its forward output against `reference` (None: the first impl's output). A program
    that fails or disagrees is recorded with its error and not timed. flops: mode -> count."""
    for name, fn, modes in impls:
        if not modes:
            continue
        left = list(modes)
        checked = False
        try:
            out = jax.block_until_ready(jax.jit(fn)(*args))
            reference = out if reference is None else reference
            err = rel_err(out, reference)
            checked = True
            if err > MATCH_TOLERANCE:
                record(ctx, op=op, impl=name, shape=shape, mode="fwd", gate=gate,
                       programs=len(left), error=f"output differs from ours: rel err {err:.2e}")
                continue
            while left:
                mode = left[0]
                f = fn if mode == "fwd" else fwd_bwd(fn, ct)
                record(ctx, op=op, impl=name, shape=shape, mode=mode, gate=gate,
                       timing=measure_jax(ctx, f, *args), flops=flops(mode),
                       note=f"{note}rel err vs ours {err:.1e}")
                left.pop(0)
        except Exception as e:  # a peer that cannot take a shape is reported, not fatal
            mode = left[0] if checked and left else "fwd"
            record(ctx, op=op, impl=name, shape=shape, mode=mode, gate=gate,
                   programs=len(left), error=_error(e))


# Softmax.


def attention_block_sizes(d, fields):
    """default_block_sizes(d, bfloat16) with BlockSizes fields replaced; mosaic_forward and
    mosaic_backward given as 'BQxBKVxSTAGES' (ForwardTiles / BackwardTiles), a trailing 'p' for
    the persistent forward ('64x128x2p')."""
    from gla_tpu.ops.attention.pallas_gpu import BackwardTiles, ForwardTiles, default_block_sizes

    def tiles(name, value):
        value = str(value)
        if name == "mosaic_backward":
            return BackwardTiles(*map(int, value.split("x")))
        return ForwardTiles(*map(int, value.rstrip("p").split("x")),
                            persistent=value.endswith("p"))

    fields = {name: tiles(name, value) if name in ("mosaic_forward", "mosaic_backward") else value
              for name, value in fields.items()}
    return dataclasses.replace(default_block_sizes(d, jnp.bfloat16), **fields)


def attention_impls(causal, d, modes, variants=(), ours_only=False):
    """[(name, jax function (q, k, v) -> o, modes)], all in [B, T, H, D]: ours as shipped first
    (the reference of the check), each BlockSizes variant, then the peers."""
    from gla_tpu import ops

    def ours(block_sizes=None):
        return lambda q, k, v: ops.flash_attention(q, k, v, causal=causal, backend="pallas_gpu",
                                                   block_sizes=block_sizes)

    # ours as shipped (on Hopper: the Mosaic GPU forward and backward at D 64 / 128 / 256), with
    # the Triton forward forced (timed forward only) and with the Triton backward forced (timed
    # forward+backward only), to show what each kernel brings
    impls = [("ours_pallas_gpu", ours(), modes)]
    impls += [("ours_pallas_gpu" + sizes_tag(fields), ours(attention_block_sizes(d, fields)),
               modes) for fields in variants]
    if not ours_only:
        impls += [
            ("cudnn", lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation="cudnn"), modes),
            ("xla", lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation="xla"), modes),
        ]
    if d in (64, 128):  # elsewhere ours is the Triton forward already
        impls += [
            ("ours_triton_forward", ours(attention_block_sizes(d, {"forward_kernel": "triton"})),
             [m for m in modes if m == "fwd"]),
            ("ours_triton_backward",
             ours(attention_block_sizes(d, {"backward_kernel": "triton"})),
             [m for m in modes if m == "fwd+bwd"]),
        ]
    if ours_only:
        return impls
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as jax_pallas
    impls.append(("jax_pallas_triton", lambda q, k, v: jax_pallas.mha(
        q, k, v, None, sm_scale=d**-0.5, causal=causal), modes))
    if causal and d in (64, 128):
        try:
            from jla.ops.mosaic_gpu.attention import flash_attention as jla_fa
        except ImportError:  # jax-linear-attention is not installed on every GPU machine
            jla_fa = None
        if jla_fa is not None:
            impls.append(("jla_mosaic_fa3", lambda q, k, v: jla_fa(q, k, v), modes))
    return impls


def bench_attention(ctx, rng, shape, impls):
    """One attention shape: `impls` (attention_impls) on inputs drawn from `rng` (one generator
    for the part's shapes in turn)."""
    b, h, t, d, causal = shape
    arrs = [jnp.asarray(rng.standard_normal((b, t, h, d), np.float32), jnp.bfloat16)
            for _ in range(3)]
    ct = jnp.asarray(rng.standard_normal((b, t, h, d), np.float32))
    time_jax_impls(ctx, impls, arrs, ct, op="softmax",
                   shape=(b, h, t, d, "causal" if causal else "full"),
                   flops=lambda mode: attention_flops(b, t, t, h, d, causal=causal,
                                                      backward=mode == "fwd+bwd"))


# Segment ids: documents packed in each row (a new id after each token with probability 1 / 1024,
# about four documents per 4096 tokens). Every block is masked with segment ids, in both our
# kernels, so the time does not depend on where the documents end. cuDNN through
# jax.nn.dot_product_attention takes sequence lengths, not segment ids: the peers are our Triton
# kernels (forced) and our XLA backend.
SEGMENT_SHAPES = [(4, 16, 4096, 128, True), (4, 16, 4096, 128, False), (4, 16, 4096, 64, True),
                  (2, 16, 4096, 256, True)]


def attention_segment_impls(causal, d, modes, ids):
    """[(name, jax function (q, k, v) -> o, modes)] with segment ids `ids` [B, T]."""
    from gla_tpu import ops

    triton = attention_block_sizes(d, {"forward_kernel": "triton", "backward_kernel": "triton"})
    kinds = {
        "ours_pallas_gpu": dict(backend="pallas_gpu"),
        "ours_triton": dict(backend="pallas_gpu", block_sizes=triton),
        "ours_xla": dict(backend="xla"),
    }
    return [(name, functools.partial(ops.flash_attention, causal=causal, segment_ids=ids,
                                     **kwargs), modes)
            for name, kwargs in kinds.items()]


def bench_attention_segments(ctx, rng, shape, modes):
    """One shape with segment ids: attention_segment_impls on inputs drawn from `rng`."""
    b, h, t, d, causal = shape
    arrs = [jnp.asarray(rng.standard_normal((b, t, h, d), np.float32), jnp.bfloat16)
            for _ in range(3)]
    ids = jnp.asarray(np.cumsum(rng.random((b, t)) < 1 / 1024, axis=1), jnp.int32)
    ct = jnp.asarray(rng.standard_normal((b, t, h, d), np.float32))
    time_jax_impls(ctx, attention_segment_impls(causal, d, modes, ids), arrs, ct, op="softmax",
                   shape=(b, h, t, d, ("causal" if causal else "full") + "+segments"),
                   flops=lambda mode: attention_flops(b, t, t, h, d, causal=causal,
                                                      backward=mode == "fwd+bwd"),
                   note=f"segment ids: {int(ids[0, -1]) + 1} documents in row 0; ")


# Local windows: causal, query i sees keys i - w .. i (local_window_size=(w, 0)), B1 H8 D128, as
# the TPU estimate of docs/benchmarks.md. cuDNN takes the window through
# jax.nn.dot_product_attention(local_window_size=...) and has no soft cap: the soft-capped
# programs are ours against ours uncapped. FLOPs count the visible (query, key) pairs.
WINDOW_SHAPES = [(1, 8, 8192, 128), (1, 8, 16384, 128)]  # (B, H, T, D)
WINDOWS = [1024, 4096]
WINDOW_SOFT_CAP = 50.0  # Gemma 2's attention cap


def window_pairs(t: int, w: int | None) -> int:
    """Visible (query, key) pairs of causal attention over T tokens under a window (w, 0)."""
    if w is None:
        return t * (t + 1) // 2
    w = min(w, t - 1)
    return (w + 1) * (w + 2) // 2 + (t - w - 1) * (w + 1)


def attention_window_impls(window, modes, ours_only=False):
    """[(name, jax function (q, k, v) -> o, modes)] for one window size (None: causal only)."""
    from gla_tpu import ops

    def ours(**options):
        return lambda q, k, v: ops.flash_attention(q, k, v, causal=True, backend="pallas_gpu",
                                                   **options)

    if window is None:
        return [("ours_pallas_gpu", ours(), modes)]
    impls = [("ours_pallas_gpu", ours(local_window_size=(window, 0)), modes),
             ("ours_pallas_gpu_softcap",
              ours(local_window_size=(window, 0), logits_soft_cap=WINDOW_SOFT_CAP), modes)]
    if not ours_only:
        impls.append(("cudnn", lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=(window, 0), implementation="cudnn"),
            modes))
    return impls


def bench_attention_window(ctx, rng, shape, window, modes):
    """One shape and window: attention_window_impls on inputs drawn from `rng`."""
    b, h, t, d = shape
    arrs = [jnp.asarray(rng.standard_normal((b, t, h, d), np.float32), jnp.bfloat16)
            for _ in range(3)]
    ct = jnp.asarray(rng.standard_normal((b, t, h, d), np.float32))
    pairs = window_pairs(t, window)

    def flops(mode):  # 2 matmuls of 2 D flops per visible pair; fwd+bwd 3.5x
        return 4.0 * b * h * d * pairs * (3.5 if mode == "fwd+bwd" else 1.0)

    tag = "causal" if window is None else f"causal+window{window}"
    time_jax_impls(ctx, attention_window_impls(window, modes, ctx.ours_only), arrs, ct,
                   op="softmax", shape=(b, h, t, d, tag), flops=flops,
                   note=f"visible pairs {pairs / window_pairs(t, None):.3f} of causal; ")


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


def gla_jax_impls(ctx, modes, *, per_head, variants=({},)):
    """[(name, jax function (q, k, v, g) -> o, modes)] for one GLA shape: ours in each BlockSizes
    variant ({}: as shipped), the Triton kernels where asked, jla's."""
    impls = []
    if not ctx.peers_only:
        impls += [("ours_chunk" + sizes_tag(fields), ours_gla("chunk", **fields), modes)
                  for fields in variants]
        if per_head:  # "auto" takes the Mosaic GPU forward on Hopper; Triton's for comparison
            impls.append(("ours_chunk_triton_fwd", ours_gla("chunk", forward_kernel="triton"),
                          [m for m in modes if m == "fwd"]))
        if ctx.with_triton:  # "auto" runs the pair-level Mosaic GPU kernels on Hopper
            impls.append(("ours_chunk_triton", ours_gla("chunk", chunk_kernel="triton"), modes))
    if not per_head and not ctx.ours_only:  # jla's GLA takes per-key gates only
        impls.append(("jla_mosaic_gpu", jla_gla, modes))
    return impls


def fla_peers(ctx, *, per_head, fla_recurrent):
    """Names of the fla functions timed for one GLA shape."""
    if ctx.ours_only:
        return []
    if per_head:
        return ["fla_chunk_simple_gla"]
    return ["fla_chunk_gla"] + (["fla_fused_recurrent_gla"] if fla_recurrent else [])


def _fla_function(name, q, k, v, g):
    """fla's function `name` on torch tensors, -> o."""
    if name == "fla_chunk_simple_gla":
        from fla.ops.simple_gla import chunk_simple_gla

        return lambda: chunk_simple_gla(q, k, v, g)[0]
    from fla.ops.gla import chunk_gla, fused_recurrent_gla

    fn = {"fla_chunk_gla": chunk_gla, "fla_fused_recurrent_gla": fused_recurrent_gla}[name]
    return lambda: fn(q, k, v, g)[0]


def bench_gla_shape(ctx, shape, gate, jax_impls, peers, fla_modes, *, per_head=False):
    """One GLA shape and gate distribution: `jax_impls` (gla_jax_impls) and fla's `peers`
    (fla_peers, in `fla_modes`), each checked against ours as shipped."""
    b, t, h, kd, vd = shape
    op = "gla_per_head" if per_head else "gla"
    rng = np.random.default_rng(ctx.seed)
    q, k, v, g, _ = gla_inputs(rng, b, t, h, kd, vd, gate=gate, per_head=per_head)
    jq, jk, jv = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    jg = jnp.asarray(g)
    jct = jnp.asarray(rng.standard_normal((b, t, h, vd), np.float32))
    ours = jax.block_until_ready(jax.jit(ours_gla("chunk"))(jq, jk, jv, jg))

    def flops(mode):
        return gla_flops(b, t, h, kd, vd, backward=mode == "fwd+bwd")

    time_jax_impls(ctx, jax_impls, (jq, jk, jv, jg), jct, op=op, shape=shape, flops=flops,
                   reference=ours, gate=gate)
    if not peers:
        return
    import torch

    dev = "cuda"
    tq, tk, tv = (torch.from_numpy(x).to(dev).to(torch.bfloat16).requires_grad_()
                  for x in (q, k, v))
    tg = torch.from_numpy(g).to(dev).requires_grad_()
    tct = torch.from_numpy(np.asarray(jct)).to(dev).to(torch.bfloat16)
    for name in peers:
        left = list(fla_modes)
        try:
            fn = _fla_function(name, tq, tk, tv, tg)
            with torch.no_grad():
                out = fn().float().cpu().numpy()
            err = rel_err(out, ours)
            if err > MATCH_TOLERANCE:
                record(ctx, op=op, impl=name, shape=shape, mode="fwd", gate=gate,
                       programs=len(left), error=f"output differs from ours: rel err {err:.2e}")
                continue
            while left:
                mode = left[0]
                if mode == "fwd":
                    def run(fn=fn):
                        with torch.no_grad():
                            fn()
                else:
                    def run(fn=fn):
                        fn().backward(tct)
                record(ctx, op=op, impl=name, shape=shape, mode=mode, gate=gate,
                       timing=measure_torch(ctx, run), flops=flops(mode),
                       note=f"rel err vs ours {err:.1e}")
                left.pop(0)
        except Exception as e:
            record(ctx, op=op, impl=name, shape=shape, mode="fwd", gate=gate,
                   programs=len(left), error=_error(e))


SEGMENT_MEAN_LEN = 512  # GLA documents packed into a row: segment lengths geometric, this mean


def gla_segment_impls(modes, segment_ids):
    """([(name, jax function (q, k, v, g) -> o, modes)] with `segment_ids`, the same without)."""
    with_ids = [("ours_chunk_segments", ours_gla("chunk", segment_ids=segment_ids), modes),
                # the Triton kernels' forward only (their backward's autotuning takes minutes)
                ("ours_chunk_triton_segments",
                 ours_gla("chunk", chunk_kernel="triton", segment_ids=segment_ids),
                 [m for m in modes if m == "fwd"])]
    return with_ids, [("ours_chunk", ours_gla("chunk"), modes)]


def bench_gla_segments(ctx, shape, gate, modes):
    """Ours with segment ids (random_segment_ids, mean length SEGMENT_MEAN_LEN; the Triton
    kernels checked against "auto"), and ours without them on the same draw: what segment ids
    cost."""
    from gla_tpu.testing.problems import random_segment_ids

    b, t, h, kd, vd = shape
    args, ct = timing_inputs(ctx.seed, shape, gate)
    ids = random_segment_ids(jax.random.key(ctx.seed), b, t, mean_len=SEGMENT_MEAN_LEN)
    with_ids, without = gla_segment_impls(modes, ids)

    def flops(mode):
        return gla_flops(b, t, h, kd, vd, backward=mode == "fwd+bwd")

    time_jax_impls(ctx, with_ids, args, ct, op="gla", shape=shape, flops=flops, gate=gate,
                   note=f"segment_ids: random_segment_ids mean length {SEGMENT_MEAN_LEN}; ")
    time_jax_impls(ctx, without, args, ct, op="gla", shape=shape, flops=flops, gate=gate,
                   note="no segment_ids; ")


def timing_inputs(seed, shape, gate, per_head=False):
    """(q, k, v bfloat16 and g float32 on the device, a float32 output cotangent) for timing
    forward and forward+backward: q, k, v ~ N(0, 1), g from GATES."""
    b, t, h, kd, vd = shape
    rng = np.random.default_rng(seed)
    q, k, v, g, _ = gla_inputs(rng, b, t, h, kd, vd, gate=gate, per_head=per_head)
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)] + [jnp.asarray(g)]
    return args, jnp.asarray(rng.standard_normal(v.shape, np.float32))


def decode_impls(ctx):
    return ["ours_fused_recurrent"] + ([] if ctx.ours_only else ["fla_fused_recurrent_gla"])


def bench_decode(ctx, b=64, h=16, kd=128, vd=128):
    """One token with a state: ours (mode fused_recurrent) vs fla's fused_recurrent_gla, fwd."""
    rng = np.random.default_rng(ctx.seed)
    q, k, v, g, s0 = gla_inputs(rng, b, 1, h, kd, vd, with_state=True)
    jargs = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)] + [jnp.asarray(g), jnp.asarray(s0)]
    shape = (b, 1, h, kd, vd)
    fn = ours_gla("fused_recurrent")
    ours = np.asarray(jax.jit(fn)(*jargs), np.float32)
    record(ctx, op="gla_decode", impl="ours_fused_recurrent", shape=shape, mode="fwd", gate="fla",
           timing=measure_jax(ctx, fn, *jargs))
    if ctx.ours_only:
        return
    import torch
    from fla.ops.gla import fused_recurrent_gla

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
           gate="fla", timing=measure_torch(ctx, run), note=f"rel err vs ours {err:.1e}")


def triton_geometry(shape):
    """The chunked Triton kernels' plan.ChunkGeometry at `shape` in mode "chunk"."""
    from gla_tpu.ops.gla.pallas_gpu import plan

    _, t, _, kd, vd = shape
    return plan.chunk_geometry(t, kd, vd, scale=kd**-0.5, has_segments=False, exact_inter=False)


def triton_stages(geo):
    """name -> jax function, each kernel of the chunked Triton GLA (forward: state pass, intra
    scores, output; backward: reversed state pass, dA, dq/dk/dg, dv) in the order they run."""
    from gla_tpu.ops.common.chunk_cumsum import chunk_local_cumsum
    from gla_tpu.ops.gla.pallas_gpu import kernels_intra, kernels_output, kernels_state

    return {
        "gate_cumsum": lambda g: chunk_local_cumsum(g, geo.chunk, method="triangular"),
        "state_pass_fwd": lambda k, v, b: kernels_state.state_pass(
            k, v, b, None, None, None, geo=geo, reverse=False, interpret=False),
        "bounded_flags": lambda b: kernels_intra.bounded_chunks(b, geo.chunk),
        "intra_scores": lambda q, k, b, f: kernels_intra.intra_scores(q, k, b, None, f, geo=geo,
                                                                     interpret=False),
        "chunk_output": lambda q, b, a, v, s: kernels_output.chunk_output(
            q, b, None, a, v, s, geo=geo, interpret=False),
        "state_pass_rev": lambda q, do, b, s: kernels_state.state_pass(
            q, do, b, None, None, s, geo=geo, reverse=True, interpret=False),
        "chunk_da": lambda do, v: kernels_intra.chunk_da(do, v, None, geo=geo, interpret=False),
        "chunk_dqk": lambda q, k, v, do, b, da, s, ds, f: kernels_intra.chunk_dqk(
            q, k, v, do, b, *da, None, None, None, None, s, ds, f, geo=geo, interpret=False),
        "chunk_dv": lambda k, b, a, do, ds: kernels_output.chunk_dv(
            k, b, None, a, do, ds, geo=geo, interpret=False),
    }


def bench_gla_breakdown(ctx, shape):
    """Times each kernel of the chunked Triton GLA alone, to show where the time goes."""
    b, t, h, kd, vd = shape
    rng = np.random.default_rng(ctx.seed)
    q, k, v, g, _ = gla_inputs(rng, b, t, h, kd, vd)
    jq, jk, jv = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    do = jv
    run = {name: jax.jit(fn) for name, fn in triton_stages(triton_geometry(shape)).items()}
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
            record(ctx, op="gla_kernel", impl=name, shape=shape, mode="fwd", gate="fla",
                   timing=measure_jax(ctx, fn, *args[name]))
        except Exception as e:
            record(ctx, op="gla_kernel", impl=name, shape=shape, mode="fwd", gate="fla",
                   error=_error(e))


def pair_level_geometry(shape, sizes=None):
    """plan.ChunkGeometry of the pair-level Mosaic GPU kernels at `shape` with BlockSizes fields
    `sizes`, as ops.gla plans a call (key groups of 128 as virtual heads)."""
    from gla_tpu.ops.gla.pallas_gpu.plan import BlockSizes, chunk_geometry

    b, t, h, kd, vd = shape
    return chunk_geometry(t, kd, vd, scale=kd ** -0.5, has_segments=False, exact_inter=False,
                          mosaic_chunk=True, batch=b, heads=h,
                          block_sizes=BlockSizes(chunk_kernel="mosaic_gpu", **(sizes or {})))


def kernel_stages(geo):
    """name -> (function, names of its arguments), in the order the forward and backward run,
    for a call of plan.ChunkGeometry `geo` (its key groups as virtual heads and its state-pass
    settings, as ops.gla runs them)."""
    from gla_tpu.ops.gla.pallas_gpu import (kernels_mosaic_grads, kernels_mosaic_levels,
                                            kernels_mosaic_state, vjp)

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


def kernel_operands(geo, shape, gate, seed=0):
    """Every operand of kernel_stages(geo), from one draw (q, k, v, do ~ N(0, 1), g from GATES);
    K above 128 as groups of 128 keys, virtual heads (q, k and g reshaped, as ops.gla does)."""
    b, t, h, kd, vd = shape
    groups = geo.key_groups
    rng = np.random.default_rng(seed)
    q, k, v, g, _ = gla_inputs(rng, b, t, h, kd, vd, gate=gate)
    q, k, g = (x.reshape(b, t, h * groups, kd // groups) for x in (q, k, g))
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
    return env


def bench_pair_level_kernels(ctx, shape, gate, sizes=None):
    """Times each pair-level Mosaic GPU kernel alone (prep, the three state passes, grads), with
    BlockSizes fields `sizes`."""
    geo = pair_level_geometry(shape, sizes)
    env = kernel_operands(geo, shape, gate, seed=ctx.seed)
    for name, (fn, arg_names) in kernel_stages(geo).items():
        try:
            record(ctx, op="gla_pair_kernel", impl=name + sizes_tag(sizes), shape=shape,
                   mode="fwd", gate=gate,
                   timing=measure_jax(ctx, fn, *(env[x] for x in arg_names)))
        except Exception as e:
            record(ctx, op="gla_pair_kernel", impl=name + sizes_tag(sizes), shape=shape,
                   mode="fwd", gate=gate, error=_error(e))


CROSSOVER_IMPLS = ("ours_flash_causal", "ours_gla_chunk")


def bench_crossover(ctx, rng, t):
    """GLA chunk (K = V = 128) vs our causal flash attention (D = 128), B2 H16, fwd+bwd, on
    inputs drawn from `rng`."""
    from gla_tpu import ops

    b, h, d = 2, 16, 128
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, h, d), np.float32), jnp.bfloat16)
               for _ in range(3))
    g = jnp.asarray(gla_inputs(rng, b, t, h, d, d)[3])
    ct = jnp.asarray(rng.standard_normal((b, t, h, d), np.float32))

    def att(q, k, v):
        return ops.flash_attention(q, k, v, causal=True, backend="pallas_gpu")

    record(ctx, op="crossover", impl=CROSSOVER_IMPLS[0], shape=(b, h, t, d), mode="fwd+bwd",
           timing=measure_jax(ctx, fwd_bwd(att, ct), q, k, v),
           flops=attention_flops(b, t, t, h, d, causal=True, backward=True))
    record(ctx, op="crossover", impl=CROSSOVER_IMPLS[1], shape=(b, h, t, d), mode="fwd+bwd",
           gate="fla", timing=measure_jax(ctx, fwd_bwd(ours_gla("chunk"), ct), q, k, v, g),
           flops=gla_flops(b, t, h, d, d, backward=True))


def plan_part(ctx, part, args):
    """[(programs, run)] of one part: the programs each step measures (one printed line each)
    and the call that measures them, built from the same lists the benchmark functions time."""
    modes = args.modes.split(",")
    fla_modes = modes if args.fla_modes is None else args.fla_modes.split(",")
    gates = args.gates.split(",")
    gla_shapes = GLA_SHAPES[:1] if args.quick else GLA_SHAPES
    if args.gla_shapes:
        gla_shapes = [GLA_SHAPES[int(i)] for i in args.gla_shapes.split(",")]
    gla_variants = parse_sizes(args.gla_sizes) if args.gla_sizes else []
    # the parts over several shapes draw each shape's inputs from one generator in turn
    rng = np.random.default_rng(ctx.seed)
    steps = []
    if part == "attention":
        shapes = ATTENTION_SHAPES[:2] if args.quick else ATTENTION_SHAPES
        if args.attention_shapes:
            shapes = [ATTENTION_SHAPES[int(i)] for i in args.attention_shapes.split(",")]
        variants = parse_sizes(args.attention_sizes) if args.attention_sizes else []
        for shape in shapes:
            impls = attention_impls(shape[4], shape[3], modes, variants, ctx.ours_only)
            if args.peers is not None:  # ours and its variants, and the peers named
                impls = [i for i in impls if i[0].startswith("ours_pallas_gpu")
                         or i[0] in args.peers.split(",")]
            steps.append((sum(len(m) for _, _, m in impls),
                          functools.partial(bench_attention, ctx, rng, shape, impls)))
    elif part == "attention_segments":
        for shape in SEGMENT_SHAPES[:1] if args.quick else SEGMENT_SHAPES:
            impls = attention_segment_impls(shape[4], shape[3], modes, None)
            steps.append((sum(len(m) for _, _, m in impls),
                          functools.partial(bench_attention_segments, ctx, rng, shape,
                                            modes)))
    elif part == "attention_window":
        shapes = WINDOW_SHAPES[:1] if args.quick else WINDOW_SHAPES
        if args.attention_shapes:
            shapes = [WINDOW_SHAPES[int(i)] for i in args.attention_shapes.split(",")]
        for shape in shapes:
            for window in [None, *WINDOWS]:
                impls = attention_window_impls(window, modes, ctx.ours_only)
                steps.append((sum(len(m) for _, _, m in impls),
                              functools.partial(bench_attention_window, ctx, rng, shape, window,
                                                modes)))
    elif part in ("gla", "gla_per_head"):
        per_head = part == "gla_per_head"
        impls = gla_jax_impls(ctx, modes, per_head=per_head, variants=[{}] + gla_variants)
        peers = fla_peers(ctx, per_head=per_head, fla_recurrent=not args.no_fla_recurrent)
        for shape in gla_shapes:
            for gate in gates:
                steps.append((sum(len(m) for _, _, m in impls) + len(peers) * len(fla_modes),
                              functools.partial(bench_gla_shape, ctx, shape, gate, impls, peers,
                                                fla_modes, per_head=per_head)))
    elif part == "gla_segments":
        count = sum(len(m) for impls in gla_segment_impls(modes, None) for _, _, m in impls)
        steps += [(count, functools.partial(bench_gla_segments, ctx, shape, gate, modes))
                  for shape in gla_shapes for gate in gates]
    elif part == "decode":
        steps.append((len(decode_impls(ctx)), functools.partial(bench_decode, ctx)))
    elif part == "breakdown":
        for index in (args.gla_shapes or "0").split(","):
            shape = GLA_SHAPES[int(index)]
            steps.append((len(triton_stages(triton_geometry(shape))),
                          functools.partial(bench_gla_breakdown, ctx, shape)))
    elif part == "breakdown_pair_levels":
        for index in (args.gla_shapes or "0").split(","):
            shape = GLA_SHAPES[int(index)]
            for gate in gates:
                for sizes in [{}] + gla_variants:
                    steps.append((len(kernel_stages(pair_level_geometry(shape, sizes))),
                                  functools.partial(bench_pair_level_kernels, ctx, shape, gate,
                                                    sizes)))
    else:
        lengths = CROSSOVER_T[:3] if args.quick else CROSSOVER_T
        if args.crossover_t:
            lengths = [int(x) for x in args.crossover_t.split(",")]
        steps += [(len(CROSSOVER_IMPLS), functools.partial(bench_crossover, ctx, rng, t))
                  for t in lengths]
    return steps


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
    parser.add_argument("--part", action="append", choices=PARTS, required=True)
    parser.add_argument("--gates", default=",".join(DEFAULT_GATES),
                        help=f"GLA: comma-separated log-gate distributions from {sorted(GATES)} "
                             "(each shape is timed with each)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="gpu_side_by_side")
    parser.add_argument("--quick", action="store_true", help="first shape of each list only")
    parser.add_argument("--attention-shapes", default=None,
                        help="comma-separated indices into ATTENTION_SHAPES (default: all)")
    parser.add_argument("--gla-shapes", default=None,
                        help="comma-separated indices into GLA_SHAPES (default: all; the "
                             "breakdown parts: 0)")
    parser.add_argument("--crossover-t", default=None,
                        help="comma-separated T values for the crossover (default: CROSSOVER_T)")
    parser.add_argument("--attention-sizes", default=None,
                        help="attention: variants of our BlockSizes, each timed beside ours as "
                             "shipped: ';'-separated, each 'field=value,...' (e.g. "
                             "'forward_kernel=mosaic_gpu,mosaic_forward=64x64x3;"
                             "mosaic_backward=64x128x2'; tiles as BQxBKVxSTAGES)")
    parser.add_argument("--gla-sizes", default=None,
                        help="gla, gla_per_head, breakdown_pair_levels: variants of our GLA "
                             "BlockSizes, each timed beside ours as shipped: ';'-separated, "
                             "each 'field=value,...' (e.g. 'mosaic_group_sums=float32;"
                             "mosaic_block_v=32,mosaic_state_parts=2'; 'default': as shipped "
                             "again)")
    parser.add_argument("--peers-only", action="store_true",
                        help="GLA: time only the peers (ours runs once for the numerics check)")
    parser.add_argument("--peers", default=None,
                        help="part attention: time only these peers beside ours and its "
                        "variants (comma-separated impl names, e.g. cudnn)")
    parser.add_argument("--ours-only", action="store_true",
                        help="time only our kernels (no cuDNN, XLA, JAX's Pallas, jla or fla)")
    parser.add_argument("--with-triton", action="store_true",
                        help="GLA: also time our chunked Triton kernels (chunk_kernel='triton')")
    parser.add_argument("--no-fla-recurrent", action="store_true",
                        help="GLA: leave out fla's fused_recurrent_gla (50-100 ms a step)")
    parser.add_argument("--modes", default="fwd,fwd+bwd")
    parser.add_argument("--fla-modes", default=None,
                        help="GLA: fla's modes where not --modes (its backward autotunes for "
                             "minutes at some shapes)")
    parser.add_argument("--profile", action="store_true",
                        help="run each program twice (a warm-up call, then one more) instead of "
                             "timing it, under a profiler: ncu, nsys or MOSAIC_GPU_DUMP_PTXAS=1 "
                             "(the numerics checks run as well)")
    args = parser.parse_args(argv)
    for gate in args.gates.split(","):
        if gate not in GATES:
            parser.error(f"--gates: unknown distribution {gate!r}; choose from {sorted(GATES)}")
    if args.peers_only and args.ours_only:
        parser.error("--peers-only and --ours-only exclude each other")
    env = environment()
    env["versions"] = versions()
    ctx = Context(env=env, records=[], path=os.path.join(args.out, f"{args.tag}.json"),
                  peers_only=args.peers_only, ours_only=args.ours_only,
                  with_triton=args.with_triton, profile=args.profile)
    plans = [plan_part(ctx, part, args) for part in args.part]
    ctx.progress = Progress(sum(programs for steps in plans for programs, _ in steps))
    print(f"{ctx.progress.total} programs, device {env['device']}", flush=True)
    for steps in plans:
        for programs, run in steps:
            start = ctx.progress.done
            try:
                run()
            except Exception as e:  # the other steps still run; the traceback says what failed
                traceback.print_exc()
                left = programs - (ctx.progress.done - start)
                print(f"{ctx.progress.step(left)} {left} programs not measured: {_error(e)}",
                      flush=True)
        write_outputs(ctx, args.out, args.tag)
    print(write_outputs(ctx, args.out, args.tag))


if __name__ == "__main__":
    main()
