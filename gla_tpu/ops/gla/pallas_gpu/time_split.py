"""T cut into P segments that run side by side as P times the batch, where the blocks of a
chunk-serial kernel cannot fill the GPU: the folds, and the scan that joins the segments.

A chunk-serial pass over a segment started from a zero state gives that segment's own end state
S(p); with G(p) the segment's decay (the sum of its gates per key, <= 0), the state each segment
starts from is

    S_in(0) = the initial state,    S_in(p + 1) = exp(G(p)) S_in(p) + S(p),

a few [B, H, K, V] products in XLA; reversed (a backward pass), the same from the last segment.
The per-head forward (forward_mosaic.py) and the pair-level state passes (vjp.py) split so.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def fold(x, splits: int):
    """[B, P * L, ...] -> [B * P, L, ...]: P segments of the time (or chunk) axis as batch rows."""
    return x.reshape(x.shape[0] * splits, x.shape[1] // splits, *x.shape[2:])


def unfold(x, splits: int):
    """[B * P, L, ...] -> [B, P * L, ...]."""
    return x.reshape(x.shape[0] // splits, x.shape[1] * splits, *x.shape[2:])


def segment_starts(local, decay, start, *, reverse: bool = False):
    """local [B * P, H, K, V] float32 the segments' states from zero, decay [B, P, H, K'] each
    segment's exp(G(p)) (K' = K, or 1 for a per-head gate), start [B, H, K, V] the state entering
    the first segment (reverse: the one arriving after the last) -> [B * P, H, K, V] the state
    each segment starts from."""
    b, splits = decay.shape[:2]
    local = local.reshape(b, splits, *local.shape[1:])

    def carry(s_in, segment):
        seg_decay, seg_state = segment  # [B, H, K'], [B, H, K, V]
        return seg_decay[..., None] * s_in + seg_state, s_in

    _, s_in = lax.scan(carry, start, (jnp.moveaxis(decay, 1, 0), jnp.moveaxis(local, 1, 0)),
                       reverse=reverse)  # [P, B, H, K, V]
    return jnp.moveaxis(s_in, 0, 1).reshape(b * splits, *start.shape[1:])
