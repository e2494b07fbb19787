"""The fused_recurrent kernels compile for every TPU generation (AOT, on a CPU host with libtpu).

Through the public API with backend="mosaic_tpu": the issue's training shape forward and
forward+backward, and a batched T = 1 decode step forward. Compiling runs the whole Mosaic
compiler, VMEM budget included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from gla_tpu import ops
from gla_tpu.testing.tpu_compile import TPU_GENERATIONS, compile_for_tpu, libtpu_available

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(not libtpu_available(), reason="needs libtpu (pip install .[test])"),
]

# (B, T, H, K, V) of issue 4's fused_recurrent compile configuration.
TRAIN_SHAPE = (8, 256, 8, 128, 128)
# A decode step of a serving batch: one token per row, the state carried in.
DECODE_SHAPE = (64, 1, 16, 128, 128)


def _abstract_inputs(b, t, h, kd, vd, *, with_state):
    bf16 = jnp.bfloat16
    q = jax.ShapeDtypeStruct((b, t, h, kd), bf16)
    v = jax.ShapeDtypeStruct((b, t, h, vd), bf16)
    g = jax.ShapeDtypeStruct((b, t, h, kd), jnp.float32)
    s0 = jax.ShapeDtypeStruct((b, h, kd, vd), jnp.float32) if with_state else None
    return q, q, v, g, s0


def _forward(q, k, v, g, s0):
    return ops.gla(q, k, v, g, initial_state=s0, output_final_state=True, backend="mosaic_tpu",
                   mode="fused_recurrent")


def _forward_backward(q, k, v, g, s0):
    def loss(q, k, v, g, s0):
        o, final = _forward(q, k, v, g, s0)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, s0)


@pytest.mark.parametrize("generation", TPU_GENERATIONS)
@pytest.mark.parametrize("fn", [_forward, _forward_backward], ids=["fwd", "fwd_bwd"])
def test_training_shape_compiles(fn, generation):
    args = _abstract_inputs(*TRAIN_SHAPE, with_state=True)
    compiled = compile_for_tpu(fn, *args, generation=generation)
    assert compiled.memory_analysis() is not None


@pytest.mark.parametrize("generation", TPU_GENERATIONS)
def test_decode_step_compiles(generation):
    args = _abstract_inputs(*DECODE_SHAPE, with_state=True)
    compiled = compile_for_tpu(_forward, *args, generation=generation)
    b, _, h, kd, vd = DECODE_SHAPE
    # Outputs: o [B, 1, H, V] bf16 and the final state [B, H, K, V] f32, nothing else (up to
    # buffer alignment).
    expected = b * h * vd * 2 + b * h * kd * vd * 4
    assert expected <= compiled.memory_analysis().output_size_in_bytes <= 1.01 * expected


# Head-dim coverage beyond the training shape (docs/gla_mosaic_tpu_recurrent.md claims these):
# the GLA paper's K=256/V=512, the largest dims, and dims that are not multiples of 128.
HEAD_DIM_SHAPES = {
    "k256_v512": (2, 128, 4, 256, 512),
    "k512_v512": (1, 128, 2, 512, 512),
    "k448_v320": (1, 128, 2, 448, 320),
    "k64_v64": (2, 130, 4, 64, 64),
}


@pytest.mark.parametrize("generation", TPU_GENERATIONS)
@pytest.mark.parametrize("name", list(HEAD_DIM_SHAPES))
def test_head_dims_compile_forward_backward(name, generation):
    args = _abstract_inputs(*HEAD_DIM_SHAPES[name], with_state=True)
    assert compile_for_tpu(_forward_backward, *args, generation=generation) is not None
