"""Gate and segment helpers shared by the GLA references, the XLA backend and the kernels.

Notation (docs/gla_math.md): g is the log forget gate (g <= 0); within a chunk, b is the chunk-local
inclusive running sum of g, so b_i - b_j <= 0 for j <= i and every exponential taken is of such a
non-positive difference.
"""

from __future__ import annotations

import jax.numpy as jnp


def segment_index(segment_ids):
    """Turns segment ids into a running segment index that increases where the id changes.

    GLA resets its state where the id changes, so [1, 2, 1] is three segments; the index makes
    "same segment" a plain equality test. [B, T] int -> [B, T] int32, starting at 0 per row.
    """
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    starts = jnp.concatenate(
        [jnp.zeros_like(segment_ids[:, :1], dtype=jnp.int32), changed.astype(jnp.int32)], axis=1
    )
    return jnp.cumsum(starts, axis=1, dtype=jnp.int32)


def pad_time(x, multiple: int, *, axis: int = 1, value=0):
    """Pads axis `axis` up to a multiple of `multiple` with `value` at the end."""
    t = x.shape[axis]
    pad = (-t) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def pad_segment_index(seg, multiple: int):
    """Pads a [B, T] segment index with each row's last value, so padding joins the last segment."""
    t = seg.shape[1]
    pad = (-t) % multiple
    if pad == 0:
        return seg
    return jnp.concatenate([seg, jnp.repeat(seg[:, -1:], pad, axis=1)], axis=1)


def chunk_local_cumsum(g, chunk_size: int):
    """Inclusive running sum of g restarted at every chunk, in float32.

    Args:
      g: [B, T, H] or [B, T, H, K] log gates, T a multiple of chunk_size.
    Returns:
      same shape, float32: b[t] = sum of g over [chunk_start(t), t].
    """
    b, t = g.shape[0], g.shape[1]
    if t % chunk_size:
        raise ValueError(f"chunk_local_cumsum needs T={t} to be a multiple of {chunk_size=}")
    gc = g.astype(jnp.float32).reshape((b, t // chunk_size, chunk_size) + g.shape[2:])
    return jnp.cumsum(gc, axis=2).reshape(g.shape)


def gate_kind(g, k) -> str:
    """"key" for a [B, T, H, K] gate, "head" for [B, T, H], "none" for None (shape already checked)."""
    if g is None:
        return "none"
    return "key" if g.ndim == k.ndim else "head"

