"""Pallas (Triton lowering) kernel bodies and pallas_call builders of the GPU flash attention.

Three kernels, none of which knows about autodiff (vjp.py wires them with custom_vjp):
- forward: one program per (query block, batch, head); online softmax over key blocks; writes o
  and the base-2 log-sum-exp `lse` [B, H, T].
- dq: one program per (query block, batch, head); recomputes p from lse.
- dkv: one program per (key block, batch, kv head); loops over the query heads of its GQA group
  and over query blocks, so dk, dv of a kv head are summed in registers, never in memory.
Causal and window skipping live in the loop bounds (blocks.py): every loop runs over the blocks a
tile can see, split in ranges that need no mask (all pairs visible) and ranges that are masked.

Inputs arrive padded (entry.py) so T and S are multiples of every block size; `kv_len` is
the true S and keys at or past it are masked where they could reach an output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gla_tpu.ops.attention.pallas_gpu.blocks import kv_blocks, q_blocks, visibility_mask, walk
from gla_tpu.ops.attention.pallas_gpu.plan import Geometry
from gla_tpu.ops.attention.scores import base2_scores
from gla_tpu.ops.common.products import HIGHEST, product



def _forward_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref, *, geo: Geometry,
                    block_q: int, block_kv: int):
    q_start = pl.program_id(0) * block_q
    q = q_ref[...]  # [block_q, D]
    q_pos = (q_start + jnp.arange(block_q, dtype=jnp.int32))[:, None]  # [block_q, 1]
    q_seg = qseg_ref[...][:, None] if geo.has_segments else None
    check_len = geo.kv_len != geo.padded_kv

    def body(masked, kb, carry):
        acc, m, l = carry  # [block_q, D], [block_q], [block_q]
        kv_slice = pl.ds(kb * block_kv, block_kv)
        k = k_ref[kv_slice, :]
        # [block_q, block_kv], base-2 logits
        s, _ = base2_scores(product(q, k, "nt", HIGHEST), geo.sm_scale, geo.soft_cap)
        if masked:
            k_pos = (kb * block_kv + jnp.arange(block_kv, dtype=jnp.int32))[None, :]
            k_seg = kseg_ref[kv_slice][None, :] if geo.has_segments else None
            vis = visibility_mask(geo, q_pos, k_pos, q_seg, k_seg, check_len=check_len)
            s = s if vis is None else jnp.where(vis, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # a row that has seen no key yet keeps max -inf; shift it by 0 so exp2 gives 0, not NaN
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l = alpha * l + jnp.sum(p, axis=1)
        v = v_ref[kv_slice, :]
        acc = alpha[:, None] * acc + product(p.astype(v.dtype), v, "nn", HIGHEST)
        return acc, m_new, l

    carry = (jnp.zeros(q.shape, jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    acc, m, l = _over_ranges(walk(geo, kv_blocks(geo, q_start, block_q, block_kv),
                                  rows_walk_keys=True), body, carry)
    seen = l > 0.0
    o = acc / jnp.where(seen, l, 1.0)[:, None]
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), geo.empty_row_lse)


def _over_ranges(ranges, body, carry):
    """body(masked, block, carry) over the [(masked, start, end)] of blocks.walk."""
    for masked, start, end in ranges:
        carry = lax.fori_loop(start, end, functools.partial(body, masked), carry)
    return carry


def _row_positions(geo: Geometry, block_index, block: int, seg_ref, tile):
    """Positions [1, block] of the tokens of block `block_index` and their segment ids [1, block]
    (None without segments); `tile` is the block's slice of the segment-id row."""
    pos = (block_index * block + jnp.arange(block, dtype=jnp.int32))[None, :]
    return pos, (seg_ref[tile][None, :] if geo.has_segments else None)


def _probabilities(geo: Geometry, rows, cols, lse, vis):
    """The backward's recomputed softmax, p = exp2(s2 - lse) with s2 the base-2 scores of
    rows cols^T, zero where `vis` (None: everything visible) is False: ([rows, cols] float32, the
    soft cap's derivative or None). dq takes q rows and k columns, dk/dv the transpose."""
    s2, cap_grad = base2_scores(product(rows, cols, "nt", HIGHEST), geo.sm_scale, geo.soft_cap)
    p = jnp.exp2(s2 - lse)
    return (p if vis is None else jnp.where(vis, p, 0.0)), cap_grad


