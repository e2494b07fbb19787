"""AOT compilation of the "mosaic_tpu" kernels for real TPU generations on a CPU host (libtpu).

Every configuration the docs claim (docs/attention_mosaic_tpu.md, docs/gla_mosaic_tpu.md,
docs/gla_mosaic_tpu_recurrent.md), through the public API, bfloat16 q, k, v (float32 gates), for
v4, v5e, v5p, v6e and 7x. Compiling runs the whole Mosaic compiler for the generation, VMEM budget
included. A forward+backward program (jax.grad of the sum of the squared outputs, whose gradient
needs the outputs' values, so no forward kernel is dropped as dead code) runs the forward kernels
in its forward pass; an inference-only forward is another program (the attention forward saves
no residuals there), so the attention configurations compile forward-only too.

The default run compiles every configuration on at least one generation and every generation on
every kernel family (the pairs below); `pytest --full` compiles every configuration on every
generation (docs/testing.md).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from gla_tpu import ops
from gla_tpu.testing.tpu_compile import TPU_GENERATIONS, compile_for_tpu, libtpu_available

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(not libtpu_available(), reason="needs libtpu (pip install .[test])"),
]
BF16, F32 = jnp.bfloat16, jnp.float32
FULL = pytest.mark.full


def _sweep(configs, default_generations, generations=TPU_GENERATIONS):
    """(name, generation) params over `configs` x `generations`, the pairs outside
    `default_generations[name]` marked `full`."""
    return [pytest.param(name, gen, id=f"{name}-{gen}",
                         marks=() if gen in default_generations(name) else FULL)
            for name in configs for gen in generations]


def _per_pass_sweep(configs, defaults):
    """(name, generation, passes) params over `configs` x generations x ("fwd_bwd", "fwd"), the
    triples outside `defaults[name][passes]` marked `full`."""
    return [pytest.param(n, gen, p, id=f"{n}-{gen}-{p}",
                         marks=() if gen in defaults[n][p] else FULL)
            for n in configs for gen in TPU_GENERATIONS for p in ("fwd_bwd", "fwd")]


def _grad_of_sum(fn, argnums):
    """Forward and backward of `fn`: the gradient of the sum of its squared outputs. (With a plain
    sum, an output's cotangent would not depend on its value and XLA would drop a forward kernel
    whose outputs the backward does not read, e.g. GLA's chunk outputs kernel.)"""
    def loss(*args):
        return sum(jnp.sum(x.astype(F32) ** 2) for x in jax.tree_util.tree_leaves(fn(*args)))

    return jax.grad(loss, argnums=argnums)


# Flash attention: (B, T, S, H, Hkv, D, causal, segments).
ATTENTION = {
    # one query head per kv head, at a long grid
    "b1_t8192_h16_d128_causal": (1, 8192, 8192, 16, 16, 128, True, False),
    # ragged lengths, padding, a segment-id pair, GQA 8:1
    "b2_t1000_s1300_h8_hkv1_d64_causal_segments": (2, 1000, 1300, 8, 1, 64, True, True),
    # the longest grid: T = S = 32768
    "t32768_d128_causal_gqa8": (1, 32768, 32768, 8, 1, 128, True, False),
    # many heads at D = 128 (every head per block of the rows forward: its VMEM grows with H)
    "b2_t4096_h32_d128_causal": (2, 4096, 4096, 32, 32, 128, True, False),
    "b1_t4096_h64_d128_full": (1, 4096, 4096, 64, 64, 128, False, False),
    # the forward on the API's layout (every head per block) with padding, segments, GQA 4:1
    "b2_t1000_s1300_h8_hkv2_d128_causal_segments": (2, 1000, 1300, 8, 2, 128, True, True),
}
# The sweep: D x causal at T = S = 2048, H=8, Hkv=1 (GQA 8:1), B=2. Every T from 1024 up takes the
# same tiles (blocks are capped at 1024, docs/attention_mosaic_tpu.md), so T only lengthens the
# grid and one T covers it ("t32768_d128_causal_gqa8" above takes the longest grid); another GQA
# group runs the same kernels too. Until 2026-11-25 the sweep also ran at T = 32768 (at T = 8192
# until 2026-11-23), with B2 T4096 H8 Hkv2 D64 non-causal and B1 T4096 H8 D256 causal.
ATTENTION.update({
    f"t2048_d{d}_{'causal' if causal else 'full'}_gqa8": (2, 2048, 2048, 8, 1, d, causal, False)
    for d in (64, 128, 256) for causal in (True, False)})


# Default run: each config of the sweep on one generation, the six (D, causal) pairs spread over
# all five generations, and each long or ragged config on one (b2_t4096_h32_d128_causal on v6e;
# v5e in --full, which compiles b1_t8192_h16_d128_causal and the D = 64 causal sweep config).
ATTENTION_DEFAULT = {
    "b1_t8192_h16_d128_causal": ("v5e",),
    "b2_t1000_s1300_h8_hkv1_d64_causal_segments": ("v4",),
    "t32768_d128_causal_gqa8": ("v6e",),
    "b2_t1000_s1300_h8_hkv2_d128_causal_segments": ("v5p",),
    "b2_t4096_h32_d128_causal": ("v6e",),
    "b1_t4096_h64_d128_full": ("7x",),
}


def _attention_default(name):
    if name in ATTENTION_DEFAULT:
        return ATTENTION_DEFAULT[name]
    *_, d, causal, _ = ATTENTION[name]
    generation = TPU_GENERATIONS[(2 * (64, 128, 256).index(d) + causal) % len(TPU_GENERATIONS)]
    # t32768_d128_causal_gqa8 runs this pair's kernels on the same generation (T only lengthens
    # the grid), so the default run does not compile them twice (about 50 s on a 2-core host).
    if (d, causal, generation) == (128, True, ATTENTION_DEFAULT["t32768_d128_causal_gqa8"][0]):
        return ()
    return (generation,)


@pytest.mark.parametrize("passes", ["fwd_bwd", "fwd"])
@pytest.mark.parametrize("name,generation", _sweep(ATTENTION, _attention_default))
def test_attention_compiles(name, generation, passes):
    b, t, s, h, hkv, d, causal, segments = ATTENTION[name]
    args = [jax.ShapeDtypeStruct((b, t, h, d), BF16), jax.ShapeDtypeStruct((b, s, hkv, d), BF16),
            jax.ShapeDtypeStruct((b, s, hkv, d), BF16)]
    if segments:
        args += [jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b, s), jnp.int32)]

    def forward(q, k, v, *seg):
        return ops.flash_attention(q, k, v, causal=causal, segment_ids=tuple(seg) or None,
                                   backend="mosaic_tpu")

    fn = _grad_of_sum(forward, (0, 1, 2)) if passes == "fwd_bwd" else forward
    assert compile_for_tpu(fn, *args, generation=generation) is not None


