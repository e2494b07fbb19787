"""Segment geometry shared by the references, the XLA backends and every kernel wrapper.

GLA resets its state where the segment id changes, so ids [1, 2, 1] are three segments. The running
segment index makes "same segment" a plain equality; the per-token masks say where a state is
carried or reset; the chunk geometry says which tokens of a chunk the state entering the chunk
reaches, which tokens feed the state leaving it, and whether any reset falls inside it.
"""

from __future__ import annotations

import jax.numpy as jnp


def segment_index(segment_ids):
    """[B, T] int ids -> [B, T] int32 running segment index, 0 at each row's start, increasing by
    one where the id changes."""
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    starts = jnp.concatenate(
        [jnp.zeros_like(segment_ids[:, :1], dtype=jnp.int32), changed.astype(jnp.int32)], axis=1
    )
    return jnp.cumsum(starts, axis=1, dtype=jnp.int32)


def token_keeps(seg):
    """[B, T] bool: True where the token continues the previous token's segment (and at each row's
    first token, which the initial state reaches), False where a new segment starts."""
    return jnp.concatenate([jnp.ones((seg.shape[0], 1), bool), seg[:, 1:] == seg[:, :-1]],
                           axis=1)


def token_starts(seg):
    """[B, T] bool: True at the first token of every segment but the row's first (the complement
    of `token_keeps`)."""
    return jnp.concatenate([jnp.zeros((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]],
                           axis=1)


def chunk_entry_segments(seg, chunk: int):
    """[B, T] segment index (T a multiple of `chunk`) -> [B, N]: the segment of the state entering
    each chunk, i.e. of the token before it (the first token's own for the first chunk)."""
    return jnp.concatenate([seg[:, :1], seg[:, chunk - 1:-1:chunk]], axis=1)


def relative_segments(seg, chunk: int):
    """[B, T] segment index (T a multiple of `chunk`) -> the index minus that of the state entering
    each chunk: 0 where the carried state still reaches (the chunked TPU kernels' `Segments`)."""
    b, t = seg.shape
    rel = seg.reshape(b, t // chunk, chunk) - chunk_entry_segments(seg, chunk)[:, :, None]
    return rel.reshape(b, t)


def chunk_segment_masks(seg_chunks, entry):
    """Which tokens of each chunk touch the carried states.

    Args:
      seg_chunks: [..., N, C] segment index by chunk.
      entry: [..., N, 1] `chunk_entry_segments`, broadcastable against seg_chunks.
    Returns:
      reaches [..., N, C]: the state entering the chunk reaches the token (no reset before it);
      in_last [..., N, C]: the token belongs to the chunk's last segment (it feeds the state
        leaving the chunk);
      keep [..., N, 1]: no reset inside the chunk (the entering state survives it).
    """
    last = seg_chunks[..., -1:]
    return seg_chunks == entry, seg_chunks == last, last == entry
