"""The programs the static profile compares: the TPU generations, `Spec` (one program), the
shapes of the comparison, the builders of each implementation's program on abstract inputs, and
the lists of specs a run profiles."""

from __future__ import annotations

import dataclasses
import math

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
    op: str  # "attention", "gla" or "delta_rule"
    impl: str
    shape: tuple  # attention (B, H, T, D, causal); gla (B, T, H, K, V, gate, mode);
    #               delta_rule (B, T, H, HV, K, V, gate)
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
    from gla_tpu.ops.common.flops import attention_flops, delta_rule_flops, gla_flops

    backward = spec.passes == "fwd_bwd"
    if spec.op == "attention":
        b, h, t, d, causal = spec.shape
        return attention_flops(b, t, t, h, d, causal=causal, backward=backward)
    if spec.op == "delta_rule":
        b, t, _, hv, kd, vd, _ = spec.shape
        return delta_rule_flops(b, t, hv, kd, vd, backward=backward)
    b, t, h, kd, vd = spec.shape[:5]
    return gla_flops(b, t, h, kd, vd, backward=backward)


def _attention_program(spec: Spec):
    """Attention on q, k, v of shape (B, H, T, D, causal): ours (mosaic_tpu or xla), JAX's flash
    attention (head-major, or from our [B, T, H, D] layout), splash, or dot_product_attention."""
    import jax
    import jax.numpy as jnp

    from gla_tpu import ops

    b, h, t, d, causal = spec.shape
    opts = dict(spec.options)
    bf16 = jnp.bfloat16
    bthd = jax.ShapeDtypeStruct((b, t, h, d), bf16)
    bhtd = jax.ShapeDtypeStruct((b, h, t, d), bf16)
    scale = d ** -0.5
    # options "window" (a causal window's left size) and "soft_cap": ours and splash only
    hybrid = _hybrid_options(opts)
    if hybrid and spec.impl not in ("gla_tpu", "splash"):
        raise ValueError(f"options {sorted(hybrid)} are for impls gla_tpu and splash; got "
                         f"{spec.impl!r}.")
    if spec.impl == "gla_tpu":
        sizes = _our_attention_blocks(opts)
        fn, args = (lambda q, k, v: ops.flash_attention(
            q, k, v, causal=causal, backend="mosaic_tpu", block_sizes=sizes,
            **hybrid)), (bthd,) * 3
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
        if hybrid.get("local_window_size") is not None:
            mask = sm.LocalMask((t, t), hybrid["local_window_size"], offset=0)
        kernel = sk.make_splash_mha(mask=sm.MultiHeadMask([mask] * h), head_shards=1,
                                    q_seq_shards=1,
                                    attn_logits_soft_cap=hybrid.get("logits_soft_cap"))
        fn = lambda q, k, v: jax.vmap(kernel)(q * scale, k, v)  # noqa: E731
        args = (bhtd,) * 3
    else:
        raise ValueError(f"unknown attention impl {spec.impl!r}")
    return fn, args


def _hybrid_options(opts: dict) -> dict:
    """flash_attention's local_window_size ((window, 0): causal) and logits_soft_cap from a
    spec's ("window", w) and ("soft_cap", c) options; {} without them."""
    out = {}
    if opts.get("window") is not None:
        out["local_window_size"] = (opts["window"], 0)
    if opts.get("soft_cap") is not None:
        out["logits_soft_cap"] = opts["soft_cap"]
    return out


def _our_attention_blocks(opts: dict):
    """Our BlockSizes from a spec's ("blocks", [[field, value], ...]) or ("defaults_with", ...)
    option (both the same): the fields given, every other one None, i.e. the op's default for the
    generation and the problem; None = defaults. Older records read these options otherwise
    (docs/tpu_static_estimate.md)."""
    from gla_tpu.ops.attention.mosaic_tpu import plan

    fields = opts.get("defaults_with", opts.get("blocks"))
    return None if fields is None else plan.BlockSizes(**dict(fields))


def _attention_backward_program(spec: Spec):
    """Our attention's backward alone, from abstract residuals: di, do (and q, k, v where the
    forward read the API's layout) into the kernels' head-major layout, the dq and dk/dv kernels
    (and at D = 64 their outputs' transposes).
    libtpu's profiler aborts on our kernels where XLA places their outputs in VMEM, as it does
    inside a whole forward+backward program; here the kernels' outputs are the program's
    (docs/tpu_static_estimate.md, "What the profiler cannot take")."""
    import jax
    import jax.numpy as jnp

    from gla_tpu.ops.attention.mosaic_tpu import plan, vjp
    from gla_tpu.ops.attention.validation import validate_attention
    from gla_tpu.testing.tpu_compile import targeting

    b, h, t, d, causal = spec.shape
    x = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
    problem, _, _ = validate_attention(x, x, x, causal=causal, sm_scale=None, segment_ids=None,
                                       **_hybrid_options(dict(spec.options)))
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
    """GLA of shape (B, T, H, K, V, gate, mode): ours (mosaic_tpu or xla; T = 1 is a decode step
    from a carried state) or deltanet-tpu's."""
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