# Hybrid-model attention: local windows (Gemma 2's 4096 at T = 8192, a window narrower than a
# block, two-sided) and soft-capped scores, forward+backward and forward only:
# name -> (B, T, H, Hkv, D, causal, local_window_size, logits_soft_cap).
ATTENTION_HYBRID = {
    "t8192_h8_d128_causal_window4096_softcap": (1, 8192, 8, 4, 128, True, 4096, 50.0),
    "t4096_h16_d128_causal_window1024": (1, 4096, 16, 16, 128, True, (1024, 0), None),
    "t2048_h8_hkv2_d64_window100_300": (2, 2048, 8, 2, 64, False, (100, 300), None),
    "t2048_h8_d256_softcap": (1, 2048, 8, 8, 256, False, None, 30.0),
}
ATTENTION_HYBRID_DEFAULT = {
    "t8192_h8_d128_causal_window4096_softcap": {"fwd_bwd": ("v5e",), "fwd": ("v6e",)},
    "t4096_h16_d128_causal_window1024": {"fwd_bwd": ("v6e",), "fwd": ("v5p",)},
    "t2048_h8_hkv2_d64_window100_300": {"fwd_bwd": ("v4",), "fwd": ()},
    "t2048_h8_d256_softcap": {"fwd_bwd": ("7x",), "fwd": ()},
}


@pytest.mark.parametrize("name,generation,passes",
                         _per_pass_sweep(ATTENTION_HYBRID, ATTENTION_HYBRID_DEFAULT))
def test_attention_window_and_soft_cap_compile(name, generation, passes):
    b, t, h, hkv, d, causal, window, cap = ATTENTION_HYBRID[name]
    args = [jax.ShapeDtypeStruct((b, t, h, d), BF16), jax.ShapeDtypeStruct((b, t, hkv, d), BF16),
            jax.ShapeDtypeStruct((b, t, hkv, d), BF16)]

    def forward(q, k, v):
        return ops.flash_attention(q, k, v, causal=causal, local_window_size=window,
                                   logits_soft_cap=cap, backend="mosaic_tpu")

    fn = _grad_of_sum(forward, (0, 1, 2)) if passes == "fwd_bwd" else forward
    assert compile_for_tpu(fn, *args, generation=generation) is not None


# float32 inputs at D = 256 with segment ids: the largest default tiles by VMEM on the chips with
# the smallest default scoped limit, 16 MiB: v4's dk/dv kernel at 512 x 512 (12.1 MiB by
# plan.vmem_estimate_bytes), v5e's and v5p's forward at 1024 x 1024 (13.2 MiB; v5p in --full).
@pytest.mark.parametrize("generation", ["v4", "v5e", pytest.param("v5p", marks=pytest.mark.full)])
def test_attention_float32_d256_compiles(generation):
    x = jax.ShapeDtypeStruct((2, 2048, 8, 256), F32)
    seg = jax.ShapeDtypeStruct((2, 2048), jnp.int32)

    def forward(q, k, v, q_seg, kv_seg):
        return ops.flash_attention(q, k, v, causal=True, segment_ids=(q_seg, kv_seg),
                                   backend="mosaic_tpu")

    fn = _grad_of_sum(forward, (0, 1, 2))
    assert compile_for_tpu(fn, x, x, x, seg, seg, generation=generation) is not None


# The forward's default tiles at 64 <= D <= 128 on 128-wide MXUs (plan._forward_tiles_128_wide):
# 1024 x 1024 in 512-key steps where the chip has 64 MiB of VMEM or more, for the head-major
# forward (at D = 128 v5p causal at batch 1: compiled here, as the compile sweep's configurations
# do not reach it; at D = 64 always, compiled on v5e causal) and for the rows forward without a
# mask; the causal rows forward keeps 512 x 512, and so does D < 64.
@pytest.mark.parametrize("generation,batch,d,causal,expected", [
    ("v5p", 1, 128, True, (False, 1024, 1024, 512)),
    ("v5p", 2, 128, True, (True, 512, 512, 512)),
    ("v5e", 1, 128, False, (True, 1024, 1024, 512)),
    ("v4", 1, 128, True, (False, 512, 512, 512)),  # 16 MiB of VMEM
    ("v5e", 1, 64, True, (False, 1024, 1024, 512)),
    ("v5p", 2, 64, False, (False, 1024, 1024, 512)),
    ("v5e", 1, 32, True, (False, 512, 512, 512)),
], ids=["v5p-d128-causal-b1", "v5p-d128-causal-b2", "v5e-d128-full", "v4-d128", "v5e-d64-causal",
        "v5p-d64-full", "v5e-d32"])
