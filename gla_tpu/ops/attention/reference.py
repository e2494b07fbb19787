"""Quadratic float64 softmax attention: the contract the kernels are tested against.

Same signature as `gla_tpu.ops.flash_attention` (less the performance arguments); computes in
float64 under `jax.enable_x64` and returns float64. Differentiable with `jax.vjp` inside
`jax.enable_x64(True)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gla_tpu.ops.attention.validation import validate_attention
from gla_tpu.ops.common.masks import attention_visibility, causal_offset


def attention_reference(q, k, v, *, causal=False, sm_scale=None, segment_ids=None,
                        local_window_size=None, logits_soft_cap=None):
    """softmax(cap(q k^T * sm_scale) + mask) v in float64, cap(s) = c tanh(s / c) with a soft
    cap c; rows that see no key give 0.

    Args/Returns: as `gla_tpu.ops.flash_attention`, output in float64.
    """
    with jax.enable_x64(True):
        problem, q_seg, kv_seg = validate_attention(
            q, k, v, causal=causal, sm_scale=sm_scale, segment_ids=segment_ids,
            local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
        )
        q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
        b, t, h, d = q.shape
        s_len, hkv = k.shape[1], k.shape[2]
        k = jnp.repeat(k, h // hkv, axis=2)
        v = jnp.repeat(v, h // hkv, axis=2)
        logits = jnp.einsum("bthd,bshd->bhts", q, k) * problem.sm_scale
        if problem.logits_soft_cap is not None:
            cap = problem.logits_soft_cap
            logits = cap * jnp.tanh(logits / cap)
        q_pos = jnp.arange(t)[None, None, :, None]
        k_pos = jnp.arange(s_len)[None, None, None, :]
        mask = attention_visibility(
            q_pos, k_pos, causal=problem.causal, offset=causal_offset(t, s_len),
            q_seg=None if q_seg is None else q_seg[:, None, :, None],
            kv_seg=None if kv_seg is None else kv_seg[:, None, None, :], window=problem.window,
        )
        mask = jnp.broadcast_to(mask, logits.shape)
        logits = jnp.where(mask, logits, -jnp.inf)
        row_max = jnp.max(logits, axis=-1, keepdims=True)
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        p = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(denom > 0, denom, 1.0)
        return jnp.einsum("bhts,bshd->bthd", p, v)