# The delta rule's shapes (B, T, H, HV, K, V, gate): Qwen3.5 GDN, Qwen3-Next GDN (HV = 2H), KDA
# and DeltaNet at K = V = 128, the sizes deltanet-tpu takes.
DELTA_RULE_SHAPES = [(1, 8192, 16, 16, 128, 128, "head"), (1, 8192, 16, 32, 128, 128, "head"),
                     (1, 8192, 32, 32, 128, 128, "key"), (1, 8192, 16, 16, 128, 128, "none")]


def _delta_rule_program(spec: Spec):
    """The delta rule of shape (B, T, H, HV, K, V, gate), mode "chunk" (option "mode":
    "fused_recurrent" for ours): ours (mosaic_tpu, chunk 64, q and k l2-normalized in the op) or
    deltanet-tpu's chunk_gdn / chunk_kda / chunk_delta_rule (chunk 128, precision "bf16",
    qk_l2norm)."""
    import jax
    import jax.numpy as jnp

    from gla_tpu import ops

    b, t, h, hv, kd, vd, gate = spec.shape
    bf16, f32 = jnp.bfloat16, jnp.float32
    q = jax.ShapeDtypeStruct((b, t, h, kd), bf16)
    v = jax.ShapeDtypeStruct((b, t, hv, vd), bf16)
    beta = jax.ShapeDtypeStruct((b, t, hv), f32)
    g = {"key": jax.ShapeDtypeStruct((b, t, hv, kd), f32),
         "head": jax.ShapeDtypeStruct((b, t, hv), f32), "none": None}[gate]
    if spec.impl == "gla_tpu":
        sizes = None
        if dict(spec.options).get("profiler_safe"):
            from gla_tpu.ops.delta_rule.mosaic_tpu import BlockSizes

            sizes = BlockSizes(profiler_safe=True)

        mode = dict(spec.options).get("mode", "chunk")

        def fn(q, k, v, beta, *g_):
            return ops.delta_rule(q, k, v, beta, *g_, mode=mode, use_qk_l2norm=True,
                                  backend="mosaic_tpu", block_sizes=sizes)[0]
    elif spec.impl == "deltanet_tpu":
        import deltanet_tpu

        common = dict(chunk_size=128, precision="bf16", qk_l2norm=True)
        if gate == "none":
            def fn(q, k, v, beta):
                return deltanet_tpu.chunk_delta_rule(q, k, v, beta, **common)
        else:
            peer = deltanet_tpu.chunk_kda if gate == "key" else deltanet_tpu.chunk_gdn

            def fn(q, k, v, beta, g_):
                return peer(q, k, v, g_, beta, **common)
    else:
        raise ValueError(f"unknown delta_rule impl {spec.impl!r}")
    return fn, (q, q, v, beta) + (() if g is None else (g,))


def _program(spec: Spec):
    """`spec`'s program and its abstract arguments: (fn, (jax.ShapeDtypeStruct, ...)); a
    forward+backward program is the gradient of a loss of the forward's output."""
    import jax
    import jax.numpy as jnp

    fn, args = {"attention": _attention_program, "gla": _gla_program,
                "delta_rule": _delta_rule_program}[spec.op](spec)
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
    ("inside_projections", True) asks for it (docs/results/history.md, "Inside
    projections"); for attention, forward programs only (`Spec` refuses the others)."""
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


# Where the profiler takes our chunked GLA forward+backward (gated) only with
# BlockSizes(profiler_safe=True): the same values, about 0.5% more cycles on v6e
# (docs/results/history.md, "GLA forward+backward on v5e and v5p").
PROFILER_SAFE_GENERATIONS = ("v5e", "v5p")


def _gla_options(generation: str, gate: str, mode: str, passes: str) -> tuple:
    """The options of our GLA's record: profiler_safe where the default kernels abort it."""
    if (generation in PROFILER_SAFE_GENERATIONS and gate in ("key", "head")
            and passes == "fwd_bwd" and mode in ("chunk", "fused_chunk")):
        return (("profiler_safe", True),)
    return ()


def specs_for(ops_: list[str], impls: list[str] | None, generations: list[str],
              passes: list[str]) -> list[Spec]:
    """The programs of the comparison for these ops ("attention", "gla"), generations and passes
    ("fwd", "fwd_bwd"); with `impls`, only those implementations."""
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
