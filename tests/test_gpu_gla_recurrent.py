"""The GPU decoding kernel of the GLA recurrence (pallas_gpu_recurrent.py): interpret-mode parity
against the float64 token-by-token reference on CPU, lowering to Triton IR for a Hopper target without a GPU,
and parity on a CUDA GPU (marker gpu)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from gla_tpu.testing.gpu_lowering import hopper_target
from gla_tpu.ops.gla.pallas_gpu.kernels_recurrent import block_v, recurrent_forward
from gla_tpu.ops.gla.reference import gla_recurrent_reference
from gla_tpu.testing.tolerance import relative_rms_error

# jax 0.11.2 deprecates the Pallas Triton lowering (docs/gpu_backend.md says why we still use it);
# the warning is raised at every lowering, which this strict environment would turn into errors.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def _inputs(key, bsz, tokens, heads, key_dim, value_dim, *, dtype, strength, initial_state):
    """Fresh random q, k, v (dtype), log gates log_sigmoid(normal) / strength (f32) and s0."""
    kq, kk, kv, kg, ks = jax.random.split(key, 5)
    q = jax.random.normal(kq, (bsz, tokens, heads, key_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (bsz, tokens, heads, key_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (bsz, tokens, heads, value_dim), jnp.float32).astype(dtype)
    g = jax.nn.log_sigmoid(jax.random.normal(kg, (bsz, tokens, heads, key_dim))) / strength
    s0 = (jax.random.normal(ks, (bsz, heads, key_dim, value_dim), jnp.float32)
          if initial_state else None)
    return q, k, v, g, s0


def _check(key, bsz, tokens, heads, key_dim, value_dim, *, dtype, strength, initial_state,
           interpret, tol):
    q, k, v, g, s0 = _inputs(key, bsz, tokens, heads, key_dim, value_dim, dtype=dtype,
                             strength=strength, initial_state=initial_state)
    scale = key_dim ** -0.5
    fn = jax.jit(functools.partial(recurrent_forward, scale=scale, interpret=interpret))
    o, final = fn(q, k, v, g, s0)
    assert o.shape == v.shape and o.dtype == v.dtype
    assert final.shape == (bsz, heads, key_dim, value_dim) and final.dtype == jnp.float32
    want_o, want_final = gla_recurrent_reference(  # float64, on the dtype-rounded inputs
        q, k, v, g, scale=scale, initial_state=s0, output_final_state=True)
    err_o, err_final = relative_rms_error(o, want_o), relative_rms_error(final, want_final)
    assert err_o <= tol, f"o: relative RMS error {err_o:.3g} > {tol}"
    assert err_final <= tol, f"final: relative RMS error {err_final:.3g} > {tol}"


DIMS = [(64, 64), (128, 128), (256, 64), (64, 512)]


@pytest.mark.parametrize("strength", [1.0, 0.1])
@pytest.mark.parametrize("initial_state", [False, True])
@pytest.mark.parametrize("key_dim,value_dim", DIMS)
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_interpret_parity(tokens, key_dim, value_dim, initial_state, strength):
    key = jax.random.key(hash((tokens, key_dim, value_dim, initial_state, strength)) % 2**31)
    _check(key, 2, tokens, 2, key_dim, value_dim, dtype=jnp.float32, strength=strength,
           initial_state=initial_state, interpret=True, tol=1e-5)


def test_interpret_parity_fori_loop():
    """More than 16 tokens take the fori_loop path."""
    _check(jax.random.key(7), 1, 20, 2, 128, 64, dtype=jnp.float32, strength=1.0,
           initial_state=True, interpret=True, tol=1e-5)


def test_block_v():
    assert [block_v(kd, 512) for kd in (64, 128, 256, 512)] == [128, 64, 32, 16]
    assert block_v(64, 64) == 64


@pytest.mark.parametrize("bad", [(96, 64), (64, 32), (1024, 64), (128, 192)])
def test_unsupported_dims_raise(bad):
    key_dim, value_dim = bad
    q = jnp.zeros((1, 1, 1, key_dim), jnp.float32)
    v = jnp.zeros((1, 1, 1, value_dim), jnp.float32)
    with pytest.raises(ValueError, match="recurrent_forward takes"):
        recurrent_forward(q, q, v, q, None, scale=1.0, interpret=True)


@pytest.mark.parametrize("tokens,key_dim,value_dim,dtype,initial_state", [
    (1, 128, 128, jnp.bfloat16, True),
    (1, 512, 512, jnp.float16, True),
    (3, 64, 512, jnp.float32, False),
    (16, 256, 64, jnp.bfloat16, True),
    (20, 128, 128, jnp.bfloat16, True),
])
def test_lowers_to_triton(tokens, key_dim, value_dim, dtype, initial_state):
    q = jax.ShapeDtypeStruct((2, tokens, 2, key_dim), dtype)
    v = jax.ShapeDtypeStruct((2, tokens, 2, value_dim), dtype)
    g = jax.ShapeDtypeStruct((2, tokens, 2, key_dim), jnp.float32)
    s0 = jax.ShapeDtypeStruct((2, 2, key_dim, value_dim), jnp.float32) if initial_state else None
    fn = functools.partial(recurrent_forward, scale=key_dim ** -0.5, interpret=False)
    with hopper_target():
        lowered = jax.jit(fn).trace(q, q, v, g, s0).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("xla.gpu.triton") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)], ids=str)
@pytest.mark.parametrize("tokens", [1, 16])
@pytest.mark.parametrize("strength", [1.0, 0.1])
def test_gpu_parity(tokens, dtype, tol, strength):
    _check(jax.random.key(tokens + int(10 * strength)), 4, tokens, 4, 128, 128, dtype=dtype,
           strength=strength, initial_state=True, interpret=False, tol=tol)
