"""Flash attention backward for Hopper in Pallas Mosaic GPU: a dq kernel and a dk/dv kernel.

Both follow the forward's block structure (kernels_mosaic_forward.py): two consumer warpgroups
that each own block rows of the tile, and one producer warpgroup that streams the other side's
blocks into a ring of shared-memory slots with the TMA unit (common/mosaic_gpu.ring_producer).
- dq: a block per (query tile, head, batch); each consumer holds q, do and its rows of lse and
  delta, and walks the key blocks its rows can see: s = q k^T, p = exp2(s * scale2 - lse),
  dp = do v^T, ds = p (dp - delta), dq += ds k, all products on the tensor cores (wgmma).
- dk/dv: a block per (key tile, kv head, batch); each consumer holds k and v and walks, for every
  query head of the kv head's group, the query blocks that can see its keys, transposed:
  s^T = k q^T, p^T, dv += p^T do, dp^T = v do^T, ds^T = p^T (dp^T - delta), dk += ds^T q. The
  group's heads are summed in the accumulators, so GQA needs no reduction afterwards.
Causal skipping as in the Triton kernels: blocks no row of a consumer can see are not visited,
blocks every row sees take no mask. Rows that see no key (lse = 0 from the forward, every p
masked) give zero gradients. Keys at or past the true S are masked in dq; their dk/dv rows are
sliced away by the caller. Head dims 64 and 128, bfloat16 / float16, no segment ids
(plan.mosaic_backward_unsupported_reason); docs/gpu_backend.md has the measurements.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gla_tpu.ops.attention.pallas_gpu.kernels_triton import (
    kv_blocks_for_query_tile,
    q_blocks_for_key_tile,
    visibility_mask,
)
from gla_tpu.ops.attention.pallas_gpu.plan import CONSUMERS, BackwardTiles, Geometry
from gla_tpu.ops.common.base2 import LOG2_E
from gla_tpu.ops.common.mosaic_gpu import SWIZZLED, release_step, ring_producer



def _products(pairs, out_shape):
    """[a @ b for (a, b) in pairs] as fresh float32 accumulators (wgmma from shared memory),
    issued together so that one wait covers them all."""
    def run(*acc_refs):
        for acc_ref, (a, b) in zip(acc_refs, pairs):
            plgpu.wgmma(acc_ref, a, b)
        return tuple(acc_ref[...] for acc_ref in acc_refs)

    return pl.run_scoped(run, *[plgpu.ACC(out_shape, jnp.float32) for _ in pairs])


def _accumulate_and_product(acc, a16, b_ref, c_ref, d_ref, out_shape, in_place: bool):
    """(acc + a16 @ b_ref, c_ref @ d_ref): the dk/dv kernel's dv update and dp^T, issued
    together (one wait)."""
    if not in_place:
        (cd,) = _products([(c_ref, d_ref)], out_shape)
        return _accumulate(acc, a16, b_ref, in_place), cd

    def run(refs):
        acc_ref, cd_ref = refs
        plgpu.wgmma(acc_ref, a16, b_ref)
        plgpu.wgmma(cd_ref, c_ref, d_ref)

    zeros = plgpu.layout_cast(jnp.full(out_shape, 0.0, jnp.float32), plgpu.Layout.WGMMA)
    return pl.run_state(run)((plgpu.ACC.init(acc), plgpu.ACC.init(zeros)))


def _accumulate(acc, a16, b_ref, in_place: bool):
    """acc + a16 @ b_ref; a16 lives in registers. GPU interpret mode runs neither ACC.init nor
    wgmma from registers, so there it is a jnp.dot."""
    if in_place:
        def run(acc_ref):
            plgpu.wgmma(acc_ref, a16, b_ref)

        return pl.run_state(run)(plgpu.ACC.init(acc))
    return acc + jnp.dot(a16, b_ref[...], preferred_element_type=jnp.float32)


def _iota(shape, dim, start):
    return start + plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _load_own(pairs, ready):
    """TMA copies of a consumer's own tiles (src, dst) onto ready barriers, then wait for all."""
    for (src, dst), barrier in zip(pairs, ready):
        plgpu.copy_gmem_to_smem(src, dst, barrier)
    for barrier in ready:
        plgpu.barrier_wait(barrier)


