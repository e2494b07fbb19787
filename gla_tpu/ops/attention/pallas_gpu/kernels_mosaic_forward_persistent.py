"""The Hopper flash attention forward as a persistent kernel: one block per SM, each walking a list
of query tiles (`ForwardTiles(persistent=True)`).

Each tile runs exactly what kernels_mosaic_forward.py runs for it (the same consumers' online
softmax, `walk_tile`, and the same epilogue), so o and lse are the same. What changes is what
happens between tiles:
- the producer's K/V ring runs on from one tile into the next, so the next tile's first key
  blocks load while the consumers finish this one (global step g in slot g mod stages);
- with o staged in tiles of its own (`ForwardTiles.separate_output`: all head dims but 256) a
  consumer loads its next q as soon as its last q k^T product has read this one, and writes o
  while it arrives; at head dim 256 o goes through the q tile and the next q loads once the
  output copy has read it;
- no block is launched, set up or drained per tile.

Work list: the (batch, head) pairs in order, heads innermost (a kv head's query heads together),
and each pair's tiles in order, the causal ones longest first. Round r hands item r * C + c to
block c, or r * C + (C - 1 - c) in odd rounds (a snake: the blocks' totals even out); C = the
block count, at most the number of items. Where few pairs hold many causal tiles (B1 H5 T16384:
5 pairs of 128 tiles on 132 blocks) that order leaves one block with 1.9x the mean work, so the
list is then rank-major instead (every pair's longest tile, then every pair's next one, ...),
whichever of the two orders `_rank_major` finds better balanced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gla_tpu.ops.attention.pallas_gpu.blocks import kv_blocks
from gla_tpu.ops.attention.pallas_gpu.kernels_mosaic_forward import (check_padded_lengths,
                                                                    epilogue, kv_block_loader,
                                                                    query_ids, scratch_types,
                                                                    walk_tile,
                                                                    warp_specialized_kernel)
from gla_tpu.ops.attention.pallas_gpu.plan import CONSUMERS, ForwardTiles, Geometry
from gla_tpu.ops.common import backends
from gla_tpu.ops.common.mosaic_gpu import ring_continue, ring_drain


def _tile_work(geo: Geometry, tiles: ForwardTiles, n_tiles: int) -> np.ndarray:
    """The key blocks each tile (in the work list's rank order: causal longest first) visits:
    [n_tiles] int, from blocks.kv_blocks evaluated at trace time."""
    rank = np.arange(n_tiles)
    tile = n_tiles - 1 - rank if geo.causal else rank
    with jax.ensure_compile_time_eval():
        lo, _, _, hi = kv_blocks(geo, jnp.asarray(tile * tiles.query_multiple, jnp.int32),
                                 tiles.query_multiple, tiles.block_kv)
    return np.maximum(np.asarray(hi) - np.asarray(lo), 0)


def _imbalance(work: np.ndarray, ctas: int) -> float:
    """The most work one block gets from the snake hand-out of `work` (in list order), over the
    mean."""
    position = np.arange(work.size)
    lane = position % ctas
    lane = np.where((position // ctas) % 2 == 0, lane, ctas - 1 - lane)
    totals = np.bincount(lane, weights=work, minlength=ctas)
    return float(totals.max() / max(totals.mean(), 1e-9))


def _rank_major(geo: Geometry, tiles: ForwardTiles, *, n_tiles: int, pairs: int,
                ctas: int) -> bool:
    """Whether the work list runs rank-major (tile rank outer, pair inner) rather than pair-major:
    where that balances the blocks' work better by more than 5% (causal or windowed tiles of
    unequal work, few pairs)."""
    work = _tile_work(geo, tiles, n_tiles)
    if work.min() == work.max():
        return False
    pair_major = np.tile(work, pairs)
    rank_major = np.repeat(work, pairs)
    return _imbalance(rank_major, ctas) < _imbalance(pair_major, ctas) - 0.05


def _work_list(geo: Geometry, tiles: ForwardTiles, *, n_tiles: int, heads: int, items: int,
               ctas: int):
    """item(cta, r) -> (valid, batch, head, tile_base, (first, end) key blocks of the tile)."""
    bq, bkv = tiles.block_q, tiles.block_kv
    pairs = items // n_tiles
    rank_major = _rank_major(geo, tiles, n_tiles=n_tiles, pairs=pairs, ctas=ctas)

    def item(cta, r):
        lane = jnp.where(lax.rem(r, 2) == 0, cta, ctas - 1 - cta)
        position = r * ctas + lane
        valid = position < items
        position = jnp.minimum(position, items - 1)  # in range for an invalid slot's indices
        if rank_major:
            rank, pair = lax.div(position, pairs), lax.rem(position, pairs)
        else:
            pair, rank = lax.div(position, n_tiles), lax.rem(position, n_tiles)
        tile = n_tiles - 1 - rank if geo.causal else rank  # causal: most keys first
        tile_base = tile * tiles.query_multiple
        blocks = (kv_blocks(geo, tile_base, bq, bkv)[0],
                  kv_blocks(geo, tile_base + bq, bq, bkv)[3])
        return valid, lax.div(pair, heads), lax.rem(pair, heads), tile_base, blocks

    return item


def forward(q, k, v, q_seg=None, kv_seg=None, *, geo: Geometry, tiles: ForwardTiles,
            interpret: bool):
    """As kernels_mosaic_forward.forward: q [B, Tp, H, D], k/v [B, Sp, Hkv, D], segment ids or
    None -> (o [B, Tp, H, D], base-2 lse [B, H, Tp] float32)."""
    b, _, h, d = q.shape
    tp = geo.padded_q
    bq, bkv, stages = tiles.block_q, tiles.block_kv, tiles.stages
    n_tiles = check_padded_lengths(geo, tiles.query_multiple, bkv)
    segments = geo.has_segments
    items = n_tiles * h * b
    ctas = min(tiles.ctas or backends.gpu_sm_count(), items)
    rounds = -(-items // ctas)
    separate = tiles.separate_output(d, jnp.dtype(q.dtype).itemsize, segments)
    item = _work_list(geo, tiles, n_tiles=n_tiles, heads=h, items=items, ctas=ctas)

    def body(*refs):
        refs = list(refs)
        q_ref, k_ref, v_ref = refs[:3]
        q_seg_ref, k_seg_ref = refs[3:5] if segments else (None, None)
        del refs[:5 if segments else 3]
        (o_ref, lse_ref, q_smem2, lse_smem2, k_smem, v_smem, q_ready, k_ready, v_ready, k_free,
         v_free, turn) = refs[:12]
        del refs[:12]
        o_smem2 = refs.pop(0) if separate else q_smem2
        if segments:
            q_seg_smem2, k_seg_smem, q_seg_ready, k_seg_ready = refs
        cta, wg = lax.axis_index("cta"), lax.axis_index("wg")

        @pl.when(wg < CONSUMERS)
        def _():
            plgpu.set_max_registers(232, action="increase")
            q_smem, o_smem, lse_smem = q_smem2.at[wg], o_smem2.at[wg], lse_smem2.at[wg]
            seg_refs = ((q_seg_ref, q_seg_smem2.at[wg], q_seg_ready.at[wg], k_seg_smem,
                         k_seg_ready) if segments else None)
            ring = (k_smem, v_smem, k_ready, v_ready, k_free, v_free, turn)

            def fetch_q(batch, head, tile_base):
                rows = (batch, pl.ds(tile_base + wg * bq, bq), head)
                plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, q_ready.at[wg])

            _, batch0, head0, base0, _ = item(cta, 0)  # every block has a first item
            fetch_q(batch0, head0, base0)

            def run(r, ring_base):
                valid, batch, head, tile_base, blocks = item(cta, r)

                @pl.when(valid)
                def _():
                    q_base = tile_base + wg * bq
                    q_seg_rows = query_ids(seg_refs, batch, q_base, bq)
                    plgpu.barrier_wait(q_ready.at[wg])
                    acc, m, l = walk_tile(q_smem, ring, seg_refs, q_seg_rows, q_base=q_base,
                                          wg=wg, tile_blocks=blocks, ring_base=ring_base,
                                          geo=geo, tiles=tiles, dtype=q_ref.dtype,
                                          in_place=not interpret)
                    next_valid, next_batch, next_head, next_base, _ = item(cta, r + 1)

                    def fetch_next():
                        pl.when(next_valid)(lambda: fetch_q(next_batch, next_head, next_base))

                    if separate:  # q is free once walk_tile has ended
                        fetch_next()
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # last tile's o, lse read
                    epilogue(acc, m, l, o_smem, lse_smem, o_ref, lse_ref, batch, head, q_base,
                             geo=geo)
                    if not separate:  # o went through q's tile: the next q waits for its copy
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        fetch_next()

                return ring_base + jnp.where(valid, blocks[1] - blocks[0], 0)

            lax.fori_loop(0, rounds, run, jnp.int32(0))
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == CONSUMERS)
        def _():
            plgpu.set_max_registers(40, action="decrease")
            kv_refs = (k_ref, v_ref, k_smem, v_smem, k_ready, v_ready)
            seg_refs = (k_seg_ref, k_seg_smem, k_seg_ready) if segments else None

            def run(r, start):
                valid, batch, head, _, (first, end) = item(cta, r)

                @pl.when(valid)
                def _():
                    load = kv_block_loader(kv_refs, seg_refs, geo=geo, block_kv=bkv, batch=batch,
                                           head=head, first=first)
                    ring_continue(load, start=start, steps=end - first, stages=stages,
                                  free=(k_free, v_free))

                return start + jnp.where(valid, end - first, 0)

            total = lax.fori_loop(0, rounds, run, jnp.int32(0))
            ring_drain(total, stages=stages, free=(k_free, v_free))

    scratch = scratch_types(q.dtype, d, tiles, segments, output_tiles=separate)
    kernel = warp_specialized_kernel(
        body, out_type=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                        jax.ShapeDtypeStruct((b, h, tp), jnp.float32)],
        scratch=scratch, grid=(ctas,), grid_names=("cta",), interpret=interpret)
    with jax.named_scope(f"flash_fwd_mosaic_persistent_block_q={bq}_block_kv={bkv}"):
        o, lse = kernel(q, k, v, *((q_seg, kv_seg) if segments else ()))
    return o, lse
