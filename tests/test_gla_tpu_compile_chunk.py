"""AOT compilation of the chunked "mosaic_tpu" GLA kernels for real TPU generations (libtpu).

The configurations docs/gla_mosaic_tpu.md claims, through the public API, bfloat16 q, k, v with
float32 gates: forward, and forward + backward (jax.grad of a scalar loss over o and the final
state, so every backward kernel and the initial-state cotangent are built). Compiling runs the
whole Mosaic compiler for the generation, VMEM budget included.
"""

import jax
import jax.numpy as jnp
import pytest

from gla_tpu import ops
from gla_tpu.testing.tpu_compile import TPU_GENERATIONS, compile_for_tpu, libtpu_available

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(not libtpu_available(), reason="needs libtpu to compile for TPU"),
]

# (mode, gate kind, B, T, H, K, V)
CONFIGS = {
    "fused_chunk-key-B2-T8192-H8-K128-V128": ("fused_chunk", "key", 2, 8192, 8, 128, 128),
    "chunk-key-B4-T2048-H4-K256-V512": ("chunk", "key", 4, 2048, 4, 256, 512),
    "fused_chunk-head-B2-T4096-H16-K64-V64": ("fused_chunk", "head", 2, 4096, 16, 64, 64),
    # Head-dim coverage: the largest dims, and dims that are not multiples of 128.
    "fused_chunk-key-B1-T1024-H2-K512-V512": ("fused_chunk", "key", 1, 1024, 2, 512, 512),
    "chunk-key-B1-T1024-H2-K192-V320": ("chunk", "key", 1, 1024, 2, 192, 320),
}


def _abstract_inputs(gate, b, t, h, kd, vd):
    bf16, f32 = jnp.bfloat16, jnp.float32
    gshape = (b, t, h, kd) if gate == "key" else (b, t, h)
    return (jax.ShapeDtypeStruct((b, t, h, kd), bf16), jax.ShapeDtypeStruct((b, t, h, kd), bf16),
            jax.ShapeDtypeStruct((b, t, h, vd), bf16), jax.ShapeDtypeStruct(gshape, f32),
            jax.ShapeDtypeStruct((b, h, kd, vd), f32))


def _forward(mode):
    def fwd(q, k, v, g, s0):
        return ops.gla(q, k, v, g, initial_state=s0, output_final_state=True, mode=mode,
                       backend="mosaic_tpu")
    return fwd


def _forward_backward(mode):
    fwd = _forward(mode)

    def loss(q, k, v, g, s0):
        o, final = fwd(q, k, v, g, s0)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))


@pytest.mark.parametrize("generation", TPU_GENERATIONS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_compiles_forward_and_backward(config, generation):
    mode, gate, *sizes = CONFIGS[config]
    args = _abstract_inputs(gate, *sizes)
    assert compile_for_tpu(_forward(mode), *args, generation=generation) is not None
    assert compile_for_tpu(_forward_backward(mode), *args, generation=generation) is not None
