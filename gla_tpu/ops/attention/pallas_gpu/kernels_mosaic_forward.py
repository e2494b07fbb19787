"""Flash attention forward for Hopper in Pallas Mosaic GPU: wgmma, TMA and warp specialization.

One block per (query tile, head, batch); a tile is 2 x block_q query rows. The block runs three
warpgroups:
- two consumers, one per block_q rows: S = Q K^T on the tensor cores (wgmma), online softmax in
  registers, O += P V (wgmma); they take turns on the tensor cores (a two-party barrier, "ping-pong"
  as in FlashAttention-3) so one's softmax overlaps the other's matmuls;
- one producer: copies K and V blocks of the tile's kv head into a ring of `stages` shared-memory
  slots with the TMA unit, and refills a slot once both consumers have released it.

Outputs match the Triton forward exactly in meaning, so the Triton backward consumes them: o in
q's dtype and the base-2 log-sum-exp lse [B, H, Tp] (0 for a row that sees no key, whose o is 0).
Causal masking is bottom-right (key j visible to query i iff j <= i + S - T), a local window
bounds the keys on both sides, and keys at or past the true S are masked; the producer streams
only the key blocks some row of the tile sees, and each consumer masks only the blocks that need
it (blocks.py). With segment ids each consumer holds its rows' ids and the producer streams the
key blocks' ids beside K and V; every block is then masked. A logit soft cap takes the scores
through c tanh(s / c) (attention/scores.py). float32 and head dims other than
64 / 128 / 256 take the Triton forward (plan.mosaic_forward_unsupported_reason).
kernels_mosaic_forward_persistent.py runs the same per-tile code (`walk_tile`, `epilogue`) with one
block per SM over a list of tiles.
docs/gpu_attention.md has the design and the measurements.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gla_tpu.ops.attention.pallas_gpu.blocks import kv_blocks, visibility_mask, walk
from gla_tpu.ops.attention.pallas_gpu.plan import CONSUMERS, ForwardTiles, Geometry
from gla_tpu.ops.attention.scores import base2_scores
from gla_tpu.ops.common.mosaic_gpu import (SWIZZLED, interpret_params, release_step,
                                           ring_producer)



def check_padded_lengths(geo: Geometry, query_multiple: int, key_multiple: int) -> int:
    """The number of query tiles; ValueError unless the geometry's padded lengths are multiples
    of the tiles."""
    if geo.padded_q % query_multiple or geo.padded_kv % key_multiple:
        raise ValueError(f"padded lengths {geo.padded_q}, {geo.padded_kv} must be multiples of "
                         f"{query_multiple}, {key_multiple}")
    return geo.padded_q // query_multiple


def warp_specialized_kernel(body, *, out_type, scratch, grid, grid_names, interpret):
    """plgpu.kernel of the attention kernels' shape: CONSUMERS consumer warpgroups and one
    producer ("wg"), approximate math; `interpret`: False, True (GPU interpret mode) or an
    InterpretGPUParams (the tests' race detector)."""
    return plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=grid_names,
        num_threads=CONSUMERS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(interpret))


def take_turn(turn):
    """Rendezvous of the two consumers on the tensor-core turn barrier."""
    plgpu.barrier_arrive(turn)
    plgpu.barrier_wait(turn)


def _row_broadcast(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def _consumer(refs, seg_refs, *, geo: Geometry, tiles: ForwardTiles, tile_blocks,
              in_place: bool):
    """tile_blocks: the key blocks [first, end) the producer streams (slot (block - first) mod
    stages). seg_refs: None, or (q_seg_ref, q_seg_smem, q_seg_ready, k_seg_smem, k_seg_ready)
    with segment ids."""
    (q_ref, o_ref, lse_ref, qo_smem, lse_smem, k_smem, v_smem, q_ready, k_ready, v_ready,
     k_free, v_free, turn, batch, head, tile_base, wg) = refs
    bq = tiles.block_q
    q_base = tile_base + wg * bq
    plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_base, bq), head], qo_smem, q_ready)
    q_seg_rows = query_ids(seg_refs, batch, q_base, bq)
    plgpu.barrier_wait(q_ready)
    ring = (k_smem, v_smem, k_ready, v_ready, k_free, v_free, turn)
    acc, m, l = walk_tile(qo_smem, ring, seg_refs, q_seg_rows, q_base=q_base, wg=wg,
                          tile_blocks=tile_blocks, ring_base=0, geo=geo, tiles=tiles,
                          dtype=q_ref.dtype, in_place=in_place)
    epilogue(acc, m, l, qo_smem, lse_smem, o_ref, lse_ref, batch, head, q_base, geo=geo)
    plgpu.wait_smem_to_gmem(0)


