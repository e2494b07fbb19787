"""TPU speed without a TPU: libtpu's static cycle estimate of whole programs, side by side.

For each (op, implementation, shape, generation, pass) a child process compiles the program for
one core of the generation on abstract inputs (the deviceless compile of gla_tpu.testing) with
`LIBTPU_INIT_ARGS=--xla_jf_dump_static_llo_profile_to=DIR`; libtpu then writes one
`*_static_llo_profile.textproto` per HLO op with its `estimated_cycles`, from the compiler's own
schedule and DMA latency model. The program's estimate is their sum. It is an estimate, never a
timing: the same model for every program, so ratios on one shape and generation mean something.
Each program compiles in its own process: the profiler aborts the process on kernels it cannot
model (splash attention), and long grids cost minutes and gigabytes.

Implementations: ours (mosaic_tpu, and our xla backend), JAX's Pallas TPU flash attention (its
default blocks and a sweep for its best), splash attention, jax.nn.dot_product_attention("xla"),
and deltanet-tpu's chunk_gla (the `tpu-bench` extra). deltanet-tpu picks interpret mode whenever
jax.default_backend() is not "tpu", so the child makes it see "tpu" while tracing.

    python -m bench.tpu_static --out DIR [--generations v5e,v6e] [--ops attention,gla]
                               [--impls ...] [--passes fwd,fwd_bwd] [--jobs 2]

writes DIR/tpu_static.json (one record per program), DIR/tpu_static.md and DIR/tpu_static.png;
records go to DIR/tpu_static.partial.jsonl as they come, and a rerun skips those already there.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile

# Per generation: the core clock and the MXU flops per cycle of one JAX device. Clock = peak bf16
# FLOP/s per device / (MXUs x MXU width^2 x 2). A JAX device of v4 and v5p is a megacore (both
# TensorCores of a chip); one of 7x is one TensorCore (a 7x chip is two devices). The MXU counts
# are checked against the compiler itself: libtpu's estimate of a 4096^3 bfloat16 XLA matmul comes
# to 97% (v5e, v5p) and 93% (v6e, 7x) of these flops per cycle (with the 2 MXUs per core sometimes
# quoted for v6e it would be 187%). libtpu 0.0.48 has no static DMA model for v4 ("only supported
# on VF/VL/GF/GL"), so v4 cannot be profiled; the compile tests still cover it.
GENERATIONS = {
    # 2 TensorCores x 4 MXUs of 128x128, 275 TF/s -> 1.05 GHz (cloud.google.com/tpu/docs/v4)
    "v4": {"peak_tflops": 275.0, "mxu_macs": 2 * 4 * 128 * 128, "hbm_gbps": 1200,
           "source": "cloud.google.com/tpu/docs/v4", "profiled": False},
    # 1 TensorCore x 4 MXUs of 128x128, 197 TF/s -> 1.50 GHz (cloud.google.com/tpu/docs/v5e)
    "v5e": {"peak_tflops": 197.0, "mxu_macs": 4 * 128 * 128, "hbm_gbps": 819,
            "source": "cloud.google.com/tpu/docs/v5e", "profiled": True},
    # 2 TensorCores x 4 MXUs of 128x128, 459 TF/s -> 1.75 GHz (cloud.google.com/tpu/docs/v5p)
    "v5p": {"peak_tflops": 459.0, "mxu_macs": 2 * 4 * 128 * 128, "hbm_gbps": 2765,
            "source": "cloud.google.com/tpu/docs/v5p", "profiled": True},
    # 1 TensorCore x 4 MXUs of 256x256, 918 TF/s -> 1.75 GHz (cloud.google.com/tpu/docs/v6e)
    "v6e": {"peak_tflops": 918.0, "mxu_macs": 4 * 256 * 256, "hbm_gbps": 1638,
            "source": "cloud.google.com/tpu/docs/v6e", "profiled": True},
    # per device (one of the chip's 2 TensorCores): 4 MXUs of 256x256 (as v6e's core, matching
    # the compiler's matmul estimate), 2307 / 2 TF/s -> 2.20 GHz (cloud.google.com/tpu/docs/tpu7x)
    "7x": {"peak_tflops": 2307.0 / 2, "mxu_macs": 4 * 256 * 256, "hbm_gbps": 7380 / 2,
           "source": "cloud.google.com/tpu/docs/tpu7x", "profiled": True},
}


def clock_ghz(generation: str) -> float:
    g = GENERATIONS[generation]
    return g["peak_tflops"] * 1e12 / (2 * g["mxu_macs"]) / 1e9


@dataclasses.dataclass(frozen=True)
class Spec:
    op: str  # "attention" or "gla"
    impl: str
    shape: tuple  # attention (B, H, T, D, causal); gla (B, T, H, K, V, gate, mode)
    generation: str
    passes: str  # "fwd", "fwd_bwd"; "bwd": part of our attention's fwd_bwd
    options: tuple = ()  # (name, value) pairs, e.g. JAX flash block sizes

    def __post_init__(self):
        # Our attention's forward+backward is two programs, the backward on abstract residuals,
        # so a layer's projections can wrap the forward only (`_inside_projections`).
        if (dict(self.options).get("inside_projections") and self.op == "attention"
                and self.passes != "fwd"):
            raise ValueError(f"Spec.options ('inside_projections', True): attention programs "
                             f"are forward only; got passes={self.passes!r}.")

    @property
    def key(self) -> str:
        opts = "".join(f"_{k}{v}" for k, v in self.options)
        shape = "x".join(map(str, self.shape))
        return f"{self.op}_{self.impl}{opts}_{shape}_{self.generation}_{self.passes}"


# Shapes of the comparison (bf16).
ATTENTION_SHAPES = [(1, 8, 4096, d, causal) for d in (64, 128, 256) for causal in (True, False)]
ATTENTION_SHAPES.append((4, 16, 2048, 128, True))
GLA_SHAPES = [(1, 4096, 8, 128, 128), (2, 2048, 4, 256, 512), (4, 2048, 16, 64, 64)]
GLA_MODES = ("chunk", "fused_chunk", "fused_recurrent")
DECODE_SHAPE = (64, 1, 16, 128, 128)
CROSSOVER_T = (1024, 2048, 4096, 8192)
# JAX flash attention block sizes tried for its best (block_q = block_k_major = block_k); its
# defaults are 128 everywhere (BlockSizes.get_default), so the default run is the 128 one.
JAX_FLASH_BLOCKS = (256, 512, 1024)
# Blocks of "jax_flash_bthd": JAX's kernel called from our [B, T, H, D] layout.
JAX_FLASH_BTHD_BLOCKS = (512, 1024)


def _flops(spec: Spec) -> float:
    from gla_tpu.ops.common.flops import attention_flops, gla_flops

    backward = spec.passes == "fwd_bwd"
    if spec.op == "attention":
        b, h, t, d, causal = spec.shape
        return attention_flops(b, t, t, h, d, causal=causal, backward=backward)
    b, t, h, kd, vd = spec.shape[:5]
    return gla_flops(b, t, h, kd, vd, backward=backward)


# The child: build one program and compile it.


def _attention_program(spec: Spec):
    import jax
    import jax.numpy as jnp

    from gla_tpu import ops

    b, h, t, d, causal = spec.shape
    opts = dict(spec.options)
    bf16 = jnp.bfloat16
    bthd = jax.ShapeDtypeStruct((b, t, h, d), bf16)
    bhtd = jax.ShapeDtypeStruct((b, h, t, d), bf16)
    scale = d ** -0.5
    if spec.impl == "gla_tpu":
        sizes = _our_attention_blocks(opts)
        fn, args = (lambda q, k, v: ops.flash_attention(
            q, k, v, causal=causal, backend="mosaic_tpu", block_sizes=sizes)), (bthd,) * 3
    elif spec.impl == "gla_tpu_xla":
        fn, args = (lambda q, k, v: ops.flash_attention(q, k, v, causal=causal,
                                                        backend="xla")), (bthd,) * 3
    elif spec.impl == "xla_dot_product_attention":
        fn, args = (lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla")), (bthd,) * 3
    elif spec.impl in ("jax_flash", "jax_flash_bthd"):
        from jax.experimental.pallas.ops.tpu import flash_attention as jf

        sizes = None
        if "block" in opts:
            blk = min(opts["block"], t)
            sizes = jf.BlockSizes(block_q=blk, block_k_major=blk, block_k=blk, block_b=1,
                                  block_q_major_dkv=blk, block_k_major_dkv=blk, block_k_dkv=blk,
                                  block_q_dkv=blk, block_k_major_dq=blk, block_k_dq=blk,
                                  block_q_dq=blk)
        fn = lambda q, k, v: jf.flash_attention(q, k, v, causal=causal, sm_scale=scale,  # noqa
                                                block_sizes=sizes)
        args = (bhtd,) * 3
        if spec.impl == "jax_flash_bthd":
            # From and back to [B, T, H, D], the layout of our API and of dot_product_attention.
            head_major = fn
            fn = lambda q, k, v: jnp.swapaxes(head_major(  # noqa: E731
                *(jnp.swapaxes(x, 1, 2) for x in (q, k, v))), 1, 2)
            args = (bthd,) * 3
    elif spec.impl == "splash":
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_kernel as sk,
        )
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

        mask = sm.CausalMask((t, t)) if causal else sm.FullMask((t, t))
        kernel = sk.make_splash_mha(mask=sm.MultiHeadMask([mask] * h), head_shards=1,
                                    q_seq_shards=1)
        fn = lambda q, k, v: jax.vmap(kernel)(q * scale, k, v)  # noqa: E731
        args = (bhtd,) * 3
    else:
        raise ValueError(f"unknown attention impl {spec.impl!r}")
    return fn, args


def _our_attention_blocks(opts: dict):
    """Our BlockSizes from a spec's ("blocks", [[field, value], ...]) or ("defaults_with", ...)
    option, the same since 2026-11-27: the fields given, every other one None, i.e. the op's
    default for the generation and the problem (before, "blocks" left the others at 512 and
    "defaults_with" at the generation's BlockSizes.default without the D = 128 forward's tile
    rule); None = defaults."""
    from gla_tpu.ops.attention.mosaic_tpu import plan

    fields = opts.get("defaults_with", opts.get("blocks"))
    return None if fields is None else plan.BlockSizes(**dict(fields))


def _attention_backward_program(spec: Spec):
    """Our attention's backward alone, from abstract residuals: di, do (and q, k, v where the
    forward read the API's layout) into the kernels' head-major layout, the dq and dk/dv kernels
    (and at D = 64 their outputs' transposes).
    libtpu's profiler aborts on our kernels where XLA places their outputs in VMEM, as it does
    inside a whole forward+backward program; here the kernels' outputs are the program's
    (docs/benchmarks.md)."""
    import jax
    import jax.numpy as jnp

    from gla_tpu.ops.attention.mosaic_tpu import plan, vjp
    from gla_tpu.ops.attention.validation import validate_attention
    from gla_tpu.testing.tpu_compile import targeting

    b, h, t, d, causal = spec.shape
    x = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
    problem, _, _ = validate_attention(x, x, x, causal=causal, sm_scale=None, segment_ids=None)
    with targeting(spec.generation):  # the generation's default tiles, as inside its program
        cfg = plan.kernel_config(problem, _our_attention_blocks(dict(spec.options)), False)
    tp = cfg.q_len_padded
    head_major = jax.ShapeDtypeStruct((b, h, tp, d), jnp.bfloat16)
    api_layout = jax.ShapeDtypeStruct((b, tp, h, d), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((b, h, 1, tp), jnp.float32)

    # The residuals as the custom_vjp saves them: q, k, v as the forward read them (the API's
    # layout where it read rows of every head, else head-major copies); o in the API's layout.
    def backward(q, k, v, o, lse, do):
        return vjp._attention_bwd(cfg, (q, k, v, None, None, o, lse), do)[:3]

    qkv = api_layout if cfg.forward_reads_rows else head_major
    return backward, (qkv,) * 3 + (api_layout, rows, api_layout)


def _gla_program(spec: Spec):
    import jax
    import jax.numpy as jnp

    from gla_tpu import ops

    b, t, h, kd, vd, gate, mode = spec.shape
    bf16, f32 = jnp.bfloat16, jnp.float32
    q = jax.ShapeDtypeStruct((b, t, h, kd), bf16)
    v = jax.ShapeDtypeStruct((b, t, h, vd), bf16)
    g = jax.ShapeDtypeStruct((b, t, h, kd) if gate == "key" else (b, t, h), f32)
    if spec.impl in ("gla_tpu", "gla_tpu_xla") and t == 1:
        # A decode step: the state carried in float32, the new one out.
        def fn(q, k, v, g, state):
            return ops.gla(q, k, v, g, mode=mode, initial_state=state, output_final_state=True,
                           backend="mosaic_tpu" if spec.impl == "gla_tpu" else "xla")
        return fn, (q, q, v, g, jax.ShapeDtypeStruct((b, h, kd, vd), f32))
    if spec.impl in ("gla_tpu", "gla_tpu_xla"):
        backend = "mosaic_tpu" if spec.impl == "gla_tpu" else "xla"
        cs = dict(spec.options).get("chunk_size")
        sizes = None
        if dict(spec.options).get("profiler_safe"):  # the kernels v5e's and v5p's profiler takes
            from gla_tpu.ops.gla.mosaic_tpu import BlockSizes

            sizes = BlockSizes(profiler_safe=True)
        fn = lambda q, k, v, g: ops.gla(q, k, v, g, mode=mode, backend=backend,  # noqa: E731
                                        chunk_size=cs, block_sizes=sizes)[0]
    elif spec.impl == "deltanet_tpu":
        import deltanet_tpu

        precision = dict(spec.options).get("precision", "bf16")
        fn = lambda q, k, v, g: deltanet_tpu.chunk_gla(q, k, v, g, chunk_size=128,  # noqa
                                                       precision=precision)
    elif spec.impl == "deltanet_tpu_gdn2":
        # Calibration only: deltanet-tpu's published GDN-2 shape, float32 inputs (its README's
        # v6e timings: B1, T8192, 12 key / 24 value heads, K = V = 128).
        import deltanet_tpu

        hv = dict(spec.options)["value_heads"]
        q = jax.ShapeDtypeStruct((b, t, h, kd), f32)
        v = jax.ShapeDtypeStruct((b, t, hv, vd), f32)
        g = jax.ShapeDtypeStruct((b, t, hv), f32)
        beta = jax.ShapeDtypeStruct((b, t, hv), f32)
        fn = lambda q, k, v, g, beta_, w: deltanet_tpu.chunk_gdn2(  # noqa: E731
            q, k, v, g, beta_, w, chunk_size=128, precision="bf16")
        return fn, (q, q, v, g, beta, beta)
    else:
        raise ValueError(f"unknown gla impl {spec.impl!r}")
    return fn, (q, q, v, g)


def _child(spec: Spec, list_ops: bool = False) -> None:
    """Compiles the program of `spec`; with `list_ops`, prints its entry computation's ops as
    JSON [[name, opcode], ...]."""
    import jax

    from gla_tpu.testing.tpu_compile import compile_for_tpu

    # deltanet-tpu runs in interpret mode unless the default backend is "tpu" while tracing.
    jax.default_backend = lambda: "tpu"
    if spec.passes == "bwd":
        fn, args = _attention_backward_program(spec)
    else:
        fn, args = _program(spec)
    compiled = compile_for_tpu(fn, *args, generation=spec.generation)
    if list_ops:
        print(json.dumps(_entry_ops(compiled.as_text())))


def _program(spec: Spec):
    import jax
    import jax.numpy as jnp

    fn, args = (_attention_program if spec.op == "attention" else _gla_program)(spec)
    if dict(spec.options).get("inside_projections"):
        fn, args = _inside_projections(spec, fn, args)
    if spec.passes == "fwd_bwd":
        forward = fn

        # The loss squares the output, so its cotangent depends on the output's value: with a
        # plain sum, XLA drops forward kernels whose outputs the backward does not read.
        def fn(*xs):
            return jax.grad(lambda *ys: jnp.sum(forward(*ys).astype(jnp.float32) ** 2),
                            argnums=tuple(range(len(xs))))(*xs)
    return fn, args


def _inside_projections(spec: Spec, fn, args):
    """`fn` as a layer calls it: every argument projected from one x [B, T, M] (M = H * D of
    the first), so that XLA writes each in the layout its kernel reads; [B, T, ...] arguments as
    (x @ w).reshape, JAX flash_attention's [B, H, T, D] ones transposed after that, float32 ones
    (GLA's log gates) as log_sigmoid of the product. In a forward+backward program the output
    [B, T, H, V] is projected back to M too, as a training step's loss sees it. The option
    ("inside_projections", True) asks for it (docs/benchmarks.md, "Inside projections"); for
    attention, forward programs only (`Spec` refuses the others)."""
    import jax
    import jax.numpy as jnp

    head_major = spec.impl.startswith("jax_flash") and spec.impl != "jax_flash_bthd"
    bf16 = jnp.bfloat16
    first = args[0].shape
    b, t = (first[0], first[2]) if head_major else first[:2]
    width = math.prod(first[1:]) // t
    x = jax.ShapeDtypeStruct((b, t, width), bf16)
    weights = [jax.ShapeDtypeStruct((width, math.prod(a.shape) // (b * t)), bf16)
               for a in args]
    project_output = spec.passes == "fwd_bwd"

    def layer(x, *ws):
        inputs = []
        for a, w in zip(args, ws[:len(args)]):
            y = x @ w
            if a.dtype == jnp.float32:
                y = jax.nn.log_sigmoid(y.astype(jnp.float32))
            if head_major:
                inputs.append(jnp.swapaxes(y.reshape(b, t, a.shape[1], a.shape[3]), 1, 2))
            else:
                inputs.append(y.reshape(a.shape))
        out = fn(*inputs)
        return out.reshape(b, t, -1) @ ws[-1] if project_output else out

    if project_output:
        out_width = math.prod(jax.eval_shape(fn, *args).shape) // (b * t)
        weights.append(jax.ShapeDtypeStruct((out_width, width), bf16))
    return layer, (x, *weights)


_ENTRY_OP = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\(")
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# Entry ops the profiler writes no profile for.
_UNPROFILED_OPCODES = {"parameter", "bitcast", "tuple", "get-tuple-element", "constant",
                       "copy-start", "copy-done"}
# ... and the asynchronous slices of a parameter (DMAs the ops that wait on them carry).
_NO_PROFILE_BY_DESIGN = _UNPROFILED_OPCODES | {"slice-start", "slice-done"}


def _entry_ops(hlo_text: str) -> list:
    """[name, opcode, result type, custom-call target or None] of the instructions of an
    optimized HLO module's entry computation."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    ops_ = []
    for line in entry.splitlines()[1:]:
        match = _ENTRY_OP.match(line)
        if match:
            target = _CUSTOM_CALL_TARGET.search(line)
            ops_.append([match.group(1), match.group(3), match.group(2),
                         target.group(1) if target else None])
    return ops_


# The parent: one child per program, estimates parsed from the dumped profiles.

_CYCLES = re.compile(r'hlo_op_name: "([^"]+)"\s+estimated_cycles: (\d+)')


def profile(spec: Spec, timeout: int = 900, twins: bool = True) -> dict:
    """Compiles `spec` in a child process and returns its record (cycles, per-op breakdown, or
    the error). Our attention's forward+backward is the sum of its forward program and of its
    backward program (the profiler cannot take our forward kernel in one program with the
    backward; `_attention_backward_program`). With `twins`, each program is compiled once more
    without the profiler to find the ops that have no profile of their own
    (`unprofiled_twins`); `cycles` stays the sum of the profiles."""
    if spec.op == "attention" and spec.impl == "gla_tpu" and spec.passes == "fwd_bwd":
        parts = [profile(dataclasses.replace(spec, passes=p), timeout, twins)
                 for p in ("fwd", "bwd")]
        record = dict(parts[0], passes="fwd_bwd", key=spec.key, method="fwd + bwd programs")
        if any(p.get("cycles") is None for p in parts):
            record.update(cycles=None, error="; ".join(str(p["error"]) for p in parts))
            return record
        record["ops"] = {f"{p['passes']}:{k}": v for p in parts for k, v in p["ops"].items()}
        record = _with_estimates(record, spec, sum(p["cycles"] for p in parts))
        if twins:
            missing = [[f"{p['passes']}:{name}", *rest] for p in parts
                       for name, *rest in (p.get("unprofiled_twins") or [])]
            _with_twins(record, None if any(p.get("unprofiled_twins") is None for p in parts)
                        else missing)
        return record
    record = _profile_one(spec, timeout)
    # a lower bound already lists what has no profile (`unprofiled_ops`)
    if twins and record.get("cycles") is not None and not record.get("lower_bound"):
        _with_twins(record, unprofiled_twins(spec, record["ops"], timeout))
    return record


# HLO ops XLA itself emits (names are the opcode plus a suffix); every other profiled op of a
# program is a Pallas kernel, named after its kernel function.
_XLA_OPCODES = (
    "copy|fusion|transpose|bitcast|convert|reduce|pad|slice|broadcast|concatenate|dot|"
    "convolution|reshape|select|dynamic|update|iota|add|multiply|subtract|divide|negate|"
    "exponential|log|maximum|minimum|compare|and|or|not|tuple|get-tuple-element|constant|"
    "custom-call|while|conditional|call|parameter|scatter|gather|sort|cumsum|rng|rsqrt|sqrt|"
    "power|tanh|logistic|clamp|abs|sign|floor|ceil|round|remainder|xor")
# An XLA op's name is its opcode, or the opcodes of a fusion joined by "_", then a suffix.
_XLA_OP = re.compile(rf"^(?:{_XLA_OPCODES})(?:_(?:{_XLA_OPCODES}))*(?:[.-]|$)")


def kernel_cycles(ops_cycles: dict) -> int:
    """The cycles of a program's Pallas kernels (its other ops are XLA's: layout copies, padding,
    the gate cumsum, casts)."""
    return sum(c for name, c in ops_cycles.items() if _is_kernel(name))


def _with_estimates(record: dict, spec: Spec, cycles: int) -> dict:
    gen = GENERATIONS[spec.generation]
    flops = _flops(spec)
    record.update(cycles=cycles, kernel_cycles=kernel_cycles(record.get("ops", {})),
                  estimated_us=cycles / (clock_ghz(spec.generation) * 1e3),
                  mxu_utilization=flops / (cycles * 2 * gen["mxu_macs"]),
                  clock_ghz=clock_ghz(spec.generation), useful_flops=flops, error=None)
    return record


def _run_child(spec: Spec, timeout: int, profile_dir: str | None = None,
               list_ops: bool = False) -> subprocess.CompletedProcess:
    """Compiles `spec` in a child process, with libtpu's static profile written to `profile_dir`
    (None: no profile). Raises subprocess.TimeoutExpired."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env.pop("LIBTPU_INIT_ARGS", None)
    if profile_dir is not None:
        env["LIBTPU_INIT_ARGS"] = f"--xla_jf_dump_static_llo_profile_to={profile_dir}"
    cmd = [sys.executable, "-m", "bench.tpu_static", *(["--list-ops"] if list_ops else []),
           "--child", json.dumps(dataclasses.asdict(spec))]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=pathlib.Path(__file__).resolve().parents[1])


def _profile_one(spec: Spec, timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as dump:
        try:
            run = _run_child(spec, timeout, profile_dir=dump)
            error = (None if run.returncode == 0
                     else f"exit {run.returncode}: {_last_error(run.stderr)}")
        except subprocess.TimeoutExpired:
            error = f"timeout after {timeout} s"
        ops_cycles = {}
        for path in pathlib.Path(dump).glob("*_static_llo_profile.textproto"):
            for name, cycles in _CYCLES.findall(path.read_text()):
                ops_cycles[name] = ops_cycles.get(name, 0) + int(cycles)
    record = dataclasses.asdict(spec)
    record.update(key=spec.key, dtype="bfloat16", error=error, method="one program")
    if error is not None and "LLO_CHECK" in error and ops_cycles:
        # libtpu's LLO type check aborts the profile of some XLA layout ops on v5e (a relayout
        # lowered to a masked bf16 matmul). Where every op it did not reach is XLA's, not a
        # kernel, the estimate stands as a lower bound that names the ops left out.
        missing = _unprofiled_ops(spec, ops_cycles, timeout)
        if missing is not None and not any(_is_kernel(name) for name, _ in missing):
            record.update(lower_bound=True, unprofiled_ops=missing,
                          note=f"lower bound, {len(missing)} XLA op(s) not profiled: {error}")
            error = record["error"] = None
    if error is None and ops_cycles:
        record["ops"] = dict(sorted(ops_cycles.items(), key=lambda kv: -kv[1]))
        return _with_estimates(record, spec, sum(ops_cycles.values()))
    if error is None:
        record["error"] = "no static profile written"
    return record


def _listed_entry_ops(spec: Spec, timeout: int) -> list | None:
    """`_entry_ops` of `spec`'s program, compiled again without the profiler; None if that
    compile fails."""
    try:
        run = _run_child(spec, timeout, list_ops=True)
        return json.loads(run.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError):
        return None


def _unprofiled_ops(spec: Spec, ops_cycles: dict, timeout: int) -> list | None:
    """The entry ops of `spec`'s program that have no profile; None if the compile fails."""
    ops_ = _listed_entry_ops(spec, timeout)
    if ops_ is None:
        return None
    return [[name, opcode] for name, opcode, *_ in ops_
            if opcode not in _UNPROFILED_OPCODES and name not in ops_cycles]


def unprofiled_twins(spec: Spec, ops_cycles: dict, timeout: int) -> list | None:
    """The entry ops of `spec`'s program that cost time but have no profile of their own, each
    with its candidate twins: [[name, opcode, result type, {profiled op: cycles}], ...] (None if
    the compile fails).

    libtpu writes one profile per distinct compiled op, so an op that XLA compiles to the same
    code as another (the relayout of v beside those of q and k, the layout copy of dv beside
    dk's) has none, and the sum of the profiles counts that code once. Its twins are the
    profiled ops of the same opcode and result type; which one it repeats is not known, so a
    record brackets the program by the cheapest and the dearest twin (`cycles_with_twins`)."""
    ops_ = _listed_entry_ops(spec, timeout)
    if ops_ is None:
        return None
    signature = {name: (opcode, type_) for name, opcode, type_, _ in ops_}
    missing = []
    for name, opcode, type_, target in ops_:
        if name in ops_cycles or opcode in _NO_PROFILE_BY_DESIGN:
            continue
        if opcode == "custom-call" and target != "tpu_custom_call":
            continue  # XLA's own custom calls here (ConcatBitcast) are free views
        twins = {other: cycles for other, cycles in ops_cycles.items()
                 if signature.get(other) == (opcode, type_)}
        missing.append([name, opcode, type_, twins])
    return missing


def _with_twins(record: dict, missing: list | None) -> dict:
    """Adds `unprofiled_twins` and the bracket `cycles_with_twins` [low, high] (None where an
    unprofiled op has no twin) to a profiled record."""
    if missing is None:
        record.update(unprofiled_twins=None, cycles_with_twins=None)
        return record
    record["unprofiled_twins"] = missing
    if any(not twins for *_, twins in missing):
        record["cycles_with_twins"] = None
    else:
        record["cycles_with_twins"] = [
            record["cycles"] + sum(min(t.values()) for *_, t in missing),
            record["cycles"] + sum(max(t.values()) for *_, t in missing)]
    return record


def _is_kernel(op_name: str) -> bool:
    return not _XLA_OP.match(op_name.split(":")[-1])


def _last_error(stderr: str) -> str:
    """The line that says why a child failed: the profiler's abort, or the Python exception."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    for marker in (" failed: ", "Error:", "Exception", "Check failed"):
        hits = [ln for ln in lines if marker in ln and "worker hostname" not in ln]
        if hits:
            return hits[-1][:400]
    return (lines or ["failed"])[-1][:400]


# Where the profiler takes our chunked GLA forward+backward (gated) only with
# BlockSizes(profiler_safe=True): the same values, about 0.5% more cycles on v6e
# (docs/benchmarks.md, "GLA forward+backward on v5e and v5p").
PROFILER_SAFE_GENERATIONS = ("v5e", "v5p")


def _gla_options(generation: str, gate: str, mode: str, passes: str) -> tuple:
    """The options of our GLA's record: profiler_safe where the default kernels abort it."""
    if (generation in PROFILER_SAFE_GENERATIONS and gate in ("key", "head")
            and passes == "fwd_bwd" and mode in ("chunk", "fused_chunk")):
        return (("profiler_safe", True),)
    return ()


def specs_for(ops_: list[str], impls: list[str] | None, generations: list[str],
              passes: list[str]) -> list[Spec]:
    out = []
    for gen in generations:
        for p in passes:
            if "attention" in ops_:
                for shape in ATTENTION_SHAPES:
                    for impl in ("gla_tpu", "jax_flash", "splash", "xla_dot_product_attention",
                                 "gla_tpu_xla"):
                        out.append(Spec("attention", impl, shape, gen, p))
                    for blk in JAX_FLASH_BLOCKS:
                        out.append(Spec("attention", "jax_flash", shape, gen, p,
                                        (("block", blk),)))
                    for blk in JAX_FLASH_BTHD_BLOCKS:
                        out.append(Spec("attention", "jax_flash_bthd", shape, gen, p,
                                        (("block", blk),)))
            if "gla" in ops_:
                for shape in GLA_SHAPES:
                    for gate in ("key", "head"):
                        for mode in GLA_MODES:
                            out.append(Spec("gla", "gla_tpu", (*shape, gate, mode), gen, p,
                                            _gla_options(gen, gate, mode, p)))
                        out.append(Spec("gla", "gla_tpu_xla", (*shape, gate, "chunk"), gen, p))
                        if shape[3] <= 128 and shape[4] <= 128:
                            out.append(Spec("gla", "deltanet_tpu", (*shape, gate, "chunk"), gen,
                                            p))
                if p == "fwd":
                    # The decode step: one token from a carried state.
                    for gate in ("key", "head"):
                        for impl in ("gla_tpu", "gla_tpu_xla"):
                            out.append(Spec("gla", impl, (*DECODE_SHAPE, gate, "fused_recurrent"),
                                            gen, p))
    if impls:
        out = [s for s in out if s.impl in impls]
    return out


def calibration_specs() -> list[Spec]:
    """Programs with published TPU timings: deltanet-tpu's chunk_gdn2 at its README's v6e shape,
    and JAX's flash attention at (1, 5, 16384, 128) (forward, causal) on v5e and v6e."""
    gdn2 = (1, 8192, 12, 128, 128, "head", "chunk")
    return [Spec("gla", "deltanet_tpu_gdn2", gdn2, "v6e", p, (("value_heads", 24),))
            for p in ("fwd", "fwd_bwd")] + [
        Spec("attention", impl, (1, 5, 16384, 128, True), gen, "fwd", opts)
        for gen in ("v5e", "v6e")
        for impl, opts in (("jax_flash", ()), ("jax_flash", (("block", 512),)), ("gla_tpu", ()))]


def crossover_specs(generations: list[str]) -> list[Spec]:
    """Our chunked GLA in both modes (per-key gates, K = V = 128) against our causal flash
    attention (D = 128), forward+backward, B1 H8, over T."""
    out = []
    for gen in generations:
        for t in CROSSOVER_T:
            out.append(Spec("attention", "gla_tpu", (1, 8, t, 128, True), gen, "fwd_bwd"))
            out += [Spec("gla", "gla_tpu", (1, t, 8, 128, 128, "key", mode), gen, "fwd_bwd",
                         _gla_options(gen, "key", mode, "fwd_bwd"))
                    for mode in ("chunk", "fused_chunk")]
    return out


PEER_ORDER = ("jax_flash", "jax_flash_bthd", "splash", "xla_dot_product_attention", "gla_tpu_xla",
              "deltanet_tpu", "deltanet_tpu_gdn2")


def _label(r: dict) -> str:
    return r["impl"] + "".join(f" {k}={v}" for k, v in r["options"])


_PROFILER_SAFE_LABEL = "gla_tpu profiler_safe=True"


def _ours(by_label: dict):
    """The program's record of ours among records by label: the default kernels, or where the
    profiler takes only the profiler-safe ones (`_gla_options`), those; None if neither."""
    return by_label.get("gla_tpu") or by_label.get(_PROFILER_SAFE_LABEL)


def _cycles(r: dict) -> str:
    """A record's cycles; "≥" marks a lower bound (XLA ops the profiler could not take)."""
    return ("≥" if r.get("lower_bound") else "") + f"{r['cycles']:,}"


def write_table(records: list[dict], path: pathlib.Path) -> None:
    """Markdown: a summary (one row per program: ours, each peer at its best options, ours/peer)
    and every record."""
    groups: dict = {}
    for r in records:
        key = (r["op"], tuple(r["shape"]), r["generation"], r["passes"])
        groups.setdefault(key, {})[_label(r)] = r
    ordered = sorted(groups.items(), key=lambda kv: str(kv[0]))
    peers = [p for p in PEER_ORDER if any(r["impl"] == p for r in records)]
    lines = ["## Summary: ours / peer at its best options (< 1 means ours estimates fewer cycles)",
             "", "≥: a lower bound, some of the program's XLA ops not profiled (the record's "
             "`unprofiled_ops`).", "",
             "| op | shape | gen | pass | ours (kernels) | " + " | ".join(peers) + " |",
             "|---|---|---|---|---|" + "---|" * len(peers)]
    for (op, shape, gen, p), by_label in ordered:
        ours = _ours(by_label) or {}
        if ours.get("cycles") is None:
            cell = "failed" if ours else "-"
        else:
            cell = f"{_cycles(ours)} ({ours['kernel_cycles']:,})" + (
                " profiler_safe" if _label(ours) == _PROFILER_SAFE_LABEL else "")
        row = [op, str(shape), gen, p, cell]
        for peer in peers:
            done = [r for r in by_label.values() if r["impl"] == peer and r.get("cycles")]
            tried = [r for r in by_label.values() if r["impl"] == peer]
            if not done:
                row.append("profiler failed" if tried else "")
                continue
            best = min(done, key=lambda r: r["cycles"])
            opts = "".join(f" {k}={v}" for k, v in best["options"])
            ratio = f", {ours['cycles'] / best['cycles']:.2f}x" if ours.get("cycles") else ""
            row.append(f"{_cycles(best)}{opts}{ratio}")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Every record", "",
              "| op | shape | gen | pass | impl | cycles | kernels | est. us | MXU util | "
              "/ ours |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (op, shape, gen, p), by_label in ordered:
        ours = (_ours(by_label) or {}).get("cycles")
        for label, r in sorted(by_label.items()):
            if r.get("cycles") is None:
                lines.append(f"| {op} | {shape} | {gen} | {p} | {label} | - | - | - | - | "
                             f"{r['error']} |")
                continue
            ratio = f"{r['cycles'] / ours:.2f}" if ours else "-"
            lines.append(f"| {op} | {shape} | {gen} | {p} | {label} | {_cycles(r)} | "
                         f"{r['kernel_cycles']:,} | {r['estimated_us']:.1f} | "
                         f"{r['mxu_utilization']:.1%} | {ratio} |")
    path.write_text("\n".join(lines) + "\n")


def write_plot(records: list[dict], path: pathlib.Path) -> None:
    """Bars of each implementation's estimated cycles relative to ours, one group per program
    (shape, generation, pass); lower is faster. Skipped without matplotlib (the bench extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    groups: dict = {}
    for r in records:
        if r.get("cycles") is None:
            continue
        label = _label(r)
        key = f"{r['op']} {'x'.join(map(str, r['shape']))} {r['generation']} {r['passes']}"
        groups.setdefault(key, {})[label] = r["cycles"]
    groups = {k: dict(v, ours=_ours(v)) for k, v in groups.items() if _ours(v)}
    impls = sorted({label for v in groups.values() for label in v if label != "ours"})
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(groups) * max(1, len(impls) / 3) + 1))
    height = 0.8 / max(len(impls), 1)
    for n, impl in enumerate(impls):
        ys = [i + n * height for i in range(len(groups))]
        xs = [v.get(impl, 0) / v["ours"] for v in groups.values()]
        ax.barh(ys, xs, height=height, label=impl)
    ax.set_yticks([i + 0.4 for i in range(len(groups))])
    ax.set_yticklabels(list(groups), fontsize=6)
    ax.axvline(1.0, color="k", lw=0.5)
    ax.set_xlabel("estimated cycles / ours (libtpu static profile; lower is faster)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--list-ops", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--generations", default="v5e,v6e")
    parser.add_argument("--ops", default="attention,gla")
    parser.add_argument("--impls", default="")
    parser.add_argument("--passes", default="fwd,fwd_bwd")
    parser.add_argument("--exclude", default="",
                        help="OP:IMPL,... programs left out, e.g. attention:gla_tpu_xla")
    parser.add_argument("--crossover", action="store_true")
    parser.add_argument("--calibration", action="store_true")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--from-json", nargs="+", metavar="JSON",
                        help="no compiling: merge these results (later files win on equal "
                             "keys), recompute the derived fields and write --out/NAME.*")
    parser.add_argument("--name", default=None, help="file stem of the results")
    args = parser.parse_args(argv)
    if args.child:
        raw = json.loads(args.child)
        raw["shape"] = tuple(raw["shape"])
        raw["options"] = tuple(tuple(o) for o in raw["options"])
        _child(Spec(**raw), list_ops=args.list_ops)
        return
    if args.from_json:
        merged, env = {}, {}
        for path in args.from_json:
            data = json.loads(pathlib.Path(path).read_text())
            env = data["env"]
            for r in data["records"]:
                merged[r["key"]] = _rederived(r)
        _write_results(list(merged.values()), env, pathlib.Path(args.out),
                       args.name or "tpu_static")
        return
    gens = args.generations.split(",")
    for gen in gens:
        if gen not in GENERATIONS:
            parser.error(f"--generations: {gen!r} is not one of {sorted(GENERATIONS)}")
        if not GENERATIONS[gen]["profiled"]:
            parser.error(f"--generations: libtpu has no static profile for {gen!r} "
                         "(no DMA latency model); the compile tests cover it")
    if args.crossover:
        specs, name = crossover_specs(gens), "tpu_static_crossover"
    elif args.calibration:
        specs, name = calibration_specs(), "tpu_static_calibration"
    else:
        specs = specs_for(args.ops.split(","), [i for i in args.impls.split(",") if i], gens,
                          args.passes.split(","))
        excluded = {tuple(item.split(":")) for item in args.exclude.split(",") if item}
        specs = [s for s in specs if (s.op, s.impl) not in excluded]
        name = "tpu_static"
    name = args.name or name
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Each record is appended here as it comes, and a rerun skips the programs already there: a
    # long run that is stopped loses nothing.
    partial = out / f"{name}.partial.jsonl"
    done = {}
    if partial.exists():
        for line in partial.read_text().splitlines():
            record = json.loads(line)
            done[record["key"]] = record
    wanted = {s.key for s in specs}
    records = [r for k, r in done.items() if k in wanted]
    todo = [s for s in specs if s.key not in done]
    print(f"{len(todo)} programs to profile, {len(records)} already in {partial}", flush=True)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool, partial.open("a") as log:
        for record in pool.map(lambda s: profile(s, args.timeout), todo):
            records.append(record)
            log.write(json.dumps(record) + "\n")
            log.flush()
            cyc = record.get("cycles")
            print(f"{record['key']}: {cyc if cyc is not None else record['error']}", flush=True)
    env = {"date": datetime.date.today().isoformat(), "python": sys.version.split()[0]}
    try:
        from importlib.metadata import version
        env.update({p: version(p) for p in ("jax", "jaxlib", "libtpu")})
        env["deltanet-tpu"] = version("deltanet-tpu")
    except Exception as e:  # noqa: BLE001 - a missing optional package is only recorded
        env["versions_note"] = repr(e)
    _write_results(records, env, out, name)
    partial.unlink()


def _rederived(record: dict) -> dict:
    """A stored record with its derived fields (estimates, kernel cycles) recomputed."""
    if record.get("cycles") is None:
        return record
    raw = {k: record[k] for k in ("op", "impl", "generation", "passes")}
    spec = Spec(shape=tuple(record["shape"]),
                options=tuple(tuple(o) for o in record["options"]), **raw)
    return _with_estimates(dict(record), spec, record["cycles"])


def _write_results(records: list[dict], env: dict, out: pathlib.Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"env": env, "records": records}, indent=1))
    write_table(records, out / f"{name}.md")
    write_plot(records, out / f"{name}.png")


if __name__ == "__main__":
    main()
