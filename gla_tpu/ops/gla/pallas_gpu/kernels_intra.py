"""Pallas (Triton lowering) kernels of the intra-chunk GLA products on GPU (no autodiff in here).

Notation of docs/gla_math.md and docs/gpu_backend.md: chunk length C, sub-chunk length
c = SUB_CHUNK = 16, b = chunk-local running sum of the log gate g (computed outside, float32,
[B, T, H, K]), B_n = b at the last token of chunk n, h_n the [K, V] state entering chunk n.
Per-head and absent
gates arrive broadcast to [B, T, H, K]. Segment masks arrive precomputed (entry.py):
`reach` (the carried state reaches the token), `last` (the token is in its chunk's last segment),
`keep` (no reset inside the chunk), and the running segment index `seg` for intra-chunk masks.

Kernels (the state pass is in kernels_state.py, outputs and dv in kernels_output.py):
- `intra_scores`: the masked, unscaled intra-chunk scores A [C, C] per chunk.
- `chunk_da`: dA = scale do v^T [C, C] per chunk, masked like A.
- `chunk_dqk`: dq, dk, dg (float32) of a chunk and K block, intra and inter parts.
The intra-chunk products take one of two paths per chunk (section "Intra-chunk products").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gla_tpu.ops.common.chunk_cumsum import SUB_CHUNK
from gla_tpu.ops.common.masks import intra_chunk_visibility
from gla_tpu.ops.common.products import HIGHEST, accurate_product, product
from gla_tpu.ops.gla.pallas_gpu.plan import ChunkGeometry, compiler_params


def _intra_mask(geo: ChunkGeometry, seg_ref, n_rows: int, row_offset: int):
    """[n_rows, C] causal (and same-segment) mask of a block of query rows: entry (r, x) pairs
    query row r of the block with key token x of the chunk."""
    r = row_offset + jnp.arange(n_rows, dtype=jnp.int32)[:, None]
    x = jnp.arange(geo.chunk, dtype=jnp.int32)[None, :]
    seg_rows = seg_all = None
    if geo.has_segments:
        seg_all = seg_ref[...][None, :]  # [1, C]
        seg_rows = seg_ref[pl.ds(row_offset, n_rows)][:, None]
    return intra_chunk_visibility(r, x, seg_rows, seg_all)


# Intra-chunk products: two paths, chosen per chunk at run time.
#
# Bounded chunks (the chunk decays by at most BOUND in every key channel, the common case): one
# reference for the whole chunk, b_0 = b at its first token, and one product on the matrix units:
#   A = (q exp(b - b_0)) (k exp(b_0 - b))^T,  dq = exp(b - b_0) (dA (k exp(b_0 - b))),
#   dk = exp(b_0 - b) (dA^T (q exp(b - b_0))),
# every factor in [exp(-BOUND), exp(BOUND)], far from float32 and bfloat16 overflow (the masked
# pairs reach exp(BOUND) |q| |k| at most); each product term keeps its relative rounding.
# Other chunks (any gates): secondary chunking in sub-chunks of SUB_CHUNK tokens. Pairs in different
# sub-chunks factor through a reference inside the chunk with every exponent <= 0 (matrix
# units); the diagonal sub-chunk blocks are summed elementwise, every exponent b_later - b_earlier.
BOUND = 40.0


def bounded_chunks(b, chunk: int):
    """b [B, Tp, H, K] chunk-local running sum of the log gate -> [B, H, N] int32: 1 where
    |b - b_first| <= BOUND over the chunk in every key channel (for log gates <= 0: the chunk
    decays by at most BOUND; NaN or infinite gates take the exact path)."""
    bsz, tp, h, kd = b.shape
    bc = b.reshape(bsz, tp // chunk, chunk, h, kd)
    span = jnp.max(jnp.abs(bc - bc[:, :, :1]), axis=(2, 4))  # [B, N, H]
    return (span <= BOUND).astype(jnp.int32).transpose(0, 2, 1)


def _token_ids(c: int):
    """Row ([C, 1]) and column ([1, C]) token indices of a chunk."""
    return jnp.arange(c, dtype=jnp.int32)[:, None], jnp.arange(c, dtype=jnp.int32)[None, :]


def _in_sub(tok, i: int):
    return jnp.logical_and(tok >= i * SUB_CHUNK, tok < (i + 1) * SUB_CHUNK)


def _per_sub_rows(ref, offset: int, ks, c: int):
    """[C, BK]: row r holds ref's row (first token of r's sub-chunk) + offset."""
    tok, _ = _token_ids(c)
    out = ref[pl.ds(offset, 1), ks]
    for i in range(1, c // SUB_CHUNK):
        out = jnp.where(tok >= i * SUB_CHUNK, ref[pl.ds(i * SUB_CHUNK + offset, 1), ks], out)
    return out


def _chunk_factors(b, b_ref, ks):
    """(exp(b - b_0), exp(b_0 - b)) [C, BK] for a bounded chunk."""
    rel = b - b_ref[pl.ds(0, 1), ks]
    return jnp.exp(rel), jnp.exp(-rel)


def _earlier_keys(x, b, b_ref, ks, i: int):
    """x exp(b_I0 - b) for the tokens of sub-chunks before i, zero from sub-chunk i on (b_I0: b at
    sub-chunk i's first token, every exponent <= 0)."""
    tok, _ = _token_ids(b.shape[0])
    anchor = b_ref[pl.ds(i * SUB_CHUNK, 1), ks]  # [1, BK]
    visible = tok < i * SUB_CHUNK
    return jnp.where(visible, x * jnp.exp(jnp.where(visible, anchor - b, 0.0)), 0.0)


def _sub_chunk_scores(q, k, b, b_ref, ks, dt):
    """sum_K q_rk k_xk exp(b_rk - b_xk) for key x in an earlier sub-chunk than query r, each
    query sub-chunk I referenced to b_I0: [C, C] float32, zero elsewhere."""
    c = q.shape[0]
    tok, _ = _token_ids(c)
    q_rel = q * jnp.exp(b - _per_sub_rows(b_ref, 0, ks, c))  # exponent <= 0
    out = jnp.zeros((c, c), jnp.float32)
    for i in range(1, c // SUB_CHUNK):
        rows = jnp.where(_in_sub(tok, i), q_rel, 0.0).astype(dt)
        out = out + product(rows, _earlier_keys(k, b, b_ref, ks, i).astype(dt), "nt", HIGHEST)
    return out


def _sub_chunk_dq(da, k, b, b_ref, ks, dt):
    """dq_r = sum_x dA_rx k_x exp(b_r - b_x) over keys x of earlier sub-chunks: [C, BK]."""
    c = k.shape[0]
    tok, _ = _token_ids(c)
    out = jnp.zeros(k.shape, jnp.float32)
    for i in range(1, c // SUB_CHUNK):
        prod = accurate_product(da, _earlier_keys(k, b, b_ref, ks, i), "nn", dt)
        out = out + jnp.where(_in_sub(tok, i), prod, 0.0)
    return out * jnp.exp(b - _per_sub_rows(b_ref, 0, ks, c))


def _sub_chunk_dk(da, q, b, b_ref, ks, dt):
    """dk_x = sum_r dA_rx q_r exp(b_r - b_x) over queries r of later sub-chunks, referenced to
    b_J1 = b at the last token of x's sub-chunk J (both exponents <= 0): [C, BK]."""
    c = q.shape[0]
    tok, _ = _token_ids(c)
    out = jnp.zeros(q.shape, jnp.float32)
    for j in range(c // SUB_CHUNK - 1):
        anchor = b_ref[pl.ds(j * SUB_CHUNK + SUB_CHUNK - 1, 1), ks]
        later = tok >= (j + 1) * SUB_CHUNK
        rel = jnp.where(later, q * jnp.exp(jnp.where(later, b - anchor, 0.0)), 0.0)
        out = out + jnp.where(_in_sub(tok, j), accurate_product(da, rel, "tn", dt), 0.0)
    return out * jnp.exp(_per_sub_rows(b_ref, SUB_CHUNK - 1, ks, c) - b)


def _exact_diagonal(x_ref, b_ref, b, ks, weights, *, keys: bool):
    """The diagonal sub-chunk blocks of dq (keys=False) or dk (keys=True) elementwise, for any
    gates: one step per position j in the sub-chunk, all sub-chunks at once, every exponent
    b_later - b_earlier <= 0. weights [C, C] is dA (query r, key x), masked.
    dq_r = sum_{x in r's sub-chunk, x <= r} dA_rx k_x exp(b_r - b_x)      (x_ref = k)
    dk_x = sum_{r in x's sub-chunk, r >= x} dA_rx q_r exp(b_r - b_x)      (x_ref = q)
    """
    c = b.shape[0]
    tok, col = _token_ids(c)
    pos = tok % SUB_CHUNK
    base_row, base_col = tok - pos, col - col % SUB_CHUNK
    out = jnp.zeros(b.shape, jnp.float32)
    for j in range(SUB_CHUNK):
        other = _per_sub_rows(x_ref, j, ks, c).astype(jnp.float32)  # token base + j, per row
        b_other = _per_sub_rows(b_ref, j, ks, c)
        if keys:  # rows are keys x, `other` the query base(x) + j >= x
            w = jnp.sum(jnp.where(tok == base_col + j, weights, 0.0), axis=0)[:, None]
            decay = jnp.exp(jnp.where(pos <= j, b_other - b, 0.0))
        else:  # rows are queries r, `other` the key base(r) + j <= r
            w = jnp.sum(jnp.where(col == base_row + j, weights, 0.0), axis=1)[:, None]
            decay = jnp.exp(jnp.where(pos >= j, b - b_other, 0.0))
        out = out + w * other * decay
    return out


def _exact_diagonal_scores(q, b, k_ref, b_ref, ks):
    """[C, C]: the diagonal sub-chunk blocks of the scores, elementwise (any gates)."""
    c = q.shape[0]
    tok, col = _token_ids(c)
    pos = tok % SUB_CHUNK
    out = jnp.zeros((c, c), jnp.float32)
    for j in range(SUB_CHUNK):
        k_j = _per_sub_rows(k_ref, j, ks, c).astype(jnp.float32)
        b_j = _per_sub_rows(b_ref, j, ks, c)
        s = jnp.sum(q * k_j * jnp.exp(jnp.where(pos >= j, b - b_j, 0.0)), axis=1)[:, None]
        out = jnp.where(col == tok - pos + j, s, out)
    return out


def _read_flag(flag_ref):
    return jnp.max(flag_ref[...]) > 0


def _intra_kernel(flag_ref, q_ref, k_ref, b_ref, seg_ref, a_ref, *, geo: ChunkGeometry):
    c, bk = geo.chunk, geo.block_k
    dt = q_ref.dtype

    def scores(bounded: bool):
        def over_k(kb, acc):
            ks = pl.ds(kb * bk, bk)
            q = q_ref[:, ks].astype(jnp.float32)  # [C, BK]
            k = k_ref[:, ks].astype(jnp.float32)
            b = b_ref[:, ks]
            if bounded:
                to_ref, from_ref = _chunk_factors(b, b_ref, ks)
                return acc + product((q * to_ref).astype(dt), (k * from_ref).astype(dt), "nt",
                                     HIGHEST)
            return (acc + _sub_chunk_scores(q, k, b, b_ref, ks, dt)
                    + _exact_diagonal_scores(q, b, k_ref, b_ref, ks))

        return lax.fori_loop(0, geo.key_dim // bk, over_k, jnp.zeros((c, c), jnp.float32))

    s = lax.cond(_read_flag(flag_ref), lambda: scores(True), lambda: scores(False))
    a_ref[...] = jnp.where(_intra_mask(geo, seg_ref, c, 0), s, 0.0)


def _per_chunk(kernel, operands, *, geo: ChunkGeometry, interpret, name: str):
    """The pallas_call of intra_scores and chunk_da: grid (B, H, N), output [B, H, Tp, C] float32
    (chunk n's [C, C] block). Each operand is None, a per-chunk flag [B, H, N], a per-token row
    [B, Tp] or a token array [B, Tp, H, D] (chunk n's rows, all of D)."""
    tokens = next(x for x in operands if x is not None and x.ndim == 4)
    bsz, tp, h, _ = tokens.shape
    c = geo.chunk

    def spec(x):
        if x is None:
            return None
        if x.ndim == 2:
            return pl.BlockSpec((None, c), lambda bi, hi, n: (bi, n))
        if x.ndim == 3:
            return pl.BlockSpec((None, None, 1), lambda bi, hi, n: (bi, hi, n))
        return pl.BlockSpec((None, c, None, x.shape[-1]), lambda bi, hi, n: (bi, n, hi, 0))

    with jax.named_scope(f"{name}_chunk={c}"):
        return pl.pallas_call(
            functools.partial(kernel, geo=geo),
            grid=(bsz, h, geo.num_chunks),
            in_specs=[spec(x) for x in operands],
            out_specs=pl.BlockSpec((None, None, c, c), lambda bi, hi, n: (bi, hi, n, 0)),
            out_shape=jax.ShapeDtypeStruct((bsz, h, tp, c), jnp.float32),
            compiler_params=compiler_params(geo),
            interpret=interpret,
            name=name,
        )(*operands)


def intra_scores(q, k, b, seg, bounded, *, geo: ChunkGeometry, interpret):
    """-> A [B, H, Tp, C] float32: per chunk the masked, unscaled intra-chunk scores.
    `bounded` [B, H, N] int32 from bounded_chunks."""
    return _per_chunk(_intra_kernel, [bounded, q, k, b, seg], geo=geo, interpret=interpret,
                      name="gla_intra_scores")


# Backward.


def _da_kernel(do_ref, v_ref, seg_ref, da_ref, *, geo: ChunkGeometry):
    bv = geo.block_v

    def over_v(vb, acc):
        vs = pl.ds(vb * bv, bv)
        return acc + product(do_ref[:, vs], v_ref[:, vs], "nt", HIGHEST)

    da = lax.fori_loop(0, geo.value_dim // bv, over_v,
                       jnp.zeros((geo.chunk, geo.chunk), jnp.float32))
    da_ref[...] = jnp.where(_intra_mask(geo, seg_ref, geo.chunk, 0), da * geo.scale, 0.0)


def chunk_da(do, v, seg, *, geo: ChunkGeometry, interpret):
    """-> dA [B, H, Tp, C] float32: per chunk scale do v^T, masked like A."""
    return _per_chunk(_da_kernel, [do, v, seg], geo=geo, interpret=interpret, name="gla_chunk_da")


def _dqk_kernel(flag_ref, q_ref, k_ref, b_ref, da_ref, v_ref, do_ref, reach_ref, last_ref,
                start_ref, keep_ref, h_ref, dh_ref, dq_ref, dk_ref, dg_ref, *,
                geo: ChunkGeometry):
    c, bk, bv = geo.chunk, geo.block_k, geo.block_v
    dt = q_ref.dtype
    ks = pl.ds(0, bk)

    # Inter-chunk products over V blocks: do h_n^T and v dh_{n+1}^T [C, BK] with the states
    # rounded to the input dtype (as in chunk_output and chunk_dv), and sum_V h_n dh_{n+1} [1, BK]
    # on the stored ones (float32: with bfloat16 ones, dg at T = 1 with an initial state fails the
    # pass rule, docs/gpu_backend.md).
    def over_v(vb, acc):
        dq, dk, hdh = acc
        vs = pl.ds(vb * bv, bv)
        h, dh = h_ref[:, vs], dh_ref[:, vs]  # [BK, BV] as stored
        do, v = do_ref[:, vs], v_ref[:, vs]  # [C, BV]
        if geo.exact_inter:
            dq = dq + accurate_product(do, h, "nt", dt)
            dk = dk + accurate_product(v, dh, "nt", dt)
        else:
            dq = dq + product(do, h.astype(do.dtype), "nt", HIGHEST)
            dk = dk + product(v, dh.astype(v.dtype), "nt", HIGHEST)
        hdh = hdh + jnp.sum(h.astype(jnp.float32) * dh.astype(jnp.float32), axis=1)[None, :]
        return dq, dk, hdh

    zeros = jnp.zeros((c, bk), jnp.float32)
    dq_inter, dk_inter, hdh = lax.fori_loop(0, geo.value_dim // bv, over_v,
                                            (zeros, zeros, jnp.zeros((1, bk), jnp.float32)))
    b = b_ref[...]  # [C, BK]
    b_last = b_ref[pl.ds(c - 1, 1), :]  # [1, BK]
    q_weight = jnp.exp(b) * geo.scale
    k_weight = jnp.exp(b_last - b)
    decay = jnp.exp(b_last)  # [1, BK]: h_n's factor in h_{n+1}
    if reach_ref is not None:
        q_weight = q_weight * reach_ref[...][:, None]
        k_weight = k_weight * last_ref[...][:, None]
        decay = decay * keep_ref[...][:, None]
    dq_inter = dq_inter * q_weight
    dk_inter = dk_inter * k_weight
    q = q_ref[...].astype(jnp.float32)
    k = k_ref[...].astype(jnp.float32)
    da = da_ref[...]  # [C, C] scaled, masked

    # The intra parts go on to dg as q dq - k dk summed over the chunk's later tokens, where the
    # terms of every query and key pair between them cancel: their products keep float32
    # operands (split bfloat16 for 16-bit inputs), as bfloat16-rounded ones left dg 3x over the
    # pass rule.
    def bounded():
        to_ref, from_ref = _chunk_factors(b, b_ref, ks)
        return (to_ref * accurate_product(da, k * from_ref, "nn", dt),
                from_ref * accurate_product(da, q * to_ref, "tn", dt))

    def exact():
        return (_sub_chunk_dq(da, k, b, b_ref, ks, dt)
                + _exact_diagonal(k_ref, b_ref, b, ks, da, keys=False),
                _sub_chunk_dk(da, q, b, b_ref, ks, dt)
                + _exact_diagonal(q_ref, b_ref, b, ks, da, keys=True))

    dq_intra, dk_intra = lax.cond(_read_flag(flag_ref), bounded, exact)
    dq = dq_inter + dq_intra
    dq_ref[...] = dq
    dk_ref[...] = dk_inter + dk_intra
    # dg_t = sum_{s >= t} (q_s dq_s - k_s dk_intra_s) + sum_{s < t} k_s dk_inter_s
    #        + keep exp(B) sum_V h_n dh_{n+1}      (docs/gpu_backend.md derives it; no sum runs
    # across chunks and no term cancels another: products with triangles of ones, exact in
    # bfloat16, keep float32 operands)
    tok, col = _token_ids(c)
    later = (col >= tok).astype(jnp.float32)  # [C, C]: s >= t
    earlier = (col < tok).astype(jnp.float32)
    dg = (accurate_product(later, q * dq - k * dk_intra, "nn", dt)
          + accurate_product(earlier, k * dk_inter, "nn", dt) + decay * hdh)
    if start_ref is not None:
        # the first token of a later segment: the reset ignores its gate
        dg = dg * (1.0 - start_ref[...][:, None])
    dg_ref[...] = dg


def chunk_dqk(q, k, v, do, b, da, reach, last, start, keep, states, dstates, bounded, *,
              geo: ChunkGeometry, interpret):
    """-> (dq, dk, dg) [B, Tp, H, K] float32. `da` [B, H, Tp, C] from chunk_da, `states`
    [B, H, N + 1, K, V] from the forward pass, `dstates` [B, H, N, K, V] from the reversed one,
    `start` [B, Tp] 1.0 where a later segment starts and `keep` [B, N] (None without segments),
    `bounded` [B, H, N] from bounded_chunks."""
    bsz, tp, h, kd = q.shape
    vd = v.shape[-1]
    c, bk = geo.chunk, geo.block_k
    grid = (bsz, h, geo.num_chunks, kd // bk)
    tok_k = pl.BlockSpec((None, c, None, bk), lambda bi, hi, n, ki: (bi, n, hi, ki))
    tok_v = pl.BlockSpec((None, c, None, vd), lambda bi, hi, n, ki: (bi, n, hi, 0))
    da_spec = pl.BlockSpec((None, None, c, c), lambda bi, hi, n, ki: (bi, hi, n, 0))
    row_spec = None if reach is None else pl.BlockSpec((None, c), lambda bi, hi, n, ki: (bi, n))
    keep_spec = None if keep is None else pl.BlockSpec((None, 1), lambda bi, hi, n, ki: (bi, n))
    st_spec = pl.BlockSpec((None, None, None, bk, vd), lambda bi, hi, n, ki: (bi, hi, n, ki, 0))
    flag_spec = pl.BlockSpec((None, None, 1), lambda bi, hi, n, ki: (bi, hi, n))
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    with jax.named_scope(f"gla_chunk_dqk_chunk={c}_block_k={bk}"):
        return pl.pallas_call(
            functools.partial(_dqk_kernel, geo=geo),
            grid=grid,
            in_specs=[flag_spec, tok_k, tok_k, tok_k, da_spec, tok_v, tok_v, row_spec, row_spec,
                      row_spec, keep_spec, st_spec, st_spec],
            out_specs=[tok_k, tok_k, tok_k],
            out_shape=[out, out, out],
            compiler_params=plgpu.CompilerParams(num_warps=geo.num_warps_dqk,
                                                 num_stages=geo.num_stages),
            interpret=interpret,
            name="gla_chunk_dqk",
        )(bounded, q, k, b, da, v, do, reach, last, start, keep, states, dstates)