def query_ids(seg_refs, batch, q_base, bq):
    """The consumer's rows' segment ids in registers (None without segment ids)."""
    if seg_refs is None:
        return None
    q_seg_ref, q_seg_smem, q_seg_ready, _, _ = seg_refs
    plgpu.copy_gmem_to_smem(q_seg_ref.at[batch, pl.ds(q_base, bq)], q_seg_smem, q_seg_ready)
    plgpu.barrier_wait(q_seg_ready)
    return plgpu.load(q_seg_smem, layout=plgpu.Layout.WGMMA.reduce(1))


def walk_tile(q_smem, ring, seg_refs, q_seg_rows, *, q_base, wg, tile_blocks, ring_base, geo,
              tiles: ForwardTiles, dtype, in_place: bool):
    """One consumer's online softmax over the key blocks of its tile: (acc [bq, D], m, l [bq])
    float32. Key block b of the tile sits in ring slot (ring_base + b - first) mod stages."""
    k_smem, v_smem, k_ready, v_ready, k_free, v_free, turn = ring
    bq, bkv, d = tiles.block_q, tiles.block_kv, q_smem.shape[-1]
    check_len = geo.kv_len != geo.padded_kv
    tile_first, tile_end = tile_blocks
    k_seg_smem = k_seg_ready = None
    if seg_refs is not None:
        _, _, _, k_seg_smem, k_seg_ready = seg_refs

    wgmma_rows = plgpu.Layout.WGMMA.reduce(1)
    m = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), wgmma_rows)
    l = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), wgmma_rows)
    acc = plgpu.layout_cast(jnp.full((bq, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)

    def slot_of(step):
        offset = step - tile_first if isinstance(ring_base, int) and ring_base == 0 else (
            step - tile_first + ring_base)
        return lax.rem(offset, jnp.int32(tiles.stages))

    def step_fn(masked: bool, step, carry):
        acc, m, l = carry
        slot = slot_of(step)
        plgpu.barrier_wait(k_ready.at[slot])

        def scores(s_ref):  # s = q k^T, [bq, bkv] float32
            plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
            take_turn(turn)
            return s_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((bq, bkv), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
        s, _ = base2_scores(s, geo.sm_scale, geo.soft_cap)  # base 2: p = exp2(s - m)
        if masked:
            q_pos = q_base + plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0,
                                                    layout=plgpu.Layout.WGMMA)
            k_pos = step * bkv + plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1,
                                                        layout=plgpu.Layout.WGMMA)
            segs = (None, None)
            if seg_refs is not None:  # the slot's ids stay until v_free: read them now
                plgpu.barrier_wait(k_seg_ready.at[slot])
                k_seg = lax.broadcast_in_dim(
                    plgpu.load(k_seg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0)),
                    (bq, bkv), [1])
                segs = (_row_broadcast(q_seg_rows, (bq, bkv)), k_seg)
            visible = visibility_mask(geo, q_pos, k_pos, *segs, check_len=check_len)
            if visible is not None:
                s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        # a row that has seen no key keeps max -inf: shift it by 0 so exp2 gives 0, not NaN
        m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(m - m_shift)
        p = jnp.exp2(s - _row_broadcast(m_shift, s.shape))
        l = l * alpha + p.sum(axis=1)
        p16 = p.astype(dtype)
        acc = acc * _row_broadcast(alpha, acc.shape)
        acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
        plgpu.barrier_arrive(turn)  # softmax done: the other consumer may take the tensor cores
        plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_wait(turn)

        if in_place:  # O += P V in the accumulator registers
            def accumulate(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

            acc = pl.run_state(accumulate)(plgpu.ACC.init(acc))
        else:  # GPU interpret mode runs neither ACC.init nor wgmma from registers
            acc = acc + jnp.dot(p16, v_smem[slot], preferred_element_type=jnp.float32)
            # that read of V went through the generic proxy (wgmma's, on the GPU, through the
            # async one): fence it before the TMA may refill the slot
            plgpu.commit_smem()
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l

    def release_only(step, carry):
        """A step the other consumer needs and this one does not: free its slots, keep turns.

        It still waits for the loads, so that each consumer sees every phase of every barrier."""
        release_step(slot_of(step), (k_ready, v_ready) + ((k_seg_ready,) if seg_refs else ()),
                     (k_free, v_free))
        take_turn(turn)
        take_turn(turn)
        return carry

    pl.when(wg == 1)(lambda: take_turn(turn))  # consumer 1 starts one turn behind consumer 0
    bounds = kv_blocks(geo, q_base, bq, bkv)
    lax.fori_loop(tile_first, bounds[0], release_only, None)  # blocks only the other consumer needs
    carry = (acc, m, l)
    for masked, start, end in walk(geo, bounds, rows_walk_keys=True):
        carry = lax.fori_loop(start, end, lambda i, c, masked=masked: step_fn(masked, i, c), carry)
    lax.fori_loop(bounds[3], tile_end, release_only, None)
    pl.when(wg == 0)(lambda: take_turn(turn))
    return carry


def epilogue(acc, m, l, o_smem, lse_smem, o_ref, lse_ref, batch, head, q_base, *, geo):
    """o = acc / l and the base-2 lse of the consumer's rows, staged in o_smem and lse_smem and
    copied out by TMA (the caller waits for the copies)."""
    bq = o_smem.shape[0]
    seen = l > 0.0
    l_safe = jnp.where(seen, l, 1.0)
    o = acc * _row_broadcast(1.0 / l_safe, acc.shape)
    o_smem[...] = o.astype(o_smem.dtype)
    lse_smem[...] = jnp.where(seen, m + jnp.log2(l_safe), geo.empty_row_lse)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[batch, pl.ds(q_base, bq), head])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(q_base, bq)])


