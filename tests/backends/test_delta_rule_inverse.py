"""The TPU delta rule's (I + A)^-1 (`unit_lower_inverse`, docs/delta_rule_mosaic_tpu.md, "The
inverse") against NumPy's float64 inverse, where chunked delta rules have gone wrong: Kimi
Linear's gates, gates of -1e3, beta near 2 and keys close to parallel (the inverse's entries then
reach several times those of A).

Float32 inputs take float32 products at HIGHEST precision; 16-bit inputs three bfloat16 products
per float32 one, whose error must stay well below that of rounding the exact inverse to bfloat16
(the next product rounds it so)."""

import jax.numpy as jnp
import numpy as np
import pytest

from gla_tpu.ops.delta_rule import xla
from gla_tpu.ops.delta_rule.mosaic_tpu.kernels_chunk_tile import unit_lower_inverse

C, K = 64, 128


def _scores(rng, gates: str, keys: str, beta_low: float):
    """beta * a [C, C] float64 for unit keys: a_ij = sum_k k_ik k_jk exp(b_ik - b_jk), j < i."""
    if keys == "parallel":  # one direction plus 30% noise
        k = rng.normal(size=(1, K)) + 0.3 * rng.normal(size=(C, K))
    else:
        k = rng.normal(size=(C, K))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    beta = beta_low + (2.0 - beta_low) * rng.uniform(size=(C, 1))
    if gates == "kimi":  # g = -exp(A_log) softplus(x + dt_bias), A_log = log U(1, 16)
        a_log = np.log(rng.uniform(1, 16, size=(1, K)))
        g = -np.exp(a_log) * np.logaddexp(0.0, rng.normal(size=(C, K)) + rng.normal(size=(1, K)))
    elif gates == "minus_1000":  # weak gates with -1e3 at every seventh token
        g = np.full((C, K), -1e-3)
        g[::7] = -1e3
    else:
        g = np.zeros((C, K))
    b = np.cumsum(g, axis=0)
    decay = np.exp(np.minimum(b[:, None, :] - b[None, :, :], 0.0))
    return np.tril(np.einsum("ik,jk,ijk->ij", k, k, decay), -1) * beta


CASES = [("none", "random", 0.0), ("kimi", "random", 0.0), ("minus_1000", "random", 0.0),
         ("none", "parallel", 1.9), ("kimi", "parallel", 1.9)]


@pytest.mark.parametrize("gates,keys,beta_low", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_inverse_against_float64(gates, keys, beta_low, dtype):
    rng = np.random.default_rng(sum(map(ord, gates + keys)))
    a = _scores(rng, gates, keys, beta_low)
    exact = np.linalg.inv(np.eye(C) + a)
    ours = np.asarray(unit_lower_inverse(jnp.asarray(a, jnp.float32), dtype), np.float64)
    error = np.linalg.norm(ours - exact) / np.linalg.norm(exact)
    if dtype == jnp.float32:
        assert error <= 2e-6, error
    else:
        rounded = np.asarray(jnp.asarray(exact, jnp.bfloat16).astype(jnp.float32), np.float64)
        rounding = np.linalg.norm(rounded - exact) / np.linalg.norm(exact)
        assert error <= 0.1 * rounding, (error, rounding)


def test_block_diagonal_inverse_is_the_inverse_of_each_block():
    """Four chunks' scores on the diagonal of one [4C, 4C] matrix, levels below C only: each
    diagonal block of the result is that chunk's inverse, and nothing leaves the blocks."""
    rng = np.random.default_rng(7)
    blocks = [_scores(rng, "kimi", "parallel", 1.5) for _ in range(4)]
    stacked = np.zeros((4 * C, 4 * C))
    for p, blk in enumerate(blocks):
        stacked[p * C:(p + 1) * C, p * C:(p + 1) * C] = blk
    ours = np.asarray(unit_lower_inverse(jnp.asarray(stacked, jnp.float32), jnp.float32,
                                         max_level=C), np.float64)
    for p, blk in enumerate(blocks):
        exact = np.linalg.inv(np.eye(C) + blk)
        got = ours[p * C:(p + 1) * C, p * C:(p + 1) * C]
        assert np.linalg.norm(got - exact) <= 2e-6 * np.linalg.norm(exact)
    off = ours.copy()
    for p in range(4):
        off[p * C:(p + 1) * C, p * C:(p + 1) * C] = 0.0
    assert not off.any()


@pytest.mark.parametrize("gates,keys,beta_low", CASES)
def test_xla_inverse_and_its_pullback_against_float64(gates, keys, beta_low):
    """The "xla" and "pallas_gpu" backends' inverse (`xla.unit_lower_inverse`: blocked like the
    kernel's, in XLA, with a two-product pullback) in float32 on a batch of three chunks, against
    float64: the inverse, and dA for a random dX (dA = -tril(X^T dX X^T, -1))."""
    import jax

    rng = np.random.default_rng(sum(map(ord, gates + keys)) + 1)
    a = np.stack([_scores(rng, gates, keys, beta_low) for _ in range(3)])
    garbage = np.triu(rng.normal(size=(C, C)))  # not read: only the strictly lower part counts
    d_inverse = rng.normal(size=a.shape)
    exact = np.linalg.inv(np.eye(C) + a)
    exact_da = -np.tril(np.swapaxes(exact, -1, -2) @ d_inverse @ np.swapaxes(exact, -1, -2), -1)
    ours, pullback = jax.vjp(xla.unit_lower_inverse, jnp.asarray(a + garbage, jnp.float32))
    (da,) = pullback(jnp.asarray(d_inverse, jnp.float32))
    for got, want in ((ours, exact), (da, exact_da)):
        got = np.asarray(got, np.float64)
        assert np.linalg.norm(got - want) <= 2e-6 * np.linalg.norm(want)
