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
    each segment starts from.

    Written out segment by segment (P is static) for XLA to fuse, not as a `lax.scan`, which XLA
    runs on the GPU as a loop launched step by step: at (2, 16384, 8, 128, 128), P = 4, that loop
    made the forward 0.482 ms against 0.436 (H200, docs/results/history.md, "the time
    split's join written out")."""
    b, splits = decay.shape[:2]
    local = local.reshape(b, splits, *local.shape[1:])
    starts = [None] * splits
    state = start
    for p in (reversed(range(splits)) if reverse else range(splits)):
        starts[p] = state
        state = decay[:, p, ..., None] * state + local[:, p]
    return jnp.stack(starts, axis=1).reshape(b * splits, *start.shape[1:])
