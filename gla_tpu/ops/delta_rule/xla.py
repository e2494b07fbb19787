"""The "xla" delta-rule backend: plain JAX, differentiated by autodiff.

"chunk" is the chunked WY form of docs/delta_rule_math.md, in three passes: per chunk in
parallel, the decayed scores, the inverse of one [C, C] unit lower triangular matrix for the WY
representation (w, u0) and the decayed queries and keys; a `lax.scan` over chunks for the states
(u = u0 - w S, S' = exp(b_last) * S + k_out^T u); the outputs per chunk in parallel.
"fused_recurrent" is a `lax.scan` over tokens.

Every exponential is of a sum of gates over a range of one chunk, summed over that range (a
running sum started after the range's first token), never taken as the difference of two running
sums: each exponent is <= 0, and a short range after strong gates loses no digits. The API floors
gates at -100 (common/gates.py), and a segment start is a gate of -100 on every key, which drops
the state before it (exp(-100) is below the rounding of every dtype).

Value head j reads q and k head j // G (G = HV // H): the value heads are laid out [H, G] and q, k
broadcast over G, so q, k and, for DeltaNet, their scores are never repeated per value head.
Inputs of 16 bits compute in float32, float64 inputs in float64. The chunked form's products
take operands rounded to the input dtype as the kernels round them (the same computation in the
input dtype: scores, the WY products, the state pass and the outputs; the inverse of I + A stays
in float32): for 16-bit inputs, 16-bit operands with float32 sums, which the matrix units run
natively; otherwise HIGHEST precision (float32 on TPU matrix units is otherwise rounded to
bfloat16).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gla_tpu.ops.common.capabilities import ANY_DIM, DELTA_RULE_FEATURES, Capabilities
from gla_tpu.ops.common.chunk_cumsum import SUB_CHUNK
from gla_tpu.ops.common.gates import GATE_FLOOR
from gla_tpu.ops.common.padding import pad_time
from gla_tpu.ops.common.segments import segment_index, token_starts
from gla_tpu.ops.delta_rule.reference import l2_normalize
from gla_tpu.ops.delta_rule.validation import (
    CHUNK_SIZES,
    GATE_KINDS,
    RESOLVED_MODES,
    state_dtype,
)

CAPABILITIES = Capabilities(
    op="delta_rule", backend="xla", platform="any (plain JAX)",
    dtypes=("bfloat16", "float16", "float32", "float64"), dims=(("K", ANY_DIM), ("V", ANY_DIM)),
    features=DELTA_RULE_FEATURES, modes=RESOLVED_MODES, gates=GATE_KINDS, chunk_sizes=CHUNK_SIZES,
    notes="chunked WY form, (I + A)^-1 by blocked inversion per chunk (chunk), or a scan "
          "over tokens (fused_recurrent); float32 arithmetic (float64 for float64 inputs), "
          "chunk's products on operands rounded to the input dtype; autodiff",
)

_einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def check_supported(problem, block_sizes) -> None:
    CAPABILITIES.check(problem, block_sizes)


def delta_rule(q, k, v, beta, g, *, problem, initial_state, segment_ids, block_sizes, interpret):
    """(o [B, T, HV, V] in v's dtype, final_state [B, HV, K, V] or None) for a validated problem;
    g already floored (common/gates.py)."""
    del block_sizes, interpret
    b, t, h, kd = q.shape
    grp, vd = problem.group, problem.value_dim
    starts = None if segment_ids is None else token_starts(segment_index(segment_ids))  # [B, T]
    s0 = None if initial_state is None else initial_state.reshape(b, h, grp, kd, vd)
    with jax.named_scope(f"delta_rule_xla_{problem.mode}"):
        if problem.mode == "fused_recurrent":
            q, k, v_, beta, gates = grouped_inputs(q, k, v, beta, g, None, problem)
            o, final = token_scan(q, k, v_, beta, gates, s0, starts, problem.scale)
        else:
            q, k, v_, beta, gates = grouped_inputs(q, k, v, beta, g, starts, problem)
            o, final = _chunked(q, k, v_, beta, gates, s0, problem.scale, problem.chunk_size,
                                problem.dtype)
    o = o.reshape(b, t, h * grp, vd).astype(v.dtype)
    if not problem.output_final_state:
        return o, None
    return o, final.reshape(b, h * grp, kd, vd)


def grouped_inputs(q, k, v, beta, g, starts, problem):
    """The inputs in the compute dtype (float32 for 16-bit inputs), q and k l2-normalized where
    asked, v [B, T, H, G, V], beta [B, T, H, G], gates [B, T, H, G, Kg] (Kg = K per key, 1 per
    head) or None (DeltaNet). With `starts` ([B, T] bool), a segment start drops the state
    before it: a gate at the floor on every key (per head, 1)."""
    b, t, h, _ = q.shape
    grp, vd = problem.group, problem.value_dim
    cd = state_dtype(problem.dtype)
    q, k = q.astype(cd), k.astype(cd)
    if problem.use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    v = v.astype(cd).reshape(b, t, h, grp, vd)
    beta = beta.astype(cd).reshape(b, t, h, grp)
    gates = None if g is None else g.astype(cd).reshape(b, t, h, grp, -1)
    if starts is not None:
        if gates is None:
            gates = jnp.zeros((b, t, h, grp, 1), cd)
        gates = jnp.where(starts[:, :, None, None, None], GATE_FLOOR, gates)
    return q, k, v, beta, gates


def token_scan(q, k, v, beta, gates, s0, starts, scale):
    """Token by token: S <- D S; u = beta (v - S^T k); S <- S + k u^T; o = scale S^T q."""
    b, t, h, kd = q.shape
    grp, vd = v.shape[3], v.shape[4]
    state = jnp.zeros((b, h, grp, kd, vd), q.dtype) if s0 is None else s0
    keeps = jnp.ones((b, t), bool) if starts is None else ~starts

    def step(state, xs):
        q_t, k_t, v_t, beta_t, keep_t, g_t = xs  # [B, H, K] x2, [B, H, G, V], [B, H, G], [B]
        state = jnp.where(keep_t[:, None, None, None, None], state, 0.0)
        if g_t is not None:
            state = jnp.exp(g_t)[..., None] * state  # g_t [B, H, G, Kg]
        predicted = _einsum("bhk,bhgkv->bhgv", k_t, state)
        u = beta_t[..., None] * (v_t - predicted)  # [B, H, G, V]
        state = state + k_t[:, :, None, :, None] * u[..., None, :]
        return state, _einsum("bhk,bhgkv->bhgv", q_t, state)

    xs = tuple(None if x is None else jnp.moveaxis(x, 1, 0)
               for x in (q, k, v, beta, keeps, gates))
    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1) * scale, state  # [B, T, H, G, V], [B, H, G, K, V]


class ChunkOperands(NamedTuple):
    """The per-chunk operands of the chunked WY form, every chunk in parallel (no state): the
    state pass's inputs. Layout [B, H, G, N, C, .] (G value heads per q/k head; 1 where an
    operand is the same for all G, broadcast), compute dtype."""

    q_in: jax.Array  # q e^b                                            [B, H, G|1, N, C, K]
    k_out: jax.Array  # k e^(b_last - b)                                [B, H, G|1, N, C, K]
    scores: jax.Array  # M_ij = q_i k_j e^(b_i - b_j), j <= i, else 0   [B, H, G|1, N, C, C]
    w: jax.Array  # (I + A)^-1 beta k_in                                [B, H, G, N, C, K]
    u0: jax.Array  # (I + A)^-1 beta v                                  [B, H, G, N, C, V]
    last: jax.Array | None  # b_last, the chunk's summed log gates      [B, H, G, N, Kg]


def chunk_operands(q, k, v, beta, gates, c, input_dtype) -> ChunkOperands:
    """q, k [B, Tp, H, K], v [B, Tp, H, G, V], beta [B, Tp, H, G], gates [B, Tp, H, G, Kg] or
    None, Tp a multiple of c, all in the compute dtype -> the ChunkOperands; products on operands
    rounded to `input_dtype` (the inverse of I + A in the compute dtype)."""
    b, t, h, kd = q.shape
    grp, vd = v.shape[3], v.shape[4]
    n = t // c
    # [B, H, 1, N, C, K]: q and k broadcast over the G value heads of their head
    qc, kc = (x.reshape(b, n, c, h, 1, kd).transpose(0, 3, 4, 1, 2, 5) for x in (q, k))
    vc = v.reshape(b, n, c, h, grp, vd).transpose(0, 3, 4, 1, 2, 5)  # [B, H, G, N, C, V]
    betac = beta.reshape(b, n, c, h, grp).transpose(0, 3, 4, 1, 2)  # [B, H, G, N, C]

    if gates is None:
        q_in = k_in = k_out = last = None
        scores, kk = _products(qc, kc, input_dtype)  # [B, H, 1, N, C, C]
    else:
        kg = gates.shape[-1]
        gc = gates.reshape(b, n, c, h, grp, kg).transpose(0, 3, 4, 1, 2, 5)
        entry, tail = entry_and_tail_sums(gc)  # [B, H, G, N, C, Kg] each
        # q_in = q e^b, k_in = k e^b, k_out = k e^(b_last - b): exponents <= 0
        q_in, k_in, k_out = qc * jnp.exp(entry), kc * jnp.exp(entry), kc * jnp.exp(tail)
        last = entry[..., -1, :]  # [B, H, G, N, Kg]
        if kg == 1:
            scores, kk = _products(qc, kc, input_dtype)
            pair = pair_decays(gc[..., 0])  # [B, H, G, N, C, C]: exp(b_i - b_j), j <= i
            scores, kk = scores * pair, kk * pair
        else:
            scores, kk = per_key_scores(qc, kc, gc, input_dtype)  # [B, H, G, N, C, C]
    # A_ij = beta_i (k_i e^(b_i - b_j)) . k_j for j < i; M_ij the same with q_i, j <= i
    a = jnp.where(_lift(_order(c, "after"), 6), betac[..., :, None] * kk, 0.0)  # [B, H, G, N, C, C]
    scores = jnp.where(_lift(_order(c, "from"), 6), scores, 0.0)

    # The WY representation: [u0, w] = (I + A)^-1 beta [v, k_in]; the inverse of the unit lower
    # triangular I + A in the compute dtype (blocked), the products with rounded operands.
    k_in = kc if k_in is None else k_in
    inverse = unit_lower_inverse(a)
    u0 = _dot("...ij,...jv->...iv", inverse, betac[..., None] * vc, input_dtype)
    w = _dot("...ij,...jk->...ik", inverse, betac[..., None] * k_in, input_dtype)
    return ChunkOperands(qc if q_in is None else q_in, kc if k_out is None else k_out, scores,
                         w, u0, last)


INVERSE_BLOCK = 16  # the diagonal blocks unit_lower_inverse solves; the rest is products


def _blocked_inverse(a):
    """(I + A)^-1 for A [..., C, C] strictly lower triangular (its other entries are not read),
    C a power of two times INVERSE_BLOCK (or at most it).

    Forward: the diagonal blocks of INVERSE_BLOCK rows by one batched triangular solve, then
    blocks of twice the size, [[X1, 0], [-X2 A21 X1, X2]], until the whole (half the time of one
    solve of the whole matrix on an H200). Pullback: dA = -tril(X^T dX X^T, -1) for
    X = (I + A)^-1 (from d(L^-1) = -L^-1 dL L^-1), two products instead of the transposed solves
    autodiff would make (under a third of their time). Products at HIGHEST precision."""
    c = a.shape[-1]
    base = min(c, INVERSE_BLOCK)
    diagonal = jnp.stack([a[..., i:i + base, i:i + base] for i in range(0, c, base)], axis=-3)
    eye = jnp.broadcast_to(jnp.eye(base, dtype=a.dtype), diagonal.shape)
    x = jax.lax.linalg.triangular_solve(diagonal, eye, left_side=True, lower=True,
                                        unit_diagonal=True)  # [..., C / size, size, size]
    size = base
    while size < c:
        x1, x2 = x[..., 0::2, :, :], x[..., 1::2, :, :]
        a21 = jnp.stack([a[..., i + size:i + 2 * size, i:i + size]
                         for i in range(0, c, 2 * size)], axis=-3)
        low = -_einsum("...ij,...jk,...kl->...il", x2, a21, x1)
        x = jnp.concatenate([jnp.concatenate([x1, jnp.zeros_like(x1)], axis=-1),
                             jnp.concatenate([low, x2], axis=-1)], axis=-2)
        size *= 2
    return x[..., 0, :, :]


unit_lower_inverse = jax.custom_vjp(_blocked_inverse)


def _unit_lower_inverse_fwd(a):
    inverse = _blocked_inverse(a)
    return inverse, inverse


def _unit_lower_inverse_bwd(inverse, d_inverse):
    da = -_einsum("...ji,...jk,...lk->...il", inverse, d_inverse, inverse)
    return (jnp.where(_lift(_order(da.shape[-1], "after"), da.ndim), da, 0.0),)


unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def _chunked(q, k, v, beta, gates, s0, scale, c, input_dtype):
    b, t, h, kd = q.shape
    grp, vd = v.shape[3], v.shape[4]
    # Padding tokens (beta = 0, g = 0, zero q, k, v) leave the state unchanged: sliced off below.
    q, k, v, beta = (pad_time(x, c) for x in (q, k, v, beta))
    gates = None if gates is None else pad_time(gates, c)
    n = q.shape[1] // c
    q_in, k_out, scores, w, u0, last = chunk_operands(q, k, v, beta, gates, c, input_dtype)
    decay = None if last is None else jnp.exp(last)  # [B, H, G, N, Kg]

    # The states, chunk after chunk: only u = u0 - w S waits for the state.
    def step(state, xs):
        w_n, u0_n, k_out_n, decay_n = xs  # [B, H, G, C, K], [B, H, G, C, V], ..., [B, H, G, Kg]
        u = u0_n - _dot("bhgck,bhgkv->bhgcv", w_n, state, input_dtype)
        decayed = state if decay_n is None else decay_n[..., None] * state
        # k_out_n has G or 1 (broadcast) value heads
        return decayed + _dot("bhgck,bhgcv->bhgkv", k_out_n, u, input_dtype), (state, u)

    state0 = jnp.zeros((b, h, grp, kd, vd), q.dtype) if s0 is None else s0
    xs = tuple(None if x is None else jnp.moveaxis(x, 3, 0) for x in (w, u0, k_out, decay))
    final, (states, u) = jax.lax.scan(step, state0, xs)
    states, u = jnp.moveaxis(states, 0, 3), jnp.moveaxis(u, 0, 3)  # [B, H, G, N, K|C, V]

    # The outputs: o = scale (q_in S_n + M u), GLA's with v replaced by the new values u.
    o = (_dot("bhgnck,bhgnkv->bhgncv", q_in, states, input_dtype)
         + _dot("bhgnij,bhgnjv->bhgniv", scores, u, input_dtype))
    o = o.transpose(0, 3, 4, 1, 2, 5).reshape(b, n * c, h, grp, vd)[:, :t]
    return o * scale, final


def _dot(spec, x, y, input_dtype):
    """The einsum of x and y (compute dtype) as the kernels' matrix units take it: operands
    rounded to the input dtype, products summed in the compute dtype. For 16-bit inputs the
    operands are cast to it, so GPU tensor cores and TPU matrix units run their 16-bit products
    with float32 sums (the values of float32 products of the rounded operands); float32 and
    float64 inputs at HIGHEST precision."""
    cd = jnp.promote_types(x.dtype, y.dtype)
    if jnp.dtype(input_dtype).itemsize >= cd.itemsize:
        return _einsum(spec, x, y)
    return jnp.einsum(spec, x.astype(input_dtype), y.astype(input_dtype),
                      preferred_element_type=cd)


def _rounded(x, dtype):
    """x rounded to the input dtype (kept in x's): a matrix product's operand, as the kernels take
    it (identity for float32 and float64 inputs). By reduce_precision, not a round trip of
    casts: XLA on GPU may drop a cast pair (excess precision), and the baseline would then round
    some products and not others."""
    if jnp.dtype(dtype).itemsize >= x.dtype.itemsize:
        return x
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _order(n, relation):
    """[n (i), n (j)] bool: j < i ("after": i comes after j) or j <= i ("from")."""
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    return i > j if relation == "after" else i >= j


def _lift(mask, ndim):
    """mask with leading unit dims up to rank `ndim` (the tests forbid implicit rank promotion)."""
    return mask.reshape((1,) * (ndim - mask.ndim) + mask.shape)


def _products(qc, kc, input_dtype):
    """q k^T and k k^T inside each chunk: [..., C, C] each."""
    return (_dot("...ik,...jk->...ij", qc, kc, input_dtype),
            _dot("...ik,...jk->...ij", kc, kc, input_dtype))


def entry_and_tail_sums(gc):
    """[..., C, Kg] gates -> the sums over [0, i] (b_i) and over (i, C-1] (b_last - b_i), each
    summed over its own range."""
    entry = jnp.cumsum(gc, axis=-2)
    later = jnp.concatenate([gc[..., 1:, :], jnp.zeros_like(gc[..., :1, :])], axis=-2)
    tail = jax.lax.cumsum(later, axis=later.ndim - 2, reverse=True)
    return entry, tail


def _range_sums(g):
    """[..., C] gates -> [..., C (i), C (j)]: the sum over (j, i] for j < i, 0 on and above the
    diagonal; a running sum over i of the gates after j."""
    after = _lift(_order(g.shape[-1], "after"), g.ndim + 1)  # [C (t), C (j)]: t after j
    return jnp.cumsum(jnp.where(after, g[..., :, None], 0.0), axis=-2)


def pair_decays(g):
    """[..., C] per-head gates -> [..., C, C]: exp(b_i - b_j) for j <= i, 0 above."""
    lower = _lift(_order(g.shape[-1], "from"), g.ndim + 1)
    return jnp.where(lower, jnp.exp(_range_sums(g)), 0.0)


def per_key_scores(qc, kc, gc, input_dtype):
    """Secondary chunking of per-key decays: sub-chunk pairs I > J factor through the boundary
    before I, exp(b_i - b_j) = exp(sum over [start(I), i]) exp(sum over (j, start(I))), both
    exponents <= 0; the diagonal sub-chunks take the elementwise [c, c, K] decays.

    Args: qc, kc [B, H, 1, N, C, K]; gc [B, H, G, N, C, K].
    Returns: (M, KK) [B, H, G, N, C, C]: sum_k x_ik k_jk exp(b_ik - b_jk) for x = q, k, on and
      below the diagonal, 0 above.
    """
    *lead, c, kd = gc.shape
    sub = min(SUB_CHUNK, c)
    ns = c // sub
    qs, ks = (x.reshape(x.shape[:-2] + (ns, sub, kd)) for x in (qc, kc))
    gs = gc.reshape(*lead, ns, sub, kd)
    within, tail = entry_and_tail_sums(gs)  # [.., ns, sub, K]: over [start(I), i], (j, end(J)]
    totals = within[..., -1, :]  # [.., ns, K]
    # between[I, J]: the gates of the sub-chunks strictly between J and I, summed
    idx = jnp.arange(ns)
    strictly = ((idx[None, :, None] < idx[None, None, :])
                & (idx[None, None, :] < idx[:, None, None]))  # [I, J, L]: J < L < I
    between = jnp.sum(jnp.where(_lift(strictly[..., None], totals.ndim + 2),
                                totals[..., None, None, :, :], 0.0), axis=-2)  # [.., I, J, K]
    before = _lift(_order(ns, "after")[..., None, None], totals.ndim + 2)  # [I, J, 1, 1]: J < I
    # k_J e^(sum over (j, start(I))), 0 unless J < I: [.., I, J, sub, K]
    k_early = jnp.where(before, ks[..., None, :, :, :]
                        * jnp.exp(tail[..., None, :, :, :] + between[..., :, :, None, :]), 0.0)
    later = jnp.exp(within)  # e^(sum over [start(I), i]) for the row token i
    diag = jnp.exp(_range_sums(jnp.moveaxis(gs, -1, -2)))  # [.., ns, K, sub (i), sub (j)]
    lower = _lift(_order(sub, "from")[..., None], diag.ndim)
    diag = jnp.where(lower, jnp.moveaxis(diag, -3, -1), 0.0)  # [.., ns, sub (i), sub (j), K]
    eye = jnp.eye(ns, dtype=gc.dtype)
    out = []
    for xs in (qs, ks):
        # HIGHEST on rounded operands: 16-bit operands here (float32 cotangents against 16-bit
        # operands in the backward) made KDA's forward+backward 12% slower on an H200
        off = _einsum("...Iik,...IJjk->...IiJj", _rounded(xs * later, input_dtype),
                      _rounded(k_early, input_dtype))
        on = _einsum("...ik,...jk,...ijk->...ij", _rounded(xs, input_dtype),
                     _rounded(ks, input_dtype), diag)  # [.., ns, sub, sub]
        full = off + _einsum("...Iij,IJ->...IiJj", on, eye)
        out.append(full.reshape(*lead, c, c))
    return tuple(out)
