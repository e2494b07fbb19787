"""One definition of the FLOPs each op does, shared by the kernels' cost estimates, the
benchmarks and the docs.

Conventions (those of FlashAttention and of the peers' benchmarks):
- softmax attention forward: 4 * B * H * T * S * D (two matmuls) over the visible part of the
  score matrix (about half when causal with T == S; exact for T != S); forward+backward = 3.5 x
  forward.
- GLA, chunked algorithm with chunk C, per token and head: intra-chunk scores and their product
  with V on the causal half of a C x C block (C*K + C*V), the inter-chunk product q S (2*K*V) and
  the state update k^T v (2*K*V). Forward+backward = 3 x forward (each forward matmul has two
  gradient matmuls). The recurrent mode does 4*K*V per token and head; it is reported with the
  same chunked count so that modes compare by time.
"""

from __future__ import annotations

import numpy as np

FWD_BWD_FACTOR_ATTENTION = 3.5
FWD_BWD_FACTOR_GLA = 3.0
# The chunked delta rule's backward holds about 2.5x its forward's products
# (docs/delta_rule_math.md, "Cost per chunk").
FWD_BWD_FACTOR_DELTA_RULE = 3.5


def causal_visible_fraction(q_len: int, kv_len: int) -> float:
    """Fraction of the [T, S] score matrix that bottom-right aligned causal masking keeps."""
    # Row i sees clip(i + S - T + 1, 0, S) keys.
    seen = np.clip(np.arange(q_len, dtype=np.int64) + (kv_len - q_len + 1), 0, kv_len).sum()
    return float(seen) / (q_len * kv_len)


def attention_matmul_flops(batch, q_len, kv_len, heads, head_dim, *, causal: bool,
                           matmuls: int) -> float:
    """FLOPs of `matmuls` [T, D] x [D, S]-sized products over the visible score matrix: 2 for the
    forward (q k^T, p v), 3 for a dq kernel (s, dp, dq), 4 for a dk/dv kernel (s, dp, dv, dk)."""
    flops = 2.0 * matmuls * batch * heads * q_len * kv_len * head_dim
    if causal:
        flops *= causal_visible_fraction(q_len, kv_len)
    return flops


def attention_flops(batch, q_len, kv_len, heads, head_dim, *, causal=False, backward=False):
    """Softmax attention: forward, or forward+backward (3.5 x) when `backward`."""
    flops = attention_matmul_flops(batch, q_len, kv_len, heads, head_dim, causal=causal,
                                   matmuls=2)
    return flops * (FWD_BWD_FACTOR_ATTENTION if backward else 1.0)


def gla_flops(batch, seq_len, heads, key_dim, value_dim, *, chunk_size=64, backward=False):
    """Chunked GLA: forward, or forward+backward (3 x) when `backward`."""
    per_token = chunk_size * key_dim + chunk_size * value_dim + 4.0 * key_dim * value_dim
    flops = batch * heads * seq_len * per_token
    return flops * (FWD_BWD_FACTOR_GLA if backward else 1.0)



def delta_rule_flops(batch, seq_len, value_heads, key_dim, value_dim, *, chunk_size=64,
                     backward=False):
    """Chunked delta rule (docs/delta_rule_math.md), per value head and token: the chunk's
    k k^T and q k^T (2 C K), the triangular solve for u0 and w (C (K + V)), the intra-chunk
    output (C V), and u = u0 - w S, q S, k^T u (3 K V), each a multiply-add; forward, or
    forward+backward (3.5 x) when `backward`."""
    c, kd, vd = chunk_size, key_dim, value_dim
    per_token = 2.0 * (2 * c * kd + c * (kd + vd) + c * vd + 3 * kd * vd)
    flops = batch * value_heads * seq_len * per_token
    return flops * (FWD_BWD_FACTOR_DELTA_RULE if backward else 1.0)
