"""The one definition of which key a query may see, shared by references, XLA backends and kernels.

Causal attention is bottom-right aligned: with T queries and S keys, query i sits at position
i + (S - T) and sees key j iff j <= i + (S - T). A local window (left, right) restricts it to
i + (S - T) - left <= j <= i + (S - T) + right (`jax.nn.dot_product_attention`'s
`local_window_size`, with the same alignment). Segment ids restrict a query to keys with an
equal id. Inside a GLA chunk, token j reaches token i iff j <= i in the same segment.
"""

from __future__ import annotations

import jax.numpy as jnp


def causal_offset(t: int, s: int) -> int:
    """Shift of the bottom-right aligned causal diagonal: query i sees key j iff j <= i + offset."""
    return s - t


def attention_visibility(q_pos, k_pos, *, causal: bool, offset: int, q_seg=None, kv_seg=None,
                         window=None):
    """Boolean visibility, broadcast over the inputs' shapes.

    All arguments must have one rank (the tests run with rank promotion disabled).

    Args:
      q_pos: query positions, e.g. [1, Tq, 1] int32.
      k_pos: key positions, e.g. [1, 1, Tk] int32.
      causal: bottom-right aligned causal masking.
      offset: `causal_offset(T, S)`.
      q_seg, kv_seg: segment ids broadcastable like q_pos / k_pos, or None.
      window: None, or (left, right): keys at most `left` before and `right` after the query's
        aligned position (`window_bounds`); None on a side: unbounded.
    Returns:
      bool array, True where the query sees the key.
    """
    shape = jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(k_pos))
    visible = jnp.ones(shape, dtype=bool)
    left, right = window_bounds(window, causal)
    if right is not None:
        visible = k_pos <= q_pos + (offset + right)
    if left is not None:
        visible = jnp.logical_and(visible, k_pos >= q_pos + (offset - left))
    if q_seg is not None:
        visible = jnp.logical_and(visible, q_seg == kv_seg)
    return visible


def window_bounds(window, causal: bool) -> tuple[int | None, int | None]:
    """(left, right) reach of a query around its aligned position; None: unbounded. Causal
    attention has right = 0 (and a window's right side cannot widen it)."""
    left = right = None
    if window is not None:
        left, right = window
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def lower_triangular(n: int, dtype=bool):
    """[n, n] with ones on and below the diagonal: token i sees token j iff j <= i."""
    return intra_chunk_visibility(jnp.arange(n)[:, None], jnp.arange(n)[None, :]).astype(dtype)


def intra_chunk_visibility(q_pos, k_pos, q_seg=None, k_seg=None):
    """Token k of a chunk reaches token q of the same chunk iff k <= q and, with segments, both
    lie in one segment. Broadcast over the arguments' shapes (one rank for all)."""
    visible = k_pos <= q_pos
    if q_seg is not None:
        visible = jnp.logical_and(visible, q_seg == k_seg)
    return visible
