"""Pallas (Triton lowering) kernels of the chunked GLA on GPU; none of them knows about autodiff.

Notation of docs/gla_math.md and docs/gpu_backend.md: chunk length C, sub-chunk length c = 16,
b = chunk-local running sum of the log gate g (computed outside, float32, [B, T, H, K]),
B_n = b at the last token of chunk n, h_n the [K, V] state entering chunk n. Per-head and absent
gates arrive broadcast to [B, T, H, K]. Segment masks arrive precomputed (pallas_gpu.py):
`reach` (the carried state reaches the token), `last` (the token is in its chunk's last segment),
`keep` (no reset inside the chunk), and the running segment index `seg` for intra-chunk masks.

Kernels:
- `state_pass`: one program per (batch, head, K block, V block), a loop over chunks, forward
  (h_{n+1} = keep_n exp(B_n) h_n + (k exp(B_n - b) last)^T v) or reversed for the backward
  (dh_n = keep_n exp(B_n) dh_{n+1} + (q exp(b) reach scale)^T do): one kernel, two directions.
- `intra_scores`: the masked, unscaled intra-chunk scores A [C, C] per chunk.
- `chunk_output`: o = scale (A v + (q exp(b) reach) h_n).
- `chunk_dqk`: dq, dk (float32) of a chunk and K block, intra and inter parts.
- `chunk_dv`: dv = scale A^T do + (k exp(B - b) last) dh_{n+1}.
Every exponent is of a non-positive difference of b (secondary chunking on the diagonal).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

SUB = 16  # sub-chunk length of the secondary chunking
_HIGHEST = lax.Precision.HIGHEST
_SPLIT_BF16 = lax.DotAlgorithmPreset.BF16_BF16_F32_X3


@dataclasses.dataclass(frozen=True)
class ChunkGeometry:
    """Static facts of one chunked GLA call (hashable)."""

    chunk: int  # C
    block_k: int
    block_v: int
    key_dim: int  # padded K (a power of two >= block_k)
    value_dim: int  # padded V
    num_chunks: int  # N
    scale: float
    has_segments: bool
    num_warps: int = 4
    num_stages: int = 2


def _dot(a, b):
    return jnp.dot(a, b, precision=_HIGHEST, preferred_element_type=jnp.float32)


def _dot_t(a, b):  # a @ b.T
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                           preferred_element_type=jnp.float32)


def _accurate_precision(input_dtype):
    """Precision of a float32 product that dg's cancellation needs: for 16-bit inputs, each
    operand split in a bfloat16 head and tail, three bfloat16 products on the matrix units (about
    2^-16 relative, enough next to bfloat16 inputs); for float32 inputs the IEEE fp32 path (the
    split's 2^-16 left dg 2.8x over the float32 bound on the H200)."""
    return _HIGHEST if jnp.dtype(input_dtype) == jnp.float32 else _SPLIT_BF16


def _t_dot_f32(a, b, input_dtype):
    """a.T @ b of float32 operands to the accuracy _accurate_precision gives."""
    return lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32),
                           (((0,), (0,)), ((), ())), precision=_accurate_precision(input_dtype),
                           preferred_element_type=jnp.float32)


def _dot_t_f32(a, b, input_dtype):
    """a @ b.T of float32 operands to the accuracy _accurate_precision gives."""
    return lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32),
                           (((1,), (1,)), ((), ())), precision=_accurate_precision(input_dtype),
                           preferred_element_type=jnp.float32)


def _t_dot(a, b):  # a.T @ b
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HIGHEST,
                           preferred_element_type=jnp.float32)


def _params(geo: ChunkGeometry):
    return plgpu.CompilerParams(num_warps=geo.num_warps, num_stages=geo.num_stages)


