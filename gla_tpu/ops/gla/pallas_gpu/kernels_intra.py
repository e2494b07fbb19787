"""Pallas (Triton lowering) kernels of the intra-chunk GLA products on GPU (no autodiff in here).

Notation of docs/gla_math.md and docs/gpu_gla.md: chunk length C, sub-chunk length
c = SUB_CHUNK = 16, b = chunk-local running sum of the log gate g (computed outside, float32,
[B, T, H, K]), B_n = b at the last token of chunk n, h_n the [K, V] state entering chunk n.
Per-head and absent
gates arrive broadcast to [B, T, H, K]. Segment masks arrive precomputed (entry.py):
`reach` (the carried state reaches the token), `last` (the token is in its chunk's last segment),
`keep` (no reset inside the chunk), and the running segment index `seg` for intra-chunk masks.

Kernels (the state pass is in kernels_state.py, outputs and dv in kernels_output.py):
- `intra_scores`: the masked, unscaled intra-chunk scores A [C, C] per chunk.
Per-head and absent gates (geo.per_head) take one path of their own, one program per chunk for
any gate strength (section "Per-head gates").
- `chunk_da`: dA = scale do v^T [C, C] per chunk, masked like A.
- `chunk_dqk`: dq, dk, dg (float32) of a chunk and K block, intra and inter parts.
The intra-chunk products take one path whatever the gates (section "Intra-chunk products").
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


def _intra_mask(geo: ChunkGeometry, seg_ref, n_rows: int, row_offset, n_cols=None,
                col_offset=0):
    """[n_rows, n_cols] causal (and same-segment) mask of a block of query rows and key columns
    of the chunk (default: all C keys): entry (r, x) pairs query row_offset + r with key
    col_offset + x."""
    n_cols = n_cols or geo.chunk
    r = row_offset + jnp.arange(n_rows, dtype=jnp.int32)[:, None]
    x = col_offset + jnp.arange(n_cols, dtype=jnp.int32)[None, :]
    seg_rows = seg_cols = None
    if geo.has_segments:
        seg_cols = seg_ref[pl.ds(col_offset, n_cols)][None, :]
        seg_rows = seg_ref[pl.ds(row_offset, n_rows)][:, None]
    return intra_chunk_visibility(r, x, seg_rows, seg_cols)


# Intra-chunk products: two paths, chosen per chunk at run time; one program per sub-chunk of
# S = SUB_CHUNK rows ([S, BK] tiles; the grid's last axis), or one per chunk when the caller knows
# every chunk of the call is bounded (all_bounded=True, vjp.py decides at run time).
# - Bounded chunks (the chunk decays by at most BOUND in every key channel; fla's GLA layer gates,
#   logsigmoid / 16): one reference for the whole chunk, b_0 = b at its first token, and one
#   product on the matrix units: A = (q exp(b - b_0)) (k exp(b_0 - b))^T,
#   dq = exp(b - b_0) (dA (k exp(b_0 - b))), dk = exp(b_0 - b) (dA^T (q exp(b - b_0))), every
#   factor in [exp(-BOUND), exp(BOUND)], far from float32 and bfloat16 overflow; each product term
#   keeps its relative rounding.
# - Other chunks (any finite gate, tested down to -1e3 a token): secondary chunking. Pairs in
#   different sub-chunks factor through a reference inside the chunk with both exponents <= 0 and
#   go to the matrix units: queries of sub-chunk I against earlier keys through b_I0 (b at I's
#   first token), keys of sub-chunk J against later queries through b_J1 (b at J's last token).
#   Pairs inside one sub-chunk (the [S, S] diagonal blocks) are summed elementwise, one step per
#   position, every exponent b_later - b_earlier <= 0. A factor that underflows belongs to a pair
#   whose true weight underflows too.
BOUND = 40.0
S = SUB_CHUNK


def bounded_chunks(b, chunk: int):
    """b [B, Tp, H, K] chunk-local running sum of the log gate -> [B, H, N] int32: 1 where
    |b - b_first| <= BOUND over the chunk in every key channel (for log gates <= 0: the chunk
    decays by at most BOUND; NaN or infinite gates take the exact path)."""
    bsz, tp, h, kd = b.shape
    bc = b.reshape(bsz, tp // chunk, chunk, h, kd)
    span = jnp.max(jnp.abs(bc - bc[:, :, :1]), axis=(2, 4))  # [B, N, H]
    return (span <= BOUND).astype(jnp.int32).transpose(0, 2, 1)


def _read_flag(flag_ref):
    return jnp.max(flag_ref[...]) > 0


def _whole_chunk_factors(x_ref, b_ref, ks, *, to_first: bool):
    """[C, BK]: x exp(b_0 - b) (keys, to_first) or x exp(b - b_0) (queries) of a bounded chunk."""
    rel = b_ref[:, ks] - b_ref[pl.ds(0, 1), ks]
    return x_ref[:, ks].astype(jnp.float32) * jnp.exp(-rel if to_first else rel)


def _rows(i):
    """The tokens of sub-chunk i (static or traced)."""
    return pl.ds(i * S, S)


def _decay(b_late, b_early, valid):
    """exp(b_late - b_early) where `valid` (there the exponent is <= 0), 1 elsewhere (pairs the
    caller's weights or masks remove; no overflow from the reversed difference)."""
    return jnp.exp(jnp.where(valid, b_late - b_early, 0.0))


def _earlier_keys(x_ref, b_ref, ks, i, c: int):
    """[C, BK]: x exp(b_I0 - b) for the tokens of sub-chunks before i, zero from sub-chunk i on
    (b_I0: b at sub-chunk i's first token)."""
    tok = jnp.arange(c, dtype=jnp.int32)[:, None]
    visible = tok < i * S
    x = x_ref[:, ks].astype(jnp.float32)
    return jnp.where(visible, x * _decay(b_ref[pl.ds(i * S, 1), ks], b_ref[:, ks], visible), 0.0)


def _later_queries(x_ref, b_ref, j, c: int):
    """[C, BK]: x exp(b - b_J1) for the tokens of sub-chunks after j, zero up to sub-chunk j's end
    (b_J1: b at sub-chunk j's last token)."""
    tok = jnp.arange(c, dtype=jnp.int32)[:, None]
    later = tok >= (j + 1) * S
    x = x_ref[...].astype(jnp.float32)
    return jnp.where(later, x * _decay(b_ref[...], b_ref[pl.ds(j * S + S - 1, 1), :], later), 0.0)


def _bounded_rows(q_ref, k_ref, b_ref, seg_ref, a_ref, rows, n_rows: int, geo: ChunkGeometry):
    """A's rows `rows` (n_rows of them) of a bounded chunk: one product per K block."""
    c, bk = geo.chunk, geo.block_k
    dt = q_ref.dtype

    def over_k(kb, acc):
        ks = pl.ds(kb * bk, bk)
        rel = b_ref[rows, ks] - b_ref[pl.ds(0, 1), ks]
        q_rel = (q_ref[rows, ks].astype(jnp.float32) * jnp.exp(rel)).astype(dt)
        keys = _whole_chunk_factors(k_ref, b_ref, ks, to_first=True).astype(dt)
        return acc + product(q_rel, keys, "nt", HIGHEST)

    s = lax.fori_loop(0, geo.key_dim // bk, over_k, jnp.zeros((n_rows, c), jnp.float32))
    a_ref[...] = jnp.where(_intra_mask(geo, seg_ref, n_rows, rows.start), s, 0.0)


def _intra_kernel(flag_ref, q_ref, k_ref, b_ref, seg_ref, a_ref, *, geo: ChunkGeometry):
    """Rows of sub-chunk i of A, by the chunk's path."""
    i = pl.program_id(3)  # sub-chunk of rows
    bounded = _read_flag(flag_ref)

    @pl.when(bounded)
    def _():
        _bounded_rows(q_ref, k_ref, b_ref, seg_ref, a_ref, _rows(i), S, geo)

    @pl.when(jnp.logical_not(bounded))
    def _():
        _exact_rows(q_ref, k_ref, b_ref, seg_ref, a_ref, i, geo)


def _whole_chunk_kernel(q_ref, k_ref, b_ref, seg_ref, a_ref, *, geo: ChunkGeometry):
    """All of A when every chunk of the call is bounded, or the gates are per head: one program
    per chunk."""
    if geo.per_head:
        _per_head_rows(q_ref, k_ref, b_ref, seg_ref, a_ref, geo)
    else:
        _bounded_rows(q_ref, k_ref, b_ref, seg_ref, a_ref, pl.ds(0, geo.chunk), geo.chunk, geo)


# Per-head gates (and none): b is one number per token, so the decay between query r and key x,
# exp(b_r - b_x), is one number per pair. A = (q k^T) * E with E_rx = exp(b_r - b_x) on the
# visible pairs (exponent <= 0, any gate strength) and 0 elsewhere: one product on the matrix
# units and one [C, C] elementwise step, whatever the gates. The backward takes the same E:
# dq = (dA * E) k, dk = (dA * E)^T q, the pair of a token with itself left apart as in the exact
# path (it drops out of dg).


def _per_head_decay(geo: ChunkGeometry, b_ref, seg_ref, *, strict: bool):
    """[C, C] E_rx = exp(b_r - b_x) where query r sees key x (strict: x < r; seg_ref None: by
    position only), 0 elsewhere. The gate arrives broadcast over K: its column 0 is b."""
    c = geo.chunk
    b_col = b_ref[:, pl.ds(0, 1)]  # [C, 1]
    tok = jnp.arange(c, dtype=jnp.int32)
    if seg_ref is None:  # the backward: dA carries the segment mask already
        visible = intra_chunk_visibility(tok[:, None], tok[None, :])
    else:
        visible = _intra_mask(geo, seg_ref, c, 0)
    if strict:
        visible = jnp.logical_and(visible, tok[:, None] != tok[None, :])
    diff = b_col - jnp.transpose(b_col)  # [C, C]: b_r - b_x
    return jnp.where(visible, jnp.exp(jnp.where(visible, diff, 0.0)), 0.0)


def _per_head_rows(q_ref, k_ref, b_ref, seg_ref, a_ref, geo: ChunkGeometry):
    """All of A for per-head gates: one product per K block, then the decay."""
    bk = geo.block_k

    def over_k(kb, acc):
        ks = pl.ds(kb * bk, bk)
        return acc + product(q_ref[:, ks], k_ref[:, ks], "nt", HIGHEST)

    s = lax.fori_loop(0, geo.key_dim // bk, over_k,
                      jnp.zeros((geo.chunk, geo.chunk), jnp.float32))
    a_ref[...] = s * _per_head_decay(geo, b_ref, seg_ref, strict=False)


def _per_head_pairs(q_ref, k_ref, b_ref, seg_ref, da_ref, da_t_ref, geo: ChunkGeometry, dt):
    """([C, BK] dq's pairs x < r, [C, BK] dk's pairs r > x, [C, 1] dA_rr) of a chunk's K block
    for per-head gates."""
    c = geo.chunk
    decay = _per_head_decay(geo, b_ref, seg_ref, strict=True)
    da = da_ref[...]
    tok = jnp.arange(c, dtype=jnp.int32)
    own = jnp.sum(jnp.where(tok[:, None] == tok[None, :], da, 0.0), axis=1)[:, None]
    dq = accurate_product(da * decay, k_ref[...], "nn", dt)
    dk = accurate_product(da_t_ref[...] * jnp.transpose(decay), q_ref[...], "nn", dt)
    return dq, dk, own


def _exact_rows(q_ref, k_ref, b_ref, seg_ref, a_ref, i, geo: ChunkGeometry):
    """A's rows of sub-chunk i for any gates: the earlier sub-chunks' keys as one product per K
    block, stored outside the diagonal block, then the diagonal block one key column at a time
    (every entry is written once)."""
    c, bk, nk = geo.chunk, geo.block_k, geo.key_dim // geo.block_k
    dt = q_ref.dtype
    rows = _rows(i)

    def other_keys(kb, acc):  # earlier sub-chunks (none for i = 0: the keys are all zero)
        ks = pl.ds(kb * bk, bk)
        q = q_ref[rows, ks].astype(jnp.float32)  # [S, BK]
        q_rel = (q * jnp.exp(b_ref[rows, ks] - b_ref[pl.ds(i * S, 1), ks])).astype(dt)
        return acc + product(q_rel, _earlier_keys(k_ref, b_ref, ks, i, c).astype(dt), "nt",
                             HIGHEST)

    s = lax.fori_loop(0, nk, other_keys, jnp.zeros((S, c), jnp.float32))
    col = jnp.arange(c, dtype=jnp.int32)[None, :]
    outside = jnp.broadcast_to(jnp.logical_or(col < i * S, col >= i * S + S), (S, c))
    plgpu.store(a_ref, jnp.where(_intra_mask(geo, seg_ref, S, i * S), s, 0.0), mask=outside)

    pos = jnp.arange(S, dtype=jnp.int32)[:, None]

    def diagonal_column(j, carry):  # key x = i S + j
        x = i * S + j

        def over_k(kb, acc):
            ks = pl.ds(kb * bk, bk)
            q = q_ref[rows, ks].astype(jnp.float32)
            k_x = k_ref[pl.ds(x, 1), ks].astype(jnp.float32)  # [1, BK]
            decay = _decay(b_ref[rows, ks], b_ref[pl.ds(x, 1), ks], pos >= j)
            return acc + jnp.sum(q * k_x * decay, axis=1)[:, None]

        s = lax.fori_loop(0, nk, over_k, jnp.zeros((S, 1), jnp.float32))
        visible = _intra_mask(geo, seg_ref, S, i * S, 1, x)  # [S, 1]
        a_ref[:, pl.ds(x, 1)] = jnp.where(visible, s, 0.0)
        return carry

    lax.fori_loop(0, S, diagonal_column, 0)


def _per_chunk(kernel, operands, *, geo: ChunkGeometry, interpret, name: str,
               row_blocks: int = 1, n_out: int = 1):
    """The pallas_call of intra_scores and chunk_da: grid (B, H, N, row_blocks), output
    [B, H, Tp, C] float32 (chunk n's [C, C] block, C / row_blocks rows per program; n_out of
    them). Each operand is None, a per-chunk flag [B, H, N], a per-token row [B, Tp] or a token
    array [B, Tp, H, D] (chunk n's rows, all of D)."""
    tokens = next(x for x in operands if x is not None and x.ndim == 4)
    bsz, tp, h, _ = tokens.shape
    c = geo.chunk

    def spec(x):
        if x is None:
            return None
        if x.ndim == 2:
            return pl.BlockSpec((None, c), lambda bi, hi, n, r: (bi, n))
        if x.ndim == 3:
            return pl.BlockSpec((None, None, 1), lambda bi, hi, n, r: (bi, hi, n))
        return pl.BlockSpec((None, c, None, x.shape[-1]), lambda bi, hi, n, r: (bi, n, hi, 0))

    out_spec = pl.BlockSpec((None, None, c // row_blocks, c),
                            lambda bi, hi, n, r: (bi, hi, n * row_blocks + r, 0))
    out_shape = jax.ShapeDtypeStruct((bsz, h, tp, c), jnp.float32)
    with jax.named_scope(f"{name}_chunk={c}"):
        return pl.pallas_call(
            functools.partial(kernel, geo=geo),
            grid=(bsz, h, geo.num_chunks, row_blocks),
            in_specs=[spec(x) for x in operands],
            out_specs=out_spec if n_out == 1 else [out_spec] * n_out,
            out_shape=out_shape if n_out == 1 else [out_shape] * n_out,
            compiler_params=compiler_params(geo),
            interpret=interpret,
            name=name,
        )(*operands)


def intra_scores(q, k, b, seg, bounded, *, geo: ChunkGeometry, interpret,
                 all_bounded: bool = False):
    """-> A [B, H, Tp, C] float32: per chunk the masked, unscaled intra-chunk scores.
    `bounded` [B, H, N] int32 from bounded_chunks. all_bounded (every chunk is): one program per
    chunk instead of one per sub-chunk of rows."""
    if all_bounded:
        return _per_chunk(_whole_chunk_kernel, [q, k, b, seg], geo=geo, interpret=interpret,
                          name="gla_intra_scores_whole")
    return _per_chunk(_intra_kernel, [bounded, q, k, b, seg], geo=geo, interpret=interpret,
                      name="gla_intra_scores", row_blocks=geo.chunk // S)


# Backward.


def _da_kernel(do_ref, v_ref, seg_ref, da_ref, da_t_ref, *, geo: ChunkGeometry):
    """dA and dA^T: the backward reads dA by key columns and by query columns, both as [S, 1]
    slices of one row-major layout or the other."""
    bv, c = geo.block_v, geo.chunk

    def over_v(vb, acc):
        vs = pl.ds(vb * bv, bv)
        do, v = do_ref[:, vs], v_ref[:, vs]
        return acc[0] + product(do, v, "nt", HIGHEST), acc[1] + product(v, do, "nt", HIGHEST)

    zeros = jnp.zeros((c, c), jnp.float32)
    da, da_t = lax.fori_loop(0, geo.value_dim // bv, over_v, (zeros, zeros))
    tok = jnp.arange(c, dtype=jnp.int32)
    seg_rows = seg_cols = None
    if geo.has_segments:
        seg_rows, seg_cols = seg_ref[...][:, None], seg_ref[...][None, :]
    # row x, column r of dA^T: query r sees key x
    visible_t = intra_chunk_visibility(tok[None, :], tok[:, None], seg_cols, seg_rows)
    da_ref[...] = jnp.where(_intra_mask(geo, seg_ref, c, 0), da * geo.scale, 0.0)
    da_t_ref[...] = jnp.where(visible_t, da_t * geo.scale, 0.0)


def chunk_da(do, v, seg, *, geo: ChunkGeometry, interpret):
    """-> (dA, dA^T) [B, H, Tp, C] float32: per chunk dA = scale do v^T, masked like A, and its
    transpose (row x, column r holds dA_rx)."""
    return _per_chunk(_da_kernel, [do, v, seg], geo=geo, interpret=interpret, name="gla_chunk_da",
                      n_out=2)


def _intra_dq(da_ref, k_ref, b_ref, b, m, c: int, dt):
    """For the queries r of sub-chunk m (b: theirs, [S, BK]): ([S, BK] sum_{x < r} dA_rx k_x
    exp(b_r - b_x), [S, 1] dA_rr). The pair of a token with itself, dA_rr k_r, is left to the
    caller: its gate factor is exp(0), so it drops out of dg exactly (see _dqk_kernel)."""
    pos = jnp.arange(S, dtype=jnp.int32)[:, None]

    def diagonal_step(j, carry):  # key x = m S + j
        out, own = carry
        x = m * S + j
        weight = da_ref[_rows(m), pl.ds(x, 1)]  # [S, 1]
        k_x = k_ref[pl.ds(x, 1), :].astype(jnp.float32)  # [1, BK]
        decay = _decay(b, b_ref[pl.ds(x, 1), :], pos > j)
        return (out + jnp.where(pos > j, weight, 0.0) * k_x * decay,
                jnp.where(pos == j, weight, own))

    out, own = lax.fori_loop(0, S, diagonal_step, (jnp.zeros(b.shape, jnp.float32),
                                                   jnp.zeros((S, 1), jnp.float32)))
    # keys of earlier sub-chunks, through b at sub-chunk m's first token (none for m = 0)
    keys = _earlier_keys(k_ref, b_ref, pl.ds(0, b.shape[1]), m, c)
    out = out + (jnp.exp(b - b_ref[pl.ds(m * S, 1), :])
                 * accurate_product(da_ref[_rows(m), :], keys, "nn", dt))
    return out, own


def _intra_dk(da_t_ref, q_ref, b_ref, b, m, c: int, dt):
    """[S, BK]: dk_x = sum_{r > x} dA_rx q_r exp(b_r - b_x) for the keys x of sub-chunk m
    (b: theirs, [S, BK]; the pair of a token with itself is left out, as in _intra_dq)."""
    pos = jnp.arange(S, dtype=jnp.int32)[:, None]

    def diagonal_step(i, out):  # query r = m S + i
        r = m * S + i
        weight = da_t_ref[_rows(m), pl.ds(r, 1)]  # [S, 1]: dA_rx for the keys x
        q_r = q_ref[pl.ds(r, 1), :].astype(jnp.float32)  # [1, BK]
        decay = _decay(b_ref[pl.ds(r, 1), :], b, pos < i)
        return out + jnp.where(pos < i, weight, 0.0) * q_r * decay

    out = lax.fori_loop(0, S, diagonal_step, jnp.zeros(b.shape, jnp.float32))
    # queries of later sub-chunks, through b at sub-chunk m's last token (none for the last m)
    anchor = b_ref[pl.ds(m * S + S - 1, 1), :]
    return out + jnp.exp(anchor - b) * accurate_product(
        da_t_ref[_rows(m), :], _later_queries(q_ref, b_ref, m, c), "nn", dt)


def _dqk_kernel(flag_ref, q_ref, k_ref, b_ref, da_ref, da_t_ref, v_ref, do_ref, reach_ref,
                last_ref, keep_ref, h_ref, dh_ref, dq_ref, dk_ref, dg_ref, *sum_refs,
                geo: ChunkGeometry, n_rows: int):
    """One chunk, K block and block m of n_rows rows: dq, dk, and of dg the part inside the
    block. n_rows = S (sub-chunks): chunk_dqk adds what the chunk's other sub-chunks contribute,
    from the column sums x_sum and y_sum (sum_refs). n_rows = C: every chunk is bounded, no flag
    and no sums."""
    c, bk, bv = geo.chunk, geo.block_k, geo.block_v
    dt = q_ref.dtype
    m = pl.program_id(4)
    rows = pl.ds(m * n_rows, n_rows)

    # Inter-chunk products over V blocks: do h_n^T and v dh_{n+1}^T [R, BK] with the states
    # rounded to the input dtype (as in chunk_output and chunk_dv), and sum_V h_n dh_{n+1} [1, BK]
    # on the stored ones (float32: with bfloat16 ones, dg at T = 1 with an initial state fails the
    # pass rule, docs/results/history.md, 2026-11-22).
    def over_v(vb, acc):
        dq, dk, hdh = acc
        vs = pl.ds(vb * bv, bv)
        h, dh = h_ref[:, vs], dh_ref[:, vs]  # [BK, BV] as stored
        do, v = do_ref[rows, vs], v_ref[rows, vs]  # [R, BV] (R = n_rows)
        if geo.exact_inter:
            dq = dq + accurate_product(do, h, "nt", dt)
            dk = dk + accurate_product(v, dh, "nt", dt)
        else:
            dq = dq + product(do, h.astype(do.dtype), "nt", HIGHEST)
            dk = dk + product(v, dh.astype(v.dtype), "nt", HIGHEST)
        hdh = hdh + jnp.sum(h.astype(jnp.float32) * dh.astype(jnp.float32), axis=1)[None, :]
        return dq, dk, hdh

    zeros = jnp.zeros((n_rows, bk), jnp.float32)
    dq_inter, dk_inter, hdh = lax.fori_loop(0, geo.value_dim // bv, over_v,
                                            (zeros, zeros, jnp.zeros((1, bk), jnp.float32)))
    b = b_ref[rows, :]  # [R, BK]
    b_last = b_ref[pl.ds(c - 1, 1), :]  # [1, BK]
    q = q_ref[rows, :].astype(jnp.float32)
    k = k_ref[rows, :].astype(jnp.float32)
    q_weight = jnp.exp(b) * geo.scale
    k_weight = jnp.exp(b_last - b)
    decay = jnp.exp(b_last)  # h_n's factor in h_{n+1}
    if reach_ref is not None:
        q_weight = q_weight * reach_ref[rows][:, None]
        k_weight = k_weight * last_ref[rows][:, None]
        decay = decay * keep_ref[...][:, None]

    def bounded():  # the pair of a token with itself stays in (own = 0): weak gates
        rel = b - b_ref[pl.ds(0, 1), :]
        keys = _whole_chunk_factors(k_ref, b_ref, pl.ds(0, bk), to_first=True)
        queries = _whole_chunk_factors(q_ref, b_ref, pl.ds(0, bk), to_first=False)
        return (jnp.exp(rel) * accurate_product(da_ref[rows, :], keys, "nn", dt),
                jnp.exp(-rel) * accurate_product(da_t_ref[rows, :], queries, "nn", dt),
                jnp.zeros((n_rows, 1), jnp.float32))

    def exact():
        dq_pairs, own = _intra_dq(da_ref, k_ref, b_ref, b, m, c, dt)
        return dq_pairs, _intra_dk(da_t_ref, q_ref, b_ref, b, m, c, dt), own

    if geo.per_head:
        dq_pairs, dk_intra, own = _per_head_pairs(q_ref, k_ref, b_ref, None, da_ref, da_t_ref,
                                                  geo, dt)
    elif flag_ref is None:
        dq_pairs, dk_intra, own = bounded()
    else:
        dq_pairs, dk_intra, own = lax.cond(_read_flag(flag_ref), bounded, exact)
    dq = dq_inter * q_weight + dq_pairs
    dk_inter = dk_inter * k_weight
    dq_ref[...] = dq + own * k
    dk_ref[...] = dk_inter + dk_intra + own * q

    # dg_t = sum_{s >= t} x_s + sum_{s < t} y_s + keep exp(B) sum_V h_n dh_{n+1}, with
    # x = q dq - k dk_intra and y = k dk_inter over the chunk's tokens s (docs/gpu_gla.md
    # derives it; no sum runs across chunks and no term cancels another). x leaves out each
    # token's pair with itself (dA_tt q_t k_t in both q dq and k dk): it cancels exactly in
    # theory, and in float32 it would leave a rounding error of the size of q k dA where, under
    # strong gates, dg itself is orders of magnitude smaller. Here the sums over this block's s,
    # as products with triangles of ones (exact in bfloat16) on float32 operands.
    x = q * dq - k * dk_intra
    y = k * dk_inter
    tok = jnp.arange(n_rows, dtype=jnp.int32)[:, None]
    col = jnp.arange(n_rows, dtype=jnp.int32)[None, :]
    later = (col >= tok).astype(jnp.float32)  # [R, R]: s >= t
    earlier = (col < tok).astype(jnp.float32)
    dg_ref[...] = (accurate_product(later, x, "nn", dt) + accurate_product(earlier, y, "nn", dt)
                   + decay * hdh)
    if sum_refs:
        x_sum_ref, y_sum_ref = sum_refs
        x_sum_ref[...] = jnp.sum(x, axis=0)[None, :]
        y_sum_ref[...] = jnp.sum(y, axis=0)[None, :]


def _exclusive_cumsum(x, axis: int, *, reverse: bool):
    """Sum of the entries strictly before (reverse: after) each one along `axis`, added up
    without subtracting anything."""
    if reverse:
        return jnp.flip(_exclusive_cumsum(jnp.flip(x, axis), axis, reverse=False), axis)
    shifted = lax.slice_in_dim(x, 0, x.shape[axis] - 1, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (1, 0)
    return jnp.cumsum(jnp.pad(shifted, pad), axis=axis)


def chunk_dqk(q, k, v, do, b, da, da_t, reach, last, start, keep, states, dstates, bounded, *,
              geo: ChunkGeometry, interpret, all_bounded: bool = False):
    """-> (dq, dk, dg) [B, Tp, H, K] float32. `da`, `da_t` [B, H, Tp, C] from chunk_da, `states`
    [B, H, N + 1, K, V] from the forward pass, `dstates` [B, H, N, K, V] from the reversed one,
    `start` [B, Tp] 1.0 where a later segment starts and `keep` [B, N] (None without segments),
    `bounded` [B, H, N] from bounded_chunks. Grid (B, H, N, K/BK, C/S): one sub-chunk of rows
    per program; all_bounded (every chunk is): (B, H, N, K/BK, 1), one chunk per program."""
    bsz, tp, h, kd = q.shape
    vd = v.shape[-1]
    c, bk = geo.chunk, geo.block_k
    n_rows = c if all_bounded else S
    ns = c // n_rows
    grid = (bsz, h, geo.num_chunks, kd // bk, ns)
    tok_k = pl.BlockSpec((None, c, None, bk), lambda bi, hi, n, ki, m: (bi, n, hi, ki))
    tok_v = pl.BlockSpec((None, c, None, vd), lambda bi, hi, n, ki, m: (bi, n, hi, 0))
    da_spec = pl.BlockSpec((None, None, c, c), lambda bi, hi, n, ki, m: (bi, hi, n, 0))
    row_spec = (None if reach is None
                else pl.BlockSpec((None, c), lambda bi, hi, n, ki, m: (bi, n)))
    keep_spec = (None if keep is None
                 else pl.BlockSpec((None, 1), lambda bi, hi, n, ki, m: (bi, n)))
    st_spec = pl.BlockSpec((None, None, None, bk, vd),
                           lambda bi, hi, n, ki, m: (bi, hi, n, ki, 0))
    flag_spec = pl.BlockSpec((None, None, 1), lambda bi, hi, n, ki, m: (bi, hi, n))
    sub_rows = pl.BlockSpec((None, n_rows, None, bk),
                            lambda bi, hi, n, ki, m: (bi, n * ns + m, hi, ki))
    sums = pl.BlockSpec((None, 1, None, bk), lambda bi, hi, n, ki, m: (bi, n * ns + m, hi, ki))
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    out_sums = jax.ShapeDtypeStruct((bsz, tp // S, h, kd), jnp.float32)
    n_out = 3 if all_bounded else 5
    with jax.named_scope(f"gla_chunk_dqk_chunk={c}_block_k={bk}_rows={n_rows}"):
        dq, dk, dg, *sums_out = pl.pallas_call(
            functools.partial(_dqk_kernel, geo=geo, n_rows=n_rows),
            grid=grid,
            in_specs=[None if all_bounded else flag_spec, tok_k, tok_k, tok_k, da_spec, da_spec,
                      tok_v, tok_v, row_spec, row_spec, keep_spec, st_spec, st_spec],
            out_specs=[sub_rows, sub_rows, sub_rows, sums, sums][:n_out],
            out_shape=[out, out, out, out_sums, out_sums][:n_out],
            compiler_params=plgpu.CompilerParams(num_warps=geo.num_warps_dqk,
                                                 num_stages=geo.num_stages),
            interpret=interpret,
            name="gla_chunk_dqk",
        )(None if all_bounded else bounded, q, k, b, da, da_t, v, do, reach, last, keep, states,
          dstates)
        if sums_out:
            # what the chunk's later sub-chunks add through x, and its earlier ones through y
            x_sum, y_sum = sums_out
            per_sub = (bsz, geo.num_chunks, ns, h, kd)
            other = (_exclusive_cumsum(x_sum.reshape(per_sub), 2, reverse=True)
                     + _exclusive_cumsum(y_sum.reshape(per_sub), 2, reverse=False))
            dg = (dg.reshape(bsz, geo.num_chunks, ns, S, h, kd)
                  + other[:, :, :, None]).reshape(q.shape)
        if start is not None:
            # the first token of a later segment: the reset ignores its gate
            dg = dg * (1.0 - start)[:, :, None, None]
    return dq, dk, dg


