"""Matrix products of every Pallas kernel (TPU and GPU), accumulated in float32.

`layout` names the orientation of the two 2-D operands: "nn" a @ b, "nt" a @ b.T, "tn" a.T @ b
(no transpose is materialized; the contraction dims say it).
`precision`: None is the platform's default (what the Mosaic TPU kernels use: one MXU pass for
16-bit operands); HIGHEST is IEEE float32 for float32 operands on the GPU's Triton lowering and has
no effect on 16-bit ones; SPLIT_BF16 splits each float32 operand into a bfloat16 head and tail
and takes three bfloat16 products (about 2^-16 relative).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

HIGHEST = lax.Precision.HIGHEST
SPLIT_BF16 = lax.DotAlgorithmPreset.BF16_BF16_F32_X3

DIMENSION_NUMBERS = {
    "nn": (((1,), (0,)), ((), ())),
    "nt": (((1,), (1,)), ((), ())),
    "tn": (((0,), (0,)), ((), ())),
}


def product(a, b, layout: str = "nn", precision=None):
    """a, b 2-D -> their product in `layout`, float32."""
    return lax.dot_general(a, b, DIMENSION_NUMBERS[layout], precision=precision,
                           preferred_element_type=jnp.float32)


def accurate_precision(input_dtype):
    """Precision of a float32 product whose result enters a cancelling sum (the GPU GLA's dg): for
    16-bit inputs the split bfloat16 products (about 2^-16 relative, enough next to bfloat16
    inputs); for float32 inputs the IEEE fp32 path (the split's 2^-16 is too coarse for dg's
    float32 bound, docs/gpu_gla.md)."""
    return HIGHEST if jnp.dtype(input_dtype) == jnp.float32 else SPLIT_BF16


def accurate_product(a, b, layout: str, input_dtype):
    """The product of a and b taken as float32 operands, to the accuracy `accurate_precision`
    gives for inputs of `input_dtype`."""
    return product(a.astype(jnp.float32), b.astype(jnp.float32), layout,
                   accurate_precision(input_dtype))
