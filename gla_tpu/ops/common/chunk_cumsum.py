"""The chunk-local running sum of the log gates, the quantity every chunked GLA path exponentiates.

Notation (docs/gla_math.md): g is the log forget gate (g <= 0); within a chunk, b is the inclusive
running sum of g restarted at the chunk's first token, so b_i - b_j <= 0 for j <= i and every
exponential taken is of such a non-positive difference. Per-key gates additionally use secondary
chunking: sub-chunks of SUB_CHUNK tokens re-reference b at a sub-chunk boundary so that pairs of
tokens in different sub-chunks factor into two bounded exponentials.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Sub-chunk length of the secondary chunking of per-key gates (the "xla" backend and the Triton
# GPU kernels; the Mosaic kernels take pair levels instead, common/pair_levels.py).
SUB_CHUNK = 16


def chunk_local_cumsum(g, chunk_size: int, *, method: str = "cumsum"):
    """Inclusive running sum of g restarted at every chunk, in float32.

    Args:
      g: [B, T, H] or [B, T, H, K] log gates, T a multiple of chunk_size.
      method: "cumsum" (XLA's cumulative sum) or "triangular" (one float32 product with a
        lower-triangular matrix of ones on the matrix units, which GPUs and TPUs run faster than
        a cumsum; docs/gpu_gla.md, docs/gla_mosaic_tpu.md).
    Returns:
      same shape, float32: b[t] = sum of g over [chunk_start(t), t].
    """
    b, t = g.shape[0], g.shape[1]
    if t % chunk_size:
        raise ValueError(f"chunk_local_cumsum needs T={t} to be a multiple of {chunk_size=}")
    if method == "triangular":
        ones = jnp.tril(jnp.ones((chunk_size, chunk_size), jnp.float32))
        gc = g.astype(jnp.float32).reshape((b, t // chunk_size, chunk_size) + g.shape[2:])
        # "bnshk" for per-key gates, "bnsh" for per-head ones
        rest = "hk"[:g.ndim - 2]
        out = jnp.einsum(f"ts,bns{rest}->bnt{rest}", ones, gc,
                         precision=jax.lax.Precision.HIGHEST)
        return out.reshape(g.shape)
    if method != "cumsum":
        raise ValueError(f"method must be 'cumsum' or 'triangular'; got {method!r}.")
    gc = g.astype(jnp.float32).reshape((b, t // chunk_size, chunk_size) + g.shape[2:])
    return jnp.cumsum(gc, axis=2).reshape(g.shape)


def reverse_exclusive_cumsum(x, block: int = 64):
    """y[:, t] = sum over s > t of x[:, s] (axis 1), in float32, as products with triangular
    matrices of ones: within blocks of `block` entries, then, recursively, over the blocks'
    totals. XLA's cumulative sum over a long axis is slower on GPUs than these products (the
    "triangular" method above). Summed from the end: the sums that reach few entries are the
    small ones, which float32 keeps to its rounding.

    x: [B, N, ...]; any N (padded with zeros to a multiple of `block` inside)."""
    x = x.astype(jnp.float32)
    b, n = x.shape[0], x.shape[1]
    if n <= block:
        upper = jnp.triu(jnp.ones((n, n), jnp.float32), k=1)  # [t, s]: 1 where s > t
        return jnp.einsum("ts,bs...->bt...", upper, x, precision=jax.lax.Precision.HIGHEST)
    m = -(-n // block)
    padded = jnp.pad(x, [(0, 0), (0, m * block - n)] + [(0, 0)] * (x.ndim - 2))
    blocks = padded.reshape((b, m, block) + x.shape[2:])
    upper = jnp.triu(jnp.ones((block, block), jnp.float32), k=1)
    within = jnp.einsum("ts,bms...->bmt...", upper, blocks, precision=jax.lax.Precision.HIGHEST)
    later = reverse_exclusive_cumsum(jnp.sum(blocks, axis=2), block)  # [B, m, ...]
    y = within + later[:, :, None]
    return y.reshape((b, m * block) + x.shape[2:])[:, :n]
