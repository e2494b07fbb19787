"""What is particular to the "pallas_gpu" flash attention (tests/ops/test_attention.py checks its
numerics with every other backend): the Mosaic GPU forward for Hopper in GPU interpret mode on
CPU (which also simulates the barriers and the TMA copies, and checks that every warpgroup sees
every barrier phase), a race check, lowering for CUDA (Mosaic GPU and Triton), tiles, errors and
kernel selection; parity on an H100/H200 under marker gpu."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from gla_tpu import ops
from gla_tpu.ops.attention.pallas_gpu import (BackwardTiles, BlockSizes, ForwardTiles,
                                              default_block_sizes)
from gla_tpu.ops.attention.pallas_gpu import kernels_mosaic_forward as mosaic_gpu_forward
from gla_tpu.ops.attention.pallas_gpu import kernels_mosaic_forward_persistent as \
    mosaic_gpu_forward_persistent
from gla_tpu.ops.attention.pallas_gpu import plan
from gla_tpu.ops.attention.pallas_gpu.plan import Geometry
from gla_tpu.ops.attention.validation import validate_attention
from gla_tpu.ops.common import backends
from gla_tpu.ops.common.padding import pad_time
from gla_tpu.testing.gpu_lowering import hopper_target
from gla_tpu.ops.attention import pallas_gpu
from gla_tpu.ops.attention import xla as xla_attention
from gla_tpu.testing.parity import case_seed, check_attention_parity
from gla_tpu.testing.problems import AttentionCase, make_attention_inputs
from gla_tpu.testing.tolerance import assert_pass_rule

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

# small Triton tiles for the backward in interpret mode; the forward is the Mosaic GPU kernel
MOSAIC = BlockSizes(32, 16, 32, 16, 16, 32, forward_kernel="mosaic_gpu",
                    mosaic_forward=ForwardTiles(64, 64, 2))


BF16, F16 = jnp.bfloat16, jnp.float16
# The interpret cases marked FULL run with --full only: the default run keeps one case of each
# kernel's structure (rows that see no key, a wrapping ring, head dim 256).
FULL = pytest.mark.full


# The two 16-bit dtypes alternate over the cases: the kernel is the same code for both.
@pytest.mark.parametrize("case,tiles,dtype", [
    # rows 0..69 see no key (T > S, bottom-right causal): o = 0, lse = 0 (--full only: the
    # persistent case below runs T > S, the segment pair below rows that see no key on this
    # forward)
    pytest.param(AttentionCase(1, 200, 130, 4, 2, 64, causal=True), ForwardTiles(64, 64, 2),
                 BF16, marks=FULL),
    # whole tiles with no key to see (rows 0..259): no load, no step, the turns still pair up
    pytest.param(AttentionCase(1, 300, 40, 2, 1, 64, causal=True), ForwardTiles(64, 64, 2), F16,
                 marks=FULL),
    # padded keys, GQA, one tile
    pytest.param(AttentionCase(2, 70, 150, 2, 1, 128, causal=False), ForwardTiles(64, 64, 2),
                 BF16, marks=FULL),
    # several tiles and a ring that wraps: consumer 0 releases the steps only consumer 1 needs
    pytest.param(AttentionCase(1, 300, 300, 2, 2, 64, causal=True), ForwardTiles(64, 64, 3), F16,
                 marks=FULL),
    pytest.param(AttentionCase(1, 260, 390, 2, 2, 64, causal=True), ForwardTiles(128, 128, 2),
                 BF16, marks=FULL),
    # head dim 256 with its default tiles, GQA, padded keys (--full only: this forward runs the
    # same case with segment ids in test_mosaic_backward_interpret_parity's head dim 256 case,
    # and at T = 136 in test_unpadded_mosaic_interpret_parity's)
    pytest.param(AttentionCase(1, 130, 200, 2, 1, 256, causal=True), ForwardTiles(64, 64, 2), F16,
                 marks=FULL),
    # segment ids, a pair where some queries see no key: every block masked
    (AttentionCase(1, 200, 300, 4, 2, 64, causal=False, segments="pair"),
     ForwardTiles(64, 64, 2), BF16),
    # a causal window narrower than a tile, soft-capped: each tile streams only the key blocks
    # its window reaches, consumer 1 releases the leading block consumer 0 alone needs
    (AttentionCase(1, 400, 400, 2, 1, 64, causal=True, window=(70, 0), soft_cap=2.0),
     ForwardTiles(64, 64, 2), BF16),
    # a two-sided window with T < S: masked blocks on both edges, unmasked ones between
    pytest.param(AttentionCase(1, 200, 330, 2, 2, 128, window=(150, 40)),
                 ForwardTiles(64, 64, 3), F16, marks=FULL),
    # The persistent forward: few blocks, so that each walks several tiles and the K/V ring runs
    # on from one tile into the next (odd rounds walk the blocks backwards).
    # causal, GQA, rows that see no key (T > S), 3 blocks over 2 x 2 x 2 tiles of a ragged last round
    (AttentionCase(2, 200, 130, 2, 1, 64, causal=True),
     ForwardTiles(64, 64, 2, persistent=True, ctas=3), BF16),
    # head dim 256: o through q's tile (the next q loads once o's copy has read it); segments
    (AttentionCase(1, 260, 200, 2, 1, 256, causal=True, segments="pair"),
     ForwardTiles(64, 64, 2, persistent=True, ctas=2), F16),
    # a causal window and a soft cap: tiles of unequal key ranges in one block's list
    pytest.param(AttentionCase(1, 400, 400, 2, 1, 64, causal=True, window=(70, 0), soft_cap=2.0),
                 ForwardTiles(64, 64, 3, persistent=True, ctas=2), BF16, marks=FULL),
    pytest.param(AttentionCase(2, 70, 150, 2, 1, 128, causal=False),
                 ForwardTiles(64, 64, 2, persistent=True, ctas=3), F16, marks=FULL),
], ids=str)
def test_mosaic_forward_interpret_parity(case, tiles, dtype):
    """The per-tile and the persistent forward (tiles.persistent) in GPU interpret mode."""
    sizes = dataclasses.replace(MOSAIC, mosaic_forward=tiles)
    check_attention_parity(case, jax.random.key(4), dtype=dtype, backend="pallas_gpu",
                           interpret=True, block_sizes=sizes)


# Both Mosaic GPU sides on q, k, v as they come (BlockSizes.mosaic_unpadded; T and S multiples of
# 8): the TMA copies read zeros past T and S and drop the rows past them on the way out (the GPU
# interpreter does the same).
# Causal only, as the backward's interpret cases (non-causal ones deadlock the interpreter). The
# persistent forward (the default) in the first case, on 3 blocks.
@pytest.mark.parametrize("case,dtype,persistent", [
    (AttentionCase(2, 200, 136, 4, 2, 64, causal=True), BF16, True),  # T > S: rows with no key
    (AttentionCase(1, 136, 200, 2, 1, 256, causal=True, segments="pair"), F16, False),
    pytest.param(AttentionCase(1, 328, 328, 2, 1, 64, causal=True, window=(90, 0), soft_cap=2.0),
                 BF16, False, marks=FULL),
], ids=str)
def test_unpadded_mosaic_interpret_parity(case, dtype, persistent):
    forward = ForwardTiles(64, 64, 2, persistent=persistent, ctas=3 if persistent else None)
    backward = BackwardTiles(64, 32, 2) if case.head_dim == 256 else BackwardTiles(64, 64, 2)
    sizes = dataclasses.replace(MOSAIC, backward_kernel="mosaic_gpu", mosaic_forward=forward,
                                mosaic_backward=backward, mosaic_unpadded=True)
    check_attention_parity(case, jax.random.key(8), dtype=dtype, backend="pallas_gpu",
                           interpret=True, block_sizes=sizes)


@pytest.mark.parametrize("kv_len,pads", [(1104, False), (1100, True)])
def test_unpadded_mosaic_calls_take_the_arrays_as_they_come(monkeypatch, kv_len, pads):
    """No pad of q, k or v before the kernels (the lowered program has no pad at all) where T and
    S are multiples of the TMA copies' 8 rows; S = 1100 is padded as before."""
    monkeypatch.setattr(backends, "is_hopper", lambda: True)
    q = jax.ShapeDtypeStruct((2, 1000, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, kv_len, 2, 128), jnp.bfloat16)
    texts = []
    for unpadded in (False, True):
        sizes = dataclasses.replace(default_block_sizes(128, jnp.bfloat16),
                                    forward_kernel="mosaic_gpu", mosaic_unpadded=unpadded)

        def loss(q, k, v, sizes=sizes):
            o = ops.flash_attention(q, k, v, causal=True, backend="pallas_gpu",
                                    block_sizes=sizes)
            return jnp.sum(o.astype(jnp.float32))

        with hopper_target():
            texts.append(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
                lowering_platforms=("cuda",)).as_text())
    assert "stablehlo.pad" in texts[0] and ("stablehlo.pad" in texts[1]) == pads
    assert texts[1].count("custom_call @mosaic_gpu") == 3