def kv_block_loader(kv_refs, seg_refs, *, geo: Geometry, block_kv: int, batch, head, first):
    """load(step, slot): the TMA copies of key block first + step of the head's kv head (and its
    segment ids) into ring slot `slot`. kv_refs: (k_ref, v_ref, k_smem, v_smem, k_ready,
    v_ready); seg_refs: None, or (k_seg_ref, k_seg_smem, k_seg_ready)."""
    k_ref, v_ref, k_smem, v_smem, k_ready, v_ready = kv_refs
    kv_head = lax.div(head, jnp.int32(geo.group))

    def load(step, slot):
        step = first + step  # the key block
        rows = (batch, pl.ds(step * block_kv, block_kv), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])
        if seg_refs is not None:
            k_seg_ref, k_seg_smem, k_seg_ready = seg_refs
            plgpu.copy_gmem_to_smem(k_seg_ref.at[batch, pl.ds(step * block_kv, block_kv)],
                                    k_seg_smem.at[slot], k_seg_ready.at[slot])

    return load


def _producer(refs, seg_refs, *, geo: Geometry, tiles: ForwardTiles, tile_blocks):
    """seg_refs: None, or (k_seg_ref, k_seg_smem, k_seg_ready) with segment ids."""
    (k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_free, v_free, batch, head) = refs
    tile_first, tile_end = tile_blocks
    load = kv_block_loader((k_ref, v_ref, k_smem, v_smem, k_ready, v_ready), seg_refs, geo=geo,
                           block_kv=tiles.block_kv, batch=batch, head=head, first=tile_first)
    ring_producer(load, steps=tile_end - tile_first, stages=tiles.stages, free=(k_free, v_free))


def scratch_types(dtype, head_dim: int, tiles: ForwardTiles, segments: bool,
                  output_tiles: bool = False) -> list:
    """The forward's shared memory and barriers, in the order its body unpacks them: q (and o,
    unless output_tiles), lse, the K/V ring, q_ready, k_ready, v_ready, k_free, v_free, turn;
    with output_tiles o's own tiles; with segment ids the consumers' and the key blocks' ids and
    their barriers."""
    bq, bkv, stages, d = tiles.block_q, tiles.block_kv, tiles.stages, head_dim
    scratch = [
        plgpu.SMEM((CONSUMERS, bq, d), dtype, transforms=SWIZZLED),  # q (and o)
        plgpu.SMEM((CONSUMERS, bq), jnp.float32),  # lse
        plgpu.SMEM((stages, bkv, d), dtype, transforms=SWIZZLED),  # K
        plgpu.SMEM((stages, bkv, d), dtype, transforms=SWIZZLED),  # V
        plgpu.Barrier(num_barriers=CONSUMERS),  # q_ready
        plgpu.Barrier(num_barriers=stages),  # k_ready
        plgpu.Barrier(num_barriers=stages),  # v_ready
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # k_free
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # v_free
        plgpu.Barrier(num_arrivals=CONSUMERS),  # turn
    ]
    if output_tiles:
        scratch.append(plgpu.SMEM((CONSUMERS, bq, d), dtype, transforms=SWIZZLED))  # o
    if segments:
        scratch += [
            plgpu.SMEM((CONSUMERS, bq), jnp.int32),  # the consumers' query ids
            plgpu.SMEM((stages, bkv), jnp.int32),  # the key blocks' ids, beside K and V
            plgpu.Barrier(num_barriers=CONSUMERS),  # q_seg_ready
            plgpu.Barrier(num_barriers=stages),  # k_seg_ready
        ]
    return scratch


