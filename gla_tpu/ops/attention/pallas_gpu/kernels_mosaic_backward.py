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
  group's heads are summed in the accumulators, so GQA needs no reduction afterwards. At head
  dim 256 (plan.splits_dkv_roles) the two consumers split the roles over one shared tile of keys
  instead: one accumulates dv (s^T, p^T, dv += p^T do), the other dk (s^T and dp^T, ds^T,
  dk += ds^T q), so that each holds one [64, 256] float32 accumulator.
Causal and window skipping as in the Triton kernels (blocks.py): blocks no row of a tile can see
are not streamed, blocks every row of a consumer sees take no mask. A logit soft cap multiplies
ds by its derivative (attention/scores.py). Rows that see no key (lse = 0 from the forward, every p
masked) give zero gradients. Keys at or past the true S are masked in dq; their dk/dv rows are
sliced away by the caller. With segment ids each side keeps its rows' ids and streams the other
side's beside its tiles, and every block is masked. Head dims 64, 128 and 256, bfloat16 / float16
(plan.mosaic_backward_unsupported_reason); docs/gpu_attention.md has the measurements.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gla_tpu.ops.attention.pallas_gpu.blocks import kv_blocks, q_blocks, visibility_mask, walk
from gla_tpu.ops.attention.pallas_gpu.kernels_mosaic_forward import (check_padded_lengths,
                                                                    warp_specialized_kernel)
from gla_tpu.ops.attention.pallas_gpu.plan import (CONSUMERS, BackwardTiles, Geometry,
                                                  splits_dkv_roles)
from gla_tpu.ops.attention.scores import base2_scores
from gla_tpu.ops.common.mosaic_gpu import SWIZZLED, SWIZZLED_64, release_step, ring_producer



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


def _write_parts(outputs, rows, dtype):
    """Each (shared tile, output refs, float32 value) written to its refs through the tile: one
    ref takes the value rounded to `dtype`; with two, the second takes what the first's rounding
    left, rounded too (ref 0 + ref 1 in float32 keeps 16 bits of the value's mantissa)."""
    values = [value for _, _, value in outputs]
    for part in range(len(outputs[0][1])):
        if part:  # the previous part's copies still read the tiles
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        rounded = [value.astype(dtype) for value in values]
        for (smem, _, _), value in zip(outputs, rounded):
            smem[...] = value
        plgpu.commit_smem()
        for smem, refs, _ in outputs:
            plgpu.copy_smem_to_gmem(smem, refs[part].at[rows], commit_group=False)
        plgpu.commit_smem_to_gmem_group()
        values = [v - r.astype(jnp.float32) for v, r in zip(values, rounded)]
    plgpu.wait_smem_to_gmem(0)


