"""Which (q block, kv block) pairs of the Mosaic TPU attention kernels see each other.

Query row r (of the padded q) sits at position r + offset (offset = S - T, bottom-right
alignment) and sees key c iff r + offset - left <= c <= r + offset + right, with
(left, right) = `KernelConfig.reach` (None on a side: unbounded; causal: right = 0). A q block
i of bq rows and a kv block j of bkv keys see each other iff some pair does; the kernels skip
the other steps (no compute, and index maps that re-point them at a needed block, so nothing is
fetched). Every function takes traced int32 block indices.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from gla_tpu.ops.attention.mosaic_tpu.plan import KernelConfig


def _first(x, d: int, n: int):
    """The first block of `d` rows holding position x, clamped into [0, n - 1] (traced int32)."""
    return jnp.minimum(lax.div(jnp.maximum(x, 0), d), n - 1)


def _last(x, d: int, n: int):
    """The last block of `d` rows at or before position x, at most n - 1; -1 where x < 0 (no
    block). Written as a select around a truncating division of a non-negative number: libtpu's
    static profile of the rows forward, whose steps run under `lo <= s <= hi`, counts only a
    fraction of them (half at T = 4096) when hi is a floor division of a possibly negative
    number, although the values are the same (docs/tpu_static_estimate.md)."""
    return jnp.where(x < 0, -1, jnp.minimum(lax.div(jnp.maximum(x, 0), d), n - 1))


def has_visible_key(cfg: KernelConfig, q_block, kv_block, bq: int, bkv: int):
    """Does q block `q_block` see any key of kv block `kv_block`? (True where unbounded; False
    for a block index past the grid, which the windowed grids' steps can reach.)"""
    left, right = cfg.reach
    visible = jnp.logical_and(kv_block <= cfg.kv_len_padded // bkv - 1,
                              q_block <= cfg.q_len_padded // bq - 1)
    if right is not None:  # the block's first key is not past its last query's reach
        visible = jnp.logical_and(
            visible, kv_block * bkv <= (q_block + 1) * bq - 1 + cfg.offset + right)
    if left is not None:  # the block's last key reaches its first query's window
        visible = jnp.logical_and(visible,
                                  (kv_block + 1) * bkv - 1 >= q_block * bq + cfg.offset - left)
    return visible


def kv_range(cfg: KernelConfig, q_block, bq: int, bkv: int):
    """(first, last) kv blocks q block `q_block` may see, clamped into [0, NKV - 1]; first > last
    only where it sees none."""
    nkv = cfg.kv_len_padded // bkv
    left, right = cfg.reach
    first, last = jnp.int32(0), jnp.int32(nkv - 1)
    if left is not None:
        first = _first(q_block * bq + cfg.offset - left, bkv, nkv)
    if right is not None:
        last = _last((q_block + 1) * bq - 1 + cfg.offset + right, bkv, nkv)
    return first, last


def q_range(cfg: KernelConfig, kv_block, bq: int, bkv: int):
    """(first, last) q blocks that may see kv block `kv_block`, clamped into [0, NQ - 1]."""
    nq = cfg.q_len_padded // bq
    left, right = cfg.reach
    first, last = jnp.int32(0), jnp.int32(nq - 1)
    if right is not None:  # query r sees key c only if r >= c - offset - right
        first = _first(kv_block * bkv - cfg.offset - right, bq, nq)
    if left is not None:  # and only if r <= c - offset + left
        last = _last((kv_block + 1) * bkv - 1 - cfg.offset + left, bq, nq)
    return first, last


def clamp_into(index, bounds):
    """`index` moved into [first, last] (first where the range is empty): a skipped step's
    block index, equal to a neighbour's so that the pipeline fetches nothing new."""
    first, last = bounds
    return jnp.maximum(jnp.minimum(index, last), first)


# A window (both sides bounded) shortens the grid's inner axis: each q block steps only over the
# kv blocks its window can reach (and each kv block over the q blocks that can reach it), so
# the kernels visit O(T * window) blocks and pay no per-step overhead for the others. Causal
# attention without a window keeps the full axis, its skipped steps re-pointed.


def windowed(cfg: KernelConfig) -> bool:
    return cfg.window is not None


def kv_steps(cfg: KernelConfig, bq: int, bkv: int) -> int:
    """The inner grid extent of the q-major kernels (forward, dq): every kv block, or under a
    window the most kv blocks one q block's keys span."""
    nkv = cfg.kv_len_padded // bkv
    if not windowed(cfg):
        return nkv
    left, right = cfg.reach
    return min(nkv, (bq - 1 + left + right) // bkv + 2)


def q_steps(cfg: KernelConfig, bq: int, bkv: int) -> int:
    """The inner grid extent of the kv-major kernel (dk/dv): every q block, or under a window the
    most q blocks that reach one kv block."""
    nq = cfg.q_len_padded // bq
    if not windowed(cfg):
        return nq
    left, right = cfg.reach
    return min(nq, (bkv - 1 + left + right) // bq + 2)


def kv_block_at(cfg: KernelConfig, q_block, step, bq: int, bkv: int):
    """The kv block of inner step `step` for q block `q_block` (may lie past the q block's last
    one, or past the grid: `has_visible_key` is then False)."""
    if not windowed(cfg):
        return step
    return kv_range(cfg, q_block, bq, bkv)[0] + step


def q_block_at(cfg: KernelConfig, kv_block, step, bq: int, bkv: int):
    """The q block of inner step `step` for kv block `kv_block` (the dk/dv kernel)."""
    if not windowed(cfg):
        return step
    return q_range(cfg, kv_block, bq, bkv)[0] + step
