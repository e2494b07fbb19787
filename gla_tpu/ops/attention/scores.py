"""Attention scores in base-2 units, with the optional logit soft cap: one definition for the TPU
and GPU kernels.

The kernels exponentiate with exp2, so they keep scores in base-2 units: s2 = s log2(e) with
s = sm_scale q k^T, or with a soft cap c, s = c tanh(sm_scale q k^T / c) (Gemma 2). The backward
multiplies the score gradient by the cap's derivative with respect to sm_scale q k^T,
1 - tanh^2 (the trailing sm_scale it applies to dq and dk as without a cap).
"""

from __future__ import annotations

import jax.numpy as jnp

from gla_tpu.ops.common.base2 import LOG2_E


def base2_scores(qk, sm_scale: float, soft_cap: float | None):
    """(s2, cap_grad) from the raw products qk (float32, any shape): s2 the base-2 scores and
    cap_grad = 1 - tanh^2 (None without a cap)."""
    if soft_cap is None:
        return qk * (sm_scale * LOG2_E), None
    tanh = jnp.tanh(qk * (sm_scale / soft_cap))
    return tanh * (soft_cap * LOG2_E), 1.0 - tanh * tanh
