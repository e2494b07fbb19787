"""The public softmax attention op: validation, backend resolution, dispatch."""

from __future__ import annotations

from gla_tpu.ops.attention.validation import validate_attention
from gla_tpu.ops.common import backends

# Each backend is the module gla_tpu.ops.attention.<backend>, implementing
# `check_supported(problem, block_sizes)` and
# `flash_attention(q, k, v, *, problem, q_segment_ids, kv_segment_ids, block_sizes, interpret)`.


def flash_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    sm_scale: float | None = None,
    segment_ids=None,
    block_sizes=None,
    backend: str = "auto",
    interpret=False,
):
    """Softmax attention `softmax(q k^T * sm_scale + mask) v`, without a [T, S] array in memory.

    Args:
      q: [B, T, H, D] queries.
      k: [B, S, Hkv, D] keys, H % Hkv == 0 (GQA/MQA when Hkv < H).
      v: [B, S, Hkv, D] values; q, k, v share one floating dtype.
      causal: bottom-right aligned: query i sees key j iff j <= i + (S - T).
      sm_scale: logit scale, default D ** -0.5.
      segment_ids: None, a [B, T] int array (T == S), or a pair ([B, T], [B, S]); a query sees
        only keys with its id.
      block_sizes: the backend's BlockSizes (performance only), or None for its defaults.
      backend: "auto", "mosaic_tpu", "pallas_gpu" or "xla".
      interpret: run a Pallas backend in interpret mode on CPU (True, or the backend's interpret
        parameters object).

    Returns:
      o: [B, T, H, D] in q's dtype. A query that sees no key gets zeros (and zero gradients).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gla_tpu import ops
      >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 128, 4, 64), jnp.float32)
      >>> ops.flash_attention(q, k, v, causal=True, backend="xla").shape
      (1, 128, 4, 64)
    """
    problem, q_seg, kv_seg = validate_attention(
        q, k, v, causal=causal, sm_scale=sm_scale, segment_ids=segment_ids
    )
    module, block_sizes = backends.dispatch("attention", "flash_attention", backend, problem,
                                            block_sizes)
    return module.flash_attention(
        q, k, v, problem=problem, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
        block_sizes=block_sizes, interpret=interpret,
    )
