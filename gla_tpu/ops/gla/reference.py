"""float64 references for gated linear attention: quadratic and token-by-token.

Both have the signature of `gla_tpu.ops.gla` (less the performance arguments), compute in float64
under `jax.enable_x64`, and return (o, final_state) in float64 (final_state None unless asked).

Quadratic form, with b the running sum of g over the whole row and seg the segment index:
  o_i = scale * sum_{j <= i, seg_j == seg_i} (q_i * exp(b_i - b_j)) . k_j  v_j
        + scale * [seg_i == seg_0] (q_i * exp(b_i)) S_0
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gla_tpu.ops.common.gates import floor_log_gates
from gla_tpu.ops.common.segments import segment_index, token_keeps
from gla_tpu.ops.gla.validation import validate_gla


def _prepare(q, k, v, g, scale, initial_state, output_final_state, segment_ids):
    problem, initial_state, segment_ids = validate_gla(
        q, k, v, g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, segment_ids=segment_ids, mode="auto",
        chunk_size=None,
    )
    b, t, h, kd = q.shape
    q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
    if g is None:
        g = jnp.zeros((b, t, h, 1), jnp.float64)
    else:
        g = floor_log_gates(jnp.asarray(g, jnp.float64))  # -inf: a hard reset
        if g.ndim == 3:
            g = g[..., None]  # [B, T, H, 1] broadcasts over K
    if initial_state is not None:
        initial_state = jnp.asarray(initial_state, jnp.float64)
    seg = (
        jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_index(segment_ids)
    )
    return problem, q, k, v, g, initial_state, seg


def gla_reference(q, k, v, g=None, *, scale=None, initial_state=None, output_final_state=False,
                  segment_ids=None):
    """Quadratic float64 GLA: builds the [T, T, K] decay tensor, so keep T * T * K moderate."""
    with jax.enable_x64(True):
        problem, q, k, v, g, s0, seg = _prepare(
            q, k, v, g, scale, initial_state, output_final_state, segment_ids
        )
        t = q.shape[1]
        cum = jnp.cumsum(g, axis=1)  # [B, T, H, Kg]
        same = seg[:, :, None] == seg[:, None, :]  # [B, T(i), T(j)]
        causal = (jnp.arange(t)[:, None] >= jnp.arange(t)[None, :])[None]  # [1, T, T]
        visible = (same & causal)[:, :, :, None, None]  # [B, i, j, 1, 1]
        diff = cum[:, :, None] - cum[:, None, :]  # [B, i, j, H, Kg]
        decay = jnp.where(visible, jnp.exp(jnp.where(visible, diff, 0.0)), 0.0)
        scores = jnp.einsum("bihk,bjhk,bijhk->bhij", q, k, jnp.broadcast_to(
            decay, decay.shape[:4] + (q.shape[-1],)))
        o = jnp.einsum("bhij,bjhv->bihv", scores, v)
        first = (seg == seg[:, :1])[:, :, None, None]  # [B, T, 1, 1]
        if s0 is not None:
            o = o + jnp.where(first, jnp.einsum("bthk,bhkv->bthv", q * jnp.exp(cum), s0), 0.0)
        o = o * problem.scale
        final = None
        if problem.output_final_state:
            last = seg == seg[:, -1:]  # tokens of each row's last segment
            tail = jnp.exp(cum[:, -1:] - cum)  # [B, T, H, Kg]
            kk = jnp.where(last[:, :, None, None], k * tail, 0.0)
            final = jnp.einsum("bthk,bthv->bhkv", kk, v)
            if s0 is not None:
                whole = jnp.all(seg == seg[:, :1], axis=1)[:, None, None, None]
                carried = jnp.exp(cum[:, -1])[..., None] * s0  # [B, H, K(g), 1] * [B, H, K, V]
                final = final + jnp.where(whole, carried, 0.0)
        return o, final


def gla_recurrent_reference(q, k, v, g=None, *, scale=None, initial_state=None,
                            output_final_state=False, segment_ids=None):
    """Token-by-token float64 GLA: S_t = keep_t * diag(exp(g_t)) S_{t-1} + k_t^T v_t."""
    with jax.enable_x64(True):
        problem, q, k, v, g, s0, seg = _prepare(
            q, k, v, g, scale, initial_state, output_final_state, segment_ids
        )
        b, t, h, kd = q.shape
        vd = v.shape[-1]
        keep = token_keeps(seg)  # [B, T]: False where a new segment starts
        state = jnp.zeros((b, h, kd, vd), jnp.float64) if s0 is None else s0

        def step(state, xs):
            q_t, k_t, v_t, g_t, keep_t = xs  # [B, H, K], [B, H, K], [B, H, V], [B, H, Kg], [B]
            decayed = jnp.exp(g_t)[..., None] * state
            state = jnp.where(keep_t[:, None, None, None], decayed, 0.0)
            state = state + k_t[..., :, None] * v_t[..., None, :]
            o_t = jnp.einsum("bhk,bhkv->bhv", q_t, state)
            return state, o_t

        xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, keep))
        state, o = jax.lax.scan(step, state, xs)
        o = jnp.moveaxis(o, 0, 1) * problem.scale
        return o, (state if problem.output_final_state else None)
