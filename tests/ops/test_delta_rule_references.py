"""The delta rule's float64 references agree with each other, with closed forms and with an
independent NumPy loop, for DeltaNet (no gate), Gated DeltaNet (per-head gate) and KDA (per-key
gate); the JAX twin of the token recurrence (the reference of the gradients) agrees with the NumPy
one and its gradients with docs/delta_rule_math.md's backward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_tpu.ops.delta_rule import (
    delta_rule_chunked,
    delta_rule_recurrent,
    delta_rule_recurrent_jax,
)
from gla_tpu.ops.delta_rule.reference import _range_decays

GATES = ("none", "head", "key")
FORMS = (delta_rule_recurrent, delta_rule_chunked)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


def _l2norm(x):
    """fla's l2norm over the last dim, in float64."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _kimi_gates(rng, gate, b, t, hv, kd):
    """Kimi Linear's gate: g = -exp(A_log) * softplus(x + dt_bias) with A_log = log U(1, 16) per
    head, dt_bias ~ N(0, 1) per head (GDN) or per head and key (KDA), x ~ N(0, 1)."""
    if gate == "none":
        return None
    shape = (hv,) if gate == "head" else (hv, kd)
    a_log = np.log(rng.uniform(1.0, 16.0, hv))
    a = np.exp(a_log) if gate == "head" else np.exp(a_log)[:, None]
    dt_bias = rng.standard_normal(shape)
    return -a * np.logaddexp(0.0, rng.standard_normal((b, t) + shape) + dt_bias)


def _segment_ids(rng, b, t):
    """Random segments with a one-token segment; row 0's ids alternate (a, b, a, ...: each change
    is a new segment even where an id comes back)."""
    starts = rng.random((b, t)) < 0.2
    starts[:, 3:5] = True  # token 3 is a segment of its own
    ids = np.cumsum(starts, axis=1)
    ids[0] %= 2
    return ids.astype(np.int32)


