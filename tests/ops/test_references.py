"""The float64 references agree with each other and with independent NumPy loops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

from gla_tpu import ops
from gla_tpu.testing import GLACase, make_attention_inputs, make_gla_inputs
from gla_tpu.testing.strategies import attention_cases, budget, gla_cases


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


@budget(2, full=3)
@given(gla_cases(key_dims=(4, 16), value_dims=(3, 16)))
def test_gla_quadratic_and_recurrent_references_agree(case):
    inputs = make_gla_inputs(case, jax.random.key(case.seq_len * 7 + case.key_dim))
    quad = ops.gla_reference(**inputs, output_final_state=True)
    rec = ops.gla_recurrent_reference(**inputs, output_final_state=True)
    assert _rel(quad[0], rec[0]) < 1e-10
    assert _rel(quad[1], rec[1]) < 1e-10


@pytest.mark.parametrize("gate", ["key", "head"])
def test_gla_references_agree_under_extreme_decay(gate):
    case = GLACase(1, 40, 2, 8, 8, gate=gate, initial_state=True, segments=True)
    inputs = make_gla_inputs(case, jax.random.key(3))
    inputs["g"] = jnp.full(inputs["g"].shape, -1e3, jnp.float32)
    quad = ops.gla_reference(**inputs, output_final_state=True)
    rec = ops.gla_recurrent_reference(**inputs, output_final_state=True)
    assert np.all(np.isfinite(quad[0])) and np.all(np.isfinite(quad[1]))
    assert _rel(quad[0], rec[0]) < 1e-10 and _rel(quad[1], rec[1]) < 1e-10


def _numpy_gla(q, k, v, g, scale, s0, seg):
    """Independent loop: state per (b, h), reset at id changes."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, kd = q.shape
    g = np.zeros((b, t, h, 1)) if g is None else np.asarray(g, np.float64)
    g = g[..., None] if g.ndim == 3 else g
    o = np.zeros((b, t, h, v.shape[-1]))
    final = np.zeros((b, h, kd, v.shape[-1]))
    for bi in range(b):
        for hi in range(h):
            s = np.zeros((kd, v.shape[-1])) if s0 is None else np.asarray(s0[bi, hi], np.float64)
            for ti in range(t):
                if seg is not None and ti > 0 and seg[bi, ti] != seg[bi, ti - 1]:
                    s = np.zeros_like(s)
                s = np.exp(g[bi, ti, hi])[:, None] * s + np.outer(k[bi, ti, hi], v[bi, ti, hi])
                o[bi, ti, hi] = scale * q[bi, ti, hi] @ s
            final[bi, hi] = s
    return o, final


@pytest.mark.parametrize("gate", ["key", "head", "none"])
def test_gla_reference_matches_numpy_loop(gate):
    case = GLACase(2, 23, 2, 5, 3, gate=gate, initial_state=True, segments=True)
    inputs = make_gla_inputs(case, jax.random.key(11))
    seg = np.array(inputs["segment_ids"])
    seg[0, 5:9] = seg[0, 4] + 100  # an id that changes back: [a, b, a] is three segments
    seg[0, 9:] = seg[0, 4]
    inputs["segment_ids"] = jnp.asarray(seg)
    o, final = ops.gla_reference(**inputs, scale=0.7, output_final_state=True)
    o_np, final_np = _numpy_gla(inputs["q"], inputs["k"], inputs["v"], inputs["g"], 0.7,
                                inputs["initial_state"], seg)
    assert _rel(o, o_np) < 1e-12 and _rel(final, final_np) < 1e-12


def _numpy_attention(q, k, v, causal, scale, q_seg, kv_seg):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    o = np.zeros((b, t, h, d))
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // hkv)
            for i in range(t):
                vis = np.ones(s, bool)
                if causal:
                    vis &= np.arange(s) <= i + (s - t)
                if q_seg is not None:
                    vis &= np.asarray(kv_seg[bi]) == np.asarray(q_seg[bi, i])
                if not vis.any():
                    continue
                logits = k[bi, vis, kh] @ q[bi, i, hi] * scale
                p = np.exp(logits - logits.max())
                o[bi, i, hi] = (p / p.sum()) @ v[bi, vis, kh]
    return o


@budget(3, full=6)
@given(attention_cases(head_dims=(8,), seq_lens=(1, 5, 12)))
def test_attention_reference_matches_numpy_loop(case):
    inputs = make_attention_inputs(case, jax.random.key(case.q_len + 13 * case.kv_len))
    seg = inputs["segment_ids"]
    o = ops.attention_reference(inputs["q"], inputs["k"], inputs["v"], causal=case.causal,
                                segment_ids=seg)
    q_seg, kv_seg = (seg, seg) if case.segments == "shared" else (seg or (None, None))
    o_np = _numpy_attention(inputs["q"], inputs["k"], inputs["v"], case.causal,
                            case.head_dim**-0.5, q_seg, kv_seg)
    assert np.asarray(o).dtype == np.float64
    assert _rel(o, o_np) < 1e-12 or np.abs(np.asarray(o) - o_np).max() < 1e-12