def test_forward_tiles_128_wide(generation, batch, d, causal, expected):
    from gla_tpu.ops.attention.mosaic_tpu.plan import kernel_config
    from gla_tpu.ops.attention.validation import validate_attention
    from gla_tpu.testing.tpu_compile import targeting

    x = jax.ShapeDtypeStruct((batch, 4096, 8, d), BF16)
    problem, _, _ = validate_attention(x, x, x, causal=causal, sm_scale=None, segment_ids=None)
    with targeting(generation):
        cfg = kernel_config(problem, None, False)
    assert (cfg.forward_reads_rows, cfg.block_q, cfg.block_kv, cfg.block_kv_compute) == expected
    if (generation, batch, d) in (("v5p", 1, 128), ("v5e", 1, 128), ("v5e", 1, 64)):
        fn = _grad_of_sum(lambda q, k, v: ops.flash_attention(q, k, v, causal=causal,
                                                              backend="mosaic_tpu"), (0, 1, 2))
        assert compile_for_tpu(fn, x, x, x, generation=generation) is not None


# The backward's default tiles on 128-wide MXUs (plan._backward_tiles_128_wide): 1024 x 1024 in
# 16-bit dtypes at D = 256 on v5p (two TensorCores, 64 MiB of VMEM), compiled there in bfloat16,
# causal with segment ids (their rows in VMEM too), and on v5e without a mask, compiled there;
# at D = 64 on v5p, compiled there causal with segment ids; v5e's full attention at D = 128 in
# dq 512 x 2048 and dk/dv 2048 x 512 (at T = 2048; each 4096 at T = 4096, test below), compiled
# there; float32, v5e with a causal mask or segment ids at D = 256, v5e at D = 64 and D = 128
# elsewhere keep 512 x 512.
@pytest.mark.parametrize("generation,d,dtype,causal,segments,expected", [
    ("v5p", 256, BF16, True, True, (1024, 1024, 1024, 1024)),
    ("v5p", 256, F32, True, True, (512, 512, 512, 512)),
    ("v5e", 256, BF16, True, False, (512, 512, 512, 512)),
    ("v5e", 256, BF16, False, True, (512, 512, 512, 512)),
    ("v5e", 256, BF16, False, False, (1024, 1024, 1024, 1024)),
    ("v5p", 64, BF16, True, True, (1024, 1024, 1024, 1024)),
    ("v5e", 64, BF16, False, False, (512, 512, 512, 512)),
    ("v5p", 128, BF16, False, False, (512, 512, 512, 512)),
    ("v5e", 128, BF16, False, False, (512, 2048, 2048, 512)),
    ("v5e", 128, BF16, True, False, (512, 512, 512, 512)),
    ("v5e", 128, F32, False, False, (512, 512, 512, 512)),
], ids=["v5p-bfloat16-causal-segments", "v5p-float32", "v5e-causal", "v5e-segments",
        "v5e-full", "v5p-d64-causal-segments", "v5e-d64", "v5p-d128", "v5e-d128-full",
        "v5e-d128-causal", "v5e-d128-float32"])
def test_backward_tiles_128_wide(generation, d, dtype, causal, segments, expected):
    from gla_tpu.ops.attention.mosaic_tpu.plan import kernel_config
    from gla_tpu.ops.attention.validation import validate_attention
    from gla_tpu.testing.tpu_compile import targeting

    x = jax.ShapeDtypeStruct((2, 2048, 8, d), dtype)
    seg = jax.ShapeDtypeStruct((2, 2048), jnp.int32)
    ids = jnp.zeros(seg.shape, seg.dtype)
    problem, _, _ = validate_attention(x, x, x, causal=causal, sm_scale=None,
                                       segment_ids=(ids, ids) if segments else None)
    with targeting(generation):
        cfg = kernel_config(problem, None, False)
    assert (cfg.block_q_dq, cfg.block_kv_dq, cfg.block_q_dkv, cfg.block_kv_dkv) == expected
    if expected != (512, 512, 512, 512):
        def forward(q, k, v, *seg_ids):
            return ops.flash_attention(q, k, v, causal=causal, segment_ids=seg_ids or None,
                                       backend="mosaic_tpu")

        fn = _grad_of_sum(forward, (0, 1, 2))
        args = (x, x, x) + ((seg, seg) if segments else ())
        assert compile_for_tpu(fn, *args, generation=generation) is not None


# The backward in one kernel (plan._fused_backward): where the kv head's dq for the whole sequence
# fits half the chip's VMEM; not on v4 (16 MiB), not at T = 32768 with 8 query heads per kv head,
# not on two TensorCores (v5p) with one (batch, kv head) pair, not where the chip is not known.
@pytest.mark.parametrize("generation,b,t,h,hkv,expected", [
    ("v5e", 1, 4096, 8, 8, True), ("v6e", 2, 4096, 32, 32, True), ("7x", 1, 8192, 16, 16, True),
    ("v4", 1, 4096, 8, 8, False), ("v5e", 1, 32768, 8, 1, False), ("v5p", 1, 4096, 1, 1, False),
    ("v5p", 1, 4096, 8, 8, True), (None, 1, 4096, 8, 8, False),
])
def test_one_kernel_backward_where_it_fits(generation, b, t, h, hkv, expected):
    from gla_tpu.ops.attention.mosaic_tpu import plan
    from gla_tpu.ops.attention.validation import validate_attention
    from gla_tpu.testing.tpu_compile import targeting

    q, kv = (jax.ShapeDtypeStruct((b, t, n, 128), BF16) for n in (h, hkv))
    problem, _, _ = validate_attention(q, kv, kv, causal=True, sm_scale=None, segment_ids=None)
    if generation is None:
        cfg = plan.kernel_config(problem, None, False)
    else:
        with targeting(generation):
            cfg = plan.kernel_config(problem, None, False)
    assert cfg.fused_backward is expected
    if expected:
        limit = cfg.fused_backward_vmem_limit_bytes
        assert plan.kernel_vmem_bytes(cfg, "dqkv") <= limit
    forced = plan.kernel_config(problem, plan.BlockSizes(fused_backward=False), False)
    assert not forced.fused_backward