def _intra_mask(geo: ChunkGeometry, seg_ref, n_rows: int, row_offset: int, *, transpose=False):
    """[n_rows, C] causal (and same-segment) mask of a row block (query rows, or key rows when
    `transpose`): entry (r, x) pairs row r of the block with token x of the chunk."""
    r = row_offset + jnp.arange(n_rows, dtype=jnp.int32)[:, None]
    x = jnp.arange(geo.chunk, dtype=jnp.int32)[None, :]
    mask = (x >= r) if transpose else (x <= r)
    if geo.has_segments:
        seg_all = seg_ref[...][None, :]  # [1, C]
        seg_rows = seg_ref[pl.ds(row_offset, n_rows)][:, None]
        mask = jnp.logical_and(mask, seg_rows == seg_all)
    return mask


# State pass.


def _state_kernel(x_ref, y_ref, b_ref, w_ref, keep_ref, init_ref, states_ref, final_ref, *,
                  geo: ChunkGeometry, reverse: bool):
    c = geo.chunk
    if init_ref is None:
        h = jnp.zeros((geo.block_k, geo.block_v), jnp.float32)
    else:
        h = init_ref[...]

    def body(step, h):
        n = geo.num_chunks - 1 - step if reverse else step
        rows = pl.ds(n * c, c)
        states_ref[n, :, :] = h
        b = b_ref[rows, :]  # [C, BK]
        b_last = b_ref[pl.ds(n * c + c - 1, 1), :]  # [1, BK]
        x = x_ref[rows, :]
        if reverse:
            weight = jnp.exp(b) * geo.scale  # exp(b) <= 1
        else:
            weight = jnp.exp(b_last - b)  # exponent <= 0
        if w_ref is not None:
            weight = weight * w_ref[rows][:, None]
        decay = jnp.exp(b_last)  # [1, BK]
        if keep_ref is not None:
            decay = decay * keep_ref[pl.ds(n, 1)][:, None]
        # the gated operand stays float32 (split-bfloat16 product): dg cancels q dq - k dk
        # against h dh, which holds only if the states are as exact as the gradients
        xw = x.astype(jnp.float32) * weight
        return h * decay.T + _t_dot_f32(xw, y_ref[rows, :], x.dtype)

    h = lax.fori_loop(0, geo.num_chunks, body, h)
    final_ref[...] = h
    if not reverse:
        states_ref[geo.num_chunks, :, :] = h


def state_pass(x, y, b, w, keep, init, *, geo: ChunkGeometry, reverse: bool, interpret):
    """x [B, Tp, H, K], y [B, Tp, H, V], b [B, Tp, H, K] f32, w [B, Tp] | None, keep [B, N] | None,
    init [B, H, K, V] f32 | None -> (states, final [B, H, K, V] f32): states [B, H, N + 1, K, V]
    f32 forward (entering each chunk, then the final state), [B, H, N, K, V] reversed (the
    gradient of the state leaving each chunk)."""
    bsz, tp, h, _ = x.shape
    bk, bv = geo.block_k, geo.block_v
    grid = (bsz, h, geo.key_dim // bk, geo.value_dim // bv)
    x_spec = pl.BlockSpec((None, tp, None, bk), lambda bi, hi, ki, vi: (bi, 0, hi, ki))
    y_spec = pl.BlockSpec((None, tp, None, bv), lambda bi, hi, ki, vi: (bi, 0, hi, vi))
    w_spec = None if w is None else pl.BlockSpec((None, tp), lambda bi, hi, ki, vi: (bi, 0))
    keep_spec = None if keep is None else pl.BlockSpec((None, geo.num_chunks),
                                                       lambda bi, hi, ki, vi: (bi, 0))
    kv_spec = pl.BlockSpec((None, None, bk, bv), lambda bi, hi, ki, vi: (bi, hi, ki, vi))
    init_spec = None if init is None else kv_spec
    n_states = geo.num_chunks + (0 if reverse else 1)
    states_spec = pl.BlockSpec((None, None, n_states, bk, bv),
                               lambda bi, hi, ki, vi: (bi, hi, 0, ki, vi))
    kernel = functools.partial(_state_kernel, geo=geo, reverse=reverse)
    direction = "reverse" if reverse else "forward"
    with jax.named_scope(f"gla_state_pass_{direction}_block_k={bk}_block_v={bv}"):
        return pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=[x_spec, y_spec, x_spec, w_spec, keep_spec, init_spec],
            out_specs=[states_spec, kv_spec],
            out_shape=[
                jax.ShapeDtypeStruct((bsz, h, n_states, geo.key_dim, geo.value_dim),
                                     jnp.float32),
                jax.ShapeDtypeStruct((bsz, h, geo.key_dim, geo.value_dim), jnp.float32),
            ],
            compiler_params=_params(geo),
            interpret=interpret,
            name=f"gla_state_pass_{direction}",
        )(x, y, b, w, keep, init)


