"""Pair levels of a chunk: the intra-chunk decay factored with every exponent <= 0, for any gate.

Inside a chunk of C = 2^n tokens with chunk-local gate sums b (non-increasing in each key channel),
the weight of query r on key x <= r is exp(b_r - b_x) per channel. A pair (r, x) with x < r has
one *level* L: the highest bit in which r and x differ (r has it set, x has it clear). At level L
the two tokens lie in one block of 2^(L+1) tokens, r in its upper half and x in its lower half, and
the last token of the lower half,

    m_L(r) = (r >> (L + 1) << (L + 1)) + 2^L - 1     (the same for r and x),

separates them: x <= m < r. So exp(b_r - b_x) = exp(b_r - b_m) exp(b_m - b_x) with both exponents
<= 0, and per level one [C, K] factor serves both sides:

    F_L[t] = exp(b_t - b_m(t))  if bit L of t is set (t a query of level L),
             exp(b_m(t) - b_t)  otherwise (t a key of level L).

The level-L part of the scores is then one matrix product, masked to pairs in the same block:
A_L = mask_L * ((q F_L [upper rows]) (k F_L [lower rows])^T). The log2(C) levels plus the diagonal
(q_t . k_t) tile the causal triangle: every pair belongs to exactly one. docs/gla_math.md
("Pair levels: any gate, every exponent non-positive, one speed") derives it; the Mosaic GPU
kernels (gla/pallas_gpu/kernels_mosaic_levels.py) and `scores_by_levels` here use it.
"""

from __future__ import annotations

import functools

import numpy as np


def num_levels(chunk: int) -> int:
    """log2(chunk): the levels 0 .. num_levels - 1 of a chunk of `chunk` tokens."""
    if chunk < 2 or chunk & (chunk - 1):
        raise ValueError(f"chunk={chunk} must be a power of two >= 2")
    return chunk.bit_length() - 1


def is_upper(t, level):
    """True where token t (an int array, numpy or traced) is in the upper half of its
    level-`level` block; `level` may be a kernel's loop index."""
    return ((t >> level) & 1) == 1


def separator(t, level: int):
    """m_L(t): the last token of the lower half of t's level-`level` block."""
    return ((t >> (level + 1)) << (level + 1)) + (1 << level) - 1


def same_block(r, x, level: int):
    """True where tokens r and x lie in one block of 2^(level + 1) tokens."""
    return (r >> (level + 1)) == (x >> (level + 1))


def level_of_pairs(chunk: int) -> np.ndarray:
    """[C, C] int32: the level of pair (r, x) for x < r, -1 on and above the diagonal."""
    t = np.arange(chunk)
    r, x = t[:, None], t[None, :]
    out = np.full((chunk, chunk), -1, np.int32)
    for level in range(num_levels(chunk)):
        out[same_block(r, x, level) & is_upper(r, level) & ~is_upper(x, level)] = level
    return out


def exponent_range(name: str, chunk: int):
    """(lo, hi) [C] int: row t's exponent is the gates summed over the tokens s, lo_t < s <= hi_t.
    name: "level<L>" (F_L's: (m, t] on a level's upper rows, (t, m] on its lower rows, m the
    separator), "prefix" (b_t: [0, t]), "suffix" (b_last - b_t: (t, C)), "before" (s < t) or
    "at_or_after" (s >= t)."""
    t = np.arange(chunk)
    if name.startswith("level"):
        level = int(name[len("level"):])
        m, up = separator(t, level), is_upper(t, level)
        return np.where(up, m, t), np.where(up, t, m)
    bounds = {"prefix": (t * 0 - 1, t), "suffix": (t, t * 0 + chunk - 1),
              "before": (t * 0 - 1, t - 1), "at_or_after": (t - 1, t * 0 + chunk - 1)}
    return bounds[name]


@functools.lru_cache(maxsize=None)
def range_matrices(names: tuple, chunk: int) -> np.ndarray:
    """[len(names), C, C] float32 0/1, read-only (built once per names and C, for every trace of
    the kernels that read it): R[t, s] = 1 where s is in row t's range (`exponent_range`), so
    R @ g sums the gates g over each row's range."""
    s = np.arange(chunk)[None, :]
    out = []
    for name in names:
        lo, hi = exponent_range(name, chunk)
        out.append(((s > lo[:, None]) & (s <= hi[:, None])).astype(np.float32))
    out = np.stack(out)
    out.setflags(write=False)
    return out


def scores_by_levels(q, k, b, operand_dtype):
    """The unscaled intra-chunk scores [.., C, C] (causal, diagonal included) computed level by
    level as the kernels do: factors in float32, operands rounded to `operand_dtype`, float32
    products. q, k [.., C, K] and b [.., C, K] float32 chunk-local gate sums. For tests and
    docs; the kernels are the fast path."""
    import jax.numpy as jnp

    chunk = q.shape[-2]
    t = np.arange(chunk)
    lead = (1,) * (q.ndim - 2)  # leading axes, explicit (no implicit rank promotion)
    qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
    scores = jnp.zeros((*q.shape[:-1], chunk), jnp.float32)
    for level in range(num_levels(chunk)):
        upper = is_upper(t, level).reshape(lead + (chunk, 1))
        ref = b[..., separator(t, level), :]
        factor = jnp.exp(jnp.where(upper, b - ref, ref - b))
        qs = jnp.where(upper, qf * factor, 0.0).astype(operand_dtype)
        ks = jnp.where(upper, 0.0, kf * factor).astype(operand_dtype)
        part = jnp.einsum("...rc,...xc->...rx", qs, ks, preferred_element_type=jnp.float32)
        mask = same_block(t[:, None], t[None, :], level).reshape(lead + (chunk, chunk))
        scores = scores + jnp.where(mask, part, 0.0)
    diag = jnp.sum(qf * kf, axis=-1)
    return scores + diag[..., :, None] * np.eye(chunk, dtype=np.float32).reshape(
        lead + (chunk, chunk))