def forward(q, k, v, q_seg=None, kv_seg=None, *, geo: Geometry, tiles: ForwardTiles,
            interpret: bool):
    """q [B, Tp, H, D], k/v [B, Sp, Hkv, D], segment ids q_seg [B, Tp], kv_seg [B, Sp] int32 or
    None -> (o [B, Tp, H, D], lse [B, H, Tp] float32).

    The kernel walks geo.padded_q rows and geo.padded_kv keys, multiples of 2 * block_q and of
    block_kv; q, k, v may be that long (entry.py pads) or shorter (its TMA copies read zeros past
    their ends and drop the rows of o past T).
    """
    b, _, h, d = q.shape
    tp = geo.padded_q
    bq, bkv = tiles.block_q, tiles.block_kv
    n_tiles = check_padded_lengths(geo, tiles.query_multiple, bkv)

    segments = geo.has_segments

    def body(*refs):
        if segments:
            (q_ref, k_ref, v_ref, q_seg_ref, k_seg_ref, o_ref, lse_ref, qo_smem2, lse_smem2,
             k_smem, v_smem, q_ready, k_ready, v_ready, k_free, v_free, turn, q_seg_smem2,
             k_seg_smem, q_seg_ready, k_seg_ready) = refs
        else:
            (q_ref, k_ref, v_ref, o_ref, lse_ref, qo_smem2, lse_smem2, k_smem, v_smem, q_ready,
             k_ready, v_ready, k_free, v_free, turn) = refs
        tile = lax.axis_index("tile")
        if geo.causal:  # the longest tiles (most keys) first
            tile = n_tiles - 1 - tile
        batch, head, wg = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("wg")
        tile_base = tile * tiles.query_multiple
        # the key blocks of the tile: from its first consumer's first to its last consumer's end
        tile_blocks = (kv_blocks(geo, tile_base, bq, bkv)[0],
                       kv_blocks(geo, tile_base + bq, bq, bkv)[3])

        @pl.when(wg < CONSUMERS)
        def _():
            plgpu.set_max_registers(232, action="increase")
            refs = (q_ref, o_ref, lse_ref, qo_smem2.at[wg], lse_smem2.at[wg], k_smem, v_smem,
                    q_ready.at[wg], k_ready, v_ready, k_free, v_free, turn, batch, head,
                    tile_base, wg)
            seg_refs = ((q_seg_ref, q_seg_smem2.at[wg], q_seg_ready.at[wg], k_seg_smem,
                         k_seg_ready) if segments else None)
            _consumer(refs, seg_refs, geo=geo, tiles=tiles, tile_blocks=tile_blocks,
                      in_place=not interpret)

        @pl.when(wg == CONSUMERS)
        def _():
            plgpu.set_max_registers(40, action="decrease")
            refs = (k_ref, v_ref, k_smem, v_smem, k_ready, v_ready, k_free, v_free, batch, head)
            seg_refs = (k_seg_ref, k_seg_smem, k_seg_ready) if segments else None
            _producer(refs, seg_refs, geo=geo, tiles=tiles, tile_blocks=tile_blocks)

    scratch = scratch_types(q.dtype, d, tiles, segments)
    kernel = warp_specialized_kernel(
        body, out_type=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                        jax.ShapeDtypeStruct((b, h, tp), jnp.float32)],
        scratch=scratch, grid=(n_tiles, h, b), grid_names=("tile", "head", "batch"),
        interpret=interpret)
    with jax.named_scope(f"flash_fwd_mosaic_block_q={bq}_block_kv={bkv}"):
        o, lse = kernel(q, k, v, *((q_seg, kv_seg) if segments else ()))
    return o, lse
