"""Every bad input gets a ValueError (invalid) or NotImplementedError (backend cannot take it),
with a message that names the argument, the value and what is accepted."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from gla_tpu import ops

B, T, H, D = 2, 16, 4, 32
Q = jnp.ones((B, T, H, D), jnp.float32)
KV = jnp.ones((B, T, 2, D), jnp.float32)
GK = -jnp.ones((B, T, H, D), jnp.float32)
SEG = jnp.zeros((B, T), jnp.int32)


def attention(**overrides):
    args = dict(q=Q, k=KV, v=KV)
    args.update(overrides)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    return ops.flash_attention(q, k, v, **args)


def gla(**overrides):
    args = dict(q=Q, k=Q, v=Q, g=GK)
    args.update(overrides)
    q, k, v, g = args.pop("q"), args.pop("k"), args.pop("v"), args.pop("g")
    return ops.gla(q, k, v, g, **args)


ATTENTION_BAD = [
    ({"q": jnp.ones((B, T, D))}, ValueError, r"q must have rank 4.*\(2, 16, 32\)"),
    ({"q": np.ones((B, T, H, D), np.int32)}, ValueError, r"q must have a floating dtype.*int32"),
    ({"k": jnp.ones((B, T, 2, 16))}, ValueError, r"k must have shape.*\(2, 16, 2, 32\).*\(2, 16, 2, 16\)"),
    ({"v": jnp.ones((B, T + 1, 2, D))}, ValueError, r"v must have shape"),
    ({"k": jnp.ones((B, T, 3, D)), "v": jnp.ones((B, T, 3, D))}, ValueError, r"H=4.*Hkv=3"),
    ({"q": Q.astype(jnp.bfloat16)}, ValueError, r"share one dtype.*bfloat16"),
    ({"q": jnp.ones((B, 0, H, D))}, ValueError, r"zero-sized"),
    ({"causal": "yes"}, ValueError, r"causal must be a bool; got 'yes'"),
    ({"sm_scale": -1.0}, ValueError, r"sm_scale must be a finite positive number; got -1.0"),
    ({"sm_scale": jnp.float32(0.1)}, ValueError, r"sm_scale must be None or a finite positive number"),
    ({"segment_ids": jnp.zeros((B, T), jnp.float32)}, ValueError, r"segment_ids \(queries\) must have an integer dtype"),
    ({"segment_ids": jnp.zeros((B, T + 1), jnp.int32)}, ValueError, r"segment_ids \(queries\) must have shape"),
    ({"segment_ids": (SEG,)}, ValueError, r"a pair.*length 1"),
    ({"k": jnp.ones((B, 8, 2, D)), "v": jnp.ones((B, 8, 2, D)), "segment_ids": SEG}, ValueError, r"T == S.*T=16, S=8"),
    ({"backend": "cuda"}, ValueError, r"backend must be one of .*'cuda'"),
    ({"backend": "xla", "block_sizes": object()}, NotImplementedError, r"'xla' backend takes None"),
]


@pytest.mark.parametrize("overrides,exc,pattern", ATTENTION_BAD)
def test_flash_attention_rejects(overrides, exc, pattern):
    with pytest.raises(exc, match=pattern):
        attention(**overrides)


GLA_BAD = [
    ({"q": jnp.ones((B, T, D))}, ValueError, r"q must have rank 4"),
    ({"k": jnp.ones((B, T, H, D + 1))}, ValueError, r"k must have shape.*\(2, 16, 4, 32\)"),
    ({"v": jnp.ones((B, T + 1, H, D))}, ValueError, r"v must have shape"),
    ({"v": Q.astype(jnp.bfloat16)}, ValueError, r"share one dtype"),
    ({"q": jnp.ones((B, T, H, D), jnp.int8)}, ValueError, r"floating dtype.*int8"),
    ({"g": jnp.ones((B, T))}, ValueError, r"g must be None, a per-head gate \[B, T, H\] or a per-key gate"),
    ({"g": jnp.ones((B, T, H + 1))}, ValueError, r"g must have shape \[B, T, H\]"),
    ({"g": jnp.ones((B, T, H, D), jnp.int32)}, ValueError, r"g must have a floating dtype"),
    ({"g": -jnp.ones((B, T, H, 8))}, ValueError, r"g must have shape \[B, T, H, K\]"),
    ({"scale": 0.0}, ValueError, r"scale must be a finite positive number; got 0.0"),
    ({"initial_state": jnp.ones((B, H, D))}, ValueError, r"initial_state must have rank 4"),
    ({"initial_state": jnp.ones((B, H, D, D + 1))}, ValueError, r"initial_state must have shape"),
    ({"output_final_state": 1}, ValueError, r"output_final_state must be a bool; got 1"),
    ({"segment_ids": jnp.zeros((B, T), jnp.float32)}, ValueError, r"segment_ids must have an integer dtype"),
    ({"segment_ids": jnp.zeros((B, T - 1), jnp.int32)}, ValueError, r"segment_ids must have shape"),
    ({"mode": "parallel"}, ValueError, r"mode must be one of .*'parallel'"),
    ({"chunk_size": 32}, ValueError, r"chunk_size must be one of \(64, 128, None\); got 32"),
    ({"chunk_size": True}, ValueError, r"chunk_size must be one of"),
    ({"backend": "triton"}, ValueError, r"backend must be one of .*'triton'"),
]


@pytest.mark.parametrize("overrides,exc,pattern", GLA_BAD)
def test_gla_rejects(overrides, exc, pattern):
    with pytest.raises(exc, match=pattern):
        gla(**overrides)


def test_gla_aliases_fix_the_mode():
    with pytest.raises(ValueError, match=re.escape("mode is fixed to 'chunk'")):
        ops.chunk_gla(Q, Q, Q, GK, mode="fused_recurrent")
    o1, _ = ops.chunk_gla(Q, Q, Q, GK)
    o2, _ = ops.fused_recurrent_gla(Q, Q, Q, GK)
    np.testing.assert_allclose(o1, o2, rtol=2e-5, atol=2e-5)