# Intra-chunk scores.


def _row_block_scores(q_ref, k_ref, b_ref, i: int, ks, geo: ChunkGeometry):
    """Gated scores of query sub-chunk i against every key of the chunk, one K block:
    [SUB, C] float32, exact where key <= query (garbage above the diagonal, masked by callers)."""
    c = geo.chunk
    rows = pl.ds(i * SUB, SUB)
    q = q_ref[rows, ks].astype(jnp.float32)  # [SUB, BK]
    bq = b_ref[rows, ks]
    ref = b_ref[pl.ds(i * SUB, 1), ks]  # [1, BK]: b at the sub-chunk's first token
    before = jnp.arange(c, dtype=jnp.int32)[:, None] < i * SUB  # [C, 1]: keys of earlier sub-chunks
    k_all = k_ref[:, ks].astype(jnp.float32)  # [C, BK]
    b_all = b_ref[:, ks]
    k_rel = jnp.where(before, k_all * jnp.exp(jnp.where(before, ref - b_all, 0.0)), 0.0)
    q_rel = q * jnp.exp(bq - ref)
    dt = q_ref.dtype
    s = _dot_t(q_rel.astype(dt), k_rel.astype(dt))  # [SUB, C]
    cols = jnp.arange(c, dtype=jnp.int32)[None, :]
    below = jnp.arange(SUB, dtype=jnp.int32)[:, None]
    for j in range(SUB):
        kj = k_ref[pl.ds(i * SUB + j, 1), ks].astype(jnp.float32)  # [1, BK]
        bj = b_ref[pl.ds(i * SUB + j, 1), ks]
        term = q * kj * jnp.exp(jnp.where(below >= j, bq - bj, 0.0))
        s = s + jnp.where(cols == i * SUB + j, jnp.sum(term, axis=1)[:, None], 0.0)
    return s


def _intra_kernel(q_ref, k_ref, b_ref, seg_ref, a_ref, *, geo: ChunkGeometry):
    n_sub = geo.chunk // SUB
    for i in range(n_sub):
        def over_k(kb, acc, i=i):
            ks = pl.ds(kb * geo.block_k, geo.block_k)
            return acc + _row_block_scores(q_ref, k_ref, b_ref, i, ks, geo)

        s = lax.fori_loop(0, geo.key_dim // geo.block_k, over_k,
                          jnp.zeros((SUB, geo.chunk), jnp.float32))
        mask = _intra_mask(geo, seg_ref, SUB, i * SUB)
        a_ref[pl.ds(i * SUB, SUB), :] = jnp.where(mask, s, 0.0)


def intra_scores(q, k, b, seg, *, geo: ChunkGeometry, interpret):
    """-> A [B, H, Tp, C] float32: per chunk the masked, unscaled intra-chunk scores."""
    bsz, tp, h, kd = q.shape
    c = geo.chunk
    grid = (bsz, h, geo.num_chunks)
    tok_spec = pl.BlockSpec((None, c, None, kd), lambda bi, hi, n: (bi, n, hi, 0))
    seg_spec = None if seg is None else pl.BlockSpec((None, c), lambda bi, hi, n: (bi, n))
    with jax.named_scope(f"gla_intra_scores_chunk={c}"):
        return pl.pallas_call(
            functools.partial(_intra_kernel, geo=geo),
            grid=grid,
            in_specs=[tok_spec, tok_spec, tok_spec, seg_spec],
            out_specs=pl.BlockSpec((None, None, c, c), lambda bi, hi, n: (bi, hi, n, 0)),
            out_shape=jax.ShapeDtypeStruct((bsz, h, tp, c), jnp.float32),
            compiler_params=_params(geo),
            interpret=interpret,
            name="gla_intra_scores",
        )(q, k, b, seg)


