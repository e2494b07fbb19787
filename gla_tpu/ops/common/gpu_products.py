"""Matrix products of the GPU (Triton-lowered) kernels, accumulated in float32.

`layout` names the orientation of the two operands: "nn" a @ b, "nt" a @ b.T, "tn" a.T @ b
(no transpose is materialized). The default precision is IEEE float32 for float32 operands and
has no effect on 16-bit ones.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

HIGHEST = lax.Precision.HIGHEST
# each float32 operand split in a bfloat16 head and tail, three bfloat16 products (~2^-16)
SPLIT_BF16 = lax.DotAlgorithmPreset.BF16_BF16_F32_X3

_CONTRACT = {"nn": ((1,), (0,)), "nt": ((1,), (1,)), "tn": ((0,), (0,))}


def product(a, b, layout: str = "nn", precision=HIGHEST):
    """a, b 2-D -> their product in `layout`, float32."""
    return lax.dot_general(a, b, (_CONTRACT[layout], ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)