def _dq_consumer(refs, *, geo: Geometry, tiles: BackwardTiles, tile_steps, in_place: bool):
    (q_ref, do_ref, lse_ref, delta_ref, dq_ref, q_smem, do_smem, lse_smem, delta_smem, own_ready,
     k_smem, v_smem, k_ready, v_ready, kv_free, batch, head, tile_base, wg) = refs
    bq, bkv, d = tiles.block_q, tiles.block_kv, q_ref.shape[-1]
    dtype = q_ref.dtype
    scale2 = geo.sm_scale * LOG2_E
    check_len = geo.kv_len != geo.padded_kv
    q_base = tile_base + wg * bq
    full, hi = kv_blocks_for_query_tile(geo, q_base, bq, bkv)
    rows = (batch, pl.ds(q_base, bq), head)
    row_vec = (batch, head, pl.ds(q_base, bq))
    _load_own([(q_ref.at[rows], q_smem), (do_ref.at[rows], do_smem),
               (lse_ref.at[row_vec], lse_smem), (delta_ref.at[row_vec], delta_smem)], own_ready)
    per_row = plgpu.Layout.WGMMA.reduce(1)
    lse = lax.broadcast_in_dim(plgpu.load(lse_smem, layout=per_row), (bq, bkv), [0])
    delta = lax.broadcast_in_dim(plgpu.load(delta_smem, layout=per_row), (bq, bkv), [0])

    def step_fn(masked: bool, step, dq):
        slot = lax.rem(step, jnp.int32(tiles.stages))
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(v_ready.at[slot])
        s, dp = _products([(q_smem, k_smem.at[slot].transpose((1, 0))),
                           (do_smem, v_smem.at[slot].transpose((1, 0)))], (bq, bkv))
        p = jnp.exp2(s * scale2 - lse)
        if masked:
            visible = visibility_mask(geo, _iota((bq, bkv), 0, q_base),
                                      _iota((bq, bkv), 1, step * bkv), None, None,
                                      check_len=check_len)
            if visible is not None:
                p = jnp.where(visible, p, 0.0)
        ds = (p * (dp - delta)).astype(dtype)
        dq = _accumulate(dq, ds, k_smem.at[slot], in_place)
        if not in_place:  # interpret: the jnp.dot read k through the generic proxy; order it
            plgpu.commit_smem()  # before the TMA unit's refill of the slot
        plgpu.barrier_arrive(kv_free.at[slot])
        return dq

    def release(step, carry):
        release_step(lax.rem(step, jnp.int32(tiles.stages)), (k_ready, v_ready), (kv_free,))
        return carry

    dq = plgpu.layout_cast(jnp.full((bq, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    dq = lax.fori_loop(0, full, lambda i, c: step_fn(False, i, c), dq)
    dq = lax.fori_loop(full, hi, lambda i, c: step_fn(True, i, c), dq)
    lax.fori_loop(hi, tile_steps, release, None)  # steps only the other consumer needs

    q_smem[...] = (dq * geo.sm_scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
    plgpu.wait_smem_to_gmem(0)


def _dkv_consumer(refs, *, geo: Geometry, tiles: BackwardTiles, first_block, per_head,
                  in_place: bool):
    (k_ref, v_ref, dk_ref, dv_ref, k_smem, v_smem, own_ready, q_smem, do_smem, lse_smem,
     delta_smem, ready, q_free, batch, kv_head, tile_base, wg) = refs
    bq, bkv, d = tiles.block_q, tiles.block_kv, k_ref.shape[-1]
    dtype = k_ref.dtype
    scale2 = geo.sm_scale * LOG2_E
    k_base = tile_base + wg * bkv
    lo, full = q_blocks_for_key_tile(geo, k_base, bkv, bq)
    n_q = geo.padded_q // bq
    rows = (batch, pl.ds(k_base, bkv), kv_head)
    _load_own([(k_ref.at[rows], k_smem), (v_ref.at[rows], v_smem)], own_ready)
    per_col = plgpu.Layout.WGMMA.reduce(0)

    def step_fn(masked: bool, g, block, carry):
        dk, dv = carry
        step = g * per_head + (block - first_block)
        slot = lax.rem(step, jnp.int32(tiles.stages))
        for barrier in ready:
            plgpu.barrier_wait(barrier.at[slot])
        lse = lax.broadcast_in_dim(plgpu.load(lse_smem.at[slot], layout=per_col),
                                   (bkv, bq), [1])
        delta = lax.broadcast_in_dim(plgpu.load(delta_smem.at[slot], layout=per_col),
                                     (bkv, bq), [1])
        (st,) = _products([(k_smem, q_smem.at[slot].transpose((1, 0)))], (bkv, bq))
        pt = jnp.exp2(st * scale2 - lse)
        if masked:
            # keys past kv_len only reach dk/dv rows the caller slices away: no length check
            visible = visibility_mask(geo, _iota((bkv, bq), 1, block * bq),
                                      _iota((bkv, bq), 0, k_base), None, None, check_len=False)
            if visible is not None:
                pt = jnp.where(visible, pt, 0.0)
        dv, dpt = _accumulate_and_product(dv, pt.astype(dtype), do_smem.at[slot], v_smem,
                                          do_smem.at[slot].transpose((1, 0)), (bkv, bq),
                                          in_place)
        dst = (pt * (dpt - delta)).astype(dtype)
        dk = _accumulate(dk, dst, q_smem.at[slot], in_place)
        if not in_place:  # as in the dq kernel
            plgpu.commit_smem()
        plgpu.barrier_arrive(q_free.at[slot])
        return dk, dv

    def release(g, block, carry):
        step = g * per_head + (block - first_block)
        release_step(lax.rem(step, jnp.int32(tiles.stages)), ready, (q_free,))
        return carry

    zeros = plgpu.layout_cast(jnp.full((bkv, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    carry = (zeros, zeros)
    for g in range(geo.group):
        lax.fori_loop(first_block, lo, lambda i, c, g=g: release(g, i, c), None)
        carry = lax.fori_loop(lo, full, lambda i, c, g=g: step_fn(True, g, i, c), carry)
        carry = lax.fori_loop(full, n_q, lambda i, c, g=g: step_fn(False, g, i, c), carry)
    dk, dv = carry

    k_smem[...] = (dk * geo.sm_scale).astype(dtype)
    v_smem[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[rows], commit_group=False)
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[rows], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)


def _kernel(body, *, out_type, scratch, grid, interpret):
    """`interpret`: False, True (GPU interpret mode) or plgpu.InterpretGPUParams (the tests' race
    detector)."""
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    return plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=grid,
        grid_names=("tile", "head", "batch"), num_threads=CONSUMERS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret or None)


def _own_scratch(rows: int, d: int, dtype, n_vectors: int):
    """Each consumer's two [rows, D] tiles, `n_vectors` [rows] float32 rows, and a barrier each."""
    tiles = [plgpu.SMEM((CONSUMERS, rows, d), dtype, transforms=SWIZZLED) for _ in range(2)]
    vectors = [plgpu.SMEM((CONSUMERS, rows), jnp.float32) for _ in range(n_vectors)]
    barriers = [plgpu.Barrier(num_barriers=CONSUMERS) for _ in range(len(tiles + vectors))]
    return tiles + vectors + barriers


def backward_dq(q, k, v, do, lse, delta, *, geo: Geometry, tiles: BackwardTiles, interpret):
    """dq [B, Tp, H, D] in q's dtype from q, do [B, Tp, H, D], k, v [B, Sp, Hkv, D] and the
    base-2 lse and delta [B, H, Tp]. Tp must be a multiple of 2 * block_q, Sp of block_kv."""
    b, tp, h, d = q.shape
    bq, bkv, stages = tiles.block_q, tiles.block_kv, tiles.stages
    n_tiles = tp // (CONSUMERS * bq)

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, q_smem2, do_smem2,
             lse_smem2, delta_smem2, q_ready, do_ready, lse_ready, delta_ready, k_smem, v_smem,
             k_ready, v_ready, kv_free):
        tile = lax.axis_index("tile")
        if geo.causal:  # the tiles with the most keys first
            tile = n_tiles - 1 - tile
        batch, head, wg = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("wg")
        tile_base = tile * (CONSUMERS * bq)
        _, tile_steps = kv_blocks_for_query_tile(geo, tile_base + (CONSUMERS - 1) * bq, bq, bkv)

        @pl.when(wg < CONSUMERS)
        def _():
            plgpu.set_max_registers(232, action="increase")
            own_ready = tuple(x.at[wg] for x in (q_ready, do_ready, lse_ready, delta_ready))
            refs = (q_ref, do_ref, lse_ref, delta_ref, dq_ref, q_smem2.at[wg], do_smem2.at[wg],
                    lse_smem2.at[wg], delta_smem2.at[wg], own_ready, k_smem, v_smem, k_ready,
                    v_ready, kv_free, batch, head, tile_base, wg)
            _dq_consumer(refs, geo=geo, tiles=tiles, tile_steps=tile_steps,
                         in_place=not interpret)

        @pl.when(wg == CONSUMERS)
        def _():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = lax.div(head, jnp.int32(geo.group))

            def load(step, slot):
                keys = (batch, pl.ds(step * bkv, bkv), kv_head)
                plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], k_ready.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], v_ready.at[slot])

            ring_producer(load, steps=tile_steps, stages=stages, free=(kv_free,))

    scratch = _own_scratch(bq, d, q.dtype, n_vectors=2) + [
        *[plgpu.SMEM((stages, bkv, d), k.dtype, transforms=SWIZZLED) for _ in range(2)],
        *[plgpu.Barrier(num_barriers=stages) for _ in range(2)],
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages)]
    kernel = _kernel(body, out_type=jax.ShapeDtypeStruct(q.shape, q.dtype), scratch=scratch,
                     grid=(n_tiles, h, b), interpret=interpret)
    with jax.named_scope(f"flash_dq_mosaic_block_q={bq}_block_kv={bkv}"):
        return kernel(q, k, v, do, lse, delta)