def _score_grad(p, cap_grad, d_rows, d_cols, delta):
    """ds = p * (d_rows d_cols^T - delta) (times the soft cap's derivative): the gradient of
    sm_scale q k^T, oriented like p."""
    ds = p * (product(d_rows, d_cols, "nt", HIGHEST) - delta)
    return ds if cap_grad is None else ds * cap_grad


def _dq_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, dq_ref, *,
               geo: Geometry, block_q: int, block_kv: int):
    q_start = pl.program_id(0) * block_q
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...][:, None]  # [block_q, 1]
    delta = delta_ref[...][:, None]
    q_pos = (q_start + jnp.arange(block_q, dtype=jnp.int32))[:, None]
    q_seg = qseg_ref[...][:, None] if geo.has_segments else None
    check_len = geo.kv_len != geo.padded_kv

    def body(masked, kb, dq):
        kv_slice = pl.ds(kb * block_kv, block_kv)
        k = k_ref[kv_slice, :]
        v = v_ref[kv_slice, :]
        vis = None
        if masked:
            k_pos, k_seg = _row_positions(geo, kb, block_kv, kseg_ref, kv_slice)
            vis = visibility_mask(geo, q_pos, k_pos, q_seg, k_seg, check_len=check_len)
        p, cap_grad = _probabilities(geo, q, k, lse, vis)  # [block_q, block_kv]
        ds = _score_grad(p, cap_grad, do, v, delta)
        return dq + product(ds.astype(k.dtype), k, "nn", HIGHEST)

    dq = _over_ranges(walk(geo, kv_blocks(geo, q_start, block_q, block_kv), rows_walk_keys=True),
                      body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * geo.sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, dk_ref,
                dv_ref, *, geo: Geometry, block_q: int, block_kv: int):
    k_start = pl.program_id(0) * block_kv
    k = k_ref[...]  # [block_kv, D]
    v = v_ref[...]
    k_pos = (k_start + jnp.arange(block_kv, dtype=jnp.int32))[:, None]  # [block_kv, 1]
    k_seg = kseg_ref[...][:, None] if geo.has_segments else None

    def body(masked, g, qb, carry):
        dk, dv = carry
        q_slice = pl.ds(qb * block_q, block_q)
        q = q_ref[q_slice, g, :]  # [block_q, D]
        do = do_ref[q_slice, g, :]
        lse = lse_ref[g, q_slice][None, :]  # [1, block_q]
        delta = delta_ref[g, q_slice][None, :]
        vis = None
        if masked:
            q_pos, q_seg = _row_positions(geo, qb, block_q, qseg_ref, q_slice)
            # keys past kv_len only produce rows of dk, dv that are sliced away: no length check
            vis = visibility_mask(geo, q_pos, k_pos, q_seg, k_seg, check_len=False)
        pt, cap_grad = _probabilities(geo, k, q, lse, vis)  # [block_kv, block_q]
        dv = dv + product(pt.astype(do.dtype), do, "nn", HIGHEST)
        dst = _score_grad(pt, cap_grad, v, do, delta)
        dk = dk + product(dst.astype(q.dtype), q, "nn", HIGHEST)
        return dk, dv

    ranges = walk(geo, q_blocks(geo, k_start, block_kv, block_q), rows_walk_keys=False)
    carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for g in range(geo.group):
        carry = _over_ranges(ranges, lambda masked, qb, c, g=g: body(masked, g, qb, c), carry)
    dk, dv = carry
    dk_ref[...] = (dk * geo.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _params(num_warps: int, num_stages: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _seg_specs(geo: Geometry, q_block, kv_block):
    """BlockSpecs of the [B, T] / [B, S] segment ids (None entries when there are none)."""
    if not geo.has_segments:
        return None, None
    return q_block, kv_block


def _query_tiled_specs(geo: Geometry, q, k, block_q: int):
    """Grid (query block, batch, head), all parallel, and the BlockSpecs of the forward and dq
    kernels: q-shaped tiles, whole k/v of the GQA head, [B, H, Tp] rows, segment ids."""
    b, tp, h, d = q.shape
    sp = k.shape[1]
    group = geo.group
    grid = (tp // block_q, b, h)
    q_spec = pl.BlockSpec((None, block_q, None, d), lambda i, bi, hi: (bi, i, hi, 0))
    kv_spec = pl.BlockSpec((None, sp, None, d), lambda i, bi, hi: (bi, 0, hi // group, 0))
    row_spec = pl.BlockSpec((None, None, block_q), lambda i, bi, hi: (bi, hi, i))
    qs_spec, ks_spec = _seg_specs(
        geo, pl.BlockSpec((None, block_q), lambda i, bi, hi: (bi, i)),
        pl.BlockSpec((None, sp), lambda i, bi, hi: (bi, 0)))
    return grid, q_spec, kv_spec, row_spec, qs_spec, ks_spec


def forward(q, k, v, q_seg, kv_seg, *, geo: Geometry, block_q: int, block_kv: int,
            num_warps: int, num_stages: int, interpret):
    """q [B, Tp, H, D], k/v [B, Sp, Hkv, D] -> (o [B, Tp, H, D], lse [B, H, Tp] float32)."""
    b, tp, h, _ = q.shape
    grid, q_spec, kv_spec, row_spec, qs_spec, ks_spec = _query_tiled_specs(geo, q, k, block_q)
    kernel = functools.partial(_forward_kernel, geo=geo, block_q=block_q, block_kv=block_kv)
    with jax.named_scope(f"flash_fwd_block_q={block_q}_block_kv={block_kv}"):
        return pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=[q_spec, kv_spec, kv_spec, qs_spec, ks_spec],
            out_specs=[q_spec, row_spec],
            out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                       jax.ShapeDtypeStruct((b, h, tp), jnp.float32)],
            compiler_params=_params(num_warps, num_stages),
            interpret=interpret,
            name="flash_attention_fwd",
        )(q, k, v, q_seg, kv_seg)


def backward_dq(q, k, v, q_seg, kv_seg, do, lse, delta, *, geo: Geometry, block_q: int,
                block_kv: int, num_warps: int, num_stages: int, interpret, out_dtype=None):
    """-> dq [B, Tp, H, D] in `out_dtype` (default q's dtype)."""
    grid, q_spec, kv_spec, row_spec, qs_spec, ks_spec = _query_tiled_specs(geo, q, k, block_q)
    kernel = functools.partial(_dq_kernel, geo=geo, block_q=block_q, block_kv=block_kv)
    with jax.named_scope(f"flash_dq_block_q={block_q}_block_kv={block_kv}"):
        return pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=[q_spec, kv_spec, kv_spec, qs_spec, ks_spec, q_spec, row_spec, row_spec],
            out_specs=q_spec,
            out_shape=jax.ShapeDtypeStruct(q.shape, out_dtype or q.dtype),
            compiler_params=_params(num_warps, num_stages),
            interpret=interpret,
            name="flash_attention_dq",
        )(q, k, v, q_seg, kv_seg, do, lse, delta)


def backward_dkv(q, k, v, q_seg, kv_seg, do, lse, delta, *, geo: Geometry, block_q: int,
                 block_kv: int, num_warps: int, num_stages: int, interpret, out_dtype=None):
    """-> (dk, dv) [B, Sp, Hkv, D] in `out_dtype` (default k's dtype), summed over each kv head's
    query group."""
    b, tp, h, d = q.shape
    sp, hkv = k.shape[1], k.shape[2]
    group = geo.group
    grid = (sp // block_kv, b, hkv)  # (key block, batch, kv head): all parallel
    kv_spec = pl.BlockSpec((None, block_kv, None, d), lambda j, bi, hi: (bi, j, hi, 0))
    # every query head of the group, whole (padded) time axis: [Tp, group, D]
    q_spec = pl.BlockSpec((None, tp, group, d), lambda j, bi, hi: (bi, 0, hi, 0))
    row_spec = pl.BlockSpec((None, group, tp), lambda j, bi, hi: (bi, hi, 0))
    qs_spec, ks_spec = _seg_specs(
        geo, pl.BlockSpec((None, tp), lambda j, bi, hi: (bi, 0)),
        pl.BlockSpec((None, block_kv), lambda j, bi, hi: (bi, j)))
    kernel = functools.partial(_dkv_kernel, geo=geo, block_q=block_q, block_kv=block_kv)
    with jax.named_scope(f"flash_dkv_block_q={block_q}_block_kv={block_kv}"):
        return pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=[q_spec, kv_spec, kv_spec, qs_spec, ks_spec, q_spec, row_spec, row_spec],
            out_specs=[kv_spec, kv_spec],
            out_shape=[jax.ShapeDtypeStruct(k.shape, out_dtype or k.dtype),
                       jax.ShapeDtypeStruct(v.shape, out_dtype or v.dtype)],
            compiler_params=_params(num_warps, num_stages),
            interpret=interpret,
            name="flash_attention_dkv",
        )(q, k, v, q_seg, kv_seg, do, lse, delta)
