"""The "xla" attention backend: plain JAX, differentiable by autodiff, float32 softmax statistics.

The [T, S] score matrix is built per (batch, head); this backend favours clarity and serves as the
same-dtype baseline of the pass rule and as the fallback of "auto".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gla_tpu.ops.common.capabilities import ANY_DIM, ATTENTION_FEATURES, Capabilities
from gla_tpu.ops.common.masks import attention_visibility, causal_offset

CAPABILITIES = Capabilities(
    op="flash_attention", backend="xla", platform="any (plain JAX)",
    dtypes=("bfloat16", "float16", "float32", "float64"), dims=(("head_dim", ANY_DIM),),
    features=ATTENTION_FEATURES,
    notes="[T, S] scores per (batch, head), float32 softmax statistics; autodiff",
)


def check_supported(problem, block_sizes) -> None:
    CAPABILITIES.check(problem, block_sizes)


def visibility_mask(problem, q_segment_ids, kv_segment_ids):
    """[B or 1, 1, 1, T, S] bool: True where query t sees key s (broadcasts over Hkv and group)."""
    t, s = problem.q_len, problem.kv_len
    q_pos = jnp.arange(t, dtype=jnp.int32)[None, :, None]
    k_pos = jnp.arange(s, dtype=jnp.int32)[None, None, :]
    q_seg = kv_seg = None
    if q_segment_ids is not None:
        q_seg = q_segment_ids[:, :, None]  # [B, T, 1]
        kv_seg = kv_segment_ids[:, None, :]  # [B, 1, S]
    mask = attention_visibility(
        q_pos, k_pos, causal=problem.causal, offset=causal_offset(t, s), q_seg=q_seg, kv_seg=kv_seg
    )
    return mask[:, None, None]


def flash_attention(q, k, v, *, problem, q_segment_ids, kv_segment_ids, block_sizes, interpret):
    del block_sizes, interpret
    b, t, h, d = q.shape
    hkv = problem.num_kv_heads
    group = h // hkv
    # Grouped queries attend to their kv head without materializing repeated k/v.
    qg = q.reshape(b, t, hkv, group, d)
    with jax.named_scope("attention_xla"):
        s = jnp.einsum("btngd,bsnd->bngts", qg, k, preferred_element_type=jnp.float32)
        s = s * problem.sm_scale  # [B, Hkv, G, T, S]
        mask = visibility_mask(problem, q_segment_ids, kv_segment_ids)
        s = jnp.where(mask, s, -jnp.inf)
        row_max = jnp.max(s, axis=-1, keepdims=True)
        # A row that sees no key has max -inf; shifting by 0 keeps it finite and all-zero.
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        p = jnp.where(mask, jnp.exp(s - jax.lax.stop_gradient(row_max)), 0.0)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum(
            "bngts,bsnd->btngd", p.astype(v.dtype), v, preferred_element_type=jnp.float32
        )
        denom = jnp.moveaxis(denom, -2, 1)  # [B, T, Hkv, G, 1]
        o = o / jnp.where(denom > 0, denom, 1.0)
    return o.reshape(b, t, h, d).astype(q.dtype)