def _dq_consumer(refs, seg_refs, *, geo: Geometry, tiles: BackwardTiles, tile_blocks,
                 in_place: bool):
    """tile_blocks: the key blocks [first, end) the producer streams. seg_refs: None, or (q_seg_ref, q_seg_smem, q_seg_ready, k_seg_smem, k_seg_ready) with
    segment ids (the rows' own ids; the key blocks' ids streamed beside k and v)."""
    (q_ref, do_ref, lse_ref, delta_ref, dq_refs, q_smem, do_smem, lse_smem, delta_smem, own_ready,
     k_smem, v_smem, k_ready, v_ready, kv_free, batch, head, tile_base, wg, kc_smem,
     kc_ready) = refs
    bq, bkv, d = tiles.block_q, tiles.block_kv, q_ref.shape[-1]
    # the keys dq += ds k contracts over: k_smem itself, or its 64-byte-swizzled copy (32 keys)
    ready = (k_ready, v_ready) + ((kc_ready,) if kc_ready is not None else ())
    if seg_refs is not None:
        q_seg_ref, q_seg_smem, q_seg_ready, k_seg_smem, k_seg_ready = seg_refs
        ready += (k_seg_ready,)
    dtype = q_ref.dtype
    check_len = geo.kv_len != geo.padded_kv
    q_base = tile_base + wg * bq
    tile_first, tile_end = tile_blocks
    rows = (batch, pl.ds(q_base, bq), head)
    row_vec = (batch, head, pl.ds(q_base, bq))
    own = [(q_ref.at[rows], q_smem), (do_ref.at[rows], do_smem),
           (lse_ref.at[row_vec], lse_smem), (delta_ref.at[row_vec], delta_smem)]
    if seg_refs is not None:
        own.append((q_seg_ref.at[batch, pl.ds(q_base, bq)], q_seg_smem))
        own_ready = own_ready + (q_seg_ready,)
    _load_own(own, own_ready)
    per_row = plgpu.Layout.WGMMA.reduce(1)
    lse = lax.broadcast_in_dim(plgpu.load(lse_smem, layout=per_row), (bq, bkv), [0])
    delta = lax.broadcast_in_dim(plgpu.load(delta_smem, layout=per_row), (bq, bkv), [0])
    if seg_refs is not None:  # broadcast over the keys where a step masks
        q_seg_rows = plgpu.load(q_seg_smem, layout=per_row)

    def slot_of(step):
        return lax.rem(step - tile_first, jnp.int32(tiles.stages))

    def step_fn(masked: bool, step, dq):
        slot = slot_of(step)
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_wait(v_ready.at[slot])
        s, dp = _products([(q_smem, k_smem.at[slot].transpose((1, 0))),
                           (do_smem, v_smem.at[slot].transpose((1, 0)))], (bq, bkv))
        s, cap_grad = base2_scores(s, geo.sm_scale, geo.soft_cap)
        p = jnp.exp2(s - lse)
        if masked:
            segs = (None, None)
            if seg_refs is not None:
                plgpu.barrier_wait(k_seg_ready.at[slot])
                segs = (lax.broadcast_in_dim(q_seg_rows, (bq, bkv), [0]),
                        lax.broadcast_in_dim(plgpu.load(k_seg_smem.at[slot],
                                                        layout=plgpu.Layout.WGMMA.reduce(0)),
                                             (bq, bkv), [1]))
            visible = visibility_mask(geo, _iota((bq, bkv), 0, q_base),
                                      _iota((bq, bkv), 1, step * bkv), *segs,
                                      check_len=check_len)
            if visible is not None:
                p = jnp.where(visible, p, 0.0)
        ds = p * (dp - delta)
        ds = (ds if cap_grad is None else ds * cap_grad).astype(dtype)
        if kc_ready is not None:
            plgpu.barrier_wait(kc_ready.at[slot])
        dq = _accumulate(dq, ds, (kc_smem if kc_ready is not None else k_smem).at[slot],
                         in_place)
        if not in_place:  # interpret: the jnp.dot read k through the generic proxy; order it
            plgpu.commit_smem()  # before the TMA unit's refill of the slot
        plgpu.barrier_arrive(kv_free.at[slot])
        return dq

    def release(step, carry):
        release_step(slot_of(step), ready, (kv_free,))
        return carry

    bounds = kv_blocks(geo, q_base, bq, bkv)
    dq = plgpu.layout_cast(jnp.full((bq, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    lax.fori_loop(tile_first, bounds[0], release, None)  # blocks only the other consumer needs
    for masked, start, end in walk(geo, bounds, rows_walk_keys=True):
        dq = lax.fori_loop(start, end, lambda i, c, masked=masked: step_fn(masked, i, c), dq)
    lax.fori_loop(bounds[3], tile_end, release, None)

    _write_parts([(q_smem, dq_refs, dq * geo.sm_scale)], rows, dtype)


# The dk/dv kernel's consumer roles: both gradients of its own keys, or (head dim 256) one of the
# two over the tile's keys, which both consumers hold.
BOTH, DV, DK = "dk,dv", "dv", "dk"


def _dkv_consumer(refs, seg_refs, *, geo: Geometry, tiles: BackwardTiles, tile_blocks,
                  in_place: bool, role: str):
    """tile_blocks: the query blocks [first, end) of each head the producer streams, head after
    head. seg_refs: None, or (k_seg_ref, k_seg_smem, k_seg_ready, q_seg_smem) with segment ids (the
    keys' own ids; the query blocks' ids streamed with q, their barrier among `ready`)."""
    (k_ref, v_ref, dk_refs, dv_refs, k_smem, v_smem, own_ready, q_smem, do_smem, lse_smem,
     delta_smem, ready, q_free, batch, kv_head, tile_base, wg, done) = refs
    bq, keys, d = tiles.block_q, k_smem.shape[0], k_ref.shape[-1]
    dtype = k_ref.dtype
    k_base = tile_base + wg * keys if role == BOTH else tile_base
    first_block, end_block = tile_blocks
    per_head = end_block - first_block
    rows = (batch, pl.ds(k_base, keys), kv_head)
    own = [(k_ref.at[rows], k_smem), (v_ref.at[rows], v_smem)]
    if seg_refs is not None:
        k_seg_ref, k_seg_smem, k_seg_ready, q_seg_smem = seg_refs
        own.append((k_seg_ref.at[batch, pl.ds(k_base, keys)], k_seg_smem))
        own_ready = own_ready + (k_seg_ready,)
    if role == BOTH:
        _load_own(own, own_ready)
    else:  # the dv role fetches k (and the ids), the dk role v; both wait for all
        for i, ((src, dst), barrier) in enumerate(zip(own, own_ready)):
            if (i == 1) == (role == DK):
                plgpu.copy_gmem_to_smem(src, dst, barrier)
        for barrier in own_ready:
            plgpu.barrier_wait(barrier)
    per_col = plgpu.Layout.WGMMA.reduce(0)
    if seg_refs is not None:  # broadcast over the queries where a step masks
        k_seg_rows = plgpu.load(k_seg_smem, layout=plgpu.Layout.WGMMA.reduce(1))

    def per_query(vectors, slot):
        return lax.broadcast_in_dim(plgpu.load(vectors.at[slot], layout=per_col), (keys, bq), [1])

    def step_fn(masked: bool, g, block, carry):
        step = g * per_head + (block - first_block)
        slot = lax.rem(step, jnp.int32(tiles.stages))
        for barrier in ready:
            plgpu.barrier_wait(barrier.at[slot])
        lse = per_query(lse_smem, slot)
        delta = per_query(delta_smem, slot) if role != DV else None
        q_t = q_smem.at[slot].transpose((1, 0))
        do_t = do_smem.at[slot].transpose((1, 0))
        if role == DK:  # s^T and dp^T, one wait
            st, dpt = _products([(k_smem, q_t), (v_smem, do_t)], (keys, bq))
        else:
            (st,) = _products([(k_smem, q_t)], (keys, bq))
        st, cap_grad = base2_scores(st, geo.sm_scale, geo.soft_cap)
        pt = jnp.exp2(st - lse)
        if masked:
            segs = (None, None)
            if seg_refs is not None:  # (query ids, key ids), [keys, bq] each
                segs = (per_query(q_seg_smem, slot),
                        lax.broadcast_in_dim(k_seg_rows, (keys, bq), [0]))
            # keys past kv_len only reach dk/dv rows the caller slices away: no length check
            visible = visibility_mask(geo, _iota((keys, bq), 1, block * bq),
                                      _iota((keys, bq), 0, k_base), *segs, check_len=False)
            if visible is not None:
                pt = jnp.where(visible, pt, 0.0)
        if role == DV:
            carry = (_accumulate(carry[0], pt.astype(dtype), do_smem.at[slot], in_place),)
        else:
            if role == BOTH:
                dv, dpt = _accumulate_and_product(carry[1], pt.astype(dtype), do_smem.at[slot],
                                                  v_smem, do_t, (keys, bq), in_place)
            dst = pt * (dpt - delta)
            dst = (dst if cap_grad is None else dst * cap_grad).astype(dtype)
            dk = _accumulate(carry[0], dst, q_smem.at[slot], in_place)
            carry = (dk, dv) if role == BOTH else (dk,)
        if not in_place:  # as in the dq kernel
            plgpu.commit_smem()
        plgpu.barrier_arrive(q_free.at[slot])
        return carry

    def release(g, block, carry):
        step = g * per_head + (block - first_block)
        release_step(lax.rem(step, jnp.int32(tiles.stages)), ready, (q_free,))
        return carry

    zeros = plgpu.layout_cast(jnp.full((keys, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    carry = (zeros, zeros) if role == BOTH else (zeros,)
    bounds = q_blocks(geo, k_base, keys, bq)
    ranges = walk(geo, bounds, rows_walk_keys=False)
    for g in range(geo.group):
        lax.fori_loop(first_block, bounds[0], lambda i, c, g=g: release(g, i, c), None)
        for masked, start, end in ranges:
            carry = lax.fori_loop(start, end, lambda i, c, g=g, masked=masked:
                                  step_fn(masked, g, i, c), carry)
        lax.fori_loop(bounds[3], end_block, lambda i, c, g=g: release(g, i, c), None)

    if role == BOTH:
        dk, dv = carry
        outputs = ((k_smem, dk_refs, dk * geo.sm_scale), (v_smem, dv_refs, dv))
    else:  # the partner reads both shared tiles until its last step: wait for it
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)
        outputs = (((v_smem, dv_refs, carry[0]),) if role == DV
                   else ((k_smem, dk_refs, carry[0] * geo.sm_scale),))
    _write_parts(outputs, rows, dtype)


def _kernel(body, *, out_type, scratch, grid, interpret):
    return warp_specialized_kernel(body, out_type=out_type, scratch=scratch, grid=grid,
                                   grid_names=("tile", "head", "batch"), interpret=interpret)


def _own_scratch(rows: int, d: int, dtype, n_vectors: int, owners: int = CONSUMERS):
    """Each owner's two [rows, D] tiles, `n_vectors` [rows] float32 rows, and a barrier each
    (owners: the consumers, or 1 where they share the tiles)."""
    tiles = [plgpu.SMEM((owners, rows, d), dtype, transforms=SWIZZLED) for _ in range(2)]
    vectors = [plgpu.SMEM((owners, rows), jnp.float32) for _ in range(n_vectors)]
    barriers = [plgpu.Barrier(num_barriers=owners) for _ in range(len(tiles + vectors))]
    return tiles + vectors + barriers


def _check_parts(parts: int) -> None:
    if parts not in (1, 2):
        raise ValueError(f"parts={parts!r}: the backward writes its gradients in 1 or 2 parts.")


def _take(refs: list, n: int) -> list:
    """The next n of a kernel body's flat refs (popped from the front); [None] * n for n < 0
    (a group of optional refs the kernel does not have)."""
    if n < 0:
        return [None] * -n
    taken = refs[:n]
    del refs[:n]
    return taken


def backward_dq(q, k, v, do, lse, delta, q_seg=None, kv_seg=None, *, geo: Geometry,
                tiles: BackwardTiles, interpret, parts: int = 1):
    """dq [B, Tp, H, D] in q's dtype from q, do [B, Tp, H, D], k, v [B, Sp, Hkv, D], the base-2
    lse and delta [B, H, Tp] and the segment ids q_seg [B, Tp], kv_seg [B, Sp] (None without).
    The kernel walks geo.padded_q (Tp) rows, a multiple of 2 * block_q, and geo.padded_kv (Sp)
    keys, of block_kv; the arrays may be shorter (TMA reads zeros past their ends and drops the
    rows of dq past T). parts = 2: a list [hi, lo] of two such arrays, whose float32 sum is dq
    to 16 bits (_write_parts; ring attention's float32 block gradients)."""
    _check_parts(parts)
    b, _, h, d = q.shape
    bq, bkv, stages = tiles.block_q, tiles.block_kv, tiles.stages
    n_tiles = check_padded_lengths(geo, CONSUMERS * bq, bkv)
    segments = geo.has_segments
    # dq += ds k contracts over the block's keys. wgmma contracts a 128-byte-swizzled operand in
    # groups of 64, so 32-key blocks (head dim 256) take a second copy of k with the 64-byte
    # swizzle for it (s = q k^T reads k transposed, which layout inference refuses with that
    # swizzle).
    contraction_copy = bkv < 64

    # Shared memory, by name in allocation order. Mosaic GPU aligns every buffer to 1 KiB, so with
    # the second copy of k (head dim 256, where the unpacked vectors took 231,552 of the 232,448
    # bytes and 233,632 with segment ids) the small vectors share buffers: lse and delta one [CONSUMERS, 2, block_q], the segment ids one [CONSUMERS +
    # stages, max(block_q, block_kv)] (the consumers' rows, then the ring's key blocks).
    pack = contraction_copy
    vectors = ({"vec_smem2": plgpu.SMEM((CONSUMERS, 2, bq), jnp.float32)} if pack else
               {"lse_smem2": plgpu.SMEM((CONSUMERS, bq), jnp.float32),
                "delta_smem2": plgpu.SMEM((CONSUMERS, bq), jnp.float32)})
    buffers = {
        "q_smem2": plgpu.SMEM((CONSUMERS, bq, d), q.dtype, transforms=SWIZZLED),
        "do_smem2": plgpu.SMEM((CONSUMERS, bq, d), q.dtype, transforms=SWIZZLED),
        **vectors,
        **{name: plgpu.Barrier(num_barriers=CONSUMERS)
           for name in ("q_ready", "do_ready", "lse_ready", "delta_ready")},
        "k_smem": plgpu.SMEM((stages, bkv, d), k.dtype, transforms=SWIZZLED),
        "v_smem": plgpu.SMEM((stages, bkv, d), k.dtype, transforms=SWIZZLED),
        "k_ready": plgpu.Barrier(num_barriers=stages),
        "v_ready": plgpu.Barrier(num_barriers=stages),
        "kv_free": plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
    }
    if contraction_copy:
        buffers.update(kc_smem=plgpu.SMEM((stages, bkv, d), k.dtype, transforms=SWIZZLED_64),
                       kc_ready=plgpu.Barrier(num_barriers=stages))
    if segments and pack:
        buffers.update(ids_smem=plgpu.SMEM((CONSUMERS + stages, max(bq, bkv)), jnp.int32),
                       q_seg_ready=plgpu.Barrier(num_barriers=CONSUMERS),
                       k_seg_ready=plgpu.Barrier(num_barriers=stages))
    elif segments:  # the rows' own ids; the key blocks' ids beside k and v
        buffers.update(q_seg_smem2=plgpu.SMEM((CONSUMERS, bq), jnp.int32),
                       q_seg_ready=plgpu.Barrier(num_barriers=CONSUMERS),
                       k_seg_smem=plgpu.SMEM((stages, bkv), jnp.int32),
                       k_seg_ready=plgpu.Barrier(num_barriers=stages))
    names = list(buffers)

    def body(*flat):
        refs = list(flat)
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = _take(refs, 6)
        q_seg_ref, k_seg_ref = _take(refs, 2 if segments else -2)
        dq_refs = _take(refs, parts)
        r = dict.fromkeys(("kc_smem", "kc_ready", "q_seg_smem2", "q_seg_ready", "k_seg_smem",
                           "k_seg_ready"))
        r.update(zip(names, refs))
        if pack:  # views of the shared vector buffers, as the unpacked ones
            r["lse_smem2"], r["delta_smem2"] = r["vec_smem2"].at[:, 0], r["vec_smem2"].at[:, 1]
            if segments:
                ids = r["ids_smem"]
                r["q_seg_smem2"] = ids.at[pl.ds(0, CONSUMERS), pl.ds(0, bq)]
                r["k_seg_smem"] = ids.at[pl.ds(CONSUMERS, stages), pl.ds(0, bkv)]
        sm = types.SimpleNamespace(**r)
        tile = lax.axis_index("tile")
        if geo.causal:  # the tiles with the most keys first
            tile = n_tiles - 1 - tile
        batch, head, wg = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("wg")
        tile_base = tile * (CONSUMERS * bq)
        # the key blocks of the tile: from its first consumer's first to its last consumer's end
        tile_blocks = (kv_blocks(geo, tile_base, bq, bkv)[0],
                       kv_blocks(geo, tile_base + (CONSUMERS - 1) * bq, bq, bkv)[3])

        @pl.when(wg < CONSUMERS)
        def _():
            plgpu.set_max_registers(232, action="increase")
            own_ready = tuple(x.at[wg] for x in (sm.q_ready, sm.do_ready, sm.lse_ready,
                                                 sm.delta_ready))
            refs = (q_ref, do_ref, lse_ref, delta_ref, dq_refs, sm.q_smem2.at[wg],
                    sm.do_smem2.at[wg], sm.lse_smem2.at[wg], sm.delta_smem2.at[wg], own_ready,
                    sm.k_smem, sm.v_smem, sm.k_ready, sm.v_ready, sm.kv_free, batch, head,
                    tile_base, wg, sm.kc_smem, sm.kc_ready)
            seg_refs = ((q_seg_ref, sm.q_seg_smem2.at[wg], sm.q_seg_ready.at[wg], sm.k_seg_smem,
                         sm.k_seg_ready) if segments else None)
            _dq_consumer(refs, seg_refs, geo=geo, tiles=tiles, tile_blocks=tile_blocks,
                         in_place=not interpret)

        @pl.when(wg == CONSUMERS)
        def _():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = lax.div(head, jnp.int32(geo.group))

            def load(step, slot):
                step = tile_blocks[0] + step  # the key block
                keys = (batch, pl.ds(step * bkv, bkv), kv_head)
                plgpu.copy_gmem_to_smem(k_ref.at[keys], sm.k_smem.at[slot], sm.k_ready.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[keys], sm.v_smem.at[slot], sm.v_ready.at[slot])
                if contraction_copy:
                    plgpu.copy_gmem_to_smem(k_ref.at[keys], sm.kc_smem.at[slot],
                                            sm.kc_ready.at[slot])
                if segments:
                    plgpu.copy_gmem_to_smem(k_seg_ref.at[batch, pl.ds(step * bkv, bkv)],
                                            sm.k_seg_smem.at[slot], sm.k_seg_ready.at[slot])

            ring_producer(load, steps=tile_blocks[1] - tile_blocks[0], stages=stages,
                          free=(sm.kv_free,))

    scratch = [buffers[name] for name in names]
    out = [jax.ShapeDtypeStruct(q.shape, q.dtype)] * parts
    kernel = _kernel(body, out_type=out, scratch=scratch, grid=(n_tiles, h, b),
                     interpret=interpret)
    with jax.named_scope(f"flash_dq_mosaic_block_q={bq}_block_kv={bkv}"):
        dq = kernel(q, k, v, do, lse, delta, *((q_seg, kv_seg) if segments else ()))
    return dq[0] if parts == 1 else dq


def produce_query_blocks(sources, buffers, ready, free, *, batch, kv_head, first_block,
                         per_head: int, group: int, bq: int, stages: int):
    """The producer warpgroup of a kv-major backward kernel (dk/dv, and the one-kernel
    backward): streams, for each head of the kv head's query group and each of its per_head
    query blocks from first_block, the block's q and do rows, its lse and delta, and (sources'
    last, None without segment ids) its query ids into the `stages`-slot rings `buffers`, each
    copy arriving on its barrier in `ready`; `free` holds the consumers' release barrier.
    sources: (q, do [B, T, H, D], lse, delta [B, H, T], q ids [B, T] or None) refs in HBM."""
    q_ref, do_ref, lse_ref, delta_ref, q_seg_ref = sources

    def load(step, slot):
        head = kv_head * group + lax.div(step, per_head)
        block = first_block + lax.rem(step, per_head)
        rows = (batch, pl.ds(block * bq, bq), head)
        vec = (batch, head, pl.ds(block * bq, bq))
        srcs = [q_ref.at[rows], do_ref.at[rows], lse_ref.at[vec], delta_ref.at[vec]]
        if q_seg_ref is not None:
            srcs.append(q_seg_ref.at[batch, pl.ds(block * bq, bq)])
        for src, dst, barrier in zip(srcs, buffers, ready, strict=True):
            plgpu.copy_gmem_to_smem(src, dst.at[slot], barrier.at[slot])

    ring_producer(load, steps=group * per_head, stages=stages, free=(free,))


def backward_dkv(q, k, v, do, lse, delta, q_seg=None, kv_seg=None, *, geo: Geometry,
                 tiles: BackwardTiles, interpret, parts: int = 1):
    """(dk, dv) [B, Sp, Hkv, D] in k's dtype, summed over each kv head's query group; segment ids
    as backward_dq's. geo.padded_kv (Sp) must be a multiple of 2 * block_kv, geo.padded_q of
    block_q; the arrays may be shorter, as backward_dq's. parts = 2: dk and dv each a list
    [hi, lo], as backward_dq's."""
    _check_parts(parts)
    b, _, hkv, d = k.shape
    bq, bkv, stages = tiles.block_q, tiles.block_kv, tiles.stages
    check_padded_lengths(geo, bq, CONSUMERS * bkv)
    n_tiles = geo.padded_kv // (CONSUMERS * bkv)
    split = splits_dkv_roles(d)
    segments = geo.has_segments
    owners, own_rows = (1, CONSUMERS * bkv) if split else (CONSUMERS, bkv)

    def body(*flat):
        refs = list(flat)
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = _take(refs, 6)
        q_seg_ref, k_seg_ref = _take(refs, 2 if segments else -2)
        dk_refs, dv_refs = _take(refs, parts), _take(refs, parts)
        (k_smem2, v_smem2, k_ready, v_ready, q_smem, do_smem, lse_smem, delta_smem, q_ready,
         do_ready, lse_ready, delta_ready, q_free) = _take(refs, 13)
        (done,) = _take(refs, 1 if split else -1)
        k_seg_smem2, k_seg_ready, q_seg_smem, q_seg_ready = _take(refs, 4 if segments else -4)
        tile = lax.axis_index("tile")
        batch, kv_head, wg = (lax.axis_index("batch"), lax.axis_index("head"),
                              lax.axis_index("wg"))
        tile_base = tile * (CONSUMERS * bkv)
        # the query blocks of one head the tile visits: from its first consumer's first to its
        # last consumer's end (under the role split both see the whole tile)
        if split:
            tile_blocks = q_blocks(geo, tile_base, CONSUMERS * bkv, bq)[::3]
        else:
            tile_blocks = (q_blocks(geo, tile_base, bkv, bq)[0],
                           q_blocks(geo, tile_base + (CONSUMERS - 1) * bkv, bkv, bq)[3])
        first_block = tile_blocks[0]
        per_head = tile_blocks[1] - first_block
        ready = (q_ready, do_ready, lse_ready, delta_ready) + ((q_seg_ready,) if segments else ())

        def consumer(owner, role):
            refs = (k_ref, v_ref, dk_refs, dv_refs, k_smem2.at[owner], v_smem2.at[owner],
                    (k_ready.at[owner], v_ready.at[owner]), q_smem, do_smem, lse_smem,
                    delta_smem, ready, q_free, batch, kv_head, tile_base, wg, done)
            seg_refs = ((k_seg_ref, k_seg_smem2.at[owner], k_seg_ready.at[owner], q_seg_smem)
                        if segments else None)
            _dkv_consumer(refs, seg_refs, geo=geo, tiles=tiles, tile_blocks=tile_blocks,
                          in_place=not interpret, role=role)

        @pl.when(wg < CONSUMERS)
        def _():
            plgpu.set_max_registers(232, action="increase")
            if split:
                pl.when(wg == 0)(lambda: consumer(0, DV))
                pl.when(wg == 1)(lambda: consumer(0, DK))
            else:
                consumer(wg, BOTH)

        @pl.when(wg == CONSUMERS)
        def _():
            plgpu.set_max_registers(40, action="decrease")
            produce_query_blocks(
                (q_ref, do_ref, lse_ref, delta_ref, q_seg_ref if segments else None),
                (q_smem, do_smem, lse_smem, delta_smem) + ((q_seg_smem,) if segments else ()),
                ready, q_free, batch=batch, kv_head=kv_head, first_block=first_block,
                per_head=per_head, group=geo.group, bq=bq, stages=stages)

    scratch = _own_scratch(own_rows, d, k.dtype, n_vectors=0, owners=owners) + [
        *[plgpu.SMEM((stages, bq, d), q.dtype, transforms=SWIZZLED) for _ in range(2)],
        *[plgpu.SMEM((stages, bq), jnp.float32) for _ in range(2)],
        *[plgpu.Barrier(num_barriers=stages) for _ in range(4)],
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages)]
    if split:  # the role split's consumers finish together before reusing the shared tiles
        scratch.append(plgpu.Barrier(num_arrivals=CONSUMERS))
    if segments:  # the keys' own ids; the query blocks' ids beside q
        scratch += [plgpu.SMEM((owners, own_rows), jnp.int32), plgpu.Barrier(num_barriers=owners),
                    plgpu.SMEM((stages, bq), jnp.int32), plgpu.Barrier(num_barriers=stages)]
    out = [jax.ShapeDtypeStruct(k.shape, k.dtype)] * (2 * parts)
    kernel = _kernel(body, out_type=out, scratch=scratch, grid=(n_tiles, hkv, b),
                     interpret=interpret)
    with jax.named_scope(f"flash_dkv_mosaic_block_q={bq}_block_kv={bkv}"):
        grads = kernel(q, k, v, do, lse, delta, *((q_seg, kv_seg) if segments else ()))
    if parts == 1:
        return tuple(grads)
    return grads[:parts], grads[parts:]
