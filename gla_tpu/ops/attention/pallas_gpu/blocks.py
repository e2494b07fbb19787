"""Which blocks the GPU attention kernels visit, and the mask inside them (Triton and Mosaic GPU).

Query row r (of the padded q) sits at position r + offset (offset = S - T, bottom-right
alignment) and sees key c iff r + offset - left <= c <= r + offset + right, with (left, right) =
`Geometry.reach` (None on a side: unbounded; causal: right = 0), keys past the true S never, and
with segment ids only keys of its segment. A tile of rows walks the blocks of the other side that
some pair of it sees, in three ranges [lo, full_lo) masked, [full_lo, full_hi) visible to every
pair (no mask), [full_hi, hi) masked; with segment ids every block is masked. A window (both
sides bounded) makes each range O(window) long, so the kernels cost O(T * window). Every function
takes traced int32 positions.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from gla_tpu.ops.attention.pallas_gpu.plan import Geometry
from gla_tpu.ops.common.masks import attention_visibility


def _cdiv_nonneg(x, d: int):
    return lax.div(jnp.maximum(x, 0) + (d - 1), d)


def _div_nonneg(x, d: int):
    return lax.div(jnp.maximum(x, 0), d)


def _ordered(lo, full_lo, full_hi, hi):
    """The four bounds made monotone: hi >= lo, and an empty or clipped full range inside."""
    hi = jnp.maximum(hi, lo)
    full_lo = jnp.clip(full_lo, lo, hi)
    return lo, full_lo, jnp.clip(full_hi, full_lo, hi), hi


def kv_blocks(geo: Geometry, q_start, rows: int, block_kv: int):
    """(lo, full_lo, full_hi, hi): the key blocks of size block_kv the query rows
    [q_start, q_start + rows) visit, as the module docstring's three ranges."""
    n_kv = geo.padded_kv // block_kv
    n_true = geo.kv_len // block_kv  # blocks without padded keys
    left, right = geo.reach
    first = q_start + geo.offset  # the first row's aligned position
    last = first + rows - 1
    lo, full_lo = jnp.int32(0), jnp.int32(0)
    hi, full_hi = jnp.int32(n_kv), jnp.int32(n_true)
    if left is not None:  # keys >= position - left
        lo = jnp.minimum(_div_nonneg(first - left, block_kv), n_kv)
        full_lo = _cdiv_nonneg(last - left, block_kv)
    if right is not None:  # keys <= position + right
        hi = jnp.minimum(_cdiv_nonneg(last + right + 1, block_kv), n_kv)
        full_hi = jnp.minimum(_div_nonneg(first + right + 1, block_kv), n_true)
    if geo.has_segments:
        full_hi = full_lo
    return _ordered(lo, full_lo, full_hi, hi)


def q_blocks(geo: Geometry, k_start, keys: int, block_q: int):
    """(lo, full_lo, full_hi, hi): the query blocks of size block_q that see the keys
    [k_start, k_start + keys), as the module docstring's three ranges (keys past the true S are
    not masked: their dk and dv rows are sliced away)."""
    n_q = geo.padded_q // block_q
    left, right = geo.reach
    first = k_start - geo.offset  # query row r sees key c iff c - right <= r + offset <= c + left
    last = first + keys - 1
    lo, full_lo = jnp.int32(0), jnp.int32(0)
    hi, full_hi = jnp.int32(n_q), jnp.int32(n_q)
    if right is not None:  # rows >= key - offset - right
        lo = jnp.minimum(_div_nonneg(first - right, block_q), n_q)
        full_lo = _cdiv_nonneg(last - right, block_q)
    if left is not None:  # rows <= key - offset + left
        hi = jnp.minimum(_cdiv_nonneg(last + left + 1, block_q), n_q)
        full_hi = jnp.minimum(_div_nonneg(first + left + 1, block_q), n_q)
    if geo.has_segments:
        full_hi = full_lo
    return _ordered(lo, full_lo, full_hi, hi)


def visibility_mask(geo: Geometry, q_pos, k_pos, q_seg, k_seg, *, check_len: bool):
    """Visibility of broadcastable positions (rank 2 each); None when everything is visible."""
    mask = None
    if geo.causal or geo.window is not None or q_seg is not None:
        mask = attention_visibility(q_pos, k_pos, causal=geo.causal, offset=geo.offset,
                                    q_seg=q_seg, kv_seg=k_seg, window=geo.window)
    if check_len:
        in_range = k_pos < geo.kv_len
        mask = in_range if mask is None else jnp.logical_and(mask, in_range)
    return mask


def walk(geo: Geometry, bounds, *, rows_walk_keys: bool):
    """[(masked, start, end)]: the loops over a tile's blocks, (lo, full_lo, full_hi, hi) from
    `kv_blocks` (rows_walk_keys) or `q_blocks`, without the ranges that are empty for every tile
    of the call (no loop body traced for them): with segment ids one masked range [lo, hi); else
    the masked range at the window's far edge only where that side is bounded (keys: left; queries:
    right), the mask-free middle, and the masked range at the near edge (queries: only where
    left is bounded)."""
    lo, full_lo, full_hi, hi = bounds
    if geo.has_segments:
        return [(True, lo, hi)]
    left, right = geo.reach
    far_bounded = left is not None if rows_walk_keys else right is not None
    near = True if rows_walk_keys else left is not None
    ranges = [(True, lo, full_lo)] if far_bounded else []
    ranges.append((False, full_lo, full_hi))
    if near:
        ranges.append((True, full_hi, hi))
    return ranges