# Output.


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
        return acc + _dot(xw, st)

    return lax.fori_loop(0, geo.key_dim // geo.block_k, over_k,
                         jnp.zeros((c, geo.block_v), jnp.float32))


def _output_kernel(q_ref, b_ref, reach_ref, a_ref, v_ref, h_ref, o_ref, *, geo: ChunkGeometry):
    vs = pl.ds(0, geo.block_v)
    v = v_ref[...]  # [C, BV]
    intra = _dot(a_ref[...].astype(v.dtype), v)
    inter = _inter_sum(q_ref, b_ref, reach_ref, h_ref, vs, geo, to_chunk_end=False)
    o_ref[...] = ((intra + inter) * geo.scale).astype(o_ref.dtype)


def chunk_output(q, b, reach, a, v, states, *, geo: ChunkGeometry, interpret):
    """-> o [B, Tp, H, V] in v's dtype."""
    bsz, tp, h, kd = q.shape
    c, bv = geo.chunk, geo.block_v
    grid = (bsz, h, geo.num_chunks, geo.value_dim // bv)
    tok_k = pl.BlockSpec((None, c, None, kd), lambda bi, hi, n, vi: (bi, n, hi, 0))
    tok_v = pl.BlockSpec((None, c, None, bv), lambda bi, hi, n, vi: (bi, n, hi, vi))
    reach_spec = None if reach is None else pl.BlockSpec((None, c), lambda bi, hi, n, vi: (bi, n))
    a_spec = pl.BlockSpec((None, None, c, c), lambda bi, hi, n, vi: (bi, hi, n, 0))
    h_spec = pl.BlockSpec((None, None, None, kd, bv), lambda bi, hi, n, vi: (bi, hi, n, 0, vi))
    with jax.named_scope(f"gla_chunk_output_chunk={c}_block_v={bv}"):
        return pl.pallas_call(
            functools.partial(_output_kernel, geo=geo),
            grid=grid,
            in_specs=[tok_k, tok_k, reach_spec, a_spec, tok_v, h_spec],
            out_specs=tok_v,
            out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype),
            compiler_params=_params(geo),
            interpret=interpret,
            name="gla_chunk_output",
        )(q, b, reach, a, v, states)


# Backward.


