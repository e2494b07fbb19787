"""The "xla" attention backend: plain JAX, differentiable by autodiff, float32 softmax statistics
(float64 for float64 inputs).

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
    notes="[T, S] scores per (batch, head), float32 softmax statistics (float64 for float64 inputs); autodiff",
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
        q_pos, k_pos, causal=problem.causal, offset=causal_offset(t, s), q_seg=q_seg,
        kv_seg=kv_seg, window=problem.window,
    )
    return mask[:, None, None]


def _accumulator(dtype):
    """The products' and statistics' dtype: float32, or float64 for float64 inputs (a float64
    product with a float32 result is what cuBLAS refuses, and it would round the reference)."""
    return jnp.promote_types(dtype, jnp.float32)


def _scores(q, k, problem, q_segment_ids, kv_segment_ids):
    """Masked logits s [B, Hkv, G, T, S] in _accumulator(q.dtype) (-inf where hidden;
    soft-capped where the problem has a cap), the mask, and the cap's derivative ds/ds_raw (None
    without a cap)."""
    b, t, h, d = q.shape
    hkv = problem.num_kv_heads
    # Grouped queries attend to their kv head without materializing repeated k/v.
    qg = q.reshape(b, t, hkv, h // hkv, d)
    s = jnp.einsum("btngd,bsnd->bngts", qg, k, preferred_element_type=_accumulator(q.dtype))
    s = s * problem.sm_scale
    cap_grad = None
    if problem.logits_soft_cap is not None:
        cap = problem.logits_soft_cap
        tanh = jnp.tanh(s / cap)
        s = cap * tanh
        cap_grad = 1.0 - tanh * tanh
    mask = visibility_mask(problem, q_segment_ids, kv_segment_ids)
    return jnp.where(mask, s, -jnp.inf), mask, cap_grad


def _weighted_values(p, v, shape):
    """sum_s p[..., t, s] v[s]: [B, Hkv, G, T, S] x [B, S, Hkv, D] -> [B, T, H, D] in
    _accumulator(v.dtype)."""
    o = jnp.einsum("bngts,bsnd->btngd", p.astype(v.dtype), v,
                   preferred_element_type=_accumulator(v.dtype))
    return o.reshape(shape)


def _normalized(q, k, v, problem, q_segment_ids, kv_segment_ids):
    """Softmax attention over k, v: (o [B, T, H, D] float32, row max and denominator
    [B, Hkv, G, T] float32). A row that sees no key gets o = 0 and denominator 0."""
    b, t, h, d = q.shape
    s, mask, _ = _scores(q, k, problem, q_segment_ids, kv_segment_ids)
    row_max = jnp.max(s, axis=-1, keepdims=True)
    # A row that sees no key has max -inf; shifting by 0 keeps it finite and all-zero.
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(mask, jnp.exp(s - jax.lax.stop_gradient(row_max)), 0.0)
    denom = jnp.sum(p, axis=-1)  # [B, Hkv, G, T]
    rows = jnp.moveaxis(denom, -1, 1).reshape(b, t, h, 1)  # [B, T, H, 1]
    o = _weighted_values(p, v, (b, t, h, d)) / jnp.where(rows > 0, rows, 1.0)
    return o, row_max[..., 0], denom


def flash_attention(q, k, v, *, problem, q_segment_ids, kv_segment_ids, block_sizes, interpret):
    del block_sizes, interpret
    with jax.named_scope("attention_xla"):
        o, _, _ = _normalized(q, k, v, problem, q_segment_ids, kv_segment_ids)
    return o.astype(q.dtype)


# The blocks of ring attention (ops/attention/ring.py): one (query block, key block) pair.


def attention_block(q, k, v, *, problem, q_segment_ids, kv_segment_ids, block_sizes, interpret):
    """Attention of q over one block of keys, with its log-sum-exp.

    Returns:
      o: [B, T, H, D] float32 (float64 for float64 inputs), normalized over this block's keys
        (0 for a row that sees none).
      lse: [B, H, T], as o's dtype, natural log; -inf for a row that sees no key of the block.
    """
    del block_sizes, interpret
    b, t, h, _ = q.shape
    with jax.named_scope("attention_xla_block"):
        o, row_max, denom = _normalized(q, k, v, problem, q_segment_ids, kv_segment_ids)
        seen = denom > 0
        lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)
    return o, lse.reshape(b, h, t)


def attention_block_grads(q, k, v, do, lse, delta, *, problem, q_segment_ids, kv_segment_ids,
                          block_sizes, interpret):
    """Gradients of one (query block, key block) pair of a softmax attention normalized elsewhere.

    Args:
      do: [B, T, H, D] cotangent of the whole attention's output.
      lse: [B, H, T] float32, the whole attention's log-sum-exp (non-finite: the row sees no key
        anywhere, and gets zero gradients).
      delta: [B, H, T] float32, rowsum(o * do) of the whole attention.
    Returns:
      dq [B, T, H, D], dk, dv [B, S, Hkv, D], float32 (float64 for float64 inputs): this
        block's terms of the gradients.
    """
    del block_sizes, interpret
    b, t, h, d = q.shape
    hkv = problem.num_kv_heads
    group = h // hkv
    with jax.named_scope("attention_xla_block_grads"):
        s, mask, cap_grad = _scores(q, k, problem, q_segment_ids, kv_segment_ids)
        lse = jnp.where(jnp.isfinite(lse), lse, jnp.inf).reshape(b, hkv, group, t, 1)
        p = jnp.where(mask, jnp.exp(s - lse), 0.0)  # [B, Hkv, G, T, S]
        dog = do.reshape(b, t, hkv, group, d)
        acc = _accumulator(q.dtype)
        dp = jnp.einsum("btngd,bsnd->bngts", dog, v, preferred_element_type=acc)
        ds = p * (dp - delta.reshape(b, hkv, group, t, 1)) * problem.sm_scale
        if cap_grad is not None:
            ds = ds * cap_grad
        dv = jnp.einsum("bngts,btngd->bsnd", p.astype(do.dtype), dog,
                        preferred_element_type=acc)
        dq = _weighted_values(ds, k, (b, t, h, d))
        dk = jnp.einsum("bngts,btngd->bsnd", ds.astype(q.dtype), q.reshape(b, t, hkv, group, d),
                        preferred_element_type=acc)
    return dq, dk, dv
