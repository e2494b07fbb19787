"""One definition of the FLOPs each op does, shared by benchmarks and docs.

Conventions (those of shared/ANCHORS.md and FlashAttention):
- softmax attention forward: 4 * B * H * T * S * D (two matmuls), halved when causal with T == S
  (for T != S the visible fraction is computed exactly); forward+backward = 3.5 x forward.
- GLA, chunked algorithm with chunk C, per token and head: intra-chunk scores and their product
  with V on the causal half of a C x C block (C*K + C*V), the inter-chunk product q S (2*K*V) and the
  state update k^T v (2*K*V). Forward+backward = 3 x forward (each forward matmul has two
  gradient matmuls). The recurrent mode does 4*K*V per token and head; we report it with the same
  chunked count so modes compare by time.
"""

from __future__ import annotations

FWD_BWD_FACTOR_ATTENTION = 3.5
FWD_BWD_FACTOR_GLA = 3.0


def causal_visible_fraction(t: int, s: int) -> float:
    """Fraction of the T x S score matrix a bottom-right aligned causal mask keeps."""
    visible = sum(max(0, min(s, i + (s - t) + 1)) for i in range(t)) if t <= 65536 else None
    if visible is None:  # closed form for very long T == S
        return 0.5 * (1 + 1 / t)
    return visible / (t * s)


def attention_flops(batch, q_len, kv_len, heads, head_dim, *, causal=False, backward=False):
    flops = 4.0 * batch * heads * q_len * kv_len * head_dim
    if causal:
        flops *= causal_visible_fraction(q_len, kv_len)
    return flops * (FWD_BWD_FACTOR_ATTENTION if backward else 1.0)


def gla_flops(batch, seq_len, heads, key_dim, value_dim, *, chunk_size=64, backward=False):
    per_token = chunk_size * key_dim + chunk_size * value_dim + 4.0 * key_dim * value_dim
    flops = batch * heads * seq_len * per_token
    return flops * (FWD_BWD_FACTOR_GLA if backward else 1.0)