def test_one_kernel_backward_forced_where_it_cannot_fit_says_so():
    """BlockSizes(fused_backward=True) where dq for the sequence outgrows the chip's VMEM (v5e,
    T = 131072, a group of 8): NotImplementedError naming the field and the bytes, not a
    compiler trace."""
    from gla_tpu.ops.attention.mosaic_tpu import plan
    from gla_tpu.ops.attention.validation import validate_attention
    from gla_tpu.testing.tpu_compile import targeting

    q, kv = (jax.ShapeDtypeStruct((1, 131072, n, 128), BF16) for n in (8, 1))
    problem, _, _ = validate_attention(q, kv, kv, causal=True, sm_scale=None, segment_ids=None)
    with targeting("v5e"), pytest.raises(NotImplementedError, match="fused_backward=True"):
        plan.kernel_config(problem, plan.BlockSizes(fused_backward=True), False)


# v5e's wide backward blocks for full attention at D = 128 (plan._wide_block): 4096 where the
# sequence pads to a multiple of it, 2048 where 4096 would pad further than 1024-blocks, none at
# T <= 1024 or T = 3000 (3072 is no multiple of 2048); whatever the head count.
@pytest.mark.parametrize("t,h,expected", [
    (4096, 8, (512, 4096, 4096, 512)), (16384, 32, (512, 4096, 4096, 512)),
    (6144, 8, (512, 2048, 2048, 512)), (3000, 8, (512, 512, 512, 512)),
    (1024, 8, (512, 512, 512, 512)),
])
def test_wide_backward_blocks_on_v5e(t, h, expected):
    from gla_tpu.ops.attention.mosaic_tpu.plan import kernel_config
    from gla_tpu.ops.attention.validation import validate_attention
    from gla_tpu.testing.tpu_compile import targeting

    x = jax.ShapeDtypeStruct((1, t, h, 128), BF16)
    problem, _, _ = validate_attention(x, x, x, causal=False, sm_scale=None, segment_ids=None)
    with targeting("v5e"):
        cfg = kernel_config(problem, None, False)
    assert (cfg.block_q_dq, cfg.block_kv_dq, cfg.block_q_dkv, cfg.block_kv_dkv) == expected
    assert cfg.q_len_padded == -(-t // 1024) * 1024 if t > 1024 else True


# A BlockSizes that sets some fields leaves the others to the op's defaults for the chip and
# problem: the 256-wide MXUs' 1024-tiles on v6e, the D = 128 forward's rule on v5e while the
# forward's tiles are unset; a forward tile set by hand turns that rule off; a default
# block_kv_compute that does not divide a block_kv set by hand gives way to one step.
@pytest.mark.parametrize("generation,d,causal,sizes,expected", [
    ("v6e", 128, True, dict(row_sum_on_mxu=False), (1024, 1024, 1024, 1024, 1024)),
    ("v5e", 128, False, dict(vmem_limit_bytes=64 * 2**20), (1024, 1024, 512, 512, 512)),
    ("v5e", 128, False, dict(block_q_dq=256), (1024, 1024, 512, 256, 512)),
    ("v5e", 128, False, dict(block_q=512), (512, 512, 512, 512, 512)),
    ("v5e", 256, True, dict(block_kv=384), (1024, 384, 384, 512, 512)),
    ("v5e", 256, True, dict(block_q_dq=256), (1024, 1024, 256, 256, 512)),
])
def test_block_sizes_fields_left_none_take_the_defaults(generation, d, causal, sizes, expected):
    from gla_tpu.ops.attention.mosaic_tpu import BlockSizes
    from gla_tpu.ops.attention.mosaic_tpu.plan import kernel_config
    from gla_tpu.ops.attention.validation import validate_attention
    from gla_tpu.testing.tpu_compile import targeting

    x = jax.ShapeDtypeStruct((1, 4096, 8, d), BF16)
    problem, _, _ = validate_attention(x, x, x, causal=causal, sm_scale=None, segment_ids=None)
    with targeting(generation):
        cfg = kernel_config(problem, BlockSizes(**sizes), False)
    assert (cfg.block_q, cfg.block_kv, cfg.block_kv_compute, cfg.block_q_dq,
            cfg.block_kv_dkv) == expected


# block_kv_compute set alone must divide the chip's default block_kv; the error says that the
# block_kv it names is the default, not one the caller set.
def test_block_kv_compute_alone_names_the_default_block_kv():
    from gla_tpu.ops.attention.mosaic_tpu import BlockSizes
    from gla_tpu.ops.attention.mosaic_tpu.plan import kernel_config
    from gla_tpu.ops.attention.validation import validate_attention
    from gla_tpu.testing.tpu_compile import targeting

    x = jax.ShapeDtypeStruct((1, 4096, 8, 128), BF16)
    problem, _, _ = validate_attention(x, x, x, causal=True, sm_scale=None, segment_ids=None)
    with targeting("v6e"), pytest.raises(ValueError, match=(
            r"block_kv_compute=384 must divide block_kv, which is left to this chip's default "
            r"1024")):
        kernel_config(problem, BlockSizes(block_kv_compute=384), False)


def _gla_args(gate, b, t, h, kd, vd):
    gshape = (b, t, h, kd) if gate == "key" else (b, t, h)
    return (jax.ShapeDtypeStruct((b, t, h, kd), BF16), jax.ShapeDtypeStruct((b, t, h, kd), BF16),
            jax.ShapeDtypeStruct((b, t, h, vd), BF16), jax.ShapeDtypeStruct(gshape, F32),
            jax.ShapeDtypeStruct((b, h, kd, vd), F32))


def _gla(mode, chunk_size=None):
    def fn(q, k, v, g, s0):
        return ops.gla(q, k, v, g, initial_state=s0, output_final_state=True, mode=mode,
                       chunk_size=chunk_size, backend="mosaic_tpu")
    return fn


# GLA: mode -> {name: (gate, B, T, H, K, V[, chunk_size])}, with an initial state; the chunked
# modes at the default chunk (128 up to K = 256, 64 above) and at 64.
GLA = {
    "fused_chunk": {
        "key-B2-T4096-H8-K128-V128": ("key", 2, 4096, 8, 128, 128),
        "key-B2-T4096-H8-K128-V128-C64": ("key", 2, 4096, 8, 128, 128, 64),
        "head-B2-T4096-H16-K64-V64": ("head", 2, 4096, 16, 64, 64),
        "key-B1-T1024-H2-K512-V512": ("key", 1, 1024, 2, 512, 512),
        "head-B2-T2048-H4-K256-V512": ("head", 2, 2048, 4, 256, 512),
    },
    "chunk": {
        "key-B4-T2048-H4-K256-V512": ("key", 4, 2048, 4, 256, 512),
        "key-B4-T2048-H4-K256-V512-C64": ("key", 4, 2048, 4, 256, 512, 64),
        "key-B1-T1024-H2-K192-V320": ("key", 1, 1024, 2, 192, 320),
        "head-B1-T2048-H4-K64-V64-C64": ("head", 1, 2048, 4, 64, 64, 64),
    },
    "fused_recurrent": {
        "key-B8-T256-H8-K128-V128": ("key", 8, 256, 8, 128, 128),
        "key-B2-T128-H4-K256-V512": ("key", 2, 128, 4, 256, 512),
        "key-B1-T128-H2-K512-V512": ("key", 1, 128, 2, 512, 512),
        "key-B1-T128-H2-K448-V320": ("key", 1, 128, 2, 448, 320),
        "key-B2-T130-H4-K64-V64": ("key", 2, 130, 4, 64, 64),
    },
}


# The chunk-64 twins of default-chunk configs on v4 (the least VMEM) and v6e; every other config
# on every generation.
C64_TWINS = ("key-B2-T4096-H8-K128-V128-C64", "key-B4-T2048-H4-K256-V512-C64")
C64_GENERATIONS = ("v4", "v6e")
# Default run: each config on one generation, every generation in every mode.
GLA_DEFAULT = {
    "fused_chunk": {
        "key-B2-T4096-H8-K128-V128": ("7x",),
        "key-B2-T4096-H8-K128-V128-C64": ("v4",),
        "head-B2-T4096-H16-K64-V64": ("v6e",),
        "key-B1-T1024-H2-K512-V512": ("v4",),
        "head-B2-T2048-H4-K256-V512": ("v5p",),
    },
    "chunk": {
        "key-B4-T2048-H4-K256-V512": ("v5e",),
        "key-B4-T2048-H4-K256-V512-C64": ("v6e",),
        "key-B1-T1024-H2-K192-V320": ("7x",),
        "head-B1-T2048-H4-K64-V64-C64": ("v5p",),
    },
    "fused_recurrent": {
        "key-B8-T256-H8-K128-V128": ("v6e",),
        "key-B2-T128-H4-K256-V512": ("v5e",),
        "key-B1-T128-H2-K512-V512": ("v4",),
        "key-B1-T128-H2-K448-V320": ("7x",),
        "key-B2-T130-H4-K64-V64": ("v5p",),
    },
}


@pytest.mark.parametrize("mode,name,generation", [
    pytest.param(m, n, gen, id=f"{m}-{n}-{gen}",
                 marks=() if gen in GLA_DEFAULT[m][n] else FULL)
    for m, configs in GLA.items() for n in configs for gen in TPU_GENERATIONS
    if n not in C64_TWINS or gen in C64_GENERATIONS])
def test_gla_compiles(mode, name, generation):
    gate, b, t, h, kd, vd, *chunk_size = GLA[mode][name]
    args = _gla_args(gate, b, t, h, kd, vd)
    fn = _grad_of_sum(_gla(mode, *chunk_size), (0, 1, 2, 3, 4))
    assert compile_for_tpu(fn, *args, generation=generation) is not None


# BlockSizes(profiler_safe=True), the kernels libtpu's static profiler takes on v5e and v5p
# (docs/tpu_static_estimate.md, "`BlockSizes(profiler_safe=True)`"): forward+backward at the shape it was
# profiled at, per-key chunk on v5e by default, the rest in --full.
@pytest.mark.parametrize("mode,generation,gate", [
    ("chunk", "v5e", "key"),
    pytest.param("fused_chunk", "v5e", "key", marks=pytest.mark.full),
    pytest.param("chunk", "v5p", "key", marks=pytest.mark.full),
    pytest.param("fused_chunk", "v5p", "key", marks=pytest.mark.full),
    pytest.param("chunk", "v5e", "head", marks=pytest.mark.full),
])
def test_gla_profiler_safe_compiles(mode, generation, gate):
    from gla_tpu.ops.gla.mosaic_tpu import BlockSizes

    def fn(q, k, v, g, s0):
        return ops.gla(q, k, v, g, initial_state=s0, output_final_state=True, mode=mode,
                       backend="mosaic_tpu", block_sizes=BlockSizes(profiler_safe=True))

    args = _gla_args(gate, 1, 4096, 8, 128, 128)
    assert compile_for_tpu(_grad_of_sum(fn, (0, 1, 2, 3, 4)), *args,
                           generation=generation) is not None


def test_gla_chunk_128_above_k_256_is_refused_on_v4():
    """v4's 16 MiB of VMEM does not hold the chunk-128 blocks at K = V = 512: a clear refusal,
    not the compiler's out-of-memory error."""
    args = _gla_args("key", 1, 1024, 2, 512, 512)
    with pytest.raises(NotImplementedError, match="chunk_size=128 for K <= 256 on v4"):
        compile_for_tpu(_gla("fused_chunk", 128), *args, generation="v4")


@pytest.mark.parametrize("generation", TPU_GENERATIONS)
def test_gla_decode_step_compiles(generation):
    """A decode step of a serving batch: one token per row, the state carried in (forward only,
    the decode kernel)."""
    b, t, h, kd, vd = 64, 1, 16, 128, 128
    compiled = compile_for_tpu(_gla("fused_recurrent"), *_gla_args("key", b, t, h, kd, vd),
                               generation=generation)
    # Outputs: o [B, 1, H, V] bf16 and the final state [B, H, K, V] f32, nothing else (up to
    # buffer alignment).
    expected = b * h * vd * 2 + b * h * kd * vd * 4
    assert expected <= compiled.memory_analysis().output_size_in_bytes <= 1.01 * expected


# The delta rule (mode "chunk", chunk 64): name -> (gate, B, T, H, HV, K, V), with beta, an
# initial state and a final state; forward+backward and forward only. The shapes at
# T = 4096 (Qwen3.5 GDN H16 HV16, Qwen3-Next GDN H16 HV32, KDA H32, DeltaNet H16), and K, V of
# 64 and 256.
DELTA_RULE = {
    "head-B1-T4096-H16-HV16-K128-V128": ("head", 1, 4096, 16, 16, 128, 128),
    "head-B1-T4096-H16-HV32-K128-V128": ("head", 1, 4096, 16, 32, 128, 128),
    "key-B1-T4096-H32-HV32-K128-V128": ("key", 1, 4096, 32, 32, 128, 128),
    "none-B1-T4096-H16-HV16-K128-V128": ("none", 1, 4096, 16, 16, 128, 128),
    "key-B2-T2048-H8-HV8-K64-V64": ("key", 2, 2048, 8, 8, 64, 64),
    "key-B1-T2048-H4-HV8-K256-V256": ("key", 1, 2048, 4, 8, 256, 256),
}
# Default run: every config on one generation, every generation, each pass on every gate kind
# (the forward-only per-head program in head-B1-T4096-H16-HV32-K128-V128 on v5e; HV16's on v6e
# with --full).
DELTA_RULE_DEFAULT = {
    "head-B1-T4096-H16-HV16-K128-V128": {"fwd_bwd": ("v5e",), "fwd": ()},
    "head-B1-T4096-H16-HV32-K128-V128": {"fwd_bwd": ("v6e",), "fwd": ("v5e",)},
    "key-B1-T4096-H32-HV32-K128-V128": {"fwd_bwd": ("v5p",), "fwd": ("7x",)},
    "none-B1-T4096-H16-HV16-K128-V128": {"fwd_bwd": ("7x",), "fwd": ("v4",)},
    "key-B2-T2048-H8-HV8-K64-V64": {"fwd_bwd": ("v4",), "fwd": ()},
    "key-B1-T2048-H4-HV8-K256-V256": {"fwd_bwd": ("v4",), "fwd": ()},
}


def _delta_rule_args(gate, b, t, h, hv, kd, vd):
    gshape = {"key": (b, t, hv, kd), "head": (b, t, hv), "none": None}[gate]
    args = [jax.ShapeDtypeStruct((b, t, h, kd), BF16), jax.ShapeDtypeStruct((b, t, h, kd), BF16),
            jax.ShapeDtypeStruct((b, t, hv, vd), BF16), jax.ShapeDtypeStruct((b, t, hv), F32),
            jax.ShapeDtypeStruct((b, hv, kd, vd), F32)]
    if gshape is not None:
        args.append(jax.ShapeDtypeStruct(gshape, F32))
    return tuple(args)


def _compile_delta_rule(mode, config, generation, passes):
    """Compiles ops.delta_rule (mosaic_tpu, states in and out, q and k l2-normalized in the op)
    of `config` = (gate, B, T, H, HV, K, V) in `mode`, forward or forward+backward."""
    gate, *shape = config
    args = _delta_rule_args(gate, *shape)

    def forward(q, k, v, beta, s0, g=None):
        return ops.delta_rule(q, k, v, beta, g, initial_state=s0, output_final_state=True,
                              use_qk_l2norm=True, mode=mode, backend="mosaic_tpu")

    fn = forward if passes == "fwd" else _grad_of_sum(forward, tuple(range(len(args))))
    assert compile_for_tpu(fn, *args, generation=generation) is not None


@pytest.mark.parametrize("name,generation,passes", _per_pass_sweep(DELTA_RULE, DELTA_RULE_DEFAULT))
def test_delta_rule_compiles(name, generation, passes):
    _compile_delta_rule("chunk", DELTA_RULE[name], generation, passes)


# Default run: every shape, every generation (the kernel's blocks follow a fixed 12 MiB, not the
# chip); --full, every shape on every generation.
DELTA_RULE_DECODE = {"B64-HV16-K128-gdn": (64, 16, 16, 128, 128, "head"),
                     "B256-HV32-K64-gdn": (256, 16, 32, 64, 64, "head"),
                     "B64-HV32-K128-kda": (64, 32, 32, 128, 128, "key")}
DELTA_RULE_DECODE_DEFAULT = {"B64-HV16-K128-gdn": ("v4", "v6e"), "B256-HV32-K64-gdn": ("v5e",),
                             "B64-HV32-K128-kda": ("v5p", "7x")}


@pytest.mark.parametrize("name,generation",
                         _sweep(DELTA_RULE_DECODE, DELTA_RULE_DECODE_DEFAULT.__getitem__))
def test_delta_rule_decode_step_compiles(name, generation):
    """A decode step of a serving batch (mode "fused_recurrent", T = 1): the decode kernel, the
    state carried in and out."""
    b, h, hv, kd, vd, gate = DELTA_RULE_DECODE[name]
    args = _delta_rule_args(gate, b, 1, h, hv, kd, vd)

    def step(q, k, v, beta, s0, g):
        return ops.delta_rule(q, k, v, beta, g, initial_state=s0, output_final_state=True,
                              use_qk_l2norm=True, mode="fused_recurrent", backend="mosaic_tpu")

    compiled = compile_for_tpu(step, *args, generation=generation)
    expected = b * hv * vd * 2 + b * hv * kd * vd * 4  # o bf16 and the final state f32
    assert expected <= compiled.memory_analysis().output_size_in_bytes <= 1.01 * expected


# The delta rule's fused_recurrent at T > 1 (GLA's time-blocked kernels with the delta update):
# name -> (gate, B, T, H, HV, K, V), forward+backward and forward only. A prefill of a few
# hundred tokens per sequence, grouped value heads, and K, V of 64 and 256.
DELTA_RULE_RECURRENT = {
    "head-B8-T256-H16-HV32-K128-V128": ("head", 8, 256, 16, 32, 128, 128),
    "key-B4-T200-H8-HV8-K256-V256": ("key", 4, 200, 8, 8, 256, 256),
    "none-B2-T512-H8-HV16-K64-V64": ("none", 2, 512, 8, 16, 64, 64),
}
DELTA_RULE_RECURRENT_DEFAULT = {
    "head-B8-T256-H16-HV32-K128-V128": {"fwd_bwd": ("v5e",), "fwd": ("v6e",)},
    "key-B4-T200-H8-HV8-K256-V256": {"fwd_bwd": ("v6e",), "fwd": ("v4",)},
    "none-B2-T512-H8-HV16-K64-V64": {"fwd_bwd": ("7x",), "fwd": ("v5p",)},
}


@pytest.mark.parametrize("name,generation,passes",
                         _per_pass_sweep(DELTA_RULE_RECURRENT, DELTA_RULE_RECURRENT_DEFAULT))
def test_delta_rule_fused_recurrent_compiles(name, generation, passes):
    _compile_delta_rule("fused_recurrent", DELTA_RULE_RECURRENT[name], generation, passes)


# The harness itself.


def _double(x):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // 128,),
        in_specs=[pl.BlockSpec((128, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((128, 128), lambda i: (i, 0)),
    )(x)


def test_harness_compiles_a_trivial_kernel_for_every_generation():
    for generation in TPU_GENERATIONS:
        compiled = compile_for_tpu(_double, jax.ShapeDtypeStruct((1024, 128), F32),
                                   generation=generation)
        assert compiled.memory_analysis().output_size_in_bytes == 1024 * 128 * 4


def test_harness_refuses_an_unknown_generation():
    with pytest.raises(ValueError, match="generation must be one of"):
        compile_for_tpu(_double, jax.ShapeDtypeStruct((128, 128), F32), generation="v3")


# Sharded programs on a 4-chip slice (docs/scale_out.md): batch and heads over a (2, 2) mesh.
SHARDED_GENERATIONS = ("v5e", "v5p", "v6e")
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def _sharded_generations(default):
    """SHARDED_GENERATIONS, all but `default` marked `full`."""
    return [pytest.param(gen, marks=() if gen == default else FULL)
            for gen in SHARDED_GENERATIONS]


# --full only: tests/ops/test_sharding.py checks the same property (no collective) on 8 CPU devices
@pytest.mark.parametrize("op,generation", [
    pytest.param(op, gen, id=f"{op}-{gen}", marks=FULL)
    for op in ("attention", "gla") for gen in SHARDED_GENERATIONS])
def test_sharded_program_compiles_for_a_4_chip_slice_without_collectives(op, generation):
    """`jax.jit` of the op's forward+backward with q, k, v (and g) split over batch and heads:
    Mosaic compiles each chip's kernels, and the partitioned program moves nothing between chips
    (without `sharding=`, the same program fails: Mosaic kernels cannot be partitioned)."""
    import re

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from gla_tpu.testing.tpu_compile import compile_sharded_for_tpu, tpu_slice_mesh

    mesh = tpu_slice_mesh(generation, (2, 2), ("data", "model"))
    sharding = NamedSharding(mesh, P("data", None, "model", None))
    x = jax.ShapeDtypeStruct((4, 1024, 4, 128), BF16, sharding=sharding)
    g = jax.ShapeDtypeStruct((4, 1024, 4, 128), F32, sharding=sharding)
    if op == "attention":
        fn = _grad_of_sum(lambda q, k, v: ops.flash_attention(
            q, k, v, causal=True, backend="mosaic_tpu", sharding=sharding), (0, 1, 2))
        args = (x, x, x)
    else:
        fn = _grad_of_sum(lambda q, k, v, g: ops.gla(
            q, k, v, g, backend="mosaic_tpu", sharding=sharding)[0], (0, 1, 2, 3))
        args = (x, x, x, g)
    text = compile_sharded_for_tpu(fn, mesh, *args).as_text()
    assert "tpu_custom_call" in text
    for name in COLLECTIVES:
        assert not re.search(rf"\b{name}(-start)?\(", text), name


def test_unsharded_call_on_sharded_inputs_is_what_sharding_fixes():
    """The problem `sharding=` solves: XLA's partitioner refuses the Mosaic kernel."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from gla_tpu.testing.tpu_compile import compile_sharded_for_tpu, tpu_slice_mesh

    mesh = tpu_slice_mesh("v5e", (2, 2), ("data", "model"))
    x = jax.ShapeDtypeStruct((4, 2048, 8, 128), BF16,
                             sharding=NamedSharding(mesh, P("data", None, "model", None)))
    with pytest.raises(Exception, match="cannot be automatically partitioned"):
        compile_sharded_for_tpu(lambda q, k, v: ops.flash_attention(
            q, k, v, causal=True, backend="mosaic_tpu"), mesh, x, x, x)


@pytest.mark.parametrize("generation", _sharded_generations("v6e"))
def test_context_parallel_gla_compiles_for_a_4_chip_slice(generation):
    """GLA forward+backward with batch and T over a (2, 2) mesh: Mosaic compiles each chip's
    kernels, and the program's collectives move the blocks' states and decays (all-gathers
    forward; reduce-scatters and, as XLA TPU splits them, all-reduces backward), nothing of
    length T."""
    import re

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from gla_tpu.testing.tpu_compile import compile_sharded_for_tpu, tpu_slice_mesh

    mesh = tpu_slice_mesh(generation, (2, 2), ("data", "seq"))
    sharding = NamedSharding(mesh, P("data", "seq", None, None))
    t = 1024
    x = jax.ShapeDtypeStruct((2, t, 4, 128), BF16, sharding=sharding)
    g = jax.ShapeDtypeStruct((2, t, 4, 128), F32, sharding=sharding)
    fn = _grad_of_sum(lambda q, k, v, g: ops.gla(
        q, k, v, g, backend="mosaic_tpu", sharding=sharding)[0], (0, 1, 2, 3))
    text = compile_sharded_for_tpu(fn, mesh, x, x, x, g).as_text()
    assert "tpu_custom_call" in text
    found = re.findall(r"= \(?\w+\[([\d,]*)\][^=]*? (all-gather|all-reduce|reduce-scatter|"
                       r"collective-permute|all-to-all)(?:-start)?\(", text)
    kinds = {kind for _, kind in found}
    assert kinds <= {"all-gather", "reduce-scatter", "all-reduce"} and "all-gather" in kinds
    sizes = [[int(d) for d in dims.split(",") if d] for dims, _ in found]
    assert not any(t in dims or t // 2 in dims for dims in sizes), sizes
    states = 2 * 2 * 4 * (128 * 128 + 128)  # P x B x H x (K V + K), whole batch
    assert sum(int(np.prod(dims)) for dims in sizes) <= 4 * states, sizes


@pytest.mark.parametrize("generation", _sharded_generations("v5e"))
def test_context_parallel_delta_rule_compiles_for_a_4_chip_slice(generation):
    """Gated DeltaNet forward+backward (HV = 2H) with batch and T over a (2, 2) mesh: Mosaic
    compiles each chip's kernels (the zero-state, transition and main passes), and the program's
    collectives move the blocks' states and transitions, nothing of length T."""
    import re

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from gla_tpu.testing.tpu_compile import compile_sharded_for_tpu, tpu_slice_mesh

    mesh = tpu_slice_mesh(generation, (2, 2), ("data", "seq"))
    sharding = NamedSharding(mesh, P("data", "seq", None, None))
    heads = NamedSharding(mesh, P("data", "seq", None))
    t, h, hv, d = 1024, 2, 4, 128
    x = jax.ShapeDtypeStruct((2, t, h, d), BF16, sharding=sharding)
    v = jax.ShapeDtypeStruct((2, t, hv, d), BF16, sharding=sharding)
    beta = jax.ShapeDtypeStruct((2, t, hv), F32, sharding=heads)
    fn = _grad_of_sum(lambda q, k, v, beta, g: ops.delta_rule(
        q, k, v, beta, g, use_qk_l2norm=True, backend="mosaic_tpu", sharding=sharding)[0],
        (0, 1, 2, 3, 4))
    text = compile_sharded_for_tpu(fn, mesh, x, x, v, beta, beta).as_text()
    assert "tpu_custom_call" in text
    found = re.findall(r"= \(?\w+\[([\d,]*)\][^=]*? (all-gather|all-reduce|reduce-scatter|"
                       r"collective-permute|all-to-all)(?:-start)?\(", text)
    kinds = {kind for _, kind in found}
    assert kinds <= {"all-gather", "reduce-scatter", "all-reduce"} and "all-gather" in kinds
    sizes = [[int(d) for d in dims.split(",") if d] for dims, _ in found]
    assert not any(t in dims or t // 2 in dims for dims in sizes), sizes
    states = 2 * 2 * hv * d * (d + d)  # P x B x HV x K (V + K), whole batch
    assert sum(int(np.prod(dims)) for dims in sizes) <= 4 * states, sizes


@pytest.mark.parametrize("generation", _sharded_generations("v5p"))
def test_ring_attention_compiles_for_a_4_chip_slice(generation):
    """Causal attention forward+backward with batch and T over a (2, 2) mesh: Mosaic compiles each
    chip's blocks, and the program's only collectives are collective-permutes of one chip's
    blocks (zigzag reordering, k/v around the ring, dk/dv back), nothing of length T."""
    import re

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from gla_tpu.testing.tpu_compile import compile_sharded_for_tpu, tpu_slice_mesh

    mesh = tpu_slice_mesh(generation, (2, 2), ("data", "seq"))
    sharding = NamedSharding(mesh, P("data", "seq", None, None))
    t = 2048
    q = jax.ShapeDtypeStruct((2, t, 4, 128), BF16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((2, t, 2, 128), BF16, sharding=sharding)
    fn = _grad_of_sum(lambda q, k, v: ops.flash_attention(
        q, k, v, causal=True, backend="mosaic_tpu", sharding=sharding), (0, 1, 2))
    text = compile_sharded_for_tpu(fn, mesh, q, kv, kv).as_text()
    assert "tpu_custom_call" in text
    # "= (bf16[1,1024,2,128]{...}, ...) collective-permute-start(": the first shape is the operand
    found = re.findall(r"= \(?\w+\[([\d,]*)\][^=]*? (all-gather|all-reduce|reduce-scatter|"
                       r"collective-permute|all-to-all)(?:-start)?\(", text)
    assert found and {kind for _, kind in found} == {"collective-permute"}, found
    assert all(int(dims.split(",")[1]) <= t // 2 for dims, _ in found), found