def _dqk_kernel(q_ref, k_ref, v_ref, do_ref, b_ref, seg_ref, reach_ref, last_ref, start_ref,
                h_ref, h_next_ref, dh_ref, dq_ref, dk_ref, dg_ref, *, geo: ChunkGeometry):
    c, bk, bv = geo.chunk, geo.block_k, geo.block_v
    n_sub = c // SUB
    n_v = geo.value_dim // bv
    dt = q_ref.dtype
    ks = pl.ds(0, bk)
    cols = jnp.arange(c, dtype=jnp.int32)[None, :]
    below = jnp.arange(SUB, dtype=jnp.int32)[:, None]
    # dg_t = sum over s >= t in the chunk of (q_s dq_s - k_s dk_s) + sum_v h_{n+1} dh_{n+1}: the
    # second term carries everything later chunks add, so no sum runs across chunks
    carry = jnp.zeros((1, bk), jnp.float32)
    for vb in range(n_v):
        vs = pl.ds(vb * bv, bv)
        carry = carry + jnp.sum(h_next_ref[ks, vs] * dh_ref[ks, vs], axis=1)[None, :]
    upper = (jnp.arange(SUB, dtype=jnp.int32)[None, :] >= below).astype(jnp.float32)
    for i in reversed(range(n_sub)):
        rows = pl.ds(i * SUB, SUB)
        b_rows = b_ref[rows, :]  # [SUB, BK]
        b_last = b_ref[pl.ds(c - 1, 1), :]
        # dA[r, x] = scale do_r . v_x (query rows r of sub-chunk i) and dA^T rows (key rows):
        # [SUB, C] each, with the inter-chunk products of the same rows, over V blocks.
        da = jnp.zeros((SUB, c), jnp.float32)
        dat = jnp.zeros((SUB, c), jnp.float32)
        dq_inter = jnp.zeros((SUB, bk), jnp.float32)
        dk_inter = jnp.zeros((SUB, bk), jnp.float32)
        for vb in range(n_v):
            vs = pl.ds(vb * bv, bv)
            do_rows = do_ref[rows, vs]  # [SUB, BV]
            v_rows = v_ref[rows, vs]
            da = da + _dot_t(do_rows, v_ref[:, vs])
            dat = dat + _dot_t(v_rows, do_ref[:, vs])
            # float32 states: dg below subtracts q dq and k dk, and rounding the states to the
            # input dtype here left dg 5x the XLA error at K >= 128 in bfloat16
            dq_inter = dq_inter + _dot_t_f32(do_rows, h_ref[ks, vs], dt)
            dk_inter = dk_inter + _dot_t_f32(v_rows, dh_ref[ks, vs], dt)
        da = jnp.where(_intra_mask(geo, seg_ref, SUB, i * SUB), da * geo.scale, 0.0)
        dat = jnp.where(_intra_mask(geo, seg_ref, SUB, i * SUB, transpose=True),
                        dat * geo.scale, 0.0)
        q_weight = jnp.exp(b_rows) * geo.scale
        k_weight = jnp.exp(b_last - b_rows)
        if reach_ref is not None:
            q_weight = q_weight * reach_ref[rows][:, None]
            k_weight = k_weight * last_ref[rows][:, None]
        dq = dq_inter * q_weight
        dk = dk_inter * k_weight

        b_all = b_ref[:, :]
        token = jnp.arange(c, dtype=jnp.int32)[:, None]
        # dq off-diagonal: keys of earlier sub-chunks, referenced to b at this sub-chunk's start
        ref = b_ref[pl.ds(i * SUB, 1), :]
        before = token < i * SUB
        k_rel = jnp.where(before, k_ref[:, :].astype(jnp.float32)
                          * jnp.exp(jnp.where(before, ref - b_all, 0.0)), 0.0)
        dq = dq + _dot(da.astype(dt), k_rel.astype(dt)) * jnp.exp(b_rows - ref)
        # dk off-diagonal: queries of later sub-chunks, referenced to b at this sub-chunk's end
        end = b_ref[pl.ds(i * SUB + SUB - 1, 1), :]
        after = token >= (i + 1) * SUB
        q_rel = jnp.where(after, q_ref[:, :].astype(jnp.float32)
                          * jnp.exp(jnp.where(after, b_all - end, 0.0)), 0.0)
        dk = dk + _dot(dat.astype(dt), q_rel.astype(dt)) * jnp.exp(end - b_rows)
        # diagonal sub-chunk, elementwise: every exponent b_r - b_x with x <= r
        for j in range(SUB):
            tok = pl.ds(i * SUB + j, 1)
            bj = b_ref[tok, :]  # [1, BK]
            da_col = jnp.sum(jnp.where(cols == i * SUB + j, da, 0.0), axis=1)[:, None]
            dq = dq + da_col * k_ref[tok, :].astype(jnp.float32) * jnp.exp(
                jnp.where(below >= j, b_rows - bj, 0.0))
            dat_col = jnp.sum(jnp.where(cols == i * SUB + j, dat, 0.0), axis=1)[:, None]
            dk = dk + dat_col * q_ref[tok, :].astype(jnp.float32) * jnp.exp(
                jnp.where(below <= j, bj - b_rows, 0.0))
        dq_ref[rows, :] = dq
        dk_ref[rows, :] = dk
        x = q_ref[rows, :].astype(jnp.float32) * dq - k_ref[rows, :].astype(jnp.float32) * dk
        dg = _dot(upper, x) + carry  # [SUB, BK]: reverse running sum within the chunk
        carry = carry + jnp.sum(x, axis=0)[None, :]
        if start_ref is not None:
            # the first token of a later segment: the reset ignores its gate
            dg = dg * (1.0 - start_ref[rows][:, None])
        dg_ref[rows, :] = dg