# rank-major with --full only: both persistent cases of test_mosaic_forward_interpret_parity take
# that order (kernels_mosaic_forward_persistent._rank_major), under the pass rule.
@pytest.mark.parametrize("rank_major", [False, pytest.param(True, marks=FULL)],
                         ids=["pair_major", "rank_major"])
def test_persistent_forward_equals_the_per_tile_forward(rank_major, monkeypatch):
    """Each tile runs the same code, in either order of the work list: o and lse agree bit for
    bit."""
    monkeypatch.setattr(mosaic_gpu_forward_persistent, "_rank_major",
                        lambda *args, **kwargs: rank_major)
    tiles = ForwardTiles(64, 64, 2)
    t, s, d = 300, 300, 64
    keys = jax.random.split(jax.random.key(6), 3)
    q = pad_time(jax.random.normal(keys[0], (2, t, 2, d), jnp.bfloat16), 128)
    k, v = (pad_time(jax.random.normal(key, (2, s, 1, d), jnp.bfloat16), 64) for key in keys[1:])
    geo = Geometry(q_len=t, kv_len=s, padded_q=384, padded_kv=320, group=2, causal=True,
                   offset=s - t, sm_scale=d**-0.5, has_segments=False)
    want = mosaic_gpu_forward.forward(q, k, v, geo=geo, tiles=tiles, interpret=True)
    got = mosaic_gpu_forward_persistent.forward(
        q, k, v, geo=geo, tiles=dataclasses.replace(tiles, persistent=True, ctas=5),
        interpret=True)
    for x, y in zip(want, got):
        assert jnp.array_equal(x, y)


