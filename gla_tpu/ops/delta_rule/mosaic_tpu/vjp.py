"""custom_vjp wiring of the chunked delta-rule kernels.

Inputs of the custom_vjp: q, k [B, Tp, H, K] (l2-normalized outside when asked), v [B, Tp, HV,
V], beta [B, Tp, HV] float32, the log gates (per key [B, Tp, HV, K] or per head [B, Tp, HV],
float32, whose range sums the kernels take themselves; or None), the initial
state and the relative segment index. The forward kernel saves the state entering every chunk
and each chunk's key scores and WY inverse; the backward kernel walks the chunks in reverse on
them (kernels_chunk.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gla_tpu.ops.delta_rule.mosaic_tpu import kernels_chunk, kernels_decode
from gla_tpu.ops.gla.mosaic_tpu.plan import (
    chunk_kernel_arrays,
    seq_pack,
    seq_unpack,
    transpose_state,
)


def _arrays(cfg, q, k, v, beta, gates, s0, rel):
    """The kernels' layouts: GLA's chunked kernels' (`chunk_kernel_arrays`), per-head log gates
    as "gcol" and "grow", and beta as a column [B, HV, T, 1]."""
    arrays = chunk_kernel_arrays(cfg, q, k, v, gates, s0, rel, head_gate_names=("gcol", "grow"))
    arrays["beta"] = jnp.transpose(beta, (0, 2, 1))[..., None]
    return arrays


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def chunked(cfg, pack, interpret, q, k, v, beta, gates, s0, rel):
    """(o [B, Tp, HV, V], final state [B, HV, K, V] float32) from padded inputs; `pack`: chunks
    per block-diagonal inverse (plan.inverse_chunks)."""
    out = kernels_chunk.forward(cfg, _arrays(cfg, q, k, v, beta, gates, s0, rel),
                                save_residuals=False, pack=pack, interpret=interpret)
    return _outputs(cfg, out)


def _outputs(cfg, out):
    return seq_unpack(out["o"], cfg.num_heads, cfg.value_dim), transpose_state(out["final"])


def _fwd(cfg, pack, interpret, q, k, v, beta, gates, s0, rel):
    out = kernels_chunk.forward(cfg, _arrays(cfg, q, k, v, beta, gates, s0, rel),
                                save_residuals=True, pack=pack, interpret=interpret)
    saved = {name: out[name] for name in ("states", "wy_inverse", "key_scores")}
    return _outputs(cfg, out), (q, k, v, beta, gates, s0, rel, saved)


def _bwd(cfg, pack, interpret, residuals, cotangents):
    q, k, v, beta, gates, s0, rel, saved = residuals
    do, dfinal = cotangents
    arrays = _arrays(cfg, q, k, v, beta, gates, s0, rel)
    arrays.update(saved)
    arrays["do"] = seq_pack(do.astype(cfg.dtype))
    arrays["dfinal"] = transpose_state(dfinal.astype(jnp.float32))
    grads = kernels_chunk.backward(cfg, arrays, interpret=interpret)
    hv, kd = cfg.num_heads, cfg.key_dim
    b, t, h = q.shape[0], q.shape[1], q.shape[2]

    def per_key_head(x):  # [1, seq_shape(B, T, HV, K)] -> [B, T, H, K], summed over the group
        x = seq_unpack(x[0], hv, kd).reshape(b, t, h, cfg.group, kd)
        return jnp.sum(x, axis=3)

    def column(x):  # [B, HV, T, 1] -> [B, T, HV]
        return jnp.transpose(x[..., 0], (0, 2, 1))

    dq, dk = per_key_head(grads["dq"]), per_key_head(grads["dk"])
    dv = seq_unpack(grads["dv"], hv, cfg.value_dim)
    if cfg.gate_kind == "key":
        dgates = seq_unpack(grads["dg"][0], hv, kd)
    elif cfg.gate_kind == "head":
        dgates = _chunk_gate_grads(column(grads["dbcol"]), column(grads["dbcol_forward"]),
                                   cfg.chunk)
    else:
        dgates = None
    ds0 = None if s0 is None else transpose_state(grads["ds0"])
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            column(grads["dbeta"]), dgates, ds0, None)


def _chunk_gate_grads(db, db_forward, c):
    """dg [B, T, HV] from the backward kernel's two parts of d loss / d b [B, T, HV] each: b_t
    sums g over the chunk's tokens up to t, so dg_t sums `db` over t .. the chunk's end, and
    `db_forward` (the leaving state's keys, whose shares of db and of the chunk's last token
    cancel for the tokens before them) over the chunk's tokens before t. One float32 product
    with triangles of ones per chunk."""
    b, t, hv = db.shape
    rows, cols = jnp.arange(c)[:, None], jnp.arange(c)[None, :]
    sums = jnp.concatenate([(cols >= rows), (cols < rows)], axis=1).astype(jnp.float32)
    parts = jnp.concatenate([db.reshape(b, t // c, c, hv),
                             db_forward.reshape(b, t // c, c, hv)], axis=2)  # [B, N, 2C, HV]
    dg = jnp.einsum("ts,bnsh->bnth", sums, parts, precision=jax.lax.Precision.HIGHEST)
    return dg.reshape(b, t, hv)


chunked.defvjp(_fwd, _bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def decode(group, block_h, gate_kind, scale, emit_final, interpret, q, k, v, beta, g, s0):
    """One token (kernels_decode.py): (o [B, HV, V], final [B, HV, K, V] float32 or None) from
    q, k [B, H, K], v [B, HV, V], beta [B, HV, 1], g [B, HV, Kg] or None, s0 or None. Its
    gradient is XLA's autodiff of the same step (`_decode_step`): one token's backward is a few
    products per head."""
    return kernels_decode.decode(q, k, v, beta, g, s0, group=group, block_h=block_h,
                                 gate_kind=gate_kind, scale=scale, emit_final=emit_final,
                                 interpret=interpret)


def _decode_step(group, scale, q, k, v, beta, g, s0):
    """The decode step in plain JAX, float32: S = D S0; u = beta (v - S^T k); S += k u^T;
    o = scale S^T q."""
    f32 = jnp.float32
    q, k = (jnp.repeat(x.astype(f32), group, axis=1) for x in (q, k))  # [B, HV, K]
    state = jnp.zeros(q.shape + v.shape[-1:], f32) if s0 is None else s0
    if g is not None:
        state = jnp.exp(g)[..., None] * state
    predicted = jnp.einsum("bhk,bhkv->bhv", k, state, precision=jax.lax.Precision.HIGHEST)
    u = beta * (v.astype(f32) - predicted)
    state = state + k[..., None] * u[:, :, None, :]
    o = scale * jnp.einsum("bhk,bhkv->bhv", q, state, precision=jax.lax.Precision.HIGHEST)
    return o.astype(v.dtype), state


def _decode_fwd(group, block_h, gate_kind, scale, emit_final, interpret, q, k, v, beta, g, s0):
    out = decode(group, block_h, gate_kind, scale, emit_final, interpret, q, k, v, beta, g, s0)
    return out, (q, k, v, beta, g, s0)


def _decode_bwd(group, block_h, gate_kind, scale, emit_final, interpret, residuals, cotangents):
    do, dfinal = cotangents
    _, pullback = jax.vjp(functools.partial(_decode_step, group, scale), *residuals)
    o_shape = residuals[2].shape
    if dfinal is None:
        b, hv, vd = o_shape
        dfinal = jnp.zeros((b, hv, residuals[0].shape[-1], vd), jnp.float32)
    return pullback((do, dfinal))


decode.defvjp(_decode_fwd, _decode_bwd)