def chunk_dqk(q, k, v, do, b, seg, reach, last, start, states, dstates, *, geo: ChunkGeometry,
              interpret):
    """-> (dq, dk, dg) [B, Tp, H, K] float32; `states` [B, H, N + 1, K, V] from the forward pass,
    `dstates` [B, H, N, K, V] from the reversed one, `start` [B, Tp] 1.0 where a later segment
    starts (None without segments)."""
    bsz, tp, h, kd = q.shape
    vd = v.shape[-1]
    c, bk = geo.chunk, geo.block_k
    grid = (bsz, h, geo.num_chunks, kd // bk)
    tok_k = pl.BlockSpec((None, c, None, bk), lambda bi, hi, n, ki: (bi, n, hi, ki))
    tok_v = pl.BlockSpec((None, c, None, vd), lambda bi, hi, n, ki: (bi, n, hi, 0))
    row_spec = None if seg is None else pl.BlockSpec((None, c), lambda bi, hi, n, ki: (bi, n))
    st_spec = pl.BlockSpec((None, None, None, bk, vd), lambda bi, hi, n, ki: (bi, hi, n, ki, 0))
    next_spec = pl.BlockSpec((None, None, None, bk, vd),
                             lambda bi, hi, n, ki: (bi, hi, n + 1, ki, 0))
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    with jax.named_scope(f"gla_chunk_dqk_chunk={c}_block_k={bk}"):
        return pl.pallas_call(
            functools.partial(_dqk_kernel, geo=geo),
            grid=grid,
            in_specs=[tok_k, tok_k, tok_v, tok_v, tok_k, row_spec, row_spec, row_spec, row_spec,
                      st_spec, next_spec, st_spec],
            out_specs=[tok_k, tok_k, tok_k],
            out_shape=[out, out, out],
            compiler_params=_params(geo),
            interpret=interpret,
            name="gla_chunk_dqk",
        )(q, k, v, do, b, seg, reach, last, start, states, states, dstates)


def _dv_kernel(k_ref, b_ref, last_ref, a_ref, do_ref, dh_ref, dv_ref, *, geo: ChunkGeometry):
    vs = pl.ds(0, geo.block_v)
    do = do_ref[...]  # [C, BV]
    intra = _t_dot(a_ref[...].astype(do.dtype), do) * geo.scale
    inter = _inter_sum(k_ref, b_ref, last_ref, dh_ref, vs, geo, to_chunk_end=True)
    dv_ref[...] = (intra + inter).astype(dv_ref.dtype)


def chunk_dv(k, b, last, a, do, dstates, *, geo: ChunkGeometry, interpret):
    """-> dv [B, Tp, H, V] in do's dtype."""
    bsz, tp, h, kd = k.shape
    c, bv = geo.chunk, geo.block_v
    grid = (bsz, h, geo.num_chunks, geo.value_dim // bv)
    tok_k = pl.BlockSpec((None, c, None, kd), lambda bi, hi, n, vi: (bi, n, hi, 0))
    tok_v = pl.BlockSpec((None, c, None, bv), lambda bi, hi, n, vi: (bi, n, hi, vi))
    last_spec = None if last is None else pl.BlockSpec((None, c), lambda bi, hi, n, vi: (bi, n))
    a_spec = pl.BlockSpec((None, None, c, c), lambda bi, hi, n, vi: (bi, hi, n, 0))
    h_spec = pl.BlockSpec((None, None, None, kd, bv), lambda bi, hi, n, vi: (bi, hi, n, 0, vi))
    with jax.named_scope(f"gla_chunk_dv_chunk={c}_block_v={bv}"):
        return pl.pallas_call(
            functools.partial(_dv_kernel, geo=geo),
            grid=grid,
            in_specs=[tok_k, tok_k, last_spec, a_spec, tok_v, h_spec],
            out_specs=tok_v,
            out_shape=jax.ShapeDtypeStruct(do.shape, do.dtype),
            compiler_params=_params(geo),
            interpret=interpret,
            name="gla_chunk_dv",
        )(k, b, last, a, do, dstates)