@pytest.mark.parametrize("shape,causal,rank_major", [
    ((1, 5, 16384), True, True),  # 5 pairs of 128 causal tiles: pair-major gives 1.9x the mean
    ((1, 8, 4096), True, True),
    ((16, 16, 1024), True, False),  # 256 pairs: both orders within 3%
    ((1, 5, 16384), False, False),  # equal tiles
])
def test_persistent_work_list_order(shape, causal, rank_major):
    """Rank-major where few pairs hold many causal tiles, pair-major elsewhere (132 blocks)."""
    b, h, t = shape
    geo = Geometry(q_len=t, kv_len=t, padded_q=t, padded_kv=t, group=1, causal=causal,
                   offset=0, sm_scale=1.0, has_segments=False)
    tiles = ForwardTiles(persistent=True)
    assert mosaic_gpu_forward_persistent._rank_major(
        geo, tiles, n_tiles=t // tiles.query_multiple, pairs=b * h, ctas=132) == rank_major


@pytest.mark.parametrize("head_dim,causal,segments,window", [
    (64, True, False, None), (128, False, True, None), (128, True, False, 300),
    (256, True, True, None)])
def test_persistent_forward_lowers_for_hopper(head_dim, causal, segments, window):
    """Mosaic GPU's lowering for CUDA (layouts, wgmma, the shared-memory budget: o in tiles of its
    own up to head dim 128, through q's at 256)."""
    q = jax.ShapeDtypeStruct((2, 1000, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 1100, 2, head_dim), jnp.bfloat16)
    ids_q = jax.ShapeDtypeStruct((2, 1000), jnp.int32)
    ids_kv = jax.ShapeDtypeStruct((2, 1100), jnp.int32)
    sizes = default_block_sizes(head_dim, jnp.bfloat16)
    sizes = dataclasses.replace(sizes, forward_kernel="mosaic_gpu", mosaic_forward=dataclasses.replace(
        sizes.mosaic_forward, persistent=True))
    assert sizes.mosaic_forward.separate_output(head_dim, 2, segments) == (head_dim < 256)

    def fwd(q, k, v, sq, skv):
        return ops.flash_attention(q, k, v, causal=causal, backend="pallas_gpu", block_sizes=sizes,
                                   segment_ids=(sq, skv) if segments else None,
                                   local_window_size=window)

    with hopper_target():
        text = jax.jit(fwd).trace(q, kv, kv, ids_q, ids_kv).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1


# The Mosaic GPU backward in GPU interpret mode, end to end (forward, dq, dk/dv under the pass
# rule). Causal cases only: non-causal programs with both Mosaic kernels deadlock the GPU
# interpreter on a 2-core host (threads parked in barrier waits, cause not found; the same
# kernels called one by one run, see the next test, and pass on the GPU).
@pytest.mark.parametrize("case,tiles,dtype", [
    # whole query tiles that see no key: dq tiles with no step, dk/dv see every tile
    pytest.param(AttentionCase(1, 300, 40, 2, 1, 64, causal=True), BackwardTiles(64, 64, 2), BF16,
                 marks=FULL),
    # T < S with a group of 4: both rings wrap (4 key steps, 16 query steps), 128-key tiles
    pytest.param(AttentionCase(1, 130, 330, 4, 1, 64, causal=True), BackwardTiles(64, 128, 2),
                 F16, marks=FULL),
    # rows 0..69 see no key (T > S): zero gradients from them
    pytest.param(AttentionCase(1, 200, 130, 4, 2, 64, causal=True), BackwardTiles(64, 64, 3),
                 BF16, marks=FULL),
    # head dim 256: dq streams 32-key blocks, dk/dv's consumers split dk and dv over 64 keys;
    # segment ids (a pair: some queries see no key) in dq's packed shared buffers
    (AttentionCase(1, 130, 200, 2, 1, 256, causal=True, segments="pair"),
     BackwardTiles(64, 32, 2), BF16),
    # segment ids (a shared array) with causal masking, GQA: the ids streamed on both sides
    (AttentionCase(1, 200, 200, 4, 2, 64, causal=True, segments="shared"),
     BackwardTiles(64, 64, 2), F16),
    # a causal window, soft-capped, GQA: both kernels stream only the blocks the window reaches
    # and release the ones only the other consumer needs
    pytest.param(AttentionCase(1, 400, 400, 4, 2, 64, causal=True, window=(90, 0), soft_cap=2.0),
                 BackwardTiles(64, 64, 2), BF16, marks=FULL),
    # head dim 256 under a window: dk/dv's split roles over a shared tile
    pytest.param(AttentionCase(1, 300, 300, 2, 1, 256, causal=True, window=(100, 0)),
                 BackwardTiles(64, 32, 2), F16, marks=FULL),
], ids=str)
def test_mosaic_backward_interpret_parity(case, tiles, dtype):
    sizes = dataclasses.replace(MOSAIC, backward_kernel="mosaic_gpu", mosaic_backward=tiles)
    check_attention_parity(case, jax.random.key(8), dtype=dtype, backend="pallas_gpu",
                           interpret=True, block_sizes=sizes)


def _softmax_grads(q, k, v, do, geo):
    """float32 dq, dk, dv (summed over each GQA group), base-2 lse and delta of non-causal
    softmax attention with the keys at or past kv_len masked: what the backward kernels take
    and give."""
    qf, kf, vf, dof = (x.astype(jnp.float32) for x in (q, k, v, do))
    kf, vf = (jnp.repeat(x, geo.group, axis=2) for x in (kf, vf))
    s = jnp.einsum("bthd,bshd->bhts", qf, kf) * geo.sm_scale
    s = jnp.where(jnp.arange(k.shape[1])[None, None, None, :] < geo.kv_len, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    delta = jnp.einsum("bthd,bthd->bht", jnp.einsum("bhts,bshd->bthd", p, vf), dof)
    ds = p * (jnp.einsum("bthd,bshd->bhts", dof, vf) - delta[..., None])
    dq = jnp.einsum("bhts,bshd->bthd", ds, kf) * geo.sm_scale
    dk = jnp.einsum("bhts,bthd->bshd", ds, qf) * geo.sm_scale
    dv = jnp.einsum("bhts,bthd->bshd", p, dof)
    b, sp, h, d = dk.shape
    dk, dv = (x.reshape(b, sp, h // geo.group, geo.group, d).sum(3) for x in (dk, dv))
    lse2 = jax.scipy.special.logsumexp(s, axis=-1) / jnp.log(2.0)
    return (dq, dk, dv), lse2, delta


@pytest.mark.parametrize("d,tiles", [pytest.param(64, BackwardTiles(64, 64, 2), marks=FULL),
                                     (256, BackwardTiles(64, 32, 2))])
def test_mosaic_backward_kernels_interpret_not_causal(d, tiles):
    """Non-causal dq and dk/dv kernels, each called alone in GPU interpret mode: padded keys,
    GQA, a wrapping ring (head dim 256: dk/dv's split roles); against float32 XLA from the same
    lse and delta."""
    from gla_tpu.ops.attention.pallas_gpu import kernels_mosaic_backward as mosaic_gpu_backward

    t, s = 128, 150
    geo = Geometry(q_len=t, kv_len=s, padded_q=t, padded_kv=256, group=2, causal=False,
                   offset=s - t, sm_scale=d**-0.5, has_segments=False)
    keys = jax.random.split(jax.random.key(9), 4)
    q, do = (jax.random.normal(key, (1, t, 2, d), jnp.bfloat16) for key in keys[:2])
    k, v = (pad_time(jax.random.normal(key, (1, s, 1, d), jnp.bfloat16), 256)
            for key in keys[2:])
    expected, lse, delta = _softmax_grads(q, k, v, do, geo)
    common = dict(geo=geo, tiles=tiles, interpret=True)
    dq = jax.block_until_ready(mosaic_gpu_backward.backward_dq(q, k, v, do, lse, delta, **common))
    dk, dv = mosaic_gpu_backward.backward_dkv(q, k, v, do, lse, delta, **common)
    for got, want in zip((dq, dk[:, :s], dv[:, :s]), (expected[0], expected[1][:, :s],
                                                       expected[2][:, :s])):
        got, want = got.astype(jnp.float32), want
        err = jnp.sqrt(jnp.mean((got - want) ** 2) / jnp.mean(want**2))
        assert err < 1e-2  # bfloat16 outputs and operands: about 2e-3


@pytest.mark.parametrize("kernel,d", [pytest.param("dq", 64, marks=FULL), ("dq", 256),
                                      pytest.param("dkv", 64, marks=FULL), ("dkv", 256)])
def test_mosaic_backward_has_no_races(kernel, d):
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret

    import jax.experimental.pallas.mosaic_gpu as plgpu
    from gla_tpu.ops.attention.pallas_gpu import kernels_mosaic_backward as mosaic_gpu_backward

    # causal, 4 blocks a side: the two-slot rings wrap; d = 256: the split roles, dq's packed
    # shared buffers and segment ids
    t = s = 256
    tiles = BackwardTiles(64, 32 if d == 256 else 64, 2)
    geo = Geometry(q_len=t, kv_len=s, padded_q=t, padded_kv=s, group=1, causal=True, offset=0,
                   sm_scale=d**-0.5, has_segments=d == 256)
    keys = jax.random.split(jax.random.key(10), 6)
    q, k, v, do = (jax.random.normal(key, (1, t, 1, d), jnp.bfloat16) for key in keys[:4])
    lse = jax.random.normal(keys[4], (1, 1, t)) + 4.0
    delta = jax.random.normal(keys[5], (1, 1, t))
    ids = (jnp.arange(t, dtype=jnp.int32)[None] // 100,) * 2 if d == 256 else ()
    run = getattr(mosaic_gpu_backward, f"backward_{kernel}")
    jax.block_until_ready(run(q, k, v, do, lse, delta, *ids, geo=geo, tiles=tiles,
                              interpret=plgpu.InterpretGPUParams(detect_races=True)))
    assert not gpu_interpret.get_races().races_found


@pytest.mark.parametrize("persistent", [False, True], ids=["per_tile", "persistent"])
def test_mosaic_forward_has_no_races(persistent):
    """The race detector of the GPU interpreter on the forward; the persistent one on two blocks,
    each walking two tiles."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret

    import jax.experimental.pallas.mosaic_gpu as plgpu

    tiles = ForwardTiles(64, 64, 2, persistent=persistent, ctas=2)
    t, s, d = 200, 256, 64
    keys = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(keys[0], (1, t, 2, d), jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, s, 1, d), jnp.bfloat16) for key in keys[1:])
    geo = Geometry(q_len=t, kv_len=s, padded_q=256, padded_kv=256, group=2, causal=True,
                   offset=s - t, sm_scale=d**-0.5, has_segments=False)
    kernels = mosaic_gpu_forward_persistent if persistent else mosaic_gpu_forward
    o, lse = kernels.forward(pad_time(q, 128), k, v, geo=geo, tiles=tiles,
                             interpret=plgpu.InterpretGPUParams(detect_races=True))
    jax.block_until_ready((o, lse))
    assert not gpu_interpret.get_races().races_found


@pytest.mark.parametrize("head_dim,causal,segments", [(64, True, True), (128, False, False),
                                                      (256, True, False)])
def test_lowers_to_three_triton_kernels(head_dim, causal, segments):
    q = jax.ShapeDtypeStruct((2, 200, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, head_dim), jnp.bfloat16)
    seg_q = jax.ShapeDtypeStruct((2, 200), jnp.int32)
    seg_kv = jax.ShapeDtypeStruct((2, 256), jnp.int32)

    def loss(q, k, v, sq, skv):
        o = ops.flash_attention(q, k, v, causal=causal, segment_ids=(sq, skv) if segments else None,
                                backend="pallas_gpu")
        return jnp.sum(o.astype(jnp.float32))

    with hopper_target():
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
            q, kv, kv, seg_q, seg_kv).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("xla.gpu.triton") == 3  # forward, dq, dkv


def test_block_sizes_validate():
    with pytest.raises(ValueError, match="block_q"):
        BlockSizes(block_q=48)


@pytest.mark.parametrize("kwargs,match", [(dict(persistent=1), "persistent=1"),
                                          (dict(ctas=0), "ctas=0"), (dict(ctas=True), "ctas=True")])
def test_forward_tiles_validate(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ForwardTiles(**kwargs)


def test_block_sizes_refuse_a_non_bool_unpadded():
    with pytest.raises(ValueError, match="mosaic_unpadded=1"):
        BlockSizes(mosaic_unpadded=1)


@pytest.mark.parametrize("head_dim,causal", [(64, True), (128, False)])
def test_lowers_to_one_mosaic_and_two_triton_kernels(head_dim, causal):
    q = jax.ShapeDtypeStruct((2, 1000, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 1100, 2, head_dim), jnp.bfloat16)
    sizes = dataclasses.replace(default_block_sizes(head_dim, jnp.bfloat16),
                                forward_kernel="mosaic_gpu")

    def loss(q, k, v):
        o = ops.flash_attention(q, k, v, causal=causal, backend="pallas_gpu", block_sizes=sizes)
        return jnp.sum(o.astype(jnp.float32))

    with hopper_target():
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1  # the forward
    assert text.count("xla.gpu.triton") == 2  # dq, dkv


def _gradient_lowered_for_cuda(head_dim, causal, segments, options, **sizes) -> str:
    """The StableHLO text of the gradient of flash_attention on Mosaic GPU kernels (B2, T 1000,
    S 1100, H4, Hkv2, bfloat16) lowered for CUDA, with `sizes` replaced in the defaults."""
    q = jax.ShapeDtypeStruct((2, 1000, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 1100, 2, head_dim), jnp.bfloat16)
    ids_q = jax.ShapeDtypeStruct((2, 1000), jnp.int32)
    ids_kv = jax.ShapeDtypeStruct((2, 1100), jnp.int32)
    block_sizes = dataclasses.replace(default_block_sizes(head_dim, jnp.bfloat16),
                                      forward_kernel="mosaic_gpu", backward_kernel="mosaic_gpu",
                                      **sizes)

    def loss(q, k, v, sq, skv):
        o = ops.flash_attention(q, k, v, causal=causal, backend="pallas_gpu",
                                block_sizes=block_sizes,
                                segment_ids=(sq, skv) if segments else None, **options)
        return jnp.sum(o.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, ids_q, ids_kv).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("head_dim,causal,tiles,segments,options", [
    (64, True, BackwardTiles(), False, {}), (128, False, BackwardTiles(64, 128, 2), False, {}),
    (256, True, BackwardTiles(64, 32, 2), True, {}), (64, False, BackwardTiles(), True, {}),
    (128, True, BackwardTiles(64, 128, 2), False,
     dict(local_window_size=300, logits_soft_cap=30.0)),
    pytest.param(256, False, BackwardTiles(64, 32, 2), True, dict(local_window_size=(200, 100)),
                 marks=FULL)])
def test_lowers_to_three_mosaic_kernels(head_dim, causal, tiles, segments, options):
    """Forward, dq and dk/dv through Mosaic GPU's lowering for CUDA (layout inference, wgmma
    shapes, shared-memory transforms, the shared-memory budget), GQA and padded lengths; with a
    window and a soft cap."""
    text = _gradient_lowered_for_cuda(head_dim, causal, segments, options,
                                      mosaic_backward=tiles, fused_backward=False)
    assert text.count("custom_call @mosaic_gpu") == 3
    assert text.count("xla.gpu.triton") == 0


@pytest.mark.parametrize("field,kwargs,match", [
    ("forward_kernel", dict(head_dim=32), "head dim 32"),
    ("backward_kernel", dict(head_dim=32), "head dim 32"),
    *[(field, dict(dtype=jnp.float32), "float32")
      for field in ("forward_kernel", "backward_kernel")],
])
def test_forced_mosaic_refuses_what_it_cannot_take(field, kwargs, match):
    head_dim = kwargs.get("head_dim", 64)
    x = jnp.ones((1, 16, 2, head_dim), kwargs.get("dtype", jnp.bfloat16))
    seg = jnp.zeros((1, 16), jnp.int32)
    with pytest.raises(NotImplementedError, match=f"{field}.*{match}"):
        ops.flash_attention(x, x, x, backend="pallas_gpu", interpret=True,
                            segment_ids=(seg, seg) if kwargs.get("segments") else None,
                            block_sizes=BlockSizes(**{field: "mosaic_gpu"}))


def test_tiles_validate():
    with pytest.raises(ValueError, match="backward_kernel"):
        BlockSizes(backward_kernel="cudnn")
    with pytest.raises(ValueError, match="mosaic_backward"):
        BlockSizes(mosaic_backward=ForwardTiles())
    with pytest.raises(ValueError, match="block_kv"):
        BackwardTiles(block_kv=16)
    with pytest.raises(ValueError, match="stages"):
        BackwardTiles(stages=5)
    with pytest.raises(ValueError, match="forward_kernel"):
        BlockSizes(forward_kernel="cudnn")
    with pytest.raises(ValueError, match="mosaic_forward"):
        BlockSizes(mosaic_forward=(64, 128, 2))
    with pytest.raises(ValueError, match="block_q"):
        ForwardTiles(block_q=32)
    with pytest.raises(ValueError, match="block_kv"):
        ForwardTiles(block_kv=96)
    with pytest.raises(ValueError, match="stages"):
        ForwardTiles(stages=1)
    x = jnp.ones((1, 16, 2, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="shared memory"):  # 3 stages of 128 keys at D=128
        ops.flash_attention(x, x, x, backend="pallas_gpu", interpret=True, block_sizes=BlockSizes(
            forward_kernel="mosaic_gpu", mosaic_forward=ForwardTiles(64, 128, 3)))
    with pytest.raises(ValueError, match="mosaic_backward.*shared memory"):
        ops.flash_attention(x, x, x, backend="pallas_gpu", interpret=True, block_sizes=BlockSizes(
            backward_kernel="mosaic_gpu", mosaic_backward=BackwardTiles(128, 128, 4)))
    # the dk/dv kernel's tile: 32-key blocks at head dim 256 only, and only those there
    for head_dim, tiles, match in ((128, BackwardTiles(64, 32, 2), "block_kv must be 64 or 128"),
                                   (256, BackwardTiles(64, 64, 2), "block_kv must be 32")):
        y = jnp.ones((1, 16, 2, head_dim), jnp.bfloat16)
        with pytest.raises(ValueError, match=f"mosaic_backward.*{match}"):
            ops.flash_attention(y, y, y, backend="pallas_gpu", interpret=True,
                                block_sizes=BlockSizes(backward_kernel="mosaic_gpu",
                                                       mosaic_backward=tiles))


def _problem(head_dim=128, dtype=jnp.bfloat16, segments=False, length=2048):
    x = jnp.ones((1, length, 2, head_dim), dtype)
    seg = jnp.zeros((1, length), jnp.int32)
    problem, _, _ = validate_attention(x, x, x, causal=True, sm_scale=None,
                                       segment_ids=(seg, seg) if segments else None)
    return problem


def test_auto_takes_mosaic_on_hopper_only(monkeypatch):
    sizes = BlockSizes()
    monkeypatch.setattr(backends, "is_hopper", lambda: True)
    assert plan.mosaic_forward_tiles(_problem(), sizes, False) == sizes.mosaic_forward
    assert plan.mosaic_forward_tiles(_problem(), sizes, True) is None  # interpret: Triton
    assert plan.mosaic_forward_tiles(_problem(32), sizes, False) is None
    assert plan.mosaic_forward_tiles(_problem(dtype=jnp.float32), sizes, False) is None
    assert plan.mosaic_forward_tiles(_problem(segments=True), sizes, False) is not None
    triton = BlockSizes(forward_kernel="triton")
    assert plan.mosaic_forward_tiles(_problem(), triton, False) is None
    # short sequences at head dim 128: "auto" takes the persistent Mosaic GPU forward (the
    # default tiles), Triton in place of the per-tile one; "mosaic_gpu" still insists
    assert sizes.mosaic_forward.persistent
    assert plan.mosaic_forward_tiles(_problem(length=1024), sizes, False) == sizes.mosaic_forward
    per_tile = BlockSizes(mosaic_forward=ForwardTiles())
    assert plan.mosaic_forward_tiles(_problem(length=1024), per_tile, False) is None
    assert plan.mosaic_forward_tiles(_problem(64, length=1024), per_tile, False) is not None
    forced = BlockSizes(forward_kernel="mosaic_gpu", mosaic_forward=ForwardTiles())
    assert plan.mosaic_forward_tiles(_problem(length=1024), forced, False) is not None
    monkeypatch.setattr(backends, "is_hopper", lambda: False)
    assert plan.mosaic_forward_tiles(_problem(), sizes, False) is None


def test_auto_takes_mosaic_backward_on_hopper_only(monkeypatch):
    sizes = BlockSizes()
    monkeypatch.setattr(backends, "is_hopper", lambda: True)
    assert plan.mosaic_backward_tiles(_problem(), sizes, False) == sizes.mosaic_backward
    assert plan.mosaic_backward_tiles(_problem(64), sizes, False) == sizes.mosaic_backward
    assert plan.mosaic_backward_tiles(_problem(), sizes, True) is None  # interpret: Triton
    wide = default_block_sizes(256, jnp.bfloat16)
    assert plan.mosaic_backward_tiles(_problem(256), wide, False) == BackwardTiles(64, 32, 2)
    assert plan.mosaic_backward_tiles(_problem(dtype=jnp.float32), sizes, False) is None
    assert plan.mosaic_backward_tiles(_problem(segments=True), sizes, False) is not None
    assert plan.mosaic_backward_tiles(_problem(256, segments=True), wide, False) is not None
    triton = BlockSizes(backward_kernel="triton")
    assert plan.mosaic_backward_tiles(_problem(), triton, False) is None
    monkeypatch.setattr(backends, "is_hopper", lambda: False)
    assert plan.mosaic_backward_tiles(_problem(), sizes, False) is None


GPU_CASES = [
    AttentionCase(2, 4096, 4096, 8, 8, 128, causal=True),
    AttentionCase(2, 4096, 4096, 8, 2, 128, causal=False),
    AttentionCase(1, 4096, 4096, 8, 8, 64, causal=True),
    AttentionCase(2, 1000, 1500, 4, 1, 128, causal=True),
    AttentionCase(2, 1500, 1000, 4, 2, 64, causal=True),
    AttentionCase(1, 777, 1029, 4, 4, 64, causal=False),
    AttentionCase(1, 2048, 2048, 4, 4, 256, causal=True),
    AttentionCase(2, 1000, 1500, 4, 2, 256, causal=True),
    AttentionCase(1, 1029, 777, 2, 2, 256, causal=False),
    # segment ids on the Mosaic GPU kernels
    AttentionCase(2, 1000, 1000, 4, 2, 128, causal=True, segments="shared"),
    AttentionCase(1, 777, 1029, 4, 4, 64, causal=False, segments="pair"),
    AttentionCase(1, 1000, 1200, 4, 2, 256, causal=True, segments="pair"),
    # local windows and soft caps: causal, two-sided with T < S, with segments, at D = 256
    AttentionCase(2, 4096, 4096, 8, 8, 128, causal=True, window=(1024, 0), soft_cap=2.0),
    AttentionCase(1, 2000, 2300, 4, 2, 64, window=(300, 200)),
    AttentionCase(2, 1000, 1000, 4, 2, 128, causal=True, segments="shared", window=(200, 0)),
    AttentionCase(1, 1000, 1000, 4, 2, 256, causal=True, window=(100, 0), soft_cap=1.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_gpu_parity(case, dtype):
    # the Mosaic GPU forward and backward
    takes = plan.mosaic_backward_unsupported_reason(case.head_dim, dtype,
                                                    case.segments != "none") is None
    backward = "mosaic_gpu" if takes else "triton"
    sizes = dataclasses.replace(default_block_sizes(case.head_dim, dtype),
                                forward_kernel="mosaic_gpu", backward_kernel=backward)
    check_attention_parity(case, jax.random.key(6), dtype=dtype, backend="pallas_gpu",
                           block_sizes=sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c.segments == "none"][::4], ids=str)
def test_gpu_persistent_forward_equals_the_per_tile_forward(case):
    """On the GPU the persistent forward computes each tile as the per-tile one does: equal
    outputs, bit for bit (every fourth GPU case without segment ids: head dims 64-256, GQA,
    ragged lengths, windows, soft caps)."""
    keys = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(keys[0], (case.batch, case.q_len, case.num_heads, case.head_dim), BF16)
    k, v = (jax.random.normal(key, (case.batch, case.kv_len, case.num_kv_heads, case.head_dim),
                              BF16) for key in keys[1:])
    outs = []
    for persistent in (False, True):
        sizes = default_block_sizes(case.head_dim, BF16)
        sizes = dataclasses.replace(sizes, forward_kernel="mosaic_gpu", mosaic_forward=(
            dataclasses.replace(sizes.mosaic_forward, persistent=persistent)))
        outs.append(jax.jit(lambda q, k, v, sizes=sizes: ops.flash_attention(
            q, k, v, **case.options(), backend="pallas_gpu", block_sizes=sizes))(q, k, v))
    assert jnp.array_equal(*outs)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    AttentionCase(4, 4000, 4000, 8, 8, 128, causal=True),
    AttentionCase(2, 1000, 1504, 4, 2, 64, causal=True, window=(300, 0)),
    AttentionCase(1, 1000, 1200, 4, 2, 256, causal=False, soft_cap=1.0)], ids=str)
def test_gpu_unpadded_mosaic_equals_padded(case):
    """On the GPU, the Mosaic GPU kernels on unpadded q, k, v (BlockSizes.mosaic_unpadded; T and S
    multiples of 8) give the padded call's output and gradients, bit for bit."""
    keys = jax.random.split(jax.random.key(9), 4)
    q = jax.random.normal(keys[0], (case.batch, case.q_len, case.num_heads, case.head_dim), BF16)
    k, v = (jax.random.normal(key, (case.batch, case.kv_len, case.num_kv_heads, case.head_dim),
                              BF16) for key in keys[1:3])
    ct = jax.random.normal(keys[3], q.shape, jnp.float32)
    outs = []
    for unpadded in (False, True):
        # the two backward kernels: the one kernel's dq sums in no fixed order (not bit-equal)
        sizes = dataclasses.replace(default_block_sizes(case.head_dim, BF16),
                                    forward_kernel="mosaic_gpu", backward_kernel="mosaic_gpu",
                                    mosaic_unpadded=unpadded, fused_backward=False)

        def loss(q, k, v, sizes=sizes):
            o = ops.flash_attention(q, k, v, **case.options(), backend="pallas_gpu",
                                    block_sizes=sizes)
            return jnp.sum(o.astype(jnp.float32) * ct), o

        outs.append(jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v))
    for want, got in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        assert jnp.array_equal(want, got)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [AttentionCase(2, 1000, 1000, 4, 2, 128, causal=True),
                                  AttentionCase(1, 700, 1000, 4, 4, 128, causal=False),
                                  AttentionCase(1, 1000, 600, 2, 1, 128, causal=True)], ids=str)
def test_gpu_parity_auto_at_short_lengths(case):
    """What "auto" runs at head dim 128 with T, S <= 1024: on Hopper the persistent Mosaic GPU
    forward and the Mosaic GPU backward (T > S: rows that see no key; T = 700: padded)."""
    sizes = default_block_sizes(case.head_dim, jnp.bfloat16)
    problem, _, _ = validate_attention(*(jnp.ones((1, n, 1, 128), jnp.bfloat16)
                                         for n in (case.q_len, case.kv_len, case.kv_len)),
                                       causal=case.causal, sm_scale=None, segment_ids=None)
    expected = sizes.mosaic_forward if backends.is_hopper() else None
    assert plan.mosaic_forward_tiles(problem, sizes, False) == expected
    check_attention_parity(case, jax.random.key(7), dtype=jnp.bfloat16, backend="pallas_gpu",
                           block_sizes=sizes)


@pytest.mark.gpu
def test_gpu_auto_picks_mosaic_on_hopper():
    problem = _problem()
    sizes = default_block_sizes(128, jnp.bfloat16)
    expected = sizes.mosaic_forward if backends.is_hopper() else None
    assert plan.mosaic_forward_tiles(problem, sizes, False) == expected


TRITON_GPU_CASES = [
    AttentionCase(2, 4096, 4096, 8, 8, 128, causal=True),
    AttentionCase(2, 4096, 4096, 8, 2, 128, causal=False),
    AttentionCase(1, 2048, 2048, 8, 8, 64, causal=True),
    AttentionCase(1, 2048, 2048, 4, 4, 256, causal=True),
    AttentionCase(1, 2048, 2048, 4, 4, 256, causal=False),
    AttentionCase(2, 1000, 1500, 4, 1, 128, causal=True),
    AttentionCase(2, 1500, 1000, 4, 2, 64, causal=True),
    AttentionCase(2, 1024, 1024, 4, 2, 128, causal=True, segments="shared"),
    AttentionCase(1, 777, 1029, 4, 4, 64, causal=False, segments="pair"),
    AttentionCase(1, 2000, 2000, 4, 2, 128, causal=True, window=(500, 0), soft_cap=2.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", TRITON_GPU_CASES, ids=str)
def test_gpu_triton_parity_bf16(case):
    # the Triton forward, forced: on Hopper "auto" takes the Mosaic GPU forward at D 64 / 128 /
    # 256, which test_gpu_parity above checks
    sizes = dataclasses.replace(default_block_sizes(case.head_dim, jnp.bfloat16),
                                forward_kernel="triton")
    check_attention_parity(case, jax.random.key(2), dtype=jnp.bfloat16, backend="pallas_gpu",
                           block_sizes=sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_triton_parity_dtypes(dtype, head_dim):
    case = AttentionCase(1, 1024, 1024, 4, 2, head_dim, causal=True)
    check_attention_parity(case, jax.random.key(3), dtype=dtype, backend="pallas_gpu")


def _check_ring_block_grads(case, dtype, block_sizes, interpret):
    """Ring attention's float32 gradients of one (query block, key block) pair, given the whole
    attention's lse and delta (`attention_block_grads`), against the xla block's in float64 under
    the pass rule. The whole lse is the block's own raised by up to 1 (the other blocks' weight);
    row 5 sees no key anywhere (lse -inf: zero gradients). case.window may have a negative side,
    as a ring block's window does."""
    key = jax.random.key(case_seed(case, "ring block"))
    inputs = make_attention_inputs(case, key, dtype)
    k_do, k_shift, k_delta = jax.random.split(jax.random.fold_in(key, 1), 3)
    x = (inputs["q"], inputs["k"], inputs["v"],
         jax.random.normal(k_do, inputs["q"].shape, jnp.float32).astype(dtype))
    b, t, h, _ = x[0].shape

    def block_args(x):
        problem, q_seg, kv_seg = validate_attention(
            *x[:3], causal=case.causal, sm_scale=None, segment_ids=inputs["segment_ids"],
            logits_soft_cap=case.soft_cap)
        return dict(problem=dataclasses.replace(problem, window=case.window),
                    q_segment_ids=q_seg, kv_segment_ids=kv_seg)

    f32 = tuple(a.astype(jnp.float32) for a in x)
    _, lse = xla_attention.attention_block(*f32[:3], **block_args(f32), block_sizes=None,
                                           interpret=False)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.5) + jax.random.uniform(k_shift, (b, h, t))
    lse = lse.at[:, :, 5].set(-jnp.inf)
    delta = jax.random.normal(k_delta, (b, h, t))

    def grads(module, x, **options):
        wide = jnp.promote_types(x[0].dtype, jnp.float32)  # float32, or float64 for the reference
        return dict(zip(("dq", "dk", "dv"), module.attention_block_grads(
            *x, lse.astype(wide), delta.astype(wide), **block_args(x), **options)))

    kernel = jax.jit(lambda *x: grads(pallas_gpu, x, block_sizes=block_sizes,
                                      interpret=interpret))(*x)
    baseline = grads(xla_attention, x, block_sizes=None, interpret=False)
    with jax.enable_x64(True):
        reference = grads(xla_attention, tuple(a.astype(jnp.float64) for a in x),
                          block_sizes=None, interpret=False)
    assert_pass_rule(kernel, baseline, reference, dtype=dtype)
    assert not jnp.any(kernel["dq"][:, 5])


def _mosaic_gradient_sizes(head_dim):
    """The Mosaic GPU pair forced, at the head dim's default tiles."""
    return dataclasses.replace(default_block_sizes(head_dim, BF16), forward_kernel="mosaic_gpu",
                               backward_kernel="mosaic_gpu")


# Ring blocks: the Mosaic GPU dq and dk/dv kernels write each gradient in two parts of the input
# dtype (hi + lo in float32: 16 bits of mantissa), the Triton ones float32. The default run takes
# the non-causal block with segment ids and padding; --full adds the causal one.
@pytest.mark.parametrize("case,dtype", [
    pytest.param(AttentionCase(1, 256, 256, 2, 1, 64, causal=True), BF16, marks=FULL),
    # not causal, segment ids, T not a multiple of the tiles (padded)
    (AttentionCase(1, 200, 200, 2, 2, 128, causal=False, segments="shared"), F16),
    # a block-local window with a negative side (the key block lies ahead of the queries) and a
    # soft cap; head dim 256 (dk/dv's split roles write one gradient each)
    pytest.param(AttentionCase(1, 256, 256, 2, 1, 256, window=(-40, 100), soft_cap=2.0), BF16,
                 marks=FULL),
    pytest.param(AttentionCase(2, 128, 128, 4, 2, 64, causal=True, segments="shared"), F16,
                 marks=FULL),
], ids=str)
def test_ring_block_gradients_from_the_mosaic_backward(case, dtype):
    sizes = _mosaic_gradient_sizes(case.head_dim)
    if case.head_dim != 256:  # the smaller interpret tiles
        sizes = dataclasses.replace(sizes, mosaic_backward=BackwardTiles(64, 64, 2))
    _check_ring_block_grads(case, dtype, sizes, interpret=True)


@pytest.mark.parametrize("head_dim,causal", [(128, True), (256, False)])
def test_ring_block_gradients_lower_to_two_mosaic_kernels(head_dim, causal):
    """The two-part outputs through Mosaic GPU's lowering for CUDA (head dim 256: dk/dv's split
    roles), no Triton kernel."""
    q = jax.ShapeDtypeStruct((1, 1024, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1024, 2, head_dim), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((1, 4, 1024), jnp.float32)
    problem, _, _ = validate_attention(q, kv, kv, causal=causal, sm_scale=None, segment_ids=None)

    def grads(q, k, v, do, lse, delta):
        return pallas_gpu.attention_block_grads(
            q, k, v, do, lse, delta, problem=problem, q_segment_ids=None, kv_segment_ids=None,
            block_sizes=_mosaic_gradient_sizes(head_dim), interpret=False)

    text = jax.jit(grads).trace(q, kv, kv, q, rows, rows).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 2
    assert text.count("xla.gpu.triton") == 0


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    AttentionCase(1, 2048, 2048, 8, 2, 128, causal=True),
    AttentionCase(2, 2000, 2000, 4, 4, 64, causal=False, segments="shared"),
    AttentionCase(1, 2048, 2048, 4, 1, 256, window=(-300, 1200), soft_cap=2.0)], ids=str)
def test_gpu_ring_block_gradients_from_the_mosaic_backward(case):
    _check_ring_block_grads(case, BF16, _mosaic_gradient_sizes(case.head_dim), interpret=False)


# Ring attention (T split over 2 GPUs): the Mosaic GPU forward, with and without segments (not
# causal, where a row can see no key of a block) and under a window, under the pass rule.
RING_GPU_CASES = [
    AttentionCase(1, 8192, 8192, 8, 2, 128, causal=True),
    AttentionCase(2, 2048, 2048, 4, 4, 64, causal=True, segments="shared"),
    AttentionCase(1, 2048, 2048, 4, 2, 128, causal=False, segments="shared"),
    # a window narrower than a block: block-local windows with negative sides, rows with no key
    AttentionCase(1, 8192, 8192, 8, 2, 128, causal=True, window=(1500, 0), soft_cap=2.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", RING_GPU_CASES, ids=str)
def test_gpu_ring_attention_parity(case):
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if jax.device_count() < 2:
        pytest.skip("needs 2 GPUs (nvidia-h200-x2)")
    mesh = Mesh(np.array(jax.devices()[:2]), ("seq",))
    check_attention_parity(case, jax.random.key(7), dtype=jnp.bfloat16, backend="pallas_gpu",
                           sharding=NamedSharding(mesh, P(None, "seq")))


# The one-kernel backward (BlockSizes.fused_backward, kernels_mosaic_backward_fused): dk, dv and
# dq added into a float32 array with the TMA unit's reduce-add. GPU interpret mode has no TMA
# reductions; there the kernel writes a dq partial per key tile (summed after it), which checks
# everything else (masks, the shared ds^T tiles, the barriers).
FUSED = BackwardTiles(64, 64, 2)


@pytest.mark.parametrize("head_dim,causal,segments,options", [
    (64, True, False, {}), (128, False, False, {}), (64, False, True, {}),
    (128, True, True, dict(local_window_size=300, logits_soft_cap=30.0))])
def test_fused_backward_lowers_to_two_mosaic_kernels(head_dim, causal, segments, options):
    """Forward and the one-kernel backward through Mosaic GPU's lowering for CUDA, GQA, padded
    lengths; the dq partials go out with a TMA reduce-add."""
    text = _gradient_lowered_for_cuda(head_dim, causal, segments, options,
                                      mosaic_backward=FUSED, fused_backward=True)
    assert text.count("custom_call @mosaic_gpu") == 2
    assert "cp.reduce.async.bulk.tensor" in text


def test_fused_backward_knob():
    with pytest.raises(ValueError, match="fused_backward"):
        BlockSizes(fused_backward="yes")
    sizes = default_block_sizes(128, BF16)
    mosaic = plan.mosaic_backward_tiles(_problem(), dataclasses.replace(
        sizes, backward_kernel="mosaic_gpu"), True)
    assert not plan.fused_backward(_problem(), sizes, mosaic)  # None: D = 64 only
    assert plan.fused_backward(_problem(64), sizes, mosaic)
    assert not plan.fused_backward(_problem(64), sizes, mosaic, interpret=True)
    assert plan.fused_backward(_problem(), dataclasses.replace(sizes, fused_backward=True),
                               mosaic)
    assert not plan.fused_backward(_problem(), dataclasses.replace(sizes, fused_backward=False),
                                   mosaic)
    forced = dataclasses.replace(sizes, fused_backward=True)
    with pytest.raises(NotImplementedError, match="head dim 256"):
        plan.fused_backward(_problem(256), forced, BackwardTiles(64, 32, 2))
    with pytest.raises(NotImplementedError, match="block_kv=128"):
        plan.fused_backward(_problem(), forced, BackwardTiles(64, 128, 2))
    with pytest.raises(NotImplementedError, match="Triton backward"):
        plan.fused_backward(_problem(), forced, None)
    with pytest.raises(NotImplementedError, match="shared memory"):
        plan.fused_backward(_problem(), forced, BackwardTiles(64, 64, 4))
    # through the op: the Triton backward (interpret mode under "auto") cannot be fused
    x = jnp.ones((1, 16, 2, 64), BF16)
    with pytest.raises(NotImplementedError, match="fused_backward=True"):
        ops.flash_attention(x, x, x, backend="pallas_gpu", interpret=True,
                            block_sizes=BlockSizes(fused_backward=True))


@pytest.mark.parametrize("tiles,head_dim,fits", [
    (BackwardTiles(64, 64, 2), 64, True), (BackwardTiles(64, 64, 4), 64, True),
    (BackwardTiles(64, 64, 2), 128, True), (BackwardTiles(64, 64, 3), 128, False),
    (BackwardTiles(128, 64, 2), 128, False)])
def test_fused_backward_shared_memory(tiles, head_dim, fits):
    """Which tiles the one kernel's shared memory fits (k, v, the ring, two ds^T tiles and the
    float32 dq tile: 201,352 bytes at head dim 128 with two stages, margin included)."""
    need = plan.fused_backward_shared_memory_bytes(tiles, head_dim)
    assert (need <= plan.SHARED_MEMORY_BYTES) == fits


@pytest.mark.parametrize("case,tiles,dtype", [
    # segment ids (shared), causal, GQA: skip steps at the diagonal, both rings wrap
    (AttentionCase(1, 200, 200, 4, 2, 64, causal=True, segments="shared"), FUSED, BF16),
    # T > S: rows that see no key; head dim 128
    pytest.param(AttentionCase(1, 200, 130, 4, 2, 128, causal=True), FUSED, F16, marks=FULL),
    # a causal window, soft-capped: skip steps on both edges
    pytest.param(AttentionCase(1, 400, 400, 4, 2, 64, causal=True, window=(90, 0), soft_cap=2.0),
                 FUSED, BF16, marks=FULL),
], ids=str)
@pytest.mark.skip(reason="hangs the GPU interpreter on a 2-core host (threads parked in barrier "
                  "waits, as the non-causal two-kernel programs); the GPU tests cover the kernel")
def test_fused_backward_interpret_parity(case, tiles, dtype):
    sizes = dataclasses.replace(MOSAIC, backward_kernel="mosaic_gpu", mosaic_backward=tiles,
                                fused_backward=True)
    check_attention_parity(case, jax.random.key(8), dtype=dtype, backend="pallas_gpu",
                           interpret=True, block_sizes=sizes)


# Every D = 64 case (the default takes the one kernel there) and the D = 128 ones up to T = 1500:
# the float64 references of the B2 T4096 D128 cases, beside test_gpu_parity's, ran the GPU out of
# memory with 4 workers.
FUSED_GPU_CASES = [c for c in GPU_CASES
                   if c.head_dim == 64 or (c.head_dim == 128 and c.q_len <= 1500)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", FUSED_GPU_CASES, ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_gpu_fused_backward_parity(case, dtype):
    """The Mosaic GPU forward and the one-kernel backward (TMA reduce-add of dq)."""
    sizes = dataclasses.replace(default_block_sizes(case.head_dim, dtype),
                                forward_kernel="mosaic_gpu", backward_kernel="mosaic_gpu",
                                mosaic_backward=FUSED, fused_backward=True)
    check_attention_parity(case, jax.random.key(6), dtype=dtype, backend="pallas_gpu",
                           block_sizes=sizes)
