"""The pair-level Mosaic GPU kernels of the "pallas_gpu" GLA (per-key gates, forward and backward;
BlockSizes(chunk_kernel="mosaic_gpu")): the decomposition itself, parity in GPU interpret mode on
CPU, lowering for a Hopper target, what they refuse; parity on a CUDA GPU under marker gpu at
every gate distribution of docs/gpu_gla.md ("Current numbers")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_tpu import ops
from gla_tpu.ops.common import pair_levels
from gla_tpu.ops.gla.pallas_gpu import BlockSizes
from gla_tpu.testing.gpu_lowering import gla_lowered_kernels
from gla_tpu.testing.parity import check_gla_parity
from gla_tpu.testing.problems import GLACase

PAIR_LEVELS = BlockSizes(chunk_kernel="mosaic_gpu")


def test_every_causal_pair_has_one_level():
    levels = pair_levels.level_of_pairs(64)
    r, x = np.indices(levels.shape)
    assert (levels[x < r] >= 0).all() and (levels[x >= r] == -1).all()
    assert sorted(np.unique(levels[x < r]).tolist()) == list(range(6))


# The kernels' exponents are range sums R g of the gates, R read from pair_levels.range_matrices:
# a level-L pair (r, x) takes row r's and row x's sums of R_L, which must add up to b_r - b_x;
# the prefix and suffix rows give b_t and b_last - b_t.
def test_range_matrices_sum_the_exponents():
    chunk = 64
    g = np.random.default_rng(0).standard_normal(chunk)
    b = np.cumsum(g)
    levels = pair_levels.level_of_pairs(chunk)
    r, x = np.nonzero(levels >= 0)
    for level in range(pair_levels.num_levels(chunk)):
        sums = pair_levels.range_matrices((f"level{level}",), chunk)[0] @ g
        on = levels[r, x] == level
        np.testing.assert_allclose(sums[r[on]] + sums[x[on]], b[r[on]] - b[x[on]], atol=1e-12)
    prefix, suffix = pair_levels.range_matrices(("prefix", "suffix"), chunk) @ g
    np.testing.assert_allclose(prefix, b, atol=1e-12)
    np.testing.assert_allclose(suffix, b[-1] - b, atol=1e-12)


@pytest.mark.parametrize("strength", [1.0, 1e-3])
def test_scores_by_levels_match_the_direct_decay(strength):
    key = jax.random.key(0)
    kq, kk, kg = jax.random.split(key, 3)
    q = jax.random.normal(kq, (2, 64, 32), jnp.float32)
    k = jax.random.normal(kk, (2, 64, 32), jnp.float32)
    b = jnp.cumsum(jax.nn.log_sigmoid(jax.random.normal(kg, (2, 64, 32))) / strength, axis=1)
    # float32 products on every platform (a GPU's default is TF32)
    with jax.default_matmul_precision("highest"):
        got = pair_levels.scores_by_levels(q, k, b, jnp.float32)
        decay = jnp.exp(jnp.minimum(b[:, :, None, :] - b[:, None, :, :], 0.0))  # [2, r, x, K]
        direct = jnp.einsum("brc,bxc,brxc->brx", q, k, decay) * jnp.tril(jnp.ones((1, 64, 64)))
    assert bool(jnp.all(jnp.isfinite(got)))
    np.testing.assert_allclose(got, direct, rtol=1e-4, atol=1e-4)


# Interpret mode runs the three kernels (prep, the state pass both ways, dq/dk/dg) with jnp.dot
# for the tensor-core products: a partial last chunk, an initial state, two value tiles and very
# strong gates (about -800 a token) in bfloat16; K 128 with fla's draw in float16; V = 200
# (padded to 256: four value tiles, twice round the dq/dk/dg kernel's ring of two); K = 300
# (padded to 384: three groups of keys as virtual heads, whose outputs and dv the state passes
# sum, the middle group reading and writing the partial sum) with two heads; K = 200 (two
# groups). --full only: every case, the first (the default options at T = 130 with a state and a
# partial last chunk: test_interpret_parity_segments, whose segment starts are gates of -1e3;
# several value tiles with a state: test_interpret_parity_value_tiles_of_32; gates of about -800
# a token and beyond: test_interpret_parity_gates_below_float16), K 128 in float16, V = 200,
# K = 200, and K = 300 (the default run takes K = 300 at the same gates in
# test_interpret_parity_group_sums[bfloat16-input], the default sums).
@pytest.mark.parametrize("case,dtype", [
    pytest.param(GLACase(1, 130, 2, 64, 128, gate="key", gate_strength=1e-3, initial_state=True),
                 jnp.bfloat16, marks=pytest.mark.full),
    pytest.param(GLACase(1, 100, 1, 128, 64, gate="key", initial_state=True), jnp.float16,
                 marks=pytest.mark.full),
    pytest.param(GLACase(1, 70, 1, 64, 200, gate="key", initial_state=True), jnp.bfloat16,
                 marks=pytest.mark.full),
    pytest.param(GLACase(1, 70, 2, 300, 64, gate="key", gate_strength=16.0, initial_state=True),
                 jnp.bfloat16, marks=pytest.mark.full),
    pytest.param(GLACase(1, 70, 1, 200, 64, gate="key", gate_strength=16.0, initial_state=True),
                 jnp.bfloat16, marks=pytest.mark.full),
], ids=str)
def test_interpret_parity(case, dtype):
    check_gla_parity(case, jax.random.key(5), dtype=dtype, backend="pallas_gpu", interpret=True,
                     block_sizes=PAIR_LEVELS)


# forward: prep and the state pass; backward: the reversed state pass and dq/dk/dg (the forward
# of a differentiated call keeps the states); split in time, a states-only pass before each state
# pass
@pytest.mark.parametrize("splits,expected", [(1, ((2, 0), (4, 0))), (4, ((3, 0), (6, 0)))])
def test_lowers_to_mosaic_kernels_and_no_triton(splits, expected):
    q = jax.ShapeDtypeStruct((2, 1000, 2, 128), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, 1000, 2, 64), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((2, 1000, 2, 128), jnp.float32)
    s0 = jax.ShapeDtypeStruct((2, 2, 128, 64), jnp.float32)
    sizes = BlockSizes(chunk_kernel="mosaic_gpu", mosaic_time_splits=splits)
    assert gla_lowered_kernels(sizes, q, v, g, s0) == expected


# The options that are not the default lower for Hopper (wgmma's operand swizzles, TMA tiles):
# 32-column value tiles with 64-byte swizzles, the key groups' partial sums in float32, two stored
# parts of h, outputs from both parts of the state (the defaults, sums in 16 bits, one stored
# part and one in the outputs, lower in the test above).
def test_options_lower_to_mosaic_kernels():
    q = jax.ShapeDtypeStruct((1, 500, 2, 256), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 500, 2, 512), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((1, 500, 2, 256), jnp.float32)
    s0 = jax.ShapeDtypeStruct((1, 2, 256, 512), jnp.float32)
    sizes = BlockSizes(chunk_kernel="mosaic_gpu", mosaic_time_splits=1, mosaic_block_v=32,
                       mosaic_group_sums="float32", mosaic_state_parts=2,
                       mosaic_output_parts=2)
    assert gla_lowered_kernels(sizes, q, v, g, s0) == ((2, 0), (4, 0))


# bench/gpu_side_by_side.py's --gla-sizes variants configure the state passes of its
# breakdown_pair_levels part as ops.gla does (its GPU timings are of the same programs): the
# defaults, then the other settings.
def test_pair_level_bench_configures_the_state_passes_as_ops_gla():
    from bench.gpu_side_by_side import kernel_stages, pair_level_geometry, parse_sizes
    from gla_tpu.ops.gla.pallas_gpu import plan, vjp

    variants = parse_sizes("default;mosaic_group_sums=float32,mosaic_state_parts=2")
    assert variants == [{}, dict(mosaic_group_sums="float32", mosaic_state_parts=2)]
    for sizes, (sums_16bit, stored, term_parts) in zip(variants, [(True, 1, 1), (False, 2, 2)]):
        geo = plan.chunk_geometry(2048, 256, 512, scale=1 / 16, has_segments=False,
                                  exact_inter=False, mosaic_chunk=True, batch=8, heads=4,
                                  block_sizes=BlockSizes(chunk_kernel="mosaic_gpu", **sizes))
        assert pair_level_geometry((8, 2048, 4, 256, 512), sizes) == geo
        inference, training, reversed_ = vjp.state_passes(geo)
        assert (training.groups, training.sums_16bit, training.store_parts) == (
            2, sums_16bit, stored)
        assert reversed_.term_parts == term_parts and inference.store_parts == 0
        assert inference.out_parts == training.out_parts == reversed_.out_parts == 1
        names = kernel_stages(geo)["state_reversed"][1]
        assert names[-term_parts:] == ("h_hi", "h_lo")[:term_parts]


@pytest.mark.parametrize("mode,dtype,match", [
    ("fused_recurrent", jnp.bfloat16, "fused_recurrent"),
    ("chunk", jnp.float32, "float32")])
def test_refuses_what_it_cannot_take(mode, dtype, match):
    x = jnp.ones((1, 64, 1, 64), dtype)
    g = jnp.full((1, 64, 1, 64), -0.1)
    with pytest.raises(NotImplementedError, match=match):
        ops.gla(x, x, x, g, mode=mode, backend="pallas_gpu", interpret=True,
                block_sizes=PAIR_LEVELS)
    with pytest.raises(ValueError, match="chunk_kernel"):
        BlockSizes(chunk_kernel="cuda")
    with pytest.raises(ValueError, match="mosaic_group_sums='bfloat16'"):
        BlockSizes(mosaic_group_sums="bfloat16")
    with pytest.raises(ValueError, match="mosaic_block_v=48"):
        BlockSizes(mosaic_block_v=48)
    with pytest.raises(ValueError, match="mosaic_state_parts=3"):
        BlockSizes(mosaic_state_parts=3)
    with pytest.raises(ValueError, match="mosaic_output_parts=0"):
        BlockSizes(mosaic_output_parts=0)


# The key groups' partial sums of o and dv (BlockSizes.mosaic_group_sums) in the input dtype (the
# default) and in float32: K = 300 (three groups, the middle one reading and writing the partial
# sum) with two heads at gates of strength 16, bfloat16 and, in --full, float32 sums and float16.
@pytest.mark.parametrize("dtype,sums", [
    (jnp.bfloat16, "input"), pytest.param(jnp.bfloat16, "float32", marks=pytest.mark.full),
    pytest.param(jnp.float16, "input", marks=pytest.mark.full)], ids=str)
def test_interpret_parity_group_sums(dtype, sums):
    case = GLACase(1, 70, 2, 300, 64, gate="key", gate_strength=16.0, initial_state=True)
    sizes = BlockSizes(chunk_kernel="mosaic_gpu", mosaic_group_sums=sums)
    check_gla_parity(case, jax.random.key(11), dtype=dtype, backend="pallas_gpu", interpret=True,
                     block_sizes=sizes)


# The state passes in 32-column value tiles (BlockSizes.mosaic_block_v=32): two tiles of V = 64
# and four of V = 128 with an initial state; in --full K = 300 (three groups) with the groups'
# partial sums in 16 bits too (64-byte rows).
@pytest.mark.parametrize("case,sums", [
    (GLACase(1, 130, 2, 64, 128, gate="key", initial_state=True), "float32"),
    pytest.param(GLACase(1, 70, 2, 300, 64, gate="key", gate_strength=16.0, initial_state=True),
                 "input", marks=pytest.mark.full),
], ids=str)
def test_interpret_parity_value_tiles_of_32(case, sums):
    sizes = BlockSizes(chunk_kernel="mosaic_gpu", mosaic_block_v=32, mosaic_group_sums=sums)
    check_gla_parity(case, jax.random.key(12), dtype=jnp.bfloat16, backend="pallas_gpu",
                     interpret=True, block_sizes=sizes)


# The stored 16-bit parts of h (BlockSizes.mosaic_state_parts). One (the default): the state
# term's first chunk from the float32 state entering it. T = 1 with an initial state is where a
# rounded first state failed dg (1.9e-3 against a bound of 1.6e-3 with the part alone); split in
# time (each segment's first chunk from its float32 start) with segment ids and two key groups in
# --full, and T = 130 in --full. Two (hi and lo): T = 130 with an initial state.
@pytest.mark.parametrize("case,splits,parts", [
    (GLACase(1, 1, 2, 64, 64, gate="key", initial_state=True), None, 1),
    pytest.param(GLACase(1, 130, 2, 64, 128, gate="key", initial_state=True), None, 1,
                 marks=pytest.mark.full),
    (GLACase(1, 130, 2, 64, 128, gate="key", initial_state=True), None, 2),
    pytest.param(GLACase(1, 300, 1, 200, 64, gate="key", gate_strength=16.0, initial_state=True,
                         segments=True), 2, 1, marks=pytest.mark.full),
], ids=str)
def test_interpret_parity_state_parts(case, splits, parts):
    sizes = BlockSizes(chunk_kernel="mosaic_gpu", mosaic_state_parts=parts,
                       mosaic_time_splits=splits)
    check_gla_parity(case, jax.random.key(13), dtype=jnp.bfloat16, backend="pallas_gpu",
                     interpret=True, block_sizes=sizes)


# The state passes' outputs from both 16-bit parts of the state (BlockSizes.mosaic_output_parts=2;
# the default, the high part alone, runs in every other test): o forward and dv reversed, with an
# initial state; in --full K = 300 (three groups of keys summing their outputs) at strong gates.
@pytest.mark.parametrize("case", [
    GLACase(1, 130, 2, 64, 128, gate="key", initial_state=True),
    pytest.param(GLACase(1, 70, 2, 300, 64, gate="key", gate_strength=1e-3, initial_state=True),
                 marks=pytest.mark.full),
], ids=str)
def test_interpret_parity_output_parts(case):
    sizes = BlockSizes(chunk_kernel="mosaic_gpu", mosaic_output_parts=2)
    check_gla_parity(case, jax.random.key(15), dtype=jnp.bfloat16, backend="pallas_gpu",
                     interpret=True, block_sizes=sizes)


# Gradients through one of the two outputs: the other's cotangent is a symbolic zero, which the
# backward takes as such (no final-state cotangent: the reversed pass starts from zero in
# registers; no output cotangent: do is zeros).
@pytest.mark.parametrize("final_state_only", [False, True], ids=["outputs_only", "state_only"])
def test_interpret_parity_one_output_differentiated(final_state_only):
    case = GLACase(1, 130, 2, 64, 128, gate="key", initial_state=True,
                   output_final_state=final_state_only)
    check_gla_parity(case, jax.random.key(10), dtype=jnp.bfloat16, backend="pallas_gpu",
                     interpret=True, block_sizes=PAIR_LEVELS, final_state_only=final_state_only)


# The state passes split in time (segments of T side by side, a scan of their states between the
# two passes), forward and reversed, with an initial state, a partial last segment of T and
# segment_ids (reset gates: the scan sees decays of exactly 0); K = 200, two groups of keys, so
# the states-only pass walks them too. (T = 200, without the last segment's whole chunk of
# padding, took as long: the interpreter's time here is compiling.)
def test_interpret_parity_time_splits():
    case = GLACase(1, 300, 1, 200, 64, gate="key", gate_strength=16.0, initial_state=True,
                   segments=True)
    check_gla_parity(case, jax.random.key(8), dtype=jnp.bfloat16, backend="pallas_gpu",
                     interpret=True,
                     block_sizes=BlockSizes(chunk_kernel="mosaic_gpu", mosaic_time_splits=2))


# segment_ids as gates of -1e3 at each segment's start (entry.reset_at_segment_starts): segments of
# about 8 tokens, one-token ones included, so most chunks hold several resets; an initial state
# (the first segment's). With the time split: test_interpret_parity_time_splits.
def test_interpret_parity_segments():
    case = GLACase(1, 130, 2, 64, 64, gate="key", initial_state=True, segments=True)
    check_gla_parity(case, jax.random.key(9), dtype=jnp.bfloat16, backend="pallas_gpu",
                     interpret=True, block_sizes=PAIR_LEVELS)


# Gates far below float16's range (logsigmoid(x) / 1e-5, -5e3 to -3e5 a token): the kernels floor
# g log2(e) at GATE_FLOOR before rounding it to float16, so every weight that holds such a gate is
# exactly 0, as it should be, instead of a NaN from 0 * -inf in the range sums.
def test_interpret_parity_gates_below_float16():
    case = GLACase(1, 64, 1, 64, 64, gate="key", gate_strength=1e-5, initial_state=True)
    check_gla_parity(case, jax.random.key(4), dtype=jnp.bfloat16, backend="pallas_gpu",
                     interpret=True, block_sizes=PAIR_LEVELS)


# Per-head and absent gates train on the same kernels, which read [B, T, H] gates (one per head,
# for every key) and sum dg over each key slab; K = 200 pads to two groups of 128 keys, each two
# slabs, so dg is summed over slabs and groups.
@pytest.mark.parametrize("case", [
    GLACase(1, 70, 1, 200, 64, gate="head", initial_state=True),
    GLACase(1, 70, 1, 64, 128, gate="none"),
], ids=str)
def test_interpret_parity_per_head_and_no_gate(case):
    check_gla_parity(case, jax.random.key(3), dtype=jnp.bfloat16, backend="pallas_gpu",
                     interpret=True, block_sizes=PAIR_LEVELS)


# The gate distributions of docs/gpu_gla.md: logsigmoid(N(0,1)) (fla's benchmark draw), the
# same / 16 (fla's GLA layer default), logsigmoid(N(0,1) - 3), and about -800 a token; T up to 4096
# and not a multiple of the chunk, K and V 64 and 128, float16, initial states, T = 1; K = 256 with
# V = 512, and K = 512 (four groups of keys) with V = 192 at strong gates.
GPU_CASES = [
    (GLACase(1, 4096, 2, 128, 128, gate="key"), jnp.bfloat16),
    (GLACase(1, 4096, 2, 128, 128, gate="key", gate_strength=16.0, initial_state=True),
     jnp.bfloat16),
    (GLACase(1, 4096, 2, 64, 64, gate="key", gate_shift=-3.0), jnp.bfloat16),
    (GLACase(1, 4096, 2, 128, 64, gate="key", gate_strength=1e-3, initial_state=True),
     jnp.bfloat16),
    (GLACase(2, 1000, 3, 64, 128, gate="key", initial_state=True), jnp.float16),
    (GLACase(2, 777, 2, 100, 100, gate="key", gate_strength=16.0), jnp.bfloat16),
    (GLACase(3, 1, 2, 128, 128, gate="key", initial_state=True), jnp.bfloat16),
    (GLACase(1, 1024, 2, 256, 512, gate="key", initial_state=True), jnp.bfloat16),
    (GLACase(1, 1000, 2, 512, 192, gate="key", gate_strength=1e-3), jnp.bfloat16),
    (GLACase(2, 2000, 2, 128, 128, gate="key", initial_state=True, segments=True), jnp.bfloat16),
    (GLACase(1, 4096, 2, 128, 128, gate="head", gate_strength=16.0, segments=True),
     jnp.bfloat16),
    (GLACase(2, 1000, 2, 256, 128, gate="head", initial_state=True), jnp.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype", GPU_CASES, ids=str)
def test_gpu_parity(case, dtype):
    check_gla_parity(case, jax.random.key(7), dtype=dtype, backend="pallas_gpu",
                     block_sizes=PAIR_LEVELS)



# The state-pass options on the GPU, the defaults (16-bit group sums, one stored part of h) and
# the others: the key groups' partial sums (K = 256 / V = 512, two groups; K = 512, four, at
# strong gates), 32-column value tiles (K = V = 128 at T = 4096; K = 256 / V = 512) and the
# stored parts of h (T = 4096 with an initial state; T = 3; all three options at K = 256); the
# outputs from both parts of the state (T = 4096; K = 256 at strong gates).
@pytest.mark.gpu
@pytest.mark.parametrize("case,sizes", [
    (GLACase(1, 1024, 2, 256, 512, gate="key", initial_state=True),
     dict(mosaic_group_sums="input")),
    (GLACase(1, 1024, 2, 256, 512, gate="key", initial_state=True),
     dict(mosaic_group_sums="float32")),
    (GLACase(1, 1000, 2, 512, 192, gate="key", gate_strength=1e-3),
     dict(mosaic_group_sums="input")),
    (GLACase(1, 4096, 2, 128, 128, gate="key", initial_state=True), dict(mosaic_block_v=32)),
    (GLACase(1, 1024, 2, 256, 512, gate="key"),
     dict(mosaic_block_v=32, mosaic_group_sums="float32")),
    (GLACase(1, 4096, 2, 128, 128, gate="key", initial_state=True), dict(mosaic_state_parts=1)),
    (GLACase(1, 4096, 2, 128, 128, gate="key", initial_state=True), dict(mosaic_state_parts=2)),
    (GLACase(2, 3, 2, 128, 128, gate="key", initial_state=True, segments=True),
     dict(mosaic_state_parts=1)),
    (GLACase(1, 1024, 2, 256, 512, gate="key", initial_state=True),
     dict(mosaic_block_v=32, mosaic_group_sums="float32", mosaic_state_parts=2)),
    (GLACase(1, 4096, 2, 128, 128, gate="key", initial_state=True), dict(mosaic_output_parts=2)),
    (GLACase(1, 1024, 2, 256, 512, gate="key", gate_strength=1e-3),
     dict(mosaic_output_parts=2)),
], ids=str)
def test_gpu_parity_options(case, sizes):
    check_gla_parity(case, jax.random.key(7), dtype=jnp.bfloat16, backend="pallas_gpu",
                     block_sizes=BlockSizes(chunk_kernel="mosaic_gpu", **sizes))
