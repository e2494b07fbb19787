"""The AOT compile helper compiles a Pallas TPU kernel for every generation on a CPU host."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from gla_tpu.testing import TPU_GENERATIONS, compile_for_tpu, libtpu_available

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(not libtpu_available(), reason="needs libtpu (pip install .[test])"),
]


def _double_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0


def _double(x):
    return pl.pallas_call(
        _double_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // 128,),
        in_specs=[pl.BlockSpec((128, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((128, 128), lambda i: (i, 0)),
    )(x)


@pytest.mark.parametrize("generation", TPU_GENERATIONS)
def test_trivial_pallas_kernel_compiles(generation):
    compiled = compile_for_tpu(_double, jax.ShapeDtypeStruct((1024, 128), jnp.float32),
                               generation=generation)
    assert compiled.memory_analysis().output_size_in_bytes == 1024 * 128 * 4


def test_unknown_generation_is_a_value_error():
    with pytest.raises(ValueError, match="generation must be one of"):
        compile_for_tpu(_double, jax.ShapeDtypeStruct((128, 128), jnp.float32), generation="v3")
