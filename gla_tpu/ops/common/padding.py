"""Padding along time and head dims, for kernels that need multiples of their blocks.

Padded tokens carry zero q, k, v and zero log gates, which leave outputs and states unchanged;
callers slice the padding off.
"""

from __future__ import annotations

import jax.numpy as jnp


def pad_time(x, multiple: int, *, axis: int = 1, value=0):
    """Pads axis `axis` up to a multiple of `multiple` with `value` at the end."""
    t = x.shape[axis]
    pad = (-t) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def pad_last(x, size: int):
    """Zero-pads the last axis up to `size`."""
    pad = size - x.shape[-1]
    if pad == 0:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def pad_segment_index(seg, multiple: int):
    """Pads a [B, T] segment index with each row's last value, so padding joins the last segment."""
    t = seg.shape[1]
    pad = (-t) % multiple
    if pad == 0:
        return seg
    return jnp.concatenate([seg, jnp.repeat(seg[:, -1:], pad, axis=1)], axis=1)
