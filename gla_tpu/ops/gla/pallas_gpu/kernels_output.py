"""Pallas (Triton lowering) kernels of the GLA outputs and dv on GPU: one program per
(batch, head, chunk, V block).

- `chunk_output`: o = scale (A v + (q exp(b) reach) h_n).
- `chunk_dv`: dv = scale A^T do + (k exp(B - b) last) dh_{n+1}.
Notation of kernels_intra.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from gla_tpu.ops.common.products import HIGHEST, product
from gla_tpu.ops.gla.pallas_gpu.plan import ChunkGeometry, compiler_params


def _inter_sum(x_ref, b_ref, w_ref, states_ref, vs, geo: ChunkGeometry, *, to_chunk_end: bool):
    """sum over K blocks of (x * gate_weight)[:, kb] @ states[kb, vs]: [C, BV] float32, with
    gate_weight exp(b) (query side) or exp(B - b) (key side)."""
    c = geo.chunk

    def over_k(kb, acc):
        ks = pl.ds(kb * geo.block_k, geo.block_k)
        b = b_ref[:, ks]
        if to_chunk_end:
            weight = jnp.exp(b_ref[pl.ds(c - 1, 1), ks] - b)
        else:
            weight = jnp.exp(b)
        if w_ref is not None:
            weight = weight * w_ref[...][:, None]
        x = x_ref[:, ks]
        xw = (x.astype(jnp.float32) * weight).astype(x.dtype)
        st = states_ref[ks, vs].astype(x.dtype)  # [BK, BV]
        return acc + product(xw, st, "nn", HIGHEST)

    return lax.fori_loop(0, geo.key_dim // geo.block_k, over_k,
                         jnp.zeros((c, geo.block_v), jnp.float32))


def _output_kernel(q_ref, b_ref, reach_ref, a_ref, v_ref, h_ref, o_ref, *, geo: ChunkGeometry):
    vs = pl.ds(0, geo.block_v)
    v = v_ref[...]  # [C, BV]
    intra = product(a_ref[...].astype(v.dtype), v, "nn", HIGHEST)
    inter = _inter_sum(q_ref, b_ref, reach_ref, h_ref, vs, geo, to_chunk_end=False)
    o_ref[...] = ((intra + inter) * geo.scale).astype(o_ref.dtype)


def _per_value_block(kernel, x, b, mask, a, y, states, *, geo: ChunkGeometry, interpret,
                     name: str):
    """The pallas_call of chunk_output and chunk_dv: grid (B, H, N, V blocks); x, b [B, Tp, H, K]
    whole, mask [B, Tp] | None, a [B, H, Tp, C], y and the output [B, Tp, H, V] by V blocks,
    states [B, H, >= N, K, V] (chunk n's [K, BV] block)."""
    bsz, tp, h, kd = x.shape
    c, bv = geo.chunk, geo.block_v
    grid = (bsz, h, geo.num_chunks, geo.value_dim // bv)
    tok_k = pl.BlockSpec((None, c, None, kd), lambda bi, hi, n, vi: (bi, n, hi, 0))
    tok_v = pl.BlockSpec((None, c, None, bv), lambda bi, hi, n, vi: (bi, n, hi, vi))
    mask_spec = None if mask is None else pl.BlockSpec((None, c), lambda bi, hi, n, vi: (bi, n))
    a_spec = pl.BlockSpec((None, None, c, c), lambda bi, hi, n, vi: (bi, hi, n, 0))
    h_spec = pl.BlockSpec((None, None, None, kd, bv), lambda bi, hi, n, vi: (bi, hi, n, 0, vi))
    with jax.named_scope(f"{name}_chunk={c}_block_v={bv}"):
        return pl.pallas_call(
            functools.partial(kernel, geo=geo),
            grid=grid,
            in_specs=[tok_k, tok_k, mask_spec, a_spec, tok_v, h_spec],
            out_specs=tok_v,
            out_shape=jax.ShapeDtypeStruct(y.shape, y.dtype),
            compiler_params=compiler_params(geo),
            interpret=interpret,
            name=name,
        )(x, b, mask, a, y, states)


def chunk_output(q, b, reach, a, v, states, *, geo: ChunkGeometry, interpret):
    """-> o [B, Tp, H, V] in v's dtype."""
    return _per_value_block(_output_kernel, q, b, reach, a, v, states, geo=geo,
                            interpret=interpret, name="gla_chunk_output")


def _dv_kernel(k_ref, b_ref, last_ref, a_ref, do_ref, dh_ref, dv_ref, *, geo: ChunkGeometry):
    vs = pl.ds(0, geo.block_v)
    do = do_ref[...]  # [C, BV]
    intra = product(a_ref[...].astype(do.dtype), do, "tn", HIGHEST) * geo.scale
    inter = _inter_sum(k_ref, b_ref, last_ref, dh_ref, vs, geo, to_chunk_end=True)
    dv_ref[...] = (intra + inter).astype(dv_ref.dtype)


def chunk_dv(k, b, last, a, do, dstates, *, geo: ChunkGeometry, interpret):
    """-> dv [B, Tp, H, V] in do's dtype."""
    return _per_value_block(_dv_kernel, k, b, last, a, do, dstates, geo=geo,
                            interpret=interpret, name="gla_chunk_dv")