def _inputs(seed, gate, t, *, b=2, h=2, hv=4, kd=16, vd=24, initial_state=True, segments=True,
            use_qk_l2norm=True):
    """Arguments of the references: q, k, v ~ N(0, 1) in float32, beta = 2 * sigmoid(N(0, 1)),
    Kimi gates. Without use_qk_l2norm the keys are drawn with unit norm, as users pass them: with
    ||k||^2 ~ K, I - beta k k^T has an eigenvalue near 1 - beta K and the state grows
    geometrically."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, kd)).astype(np.float32)
    k = rng.standard_normal((b, t, h, kd))
    if not use_qk_l2norm:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = _kimi_gates(rng, gate, b, t, hv, kd)
    return {
        "q": q, "k": k.astype(np.float32),
        "v": rng.standard_normal((b, t, hv, vd)).astype(np.float32),
        "beta": (2.0 / (1.0 + np.exp(-rng.standard_normal((b, t, hv))))).astype(np.float32),
        "g": None if g is None else g.astype(np.float32),
        "initial_state": (rng.standard_normal((b, hv, kd, vd)).astype(np.float32)
                          if initial_state else None),
        "segment_ids": _segment_ids(rng, b, t) if segments else None,
        "use_qk_l2norm": use_qk_l2norm,
    }


def _assert_forms_agree(inputs, chunk_size=16, tol=1e-10):
    o_rec, s_rec = delta_rule_recurrent(**inputs)
    o_chk, s_chk = delta_rule_chunked(**inputs, chunk_size=chunk_size)
    for x in (o_rec, s_rec, o_chk, s_chk):
        assert x.dtype == np.float64 and np.all(np.isfinite(x))
    assert _rel(o_chk, o_rec) < tol, _rel(o_chk, o_rec)
    assert _rel(s_chk, s_rec) < tol, _rel(s_chk, s_rec)
    return o_rec, s_rec


# (T, chunk_size, initial_state, segments, use_qk_l2norm); chunk_size None: the default (64)
CASES = (
    (1, 16, True, False, True),
    (7, 16, True, True, False),
    (65, 16, True, True, True),
    (65, 16, False, False, False),
    (65, None, True, True, True),
)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-C{}-s0{:d}-seg{:d}-l2{:d}".format(*c))
@pytest.mark.parametrize("gate", GATES)
def test_chunked_and_recurrent_agree(gate, case):
    t, chunk, initial_state, segments, l2norm = case
    inputs = _inputs(t + 100 * GATES.index(gate), gate, t, initial_state=initial_state,
                     segments=segments, use_qk_l2norm=l2norm)
    o, final = _assert_forms_agree(inputs, **({} if chunk is None else {"chunk_size": chunk}))
    assert o.shape == (2, t, 4, 24) and final.shape == (2, 4, 16, 24)


@pytest.mark.parametrize("gate", ["head", "key"])
def test_forms_agree_under_strong_gates(gate):
    """A third of the steps decay by -1e3, the rest weakly (Kimi gates / 16), so pairs that a
    strong gate does not cut span long weak ranges next to sums of -1e3 gates."""
    inputs = _inputs(7, gate, 65)
    rng = np.random.default_rng(8)
    strong = rng.random(inputs["g"].shape) < 0.33
    inputs["g"] = np.where(strong, -1e3, inputs["g"] / 16).astype(np.float32)
    _assert_forms_agree(inputs)


@pytest.mark.parametrize("gate", ["head", "key"])
def test_forms_agree_under_constant_extreme_decay(gate):
    inputs = _inputs(9, gate, 40)
    inputs["g"] = np.full(inputs["g"].shape, -1e3, np.float32)
    _assert_forms_agree(inputs)


def test_forms_agree_for_any_real_beta():
    """beta ~ 1.5 N(0, 1): negative and above 2, where I - beta k k^T expands the state."""
    inputs = _inputs(10, "key", 33)
    inputs["beta"] = 1.5 * np.random.default_rng(11).standard_normal(inputs["beta"].shape)
    _assert_forms_agree(inputs)


@pytest.mark.parametrize("wipe", ["one_token_segments", "head_-1e3", "key_-1e3", "head_-inf",
                                  "key_-inf"])
def test_state_wiped_at_every_step_gives_the_closed_form(wipe):
    """When every step drops the state before it, S_t = beta_t k_t v_t^T and
    o_t = scale * beta_t (q_t . k_t) v_t (value head j reading q, k head j // (HV // H))."""
    inputs = _inputs(12, wipe.split("_")[0] if "_-" in wipe else "none", 9,
                     segments=False, initial_state=True)
    if wipe == "one_token_segments":
        inputs["segment_ids"] = np.arange(9, dtype=np.int32)[None].repeat(2, axis=0)
        inputs["initial_state"] = None  # it would reach token 0, the first segment
    else:
        value = -1e3 if wipe.endswith("1e3") else -np.inf
        inputs["g"] = np.full(inputs["g"].shape, value, np.float32)
    heads = np.arange(4) // 2
    q, k = (_l2norm(inputs[n])[:, :, heads] for n in ("q", "k"))
    v, beta = (np.asarray(inputs[n], np.float64) for n in ("v", "beta"))
    o_closed = 16**-0.5 * (beta * np.sum(q * k, axis=-1))[..., None] * v
    final_closed = beta[:, -1, :, None, None] * k[:, -1, :, :, None] * v[:, -1, :, None, :]
    for form in FORMS:
        o, final = form(**inputs)
        assert _rel(o, o_closed) < 1e-12 and _rel(final, final_closed) < 1e-12


@pytest.mark.parametrize("gate", ["head", "key"])
def test_minus_inf_gate_cuts_the_state(gate):
    """g = -inf at steps of one head (KDA: of one key of it), two in a row, at a chunk's first
    and last token: finite results, and the cut part of the state before step m = 21 (the whole
    state of the head; KDA: the key's row) does not reach any output from m on. Checked by running
    tokens m.. from the state after tokens ..m-1 with that part replaced by noise."""
    inputs = _inputs(13, gate, 40, segments=False)
    inputs["g"] = inputs["g"] / 16  # weak gates: the state carries far
    head, key, m = 1, 3, 21
    cut = np.zeros(inputs["g"].shape, bool)
    cut[:, [0, 16, m, m + 1, 31], head] = True
    if gate == "key":
        cut[..., np.arange(16) != key] = False
    g_cut = np.where(cut, -np.inf, inputs["g"]).astype(np.float32)
    _assert_forms_agree({**inputs, "g": g_cut})
    noise = np.zeros((2, 4, 16, 24))
    noise[:, head, key if gate == "key" else slice(None)] = 1e3
    for g, severed in ((g_cut, True), (inputs["g"], False)):
        full = {**inputs, "g": g}
        prefix, suffix = _split_time(full, m)
        for form in FORMS:
            o, _ = form(**full)
            _, state = form(**prefix)
            o_kept, _ = form(**{**suffix, "initial_state": state})
            o_noisy, _ = form(**{**suffix, "initial_state": state + noise})
            assert _rel(o_kept, o[:, m:]) < 1e-10  # splitting the row changes nothing
            if severed:
                assert _rel(o_noisy, o[:, m:]) < 1e-10
            else:  # the same check with the finite gate sees the noise
                assert _rel(o_noisy[:, :, head], o[:, m:, head]) > 1e-2


def _split_time(inputs, m):
    """The arguments for tokens ..m-1 and for tokens m.. of each row."""
    timed = ("q", "k", "v", "beta", "g", "segment_ids")
    return tuple({n: x[:, part] if n in timed and x is not None else x for n, x in inputs.items()}
                 for part in (slice(0, m), slice(m, None)))


@pytest.mark.parametrize("variant", ["gated", "delta", "segments", "key_gate_scale"])
def test_two_tokens_by_hand(variant):
    """T = 2, K = V = 1, scalars: S_t = (1 - beta_t k_t^2) e^{g_t} S_{t-1} + beta_t k_t v_t,
    o_t = scale q_t S_t, with q = (1, 2), k = (1/2, 1), v = (3, -1), beta = (1, 1/2), S_0 = 2.
    Gated, g = (ln 1/2, ln 1/4): S = (3/4 * 1/2 * 2 + 3/2, 1/2 * 1/4 * 9/4 - 1/2) = (9/4, -7/32).
    DeltaNet: S = (3/4 * 2 + 3/2, 1/2 * 3 - 1/2) = (3, 1).
    Segments [0, 1]: the second token starts from zero, S_2 = -1/2."""
    def x(*vals):  # [1, 2, 1, 1]
        return np.array(vals, np.float64)[None, :, None, None]

    inputs = {"q": x(1, 2), "k": x(0.5, 1), "v": x(3, -1), "beta": x(1, 0.5)[..., 0],
              "g": x(np.log(0.5), np.log(0.25))[..., 0],
              "initial_state": np.full((1, 1, 1, 1), 2.0)}
    states, scale = (9 / 4, -7 / 32), 1.0
    if variant == "delta":
        inputs["g"], states = None, (3.0, 1.0)
    elif variant == "segments":
        inputs["segment_ids"], states = np.array([[5, 6]], np.int32), (9 / 4, -1 / 2)
    elif variant == "key_gate_scale":
        inputs["g"], scale = inputs["g"][..., None], 0.5
        inputs["scale"] = scale
    o_expected = scale * np.array([1, 2]) * np.array(states)
    for form, kwargs in ((delta_rule_recurrent, {}), (delta_rule_chunked, {"chunk_size": 1}),
                         (delta_rule_chunked, {})):
        o, final = form(**inputs, **kwargs)
        np.testing.assert_allclose(o.reshape(2), o_expected, rtol=0, atol=1e-15)
        np.testing.assert_allclose(final.reshape(()), states[1], rtol=0, atol=1e-15)


def _numpy_delta_rule(q, k, v, beta, g, scale, s0, seg):
    """Independent loop per (row, value head), in the 'new value' form
    S <- D S;  S <- S + beta k (v - S^T k)^T, with resets where the id changes and l2-normalized
    q, k."""
    q, k, v, beta = (np.asarray(x, np.float64) for x in (q, k, v, beta))
    b, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    o = np.zeros((b, t, hv, vd))
    final = np.zeros((b, hv, kd, vd))
    for bi in range(b):
        for j in range(hv):
            s = np.array(s0[bi, j], np.float64)
            for ti in range(t):
                if ti > 0 and seg[bi, ti] != seg[bi, ti - 1]:
                    s = np.zeros_like(s)
                q_t, k_t = q[bi, ti, j // (hv // h)], k[bi, ti, j // (hv // h)]
                q_t, k_t = q_t / np.sqrt(q_t @ q_t + 1e-6), k_t / np.sqrt(k_t @ k_t + 1e-6)
                if g is not None:
                    s = np.exp(np.asarray(g[bi, ti, j], np.float64)).reshape(-1, 1) * s
                s = s + beta[bi, ti, j] * np.outer(k_t, v[bi, ti, j] - s.T @ k_t)
                o[bi, ti, j] = scale * s.T @ q_t
            final[bi, j] = s
    return o, final


@pytest.mark.parametrize("gate", GATES)
def test_references_match_numpy_loop(gate):
    inputs = _inputs(14, gate, 23, kd=5, vd=3)
    o_np, final_np = _numpy_delta_rule(inputs["q"], inputs["k"], inputs["v"], inputs["beta"],
                                       inputs["g"], 0.7, inputs["initial_state"],
                                       inputs["segment_ids"])
    for form in FORMS:
        o, final = form(**inputs, scale=0.7)
        assert _rel(o, o_np) < 1e-12 and _rel(final, final_np) < 1e-12


def test_gate_shapes_pick_the_variant():
    """A per-head gate is the per-key gate repeated over K; DeltaNet is a gate of zeros."""
    inputs = _inputs(15, "head", 20)
    per_key = np.repeat(inputs["g"][..., None], 16, axis=-1)
    zeros = np.zeros_like(inputs["g"])
    for form in FORMS:
        o_head, s_head = form(**inputs)
        o_key, s_key = form(**{**inputs, "g": per_key})
        assert _rel(o_key, o_head) < 1e-14 and _rel(s_key, s_head) < 1e-14
        o_none, s_none = form(**{**inputs, "g": None})
        o_zero, s_zero = form(**{**inputs, "g": zeros})
        assert _rel(o_zero, o_none) < 1e-14 and _rel(s_zero, s_none) < 1e-14


def test_l2norm_is_fla_s():
    """use_qk_l2norm=True is x / sqrt(sum x^2 + 1e-6) over K, applied before everything else (a
    tiny q shows the epsilon)."""
    inputs = _inputs(16, "key", 10, segments=False)
    inputs["q"][:, 2] *= 1e-4
    normalized = {n: _l2norm(inputs[n]) for n in ("q", "k")}
    for form in FORMS:
        o, s = form(**inputs)
        o_pre, s_pre = form(**{**inputs, **normalized, "use_qk_l2norm": False})
        assert _rel(o_pre, o) < 1e-14 and _rel(s_pre, s) < 1e-14


def test_accepts_jax_arrays_of_any_float_dtype():
    inputs = _inputs(17, "key", 12)
    as_jax = {n: jnp.asarray(x, jnp.bfloat16 if n in ("q", "k", "v") else jnp.float32)
              if isinstance(x, np.ndarray) and x.dtype == np.float32 else x
              for n, x in inputs.items()}
    rounded = {n: np.asarray(x).astype(np.float64) if hasattr(x, "dtype") and n != "segment_ids"
               else x for n, x in as_jax.items()}
    for form in FORMS:
        o, s = form(**as_jax)
        o_np, s_np = form(**rounded)
        assert isinstance(o, np.ndarray) and o.dtype == np.float64 and s.dtype == np.float64
        assert _rel(o, o_np) == 0.0 and _rel(s, s_np) == 0.0


@pytest.mark.parametrize("name, bad", [("beta", np.zeros((2, 5, 2))),
                                       ("g", np.zeros((2, 5, 4, 3))),
                                       ("initial_state", np.zeros((2, 2, 16, 24)))])
def test_shape_errors_name_the_argument(name, bad):
    inputs = _inputs(18, "head", 5)
    for form in FORMS:
        with pytest.raises(ValueError, match=name):
            form(**{**inputs, name: bad})


def _doc_backward(q, k, v, beta, g, s0, scale, do, d_final, chunk):
    """The chunked backward of docs/delta_rule_math.md for one row and head (g [T, K] with -inf
    at resets, T a multiple of `chunk`): returns dq, dk, dv, dbeta, dg, d initial_state."""
    t = q.shape[0]
    fwd, state = [], s0
    for lo in range(0, t, chunk):
        c = slice(lo, lo + chunk)
        dec = _range_decays(g[c])
        e, entry, out, last = dec[1:, 1:], dec[1:, 0], dec[-1, 1:], dec[-1, 0]
        a_ij = np.tril(np.einsum("ik,jk,ijk->ij", k[c], k[c], e), -1)
        lhs = np.eye(chunk) + beta[c, None] * a_ij
        w = np.linalg.solve(lhs, beta[c, None] * k[c] * entry)
        u = np.linalg.solve(lhs, beta[c, None] * v[c]) - w @ state
        m = np.tril(np.einsum("ik,jk,ijk->ij", q[c], k[c], e))
        nxt = last[:, None] * state + (k[c] * out).T @ u
        fwd.append((c, e, entry, out, last, a_ij, lhs, w, u, m, state, nxt))
        state = nxt
    grads = [np.zeros_like(x) for x in (q, k, v, beta, g)]
    ds = d_final
    for c, e, entry, out, last, a_ij, lhs, w, u, m, s, nxt in reversed(fwd):
        qc, kc, vc, bc, doc = q[c], k[c], v[c], beta[c], do[c]
        du = scale * m.T @ doc + (kc * out) @ ds
        ds_prev = last[:, None] * ds + scale * (qc * entry).T @ doc - w.T @ du
        dr = np.linalg.solve(lhs.T, du)
        da, dm = -np.tril(dr @ u.T, -1), scale * np.tril(doc @ u.T)
        dq = np.einsum("ij,jk,ijk->ik", dm, kc, e) + scale * entry * (doc @ s.T)
        early = (np.einsum("ij,ik,ijk->jk", dm, qc, e) + np.einsum("ij,i,ik,ijk->jk", da, bc, kc, e)
                 + out * (u @ ds.T))
        late = bc[:, None] * (np.einsum("ij,jk,ijk->ik", da, kc, e) - entry * (dr @ s.T))
        db = qc * dq + kc * (late - early)
        db[-1] += np.sum(nxt * ds, axis=-1)
        grads[0][c], grads[1][c], grads[2][c] = dq, early + late, bc[:, None] * dr
        grads[3][c] = np.sum((vc - (kc * entry) @ s) * dr, -1) + np.sum(da * a_ij, -1)
        grads[4][c] = np.cumsum(db[::-1], axis=0)[::-1]  # dg_t = sum of db_m over m >= t
        ds = ds_prev
    return (*grads, ds)


@pytest.mark.parametrize("gate", ["head", "key"])
def test_math_doc_backward_matches_autodiff(gate):
    """docs/delta_rule_math.md's backward against JAX autodiff of the float64 recurrence, with
    segments (as -inf gates), a -inf gate, an initial state and a final-state cotangent."""
    t, kd, vd, chunk, scale = 48, 8, 6, 16, 8**-0.5
    rng = np.random.default_rng(19)
    q, k, v = (rng.standard_normal((t, d)) for d in (kd, kd, vd))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta, s0 = 2.0 / (1.0 + np.exp(-rng.standard_normal(t))), rng.standard_normal((kd, vd))
    g = _kimi_gates(rng, gate, 1, t, 1, kd)[0, :, 0] / 4  # [T] or [T, K]
    g = np.broadcast_to(g.reshape(t, -1), (t, kd))
    cut = np.where(np.isin(np.arange(t), [5, 16, 17, 30, 47])[:, None], -np.inf, g)
    cut[9, 2] = -np.inf
    do, d_final = rng.standard_normal((t, vd)), rng.standard_normal((kd, vd))
    with jax.enable_x64(True):
        def loss(q, k, v, beta, g, s0):
            def step(s, xs):
                q_t, k_t, v_t, b_t, g_t = xs
                s = jnp.exp(g_t)[:, None] * s
                s = s + b_t * jnp.outer(k_t, v_t - s.T @ k_t)
                return s, scale * s.T @ q_t
            final, o = jax.lax.scan(step, s0, (q, k, v, beta, g))
            return jnp.sum(o * do) + jnp.sum(final * d_final)
        # the recurrence resets by its -inf gates; the gradient at them is 0
        expected = jax.grad(loss, argnums=range(6))(q, k, v, beta, jnp.asarray(cut), s0)
        expected = [np.asarray(x) for x in expected]
    ours = list(_doc_backward(q, k, v, beta, cut, s0, scale, do, d_final, chunk))
    if gate == "head":  # one gate per step: its gradient sums over K
        ours[4], expected[4] = ours[4].sum(-1), expected[4].sum(-1)
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dg", "ds0"), ours, expected):
        assert np.all(np.isfinite(a)) and _rel(a, b) < 1e-12, (name, _rel(a, b))


def test_math_doc_operands_backward_matches_autodiff():
    """docs/delta_rule_math.md's "Backward of the operands" (dg as three sums over their own
    terms) against JAX autodiff of one chunk's operands, float64, per-head gates."""
    c, kd, vd, scale = 16, 8, 6, 8**-0.5
    rng = np.random.default_rng(23)
    q, k, v = (rng.standard_normal((c, d)) for d in (kd, kd, vd))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    beta = 2.0 / (1.0 + np.exp(-rng.standard_normal(c)))
    g = -np.logaddexp(0.0, -rng.standard_normal(c)) * 3
    r, x = np.arange(c)[:, None], np.arange(c)[None, :]
    lower, strict = x <= r, x < r

    with jax.enable_x64(True):
        def operands(q, k, v, beta, g):
            b = jnp.cumsum(g)
            decay = jnp.where(lower, jnp.exp(jnp.where(lower, b[:, None] - b[None, :], 0.0)), 0)
            m = scale * jnp.where(lower, q @ k.T * decay, 0.0)
            a = beta[:, None] * jnp.where(strict, k @ k.T * decay, 0.0)
            t_inv = jnp.linalg.inv(jnp.eye(c) + a)
            w = t_inv @ (beta[:, None] * k * jnp.exp(b)[:, None])
            return (m, scale * q * jnp.exp(b)[:, None], k * jnp.exp(b[-1] - b)[:, None], -w,
                    t_inv @ (beta[:, None] * v), b[-1])

        primals, pullback = jax.vjp(operands, q, k, v, beta, g)
        cts = [rng.standard_normal(np.shape(p)) for p in primals]
        expected = [np.asarray(e) for e in pullback(tuple(jnp.asarray(t) for t in cts))]
    d_m, dq_in, dk_out, dw_neg, du0, d_last = cts
    b = np.cumsum(g)
    decay = np.where(lower, np.exp(np.where(lower, b[:, None] - b[None, :], 0.0)), 0.0)
    kk_d = np.where(strict, k @ k.T * decay, 0.0)
    a = beta[:, None] * kk_d
    m = scale * np.where(lower, q @ k.T * decay, 0.0)
    t_inv = np.linalg.inv(np.eye(c) + a)
    e_b, e_after = np.exp(b)[:, None], np.exp(b[-1] - b)[:, None]
    kb, vb, dw = beta[:, None] * k * e_b, beta[:, None] * v, -dw_neg
    d_t = dw @ kb.T + du0 @ vb.T
    dkb, dvb = t_inv.T @ dw, t_inv.T @ du0
    d_a = -np.where(strict, t_inv.T @ d_t @ t_inv.T, 0.0)
    g_m, g_a = scale * d_m * decay, beta[:, None] * d_a * decay
    w_pairs = d_a * a + np.where(lower, d_m * m, 0.0)
    x_sum = np.sum(dkb * kb, 1) + np.sum(dq_in * scale * q * e_b, 1)
    r_sum = np.sum(dk_out * k * e_after, 1)
    at_or_after = (x >= r).astype(float)  # [t, r]: r >= t
    ours = [
        g_m @ k + scale * e_b * dq_in,
        beta[:, None] * e_b * dkb + e_after * dk_out + g_a @ k + g_a.T @ k + g_m.T @ q,
        beta[:, None] * dvb,
        np.sum(dvb * v, 1) + np.sum(dkb * k * e_b, 1) + np.sum(d_a * kk_d, 1),
        np.sum(np.where(strict, at_or_after @ w_pairs, 0.0), 1)
        + np.sum(at_or_after @ np.diag(x_sum), 1) + np.sum(strict @ np.diag(r_sum), 1) + d_last,
    ]
    for name, got, want in zip(("dq", "dk", "dv", "dbeta", "dg"), ours, expected):
        assert _rel(got, want) < 1e-12, (name, _rel(got, want))


@pytest.mark.parametrize("gate", GATES)
def test_jax_recurrence_matches_numpy(gate):
    """delta_rule_recurrent_jax, jitted, against delta_rule_recurrent: GVA, segments with a
    one-token segment, an initial state, l2norm, and (gated) -inf gates at some steps."""
    inputs = _inputs(20 + GATES.index(gate), gate, 33)
    if gate != "none":
        steps = np.arange(33).reshape((1, -1) + (1,) * (inputs["g"].ndim - 2))
        inputs["g"] = np.where(np.isin(steps, [6, 20, 21]), -np.inf, inputs["g"])
    arrays = {n: x for n, x in inputs.items() if n != "use_qk_l2norm"}
    run = jax.jit(functools.partial(delta_rule_recurrent_jax, output_final_state=True,
                                    use_qk_l2norm=inputs["use_qk_l2norm"], scale=0.3))
    o, final = run(**arrays)
    assert o.dtype == final.dtype == jnp.float64
    o_np, final_np = delta_rule_recurrent(**inputs, scale=0.3)
    assert _rel(o, o_np) < 1e-13 and _rel(final, final_np) < 1e-13
    o_only, none = delta_rule_recurrent_jax(**arrays, use_qk_l2norm=inputs["use_qk_l2norm"],
                                            scale=0.3)
    assert none is None and _rel(o_only, o_np) < 1e-13


@pytest.mark.parametrize("gate", ["head", "key"])
def test_jax_recurrence_gradients_match_the_math_doc(gate):
    """The gradients of delta_rule_recurrent_jax (autodiff through the scan) against the chunked
    backward of docs/delta_rule_math.md, with -inf gates and an initial state."""
    t, kd, vd, scale = 32, 8, 6, 0.4
    rng = np.random.default_rng(21)
    q, k, v = (rng.standard_normal((t, d)) for d in (kd, kd, vd))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta, s0 = 2.0 / (1.0 + np.exp(-rng.standard_normal(t))), rng.standard_normal((kd, vd))
    g = _kimi_gates(rng, gate, 1, t, 1, kd)[0, :, 0] / 4  # [T] or [T, K]
    g = np.where(np.isin(np.arange(t), [5, 16, 17]).reshape((t,) + (1,) * (g.ndim - 1)),
                 -np.inf, g)
    do, d_final = rng.standard_normal((t, vd)), rng.standard_normal((kd, vd))

    def loss(q, k, v, beta, g, s0):
        o, final = delta_rule_recurrent_jax(
            q[None, :, None], k[None, :, None], v[None, :, None], beta[None, :, None],
            g[None, :, None], initial_state=s0[None, None], output_final_state=True, scale=scale)
        return jnp.sum(o[0, :, 0] * do) + jnp.sum(final[0, 0] * d_final)

    with jax.enable_x64(True):
        ours = jax.grad(loss, argnums=range(6))(q, k, v, beta, jnp.asarray(g), s0)
    ours = [np.asarray(x) for x in ours]
    g_keys = np.broadcast_to(g.reshape(t, -1), (t, kd))
    expected = list(_doc_backward(q, k, v, beta, g_keys, s0, scale, do, d_final, 16))
    if gate == "head":
        expected[4] = expected[4].sum(-1)
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dg", "ds0"), ours, expected):
        assert np.all(np.isfinite(a)) and _rel(a, b) < 1e-12, (name, _rel(a, b))
