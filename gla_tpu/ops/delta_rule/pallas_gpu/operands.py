"""The delta rule's per-chunk WY operands as the state passes read them: the Mosaic GPU kernel's
inputs, the kernel, and its own backward.

`wy_operands` pads the inputs and calls a jax.custom_vjp. Forward:
`kernels_mosaic_operands.wy_operands`, which under differentiation also writes each chunk's
T = (I + A)^-1. Backward, every chunk in parallel, by docs/delta_rule_math.md "Backward of the
operands": for per-head gates and none a Mosaic GPU kernel where it takes K and V
(kernels_mosaic_operands_backward.py, `kernel_backward`), else XLA (`operands_backward`); for
per-key gates XLA's products through T and GLA's pair-level backward kernel for the scores
(`key_gate_backward`). With dkb = T^T dw and dvb = T^T du0,
dA = -strict_lower(T^T dT T^T) is -strict_lower(dkb w^T + dvb u0^T) (w = T kb, u0 = T vb), so T
enters two products only; products on 16-bit operands (the kernel's T, w, u0, q, k as they are,
the float32 cotangents rounded) with float32 sums; dg as three masked sums of its own terms.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gla_tpu.ops.common.padding import pad_last, pad_time
from gla_tpu.ops.delta_rule import xla
from gla_tpu.ops.delta_rule.pallas_gpu import (
    kernels_mosaic_operands,
    kernels_mosaic_operands_backward,
)
from gla_tpu.ops.gla.pallas_gpu import kernels_mosaic_grads

CHUNK = kernels_mosaic_operands.CHUNK
MAX_KEY_DIM = kernels_mosaic_operands.MAX_KEY_DIM
F32 = jnp.float32


def key_width(kd: int) -> int:
    """K as the kernels take it: 64 or 128."""
    return 64 if kd <= 64 else MAX_KEY_DIM


def value_width(vd: int) -> int:
    """V as the WY operands kernel takes it: a multiple of its 64-column slabs."""
    slab = kernels_mosaic_operands.SLAB
    return -(-vd // slab) * slab


def padded_inputs(q, k, v_, beta, gates, problem):
    """Grouped inputs (`xla.grouped_inputs`) padded to the WY operands kernel's widths, in the
    compute dtype: q, k [B, Tp, H, Kp], v [B, Tp, HV, Vp], beta [B, Tp, HV] and the gates
    ([B, Tp, HV] per head, zeros for none; [B, Tp, HV, Kp] per key)."""
    b, t, _, kd = q.shape
    hv = problem.num_value_heads
    kp, vp = key_width(kd), value_width(problem.value_dim)

    def padded(x, width):  # [B, T, ...] -> [B, Tp, HV|H, width] (zeros after)
        return pad_last(pad_time(x.reshape(b, t, -1, x.shape[-1]), CHUNK), width)

    beta_p = pad_time(beta.reshape(b, t, hv), CHUNK)
    if gates is None:
        gates_p = jnp.zeros(beta_p.shape, beta_p.dtype)
    elif gates.shape[-1] == 1:  # per head
        gates_p = pad_time(gates.reshape(b, t, hv), CHUNK)
    else:
        gates_p = padded(gates, kp)
    return padded(q, kp), padded(k, kp), padded(v_, vp), beta_p, gates_p


def _cast(q, k, v, beta, g, dtype):
    """Padded inputs as the kernel reads them: q, k, v in the 16-bit `dtype`, beta and g
    float32."""
    return (q.astype(dtype), k.astype(dtype), v.astype(dtype), beta.astype(F32), g.astype(F32))


def kernel_inputs(q, k, v_, beta, gates, problem):
    """Grouped inputs as the WY operands kernel takes them (`padded_inputs`, then q, k, v in the
    input dtype and beta, g float32)."""
    return _cast(*padded_inputs(q, k, v_, beta, gates, problem), jnp.dtype(problem.dtype))


def kernel_operands(q, k, v_, beta, gates, *, problem, interpret, with_inverse=False):
    """The kernel's WY operands (scores, q_in, k_out, w_neg, u0, last; with_inverse: and T) for
    grouped inputs, padded to its widths; not differentiable."""
    return kernels_mosaic_operands.wy_operands(
        *kernel_inputs(q, k, v_, beta, gates, problem), group=problem.group,
        scale=problem.scale, interpret=interpret, with_inverse=with_inverse)


def wy_operands(q, k, v_, beta, gates, *, problem, interpret):
    """Grouped inputs (`xla.grouped_inputs`; gates [B, T, H, G, K|1] or None) ->
    (scores [B, Tp, HV, C], q_in, k_out, w_neg [B, Tp, HV, Kp], u0 [B, Tp, HV, Vp] in the input
    dtype, last [B, N, HV, Kp] float32), differentiable (the module docstring)."""
    return _padded_operands(*padded_inputs(q, k, v_, beta, gates, problem),
                            jnp.dtype(problem.dtype), problem.group, problem.scale,
                            gates is not None, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _padded_operands(q, k, v, beta, g, dtype, group, scale, with_gates, interpret):
    return kernels_mosaic_operands.wy_operands(*_cast(q, k, v, beta, g, dtype), group=group,
                                               scale=scale, interpret=interpret)


def _fwd(q, k, v, beta, g, dtype, group, scale, with_gates, interpret):
    inputs = _cast(q, k, v, beta, g, dtype)
    *outs, inverse = kernels_mosaic_operands.wy_operands(
        *inputs, group=group, scale=scale, interpret=interpret, with_inverse=True)
    scores, _, _, w_neg, u0, _ = outs
    return tuple(outs), (inputs, scores, w_neg, u0, inverse)


def _bwd(dtype, group, scale, with_gates, interpret, residuals, cotangents):
    del dtype
    inputs, scores, w_neg, u0, inverse = residuals
    _, k, v, _, g = inputs
    if g.ndim == 4:  # per-key gates
        grads = key_gate_backward(*inputs, w_neg, u0, inverse, cotangents, scale=scale,
                                  interpret=interpret)
    elif kernels_mosaic_operands_backward.takes(k.shape[3], v.shape[3]):
        grads = kernel_backward(*inputs, scores, w_neg, u0, inverse, cotangents, group=group,
                                scale=scale, with_gates=with_gates, interpret=interpret)
    else:
        grads = operands_backward(*inputs, scores, w_neg, u0, inverse, cotangents, scale=scale,
                                  with_gates=with_gates)
    dq, dk, dv, dbeta, dg = grads
    return dq, dk, dv, dbeta, jnp.zeros_like(dbeta) if dg is None else dg


def kernel_backward(q, k, v, beta, g, scores, w_neg, u0, inverse, cotangents, *, group, scale,
                    with_gates, interpret):
    """`operands_backward` by the Mosaic GPU kernel (kernels_mosaic_operands_backward.py), same
    arguments and results but dv, in the 16-bit dtype (the cotangents of w_neg and u0 may come in
    it too): the kernel's per-value-head dq and dk summed over each head's group,
    and dg from its per-token parts (pairs, plus the sums over r >= t of entry and over r < t of
    tail within the chunk, plus b_last's cotangent for every token of the chunk)."""
    bsz, tp, h, kd = q.shape
    hv = v.shape[2]
    c, n, dtype = CHUNK, tp // CHUNK, q.dtype
    d_scores, d_q_in, d_k_out, d_w_neg, du0, d_last = cotangents
    dq, dk, dv, dbeta, *parts = kernels_mosaic_operands_backward.operands_backward(
        q, k, v, beta, g, scores, w_neg, u0, inverse, d_scores.astype(F32), d_q_in.astype(F32),
        d_k_out.astype(F32), d_w_neg.astype(dtype), du0.astype(dtype), group=group, scale=scale,
        with_gates=with_gates, interpret=interpret)
    dq, dk = (x.reshape(bsz, tp, h, group, kd).sum(3) for x in (dq, dk))
    dbeta = jnp.swapaxes(dbeta, 1, 2)
    dg = None
    if with_gates:
        pairs, entry, tail = (x.reshape(bsz, hv, n, c) for x in parts)
        dg = chunk_gate_cotangent(pairs, entry, tail, jnp.sum(d_last, -1).transpose(0, 2, 1))
        dg = jnp.swapaxes(dg.reshape(bsz, hv, tp), 1, 2)
    return dq, dk, dv, dbeta, dg


_padded_operands.defvjp(_fwd, _bwd)


def operands_backward(q, k, v, beta, g, scores, w_neg, u0, inverse, cotangents, *, scale,
                      with_gates=True):
    """The cotangents of the kernel's inputs from those of its outputs, every chunk in parallel.

    Args: q, k [B, Tp, H, Kp], v [B, Tp, HV, Vp] (the kernel's 16-bit inputs), beta, g
      [B, Tp, HV] float32 (natural-log gates per head, zeros for none); the kernel's scores
      [B, Tp, HV, C], w_neg [B, Tp, HV, Kp], u0 [B, Tp, HV, Vp] and T [B, Tp, HV, C] (16-bit);
      cotangents of (scores, q_in, k_out, w_neg, u0, last), float32, last's [B, N, HV, Kp].
    Returns: float32 dq, dk [B, Tp, H, Kp], dv [B, Tp, HV, Vp], dbeta, dg [B, Tp, HV] (dg None
      without gates).
    """
    bsz, tp, h, kd = q.shape
    hv = v.shape[2]
    c, n, dtype = CHUNK, tp // CHUNK, q.dtype
    d_scores, d_q_in, d_k_out, d_w_neg, du0, d_last = cotangents
    chunked, tokens, dot = _chunk_layout(bsz, tp, h, dtype)

    r, x = jnp.arange(c)[:, None], jnp.arange(c)[None, :]
    strict = r > x  # [C (r), C (x)]
    qc, kc = chunked(q), chunked(k)  # [B, N, H, 1, C, Kp] 16-bit
    q32, k32 = qc.astype(F32), kc.astype(F32)
    vc = chunked(v).astype(F32)  # [B, N, H, G, C, Vp]
    betac = chunked(beta)  # [B, N, H, G, C]
    if with_gates:
        gc = chunked(g)
        b_sums, tail_sums = xla.entry_and_tail_sums(gc[..., None])  # b, b_last - b: [.., C, 1]
        e_b, e_after = jnp.exp(b_sums), jnp.exp(tail_sums)
        decays = xla.pair_decays(gc)  # [.., C (r), C (x)]: exp(b_r - b_x), x <= r
    else:  # no decay (and no constant gates for XLA to fold through the range sums)
        e_b = e_after = 1.0
        decays = jnp.broadcast_to(r >= x, (1,) * 4 + (c, c)).astype(F32)

    # dkb = T^T dw [.., C, Kp], dvb = T^T du0 [.., C, Vp], dA [.., C, C]
    dkb, dvb, da = _through_inverse(chunked(inverse), chunked(d_w_neg), chunked(du0),
                                    chunked(w_neg), chunked(u0), dot)
    kk = jnp.where(strict, dot("...rk,...xk->...rx", kc, kc) * decays, 0.0)  # k k^T D, x < r
    g_a = betac[..., None] * da * decays  # d(k k^T) from A = beta (k k^T D)
    d_m = chunked(d_scores)
    g_m = d_m * decays  # d(q k^T) / scale from M = scale (q k^T D), x <= r
    sum_g = functools.partial(jnp.sum, axis=3, keepdims=True)  # over a head's value heads

    d_q_in, d_k_out = chunked(d_q_in), chunked(d_k_out)
    g_m_h, g_a_h = sum_g(g_m), sum_g(g_a + jnp.swapaxes(g_a, -1, -2))
    dq = scale * (dot("...rx,...xk->...rk", g_m_h, kc) + sum_g(e_b * d_q_in))
    dk = (dot("...rx,...xk->...rk", g_a_h, kc) + scale * dot("...xr,...xk->...rk", g_m_h, qc)
          + sum_g(betac[..., None] * e_b * dkb + e_after * d_k_out))
    dv = betac[..., None] * dvb
    dbeta = (jnp.sum(dvb * vc, -1) + jnp.sum(dkb * k32 * e_b, -1)
             + jnp.sum(da * kk, -1))
    dg = None
    if with_gates:
        kb = betac[..., None] * k32 * e_b
        # each pair's share of its exponent's cotangent, summed over x < t <= r
        pairs = da * (betac[..., None] * kk) + d_m * chunked(scores).astype(F32)
        before_t = jnp.cumsum(pairs, axis=-1) - pairs  # [r, t]: sum over x < t
        pair_sums = jnp.sum(jnp.where(r >= x, before_t, 0.0), axis=-2)  # over r >= t
        entry = jnp.sum(dkb * kb, -1) + jnp.sum(d_q_in * (scale * q32 * e_b), -1)
        tail = jnp.sum(d_k_out * (k32 * e_after), -1)
        d_b_last = jnp.sum(d_last, -1).reshape(bsz, n, h, hv // h)
        dg = chunk_gate_cotangent(pair_sums, entry, tail, d_b_last)
        dg = tokens(dg[..., None])[..., 0]
    return (tokens(dq), tokens(dk), tokens(dv), tokens(dbeta[..., None])[..., 0], dg)


def _chunk_layout(bsz: int, tp: int, h: int, dtype):
    """(chunked, tokens, dot) for the operands' backward in XLA: chunked [B, Tp, H|HV, ...] ->
    [B, N, H, G|1, C, ...], tokens its inverse, dot an einsum of 16-bit operands with float32
    sums."""
    c = CHUNK
    n = tp // c

    def chunked(x):
        heads = x.shape[2]
        x = x.reshape(bsz, n, c, h, heads // h, *x.shape[3:])
        return jnp.moveaxis(x, 2, 4)

    def tokens(x):  # [B, N, H, G|1, C, ...] -> [B, Tp, H * (G|1), ...]
        x = jnp.moveaxis(x, 4, 2)
        return x.reshape(bsz, tp, -1, *x.shape[5:])

    def dot(spec, x, y):
        return jnp.einsum(spec, x.astype(dtype), y.astype(dtype), preferred_element_type=F32)

    return chunked, tokens, dot


def key_gate_backward_xla(q, k, v, beta, g, w_neg, u0, inverse, cotangents, *, scale):
    """`key_gate_backward` in XLA alone, its reference in the tests: the scores' pullback by
    autodiff of "xla"'s per-key scores (`xla.per_key_scores`, recomputed from q, k and g: their
    secondary chunking), the rest as `operands_backward` with each decay per key
    (docs/delta_rule_math.md, "Backward of the operands"). Arguments and results as there."""
    bsz, tp, h, _ = q.shape
    c, dtype = CHUNK, q.dtype
    d_scores, d_q_in, d_k_out, d_w_neg, du0, d_last = cotangents
    chunked, tokens, dot = _chunk_layout(bsz, tp, h, dtype)
    r, x = jnp.arange(c)[:, None], jnp.arange(c)[None, :]
    gc = chunked(g)  # [B, N, H, G, C, Kp] float32 (float64 in the float64 tests)
    q32, k32 = chunked(q).astype(gc.dtype), chunked(k).astype(gc.dtype)  # [B, N, H, 1, C, Kp]
    betac = chunked(beta)[..., None]  # [B, N, H, G, C, 1]
    b_sums, tail_sums = xla.entry_and_tail_sums(gc)  # b, b_last - b
    e_b, e_after = jnp.exp(b_sums), jnp.exp(tail_sums)

    dkb, dvb, da = _through_inverse(chunked(inverse), chunked(d_w_neg), chunked(du0),
                                    chunked(w_neg), chunked(u0), dot)

    # M = scale (q k^T decayed), A = beta (k k^T decayed): the scores' pullback
    (_, kk), pullback = jax.vjp(
        lambda q_, k_, g_: xla.per_key_scores(q_, k_, g_, dtype), q32, k32, gc)
    d_m = jnp.where(r >= x, scale * chunked(d_scores).astype(gc.dtype), 0.0)
    dq, dk, dg = pullback((d_m, (betac * da).astype(gc.dtype)))

    sum_g = functools.partial(jnp.sum, axis=3, keepdims=True)  # over a head's value heads
    d_q_in, d_k_out = chunked(d_q_in).astype(F32), chunked(d_k_out).astype(F32)
    kb = betac * k32 * e_b
    dq = dq + sum_g(scale * e_b * d_q_in)
    dk = dk + sum_g(betac * e_b * dkb + e_after * d_k_out)
    dv = betac * dvb
    dbeta = (jnp.sum(dvb * chunked(v).astype(F32), -1) + jnp.sum(dkb * k32 * e_b, -1)
             + jnp.sum(da * kk, -1))
    # b_r (through e^b in q_in and kb) sums the gates over [0, r], b_last - b_r (k_out) over
    # (r, C), b_last over the chunk
    entry = dkb * kb + d_q_in * (scale * q32 * e_b)  # [.., C, Kp]
    tail = d_k_out * (k32 * e_after)
    d_b_last = d_last.reshape(bsz, -1, h, gc.shape[3], 1, gc.shape[-1])  # [B, N, H, G, 1, Kp]
    dg = (dg + jax.lax.cumsum(entry, axis=entry.ndim - 2, reverse=True)
          + jnp.cumsum(tail, axis=-2) - tail + d_b_last)
    return (tokens(dq), tokens(dk), tokens(dv), tokens(dbeta[..., None])[..., 0], tokens(dg))


def _through_inverse(t_c, d_w_neg, du0, w_neg, u0, dot):
    """dkb = T^T dw, dvb = T^T du0 and dA = -strict_lower(dkb w^T + dvb u0^T) (w = T kb = -w_neg,
    u0 = T vb), chunked (`_chunk_layout`), float32."""
    c = CHUNK
    dkb = dot("...jr,...jk->...rk", t_c, -d_w_neg)
    dvb = dot("...jr,...jv->...rv", t_c, du0)
    da = dot("...rk,...xk->...rx", dkb, w_neg) - dot("...rv,...xv->...rx", dvb, u0)
    return dkb, dvb, jnp.where(jnp.arange(c)[:, None] > jnp.arange(c)[None, :], da, 0.0)


def key_gate_backward(q, k, v, beta, g, w_neg, u0, inverse, cotangents, *, scale, interpret):
    """`operands_backward` for per-key gates g [B, Tp, HV, Kp] (float32), its arguments but the
    scores (the kernel does not read them) and its results: the products through T in XLA, and the scores' pullback in
    GLA's pair-level backward kernel on given cotangents (`kernels_mosaic_grads.score_grads`),
    twice: M = scale (q k^T decayed) with q_in = scale q e^b and k_out (cotangents scale dM,
    scale d q_in, d k_out), then A = beta (k k^T decayed) as the scores of (beta k) against k
    with kb = (beta k) e^b (cotangents dA and dkb; the kernel's d(beta k) gives beta's and k's
    rows' shares, so nothing divides by beta). The kernel sums dg's per-token terms of b and
    b_last - b inside the chunk; b_last's own cotangent is added here."""
    bsz, tp, h, _ = q.shape
    dtype = q.dtype
    d_scores, d_q_in, d_k_out, d_w_neg, du0, d_last = cotangents
    chunked, tokens, dot = _chunk_layout(bsz, tp, h, dtype)
    dkb, dvb, da = _through_inverse(chunked(inverse), chunked(d_w_neg), chunked(du0),
                                    chunked(w_neg), chunked(u0), dot)
    hv = g.shape[2]
    k_v = jnp.repeat(k.astype(F32), hv // h, axis=2)  # [B, Tp, HV, Kp]: each value head's k
    beta_k = (beta[..., None] * k_v).astype(dtype)
    dq_m, dk_m, dg_m = kernels_mosaic_grads.score_grads(
        q, k, g, scale * d_scores.astype(F32), scale * d_q_in.astype(F32), d_k_out,
        interpret=interpret)
    d_beta_k, dk_a, dg_a = kernels_mosaic_grads.score_grads(
        beta_k, k, g, tokens(da), tokens(dkb), jnp.zeros(g.shape, F32), interpret=interpret)

    def by_head(x):  # [B, Tp, HV, Kp] -> summed over each head's value heads [B, Tp, H, Kp]
        return x.reshape(bsz, tp, h, hv // h, x.shape[-1]).sum(3)

    dq = by_head(dq_m)
    dk = by_head(dk_m + dk_a + beta[..., None] * d_beta_k)
    dv = tokens(chunked(beta)[..., None] * dvb)
    dbeta = (tokens(jnp.sum(dvb * chunked(v).astype(F32), -1)[..., None])[..., 0]
             + jnp.sum(k_v * d_beta_k, -1))
    d_b_last = jnp.repeat(d_last, CHUNK, axis=1)  # [B, N, HV, Kp] -> every token's
    return dq, dk, dv, dbeta, dg_m + dg_a + d_b_last


def chunk_gate_cotangent(pair_sums, entry, tail, d_b_last):
    """dg [..., C] of each chunk's tokens from its per-token parts [..., C] and b_last's
    cotangent [...]: pair_sums (each pair x < t <= r's share), entry summed over r >= t (b_r,
    through e^b in q_in and beta k e^b, sums the gates over [0, r]), tail over r < t (b_last - b_r,
    through k_out, sums them over (r, C)), and d b_last on every token."""
    return (pair_sums + jax.lax.cumsum(entry, axis=entry.ndim - 1, reverse=True)
            + jnp.cumsum(tail, axis=-1) - tail + d_b_last[..., None])
