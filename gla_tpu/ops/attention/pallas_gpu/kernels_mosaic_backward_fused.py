"""Flash attention backward for Hopper in one Mosaic GPU kernel: dk, dv and a float32 dq.

The dk/dv kernel's structure (kernels_mosaic_backward.backward_dkv): a block per (2 x block_kv
keys, kv head, batch), two consumer warpgroups that own block_kv keys each (k and v in shared
memory, dk and dv [block_kv, D] float32 in registers), one producer that streams q, do, lse and
delta of every query block of every query head of the kv head's group. Per query block each
consumer computes s^T = k q^T and dp^T = v do^T (one wgmma group), p^T, ds^T, dv += p^T do and
dk += ds^T q, and also writes ds^T (16-bit) into its half of a shared [2 x block_kv, block_q]
tile. The dq partial of the block, dq_i += ds_i k over the tile's 2 x block_kv keys (one wgmma,
ds^T read transposed from shared memory), is computed by one consumer, alternating by step
parity (consumer 0 on even steps, consumer 1 on odd ones), which stages it in a float32 shared
tile and adds it into the float32 dq in global memory with the TMA unit's reduce-add
(cp.reduce.async.bulk .add). So each (query block, key block) costs 5 products, against 7 for
the dq and dk/dv kernels, which both recompute s and dp.

Synchronisation beyond the dk/dv kernel's ring:
- the ds^T tile is double-buffered by step parity; ds_ready[b] (two arrivals) completes once both
  halves of step s (b = s mod 2) are written (and fenced for the async proxy). Consumer b waits
  for it before its dq product; the other consumer observes that phase only before it writes
  buffer b again (step s + 2) or at the end. Buffer b is free again at step s + 2 because
  consumer b arrives on step s + 1's barrier only after its product of step s has completed,
  and the writer of step s + 2 has waited for that barrier (as owner of step s + 1).
- the float32 staging tile is shared: each consumer waits for its own previous reduce-add to
  have read the tile (wait_smem_to_gmem, read only) before arriving on ds_ready, so the owner of
  the next step finds it free once ds_ready completes.
- a consumer outside its keys' query range at a step (causal or window edges) writes zeros into
  its half, so every step has both halves.
- before dk and dv go out through the k and v tiles, both consumers meet on `done`: the
  partner's last dq product may still read the k tile.

In GPU interpret mode (no TMA reductions there) dq goes into a [key tiles, B, Tp, H, D] float32
array instead, one plain copy per (key tile, query block, head), summed by the caller.
Head dims 64 and 128 (at 256 the dk/dv consumers split roles and the two-kernel backward runs);
bfloat16 / float16. dq comes out unscaled (the caller multiplies by sm_scale as it casts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gla_tpu.ops.attention.pallas_gpu.blocks import q_blocks, visibility_mask, walk
from gla_tpu.ops.attention.pallas_gpu.kernels_mosaic_backward import (_accumulate, _iota,
                                                                     _load_own, _products,
                                                                     _take, _write_parts,
                                                                     produce_query_blocks)
from gla_tpu.ops.attention.pallas_gpu.kernels_mosaic_forward import (check_padded_lengths,
                                                                    warp_specialized_kernel)
from gla_tpu.ops.attention.pallas_gpu.plan import (CONSUMERS, BackwardTiles, Geometry,
                                                  fused_backward_unsupported_reason)
from gla_tpu.ops.attention.scores import base2_scores
from gla_tpu.ops.common.mosaic_gpu import SWIZZLED, SWIZZLED_F32

def _dk_dv_together(acc_dk, dst16, q_ref, acc_dv, pt16, do_ref, in_place: bool):
    """(acc_dk + dst16 @ q_ref, acc_dv + pt16 @ do_ref), both issued before one wait."""
    if not in_place:
        return (_accumulate(acc_dk, dst16, q_ref, False),
                _accumulate(acc_dv, pt16, do_ref, False))

    def run(refs):
        dk_ref, dv_ref = refs
        plgpu.wgmma(dk_ref, dst16, q_ref)
        plgpu.wgmma(dv_ref, pt16, do_ref)

    return pl.run_state(run)((plgpu.ACC.init(acc_dk), plgpu.ACC.init(acc_dv)))


def _consumer(refs, seg_refs, *, geo: Geometry, tiles: BackwardTiles, tile_blocks,
              in_place: bool):
    (k_ref, v_ref, dk_ref, dv_ref, dq_acc, k_all, v_all, own_ready, q_smem, do_smem, lse_smem,
     delta_smem, ready, q_free, ds_smem, ds_ready, dq_stage, done, batch, kv_head, tile,
     tile_base, wg) = refs
    bq, bkv, d = tiles.block_q, tiles.block_kv, k_ref.shape[-1]
    dtype = k_ref.dtype
    k_base = tile_base + wg * bkv
    own_rows = pl.ds(wg * bkv, bkv)
    k_smem, v_smem = k_all.at[own_rows], v_all.at[own_rows]
    first_block, end_block = tile_blocks
    per_head = end_block - first_block
    total = geo.group * per_head
    rows = (batch, pl.ds(k_base, bkv), kv_head)
    own = [(k_ref.at[rows], k_smem), (v_ref.at[rows], v_smem)]
    if seg_refs is not None:
        k_seg_ref, k_seg_smem, k_seg_ready, q_seg_smem = seg_refs
        own.append((k_seg_ref.at[batch, pl.ds(k_base, bkv)], k_seg_smem))
        own_ready = own_ready + (k_seg_ready,)
    _load_own(own, own_ready)
    per_col = plgpu.Layout.WGMMA.reduce(0)
    if seg_refs is not None:
        k_seg_rows = plgpu.load(k_seg_smem, layout=plgpu.Layout.WGMMA.reduce(1))

    def per_query(vectors, slot):
        return lax.broadcast_in_dim(plgpu.load(vectors.at[slot], layout=per_col), (bkv, bq), [1])

    def share_ds(step, dst16):
        """Writes this consumer's half of step's ds^T, then (if it owns the step) adds the dq
        partial of the step's query block into dq_acc."""
        buf = lax.rem(step, jnp.int32(2))
        owner = buf == wg

        @pl.when(jnp.logical_and(jnp.logical_not(owner), step >= 2))
        def _():  # the partner's product of step - 2 read this buffer: wait for its phase
            plgpu.barrier_wait(ds_ready.at[buf])

        ds_smem.at[buf, own_rows][...] = dst16
        plgpu.commit_smem()
        # this consumer's last reduce-add (an earlier step) has read the staging tile
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.barrier_arrive(ds_ready.at[buf])

        @pl.when(owner)
        def _():
            plgpu.barrier_wait(ds_ready.at[buf])
            (dq,) = _products([(ds_smem.at[buf].transpose((1, 0)), k_all)], (bq, d))
            g = lax.div(step, per_head)
            block = first_block + lax.rem(step, per_head)
            head = kv_head * geo.group + g
            dq_stage[...] = dq
            plgpu.commit_smem()
            q_rows = pl.ds(block * bq, bq)
            if in_place:
                plgpu.copy_smem_to_gmem(dq_stage, dq_acc.at[batch, q_rows, head],
                                        reduction_op="add")
            else:
                plgpu.copy_smem_to_gmem(dq_stage, dq_acc.at[tile, batch, q_rows, head])

    def step_fn(masked: bool, g, block, carry):
        step = g * per_head + (block - first_block)
        slot = lax.rem(step, jnp.int32(tiles.stages))
        for barrier in ready:
            plgpu.barrier_wait(barrier.at[slot])
        lse = per_query(lse_smem, slot)
        delta = per_query(delta_smem, slot)
        q_t = q_smem.at[slot].transpose((1, 0))
        do_t = do_smem.at[slot].transpose((1, 0))
        st, dpt = _products([(k_smem, q_t), (v_smem, do_t)], (bkv, bq))
        st, cap_grad = base2_scores(st, geo.sm_scale, geo.soft_cap)
        pt = jnp.exp2(st - lse)
        if masked:
            segs = (None, None)
            if seg_refs is not None:
                segs = (per_query(q_seg_smem, slot),
                        lax.broadcast_in_dim(k_seg_rows, (bkv, bq), [0]))
            visible = visibility_mask(geo, _iota((bkv, bq), 1, block * bq),
                                      _iota((bkv, bq), 0, k_base), *segs, check_len=False)
            if visible is not None:
                pt = jnp.where(visible, pt, 0.0)
        dst = pt * (dpt - delta)
        dst16 = (dst if cap_grad is None else dst * cap_grad).astype(dtype)
        share_ds(step, dst16)
        dk, dv = _dk_dv_together(carry[0], dst16, q_smem.at[slot], carry[1], pt.astype(dtype),
                                 do_smem.at[slot], in_place)
        if not in_place:
            plgpu.commit_smem()
        plgpu.barrier_arrive(q_free.at[slot])
        return dk, dv

    def skip(g, block, carry):
        """A step whose query block sees none of this consumer's keys: zeros for its ds^T half."""
        step = g * per_head + (block - first_block)
        slot = lax.rem(step, jnp.int32(tiles.stages))
        for barrier in ready:
            plgpu.barrier_wait(barrier.at[slot])
        share_ds(step, plgpu.layout_cast(jnp.full((bkv, bq), 0.0, dtype), plgpu.Layout.WGMMA))
        plgpu.barrier_arrive(q_free.at[slot])
        return carry

    zeros = plgpu.layout_cast(jnp.full((bkv, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    carry = (zeros, zeros)
    bounds = q_blocks(geo, k_base, bkv, bq)
    ranges = walk(geo, bounds, rows_walk_keys=False)
    for g in range(geo.group):
        carry = lax.fori_loop(first_block, bounds[0], lambda i, c, g=g: skip(g, i, c), carry)
        for masked, start, end in ranges:
            carry = lax.fori_loop(start, end, lambda i, c, g=g, masked=masked:
                                  step_fn(masked, g, i, c), carry)
        carry = lax.fori_loop(bounds[3], end_block, lambda i, c, g=g: skip(g, i, c), carry)

    # the phases of the partner's last steps this consumer has not waited for (one per buffer:
    # the last step of the other parity)
    for back in (1, 2):
        step = total - back

        @pl.when(jnp.logical_and(step >= 0, lax.rem(step, jnp.int32(2)) != wg))
        def _():
            plgpu.barrier_wait(ds_ready.at[lax.rem(step, jnp.int32(2))])

    # the partner's last dq product may still read this consumer's k tile
    plgpu.barrier_arrive(done)
    plgpu.barrier_wait(done)
    dk, dv = carry
    _write_parts(((k_smem, [dk_ref], dk * geo.sm_scale), (v_smem, [dv_ref], dv)), rows, dtype)


def backward_fused(q, k, v, do, lse, delta, q_seg=None, kv_seg=None, *, geo: Geometry,
                   tiles: BackwardTiles, interpret):
    """(dq float32 unscaled [B, T, H, D] (q's shape), dk, dv [B, Sp, Hkv, D] in k's dtype) from
    the arrays backward_dkv takes; dq times geo.sm_scale is the gradient."""
    b, _, hkv, d = k.shape
    h = q.shape[2]
    reason = fused_backward_unsupported_reason(d, tiles)
    if reason is not None:
        raise NotImplementedError(f"the one-kernel Mosaic GPU backward cannot take {reason}")
    bq, bkv, stages = tiles.block_q, tiles.block_kv, tiles.stages
    check_padded_lengths(geo, bq, CONSUMERS * bkv)
    n_tiles = geo.padded_kv // (CONSUMERS * bkv)
    segments = geo.has_segments
    in_place = not interpret

    def body(*flat):
        refs = list(flat)
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = _take(refs, 6)
        q_seg_ref, k_seg_ref = _take(refs, 2 if segments else -2)
        (dq_acc,) = _take(refs, 1)
        dk_ref, dv_ref = _take(refs, 2)
        (k_all, v_all, k_ready, v_ready, q_smem, do_smem, lse_smem, delta_smem, q_ready,
         do_ready, lse_ready, delta_ready, q_free, ds_smem, ds_ready, dq_stage,
         done) = _take(refs, 17)
        k_seg_smem2, k_seg_ready, q_seg_smem, q_seg_ready = _take(refs, 4 if segments else -4)
        tile = lax.axis_index("tile")
        batch, kv_head, wg = (lax.axis_index("batch"), lax.axis_index("head"),
                              lax.axis_index("wg"))
        tile_base = tile * (CONSUMERS * bkv)
        tile_blocks = (q_blocks(geo, tile_base, bkv, bq)[0],
                       q_blocks(geo, tile_base + (CONSUMERS - 1) * bkv, bkv, bq)[3])
        first_block = tile_blocks[0]
        per_head = tile_blocks[1] - first_block
        ready = (q_ready, do_ready, lse_ready, delta_ready) + ((q_seg_ready,) if segments else ())

        @pl.when(wg < CONSUMERS)
        def _():
            plgpu.set_max_registers(232, action="increase")
            refs = (k_ref, v_ref, dk_ref, dv_ref, dq_acc, k_all, v_all,
                    (k_ready.at[wg], v_ready.at[wg]), q_smem, do_smem, lse_smem, delta_smem,
                    ready, q_free, ds_smem, ds_ready, dq_stage, done, batch, kv_head, tile,
                    tile_base, wg)
            seg_refs = ((k_seg_ref, k_seg_smem2.at[wg], k_seg_ready.at[wg], q_seg_smem)
                        if segments else None)
            _consumer(refs, seg_refs, geo=geo, tiles=tiles, tile_blocks=tile_blocks,
                      in_place=in_place)

        @pl.when(wg == CONSUMERS)
        def _():
            plgpu.set_max_registers(40, action="decrease")
            produce_query_blocks(
                (q_ref, do_ref, lse_ref, delta_ref, q_seg_ref if segments else None),
                (q_smem, do_smem, lse_smem, delta_smem) + ((q_seg_smem,) if segments else ()),
                ready, q_free, batch=batch, kv_head=kv_head, first_block=first_block,
                per_head=per_head, group=geo.group, bq=bq, stages=stages)

    keys = CONSUMERS * bkv
    scratch = [
        plgpu.SMEM((keys, d), k.dtype, transforms=SWIZZLED),
        plgpu.SMEM((keys, d), k.dtype, transforms=SWIZZLED),
        plgpu.Barrier(num_barriers=CONSUMERS), plgpu.Barrier(num_barriers=CONSUMERS),
        *[plgpu.SMEM((stages, bq, d), q.dtype, transforms=SWIZZLED) for _ in range(2)],
        *[plgpu.SMEM((stages, bq), jnp.float32) for _ in range(2)],
        *[plgpu.Barrier(num_barriers=stages) for _ in range(4)],
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        plgpu.SMEM((2, keys, bq), q.dtype, transforms=SWIZZLED),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=2),
        plgpu.SMEM((bq, d), jnp.float32, transforms=SWIZZLED_F32),
        plgpu.Barrier(num_arrivals=CONSUMERS),
    ]
    if segments:
        scratch += [plgpu.SMEM((CONSUMERS, bkv), jnp.int32),
                    plgpu.Barrier(num_barriers=CONSUMERS),
                    plgpu.SMEM((stages, bq), jnp.int32), plgpu.Barrier(num_barriers=stages)]
    out = [jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2
    kernel = warp_specialized_kernel(body, out_type=out, scratch=scratch,
                                     grid=(n_tiles, hkv, b), grid_names=("tile", "head", "batch"),
                                     interpret=interpret)
    acc_shape = q.shape if in_place else (n_tiles, b, geo.padded_q, h, d)
    dq_acc = jax.new_ref(jnp.zeros(acc_shape, jnp.float32))
    with jax.named_scope(f"flash_dqkv_mosaic_block_q={bq}_block_kv={bkv}"):
        dk, dv = kernel(q, k, v, do, lse, delta, *((q_seg, kv_seg) if segments else ()), dq_acc)
    dq = jax.freeze(dq_acc)
    if not in_place:
        dq = dq.sum(0)[:, :q.shape[1]]
    return dq, dk, dv

