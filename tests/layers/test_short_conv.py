"""The short convolution against a direct float64 loop: taps, bias, SiLU, a carried state,
segments, the returned state; decoding in pieces; argument checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_tpu.layers import short_conv
from gla_tpu.testing import relative_rms_error
from gla_tpu.testing.tolerance import FLOAT32_MAX_RELATIVE_RMS

B, T, C = 2, 13, 6


def _conv_by_hand(x, weight, bias, activation, state, segment_ids):
    """y[b, t] = act(sum_i w[i] x[b, t - (W-1) + i] + bias), reading only the token's own segment
    (a maximal run of equal ids) and, in the row's first segment, the state before the start."""
    x, w = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    width = w.shape[0]
    b, t, c = x.shape
    seg = np.zeros((b, t), np.int64) if segment_ids is None else np.asarray(segment_ids)
    prev = np.zeros((b, width - 1, c)) if state is None else np.asarray(state, np.float64)
    y = np.zeros((b, t, c))
    final = np.zeros((b, width - 1, c))
    for r in range(b):
        start = [0] * t  # start of each token's segment
        for i in range(1, t):
            start[i] = start[i - 1] if seg[r, i] == seg[r, i - 1] else i

        def read(s, tok, r=r, start=start):
            """Input at time s (negative: the state) as token `tok` sees it."""
            if s >= start[tok]:
                return x[r, s]
            if start[tok] == 0 and s < 0:
                return prev[r, width - 1 + s]
            return np.zeros(c)

        for i in range(t):
            acc = sum(w[j] * read(i - (width - 1) + j, i) for j in range(width))
            if bias is not None:
                acc = acc + np.asarray(bias, np.float64)
            y[r, i] = acc / (1 + np.exp(-acc)) if activation == "silu" else acc
        for j in range(width - 1):
            final[r, j] = read(t - (width - 1) + j, t - 1)
    return y, final


@pytest.mark.parametrize("width,activation,bias,with_state,segments", [
    (4, None, True, True, True),
    (2, "silu", True, False, False),
])
def test_short_conv_matches_loop(width, activation, bias, with_state, segments):
    cfg = short_conv.Config(channels=C, width=width, activation=activation, bias=bias)
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = short_conv.init(k1, cfg)
    assert params["weight"].shape == (width, C)
    assert np.all(np.abs(params["weight"]) <= width**-0.5)
    if bias:
        params["bias"] = jax.random.normal(k4, (C,))
    x = jax.random.normal(k2, (B, T, C))
    state = jax.random.normal(k3, (B, width - 1, C)) if with_state else None
    # A one-token segment, an id that comes back (a new segment), a last segment shorter than
    # width - 1 (the returned state is zero before its start).
    seg = jnp.array([[3, 3, 3, 5, 7, 7, 7, 7, 7, 3, 3, 3, 3],
                     [1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 9, 9]]) if segments else None
    y, final = short_conv.apply(params, x, cfg, state=state, segment_ids=seg)
    y_ref, final_ref = _conv_by_hand(x, params["weight"], params.get("bias"), activation, state,
                                     seg)
    assert y.dtype == jnp.float32 and y.shape == (B, T, C)
    assert relative_rms_error(y, y_ref) <= FLOAT32_MAX_RELATIVE_RMS
    if with_state:
        assert final.dtype == jnp.float32
        np.testing.assert_allclose(final, final_ref, rtol=0, atol=0)
    else:
        assert final is None


def test_short_conv_pieces_equal_full_and_bfloat16_state():
    """A state carried over pieces of 1, 2 and 10 tokens (fewer than width - 1 included) gives
    the full output; bfloat16 inputs keep a float32 state holding them exactly."""
    cfg = short_conv.Config(channels=C, width=4)
    params = short_conv.init(jax.random.key(1), cfg)
    x = jax.random.normal(jax.random.key(2), (B, T, C))
    full, _ = short_conv.apply(params, x, cfg)
    state, pieces = short_conv.init_state(cfg, B), []
    for start, stop in ((0, 1), (1, 3), (3, 13)):
        y, state = short_conv.apply(params, x[:, start:stop], cfg, state=state)
        pieces.append(y)
    assert relative_rms_error(jnp.concatenate(pieces, axis=1), full) <= FLOAT32_MAX_RELATIVE_RMS
    np.testing.assert_array_equal(state, x[:, -3:])

    x16 = x.astype(jnp.bfloat16)
    y16, s16 = short_conv.apply(params, x16, cfg, state=short_conv.init_state(cfg, B))
    assert y16.dtype == jnp.bfloat16 and s16.dtype == jnp.float32
    np.testing.assert_array_equal(s16, x16[:, -3:].astype(jnp.float32))


def test_short_conv_errors():
    for make in (lambda: short_conv.Config(channels=0),
                 lambda: short_conv.Config(channels=4, width=0),
                 lambda: short_conv.Config(channels=4, activation="relu"),
                 lambda: short_conv.Config(channels=4, bias=1)):
        with pytest.raises(ValueError):
            make()
    cfg = short_conv.Config(channels=C)
    params = short_conv.init(jax.random.key(3), cfg)
    with pytest.raises(ValueError, match="channels"):
        short_conv.apply(params, jnp.ones((B, T, C + 1)), cfg)
    with pytest.raises(ValueError, match="state"):
        short_conv.apply(params, jnp.ones((B, T, C)), cfg, state=jnp.zeros((B, 4, C)))