def backward_dkv(q, k, v, do, lse, delta, *, geo: Geometry, tiles: BackwardTiles, interpret):
    """(dk, dv) [B, Sp, Hkv, D] in k's dtype, summed over each kv head's query group. Sp must be
    a multiple of 2 * block_kv, Tp of block_q."""
    b, sp, hkv, d = k.shape
    bq, bkv, stages = tiles.block_q, tiles.block_kv, tiles.stages
    n_tiles = sp // (CONSUMERS * bkv)

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, k_smem2, v_smem2,
             k_ready, v_ready, q_smem, do_smem, lse_smem, delta_smem, q_ready, do_ready,
             lse_ready, delta_ready, q_free):
        tile = lax.axis_index("tile")
        batch, kv_head, wg = (lax.axis_index("batch"), lax.axis_index("head"),
                              lax.axis_index("wg"))
        tile_base = tile * (CONSUMERS * bkv)
        # the query blocks of one head the tile visits: those its first consumer sees
        first_block, _ = q_blocks_for_key_tile(geo, tile_base, bkv, bq)
        per_head = geo.padded_q // bq - first_block
        ready = (q_ready, do_ready, lse_ready, delta_ready)

        @pl.when(wg < CONSUMERS)
        def _():
            plgpu.set_max_registers(232, action="increase")
            refs = (k_ref, v_ref, dk_ref, dv_ref, k_smem2.at[wg], v_smem2.at[wg],
                    (k_ready.at[wg], v_ready.at[wg]), q_smem, do_smem, lse_smem, delta_smem,
                    ready, q_free, batch, kv_head, tile_base, wg)
            _dkv_consumer(refs, geo=geo, tiles=tiles, first_block=first_block,
                          per_head=per_head, in_place=not interpret)

        @pl.when(wg == CONSUMERS)
        def _():
            plgpu.set_max_registers(40, action="decrease")

            def load(step, slot):
                head = kv_head * geo.group + lax.div(step, per_head)
                block = first_block + lax.rem(step, per_head)
                rows = (batch, pl.ds(block * bq, bq), head)
                vec = (batch, head, pl.ds(block * bq, bq))
                for src, dst, barrier in ((q_ref.at[rows], q_smem, q_ready),
                                          (do_ref.at[rows], do_smem, do_ready),
                                          (lse_ref.at[vec], lse_smem, lse_ready),
                                          (delta_ref.at[vec], delta_smem, delta_ready)):
                    plgpu.copy_gmem_to_smem(src, dst.at[slot], barrier.at[slot])

            ring_producer(load, steps=geo.group * per_head, stages=stages, free=(q_free,))

    scratch = _own_scratch(bkv, d, k.dtype, n_vectors=0) + [
        *[plgpu.SMEM((stages, bq, d), q.dtype, transforms=SWIZZLED) for _ in range(2)],
        *[plgpu.SMEM((stages, bq), jnp.float32) for _ in range(2)],
        *[plgpu.Barrier(num_barriers=stages) for _ in range(4)],
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages)]
    out = jax.ShapeDtypeStruct(k.shape, k.dtype)
    kernel = _kernel(body, out_type=[out, out], scratch=scratch, grid=(n_tiles, hkv, b),
                     interpret=interpret)
    with jax.named_scope(f"flash_dkv_mosaic_block_q={bq}_block_kv={bkv}"):
        dk, dv = kernel(q, k, v, do, lse, delta)
    return dk, dv
