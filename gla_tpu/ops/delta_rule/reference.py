"""float64 references for the delta rule: token by token, and chunked (WY representation).

Both take the arguments of `ops.delta_rule` (less the performance ones; the chunked form also takes
its chunk size), compute in float64 NumPy and return (o [B, T, HV, V], final_state [B, HV, K, V])
as float64 NumPy arrays. `delta_rule_recurrent_jax` is the token recurrence again in JAX, under
`jax.enable_x64`: jittable and differentiable, the reference of every gradient, with the signature
of `ops.delta_rule` (final_state None unless `output_final_state`). The gate's shape picks the
variant: g None is DeltaNet, [B, T, HV] Gated DeltaNet, [B, T, HV, K] KDA. Per batch row and value
head, state S [K, V]:

  S_t = (I - beta_t k_t k_t^T) diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,    o_t = scale * S_t^T q_t

Value head j reads q and k head j // (HV // H). docs/delta_rule_math.md derives the chunked form in
the notation used here.

    >>> import numpy as np
    >>> x = np.random.default_rng(0).normal(size=(1, 8, 2, 4))
    >>> beta = np.full((1, 8, 2), 0.5)
    >>> o, final_state = delta_rule_recurrent(x, x, x, beta, use_qk_l2norm=True)
    >>> o.shape, final_state.shape
    ((1, 8, 2, 4), (1, 2, 4, 4))
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gla_tpu.ops.common import validation
from gla_tpu.ops.common.segments import segment_index, token_starts

# fla's l2norm: x / sqrt(sum x^2 + L2NORM_EPS) over the key dim.
L2NORM_EPS = 1e-6


def l2_normalize(x):
    """fla's l2norm over the last dim, in x's dtype, as the backends apply it under
    `use_qk_l2norm` (the references below take their own float64 one)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """Head-major float64 inputs, q and k repeated to the value heads."""

    q: np.ndarray  # [B, HV, T, K]
    k: np.ndarray  # [B, HV, T, K]
    v: np.ndarray  # [B, HV, T, V]
    beta: np.ndarray  # [B, HV, T]
    g: np.ndarray  # [B, HV, T, K]: zeros for DeltaNet, a per-head gate repeated over K for GDN
    s0: np.ndarray  # [B, HV, K, V]: zeros without an initial state
    starts: np.ndarray  # [B, T] bool: a segment other than the row's first starts here
    scale: float


def _check(q, k, v, beta, g, initial_state, segment_ids):
    """ValueError naming the argument for shapes that do not fit q's [B, T, H, K]."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        validation.check_array(name, x, rank=4, layout="[batch, time, heads, dim]")
    b, t, h, kd = q.shape
    validation.check_shape("k", k, q.shape, "q's shape [B, T, H, K]")
    hv, vd = v.shape[2], v.shape[3]
    if v.shape[:2] != (b, t) or hv % h:
        raise ValueError(f"v must be [B, T, HV, V] with q's B, T and HV a multiple of H={h}; "
                         f"got {validation.describe(v)}.")
    validation.check_array("beta", beta, rank=3, layout="[B, T, HV]")
    validation.check_shape("beta", beta, (b, t, hv), "[B, T, HV]")
    if g is not None:
        if getattr(g, "ndim", None) not in (3, 4):
            raise ValueError("g must be None, a per-head gate [B, T, HV] or a per-key gate "
                             f"[B, T, HV, K]; got {validation.describe(g)}.")
        validation.check_shape("g", g, (b, t, hv, kd)[:g.ndim], "[B, T, HV] or [B, T, HV, K]")
    if initial_state is not None:
        validation.check_array("initial_state", initial_state, rank=4, layout="[B, HV, K, V]")
        validation.check_shape("initial_state", initial_state, (b, hv, kd, vd), "[B, HV, K, V]")
    if segment_ids is not None:
        validation.check_array("segment_ids", segment_ids, rank=2, layout="[batch, time]")
        validation.check_shape("segment_ids", segment_ids, (b, t), "[B, T]")


def _l2norm(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def _prepare(q, k, v, beta, g, scale, initial_state, segment_ids, use_qk_l2norm) -> _Inputs:
    _check(q, k, v, beta, g, initial_state, segment_ids)
    scale = validation.check_scale("scale", scale)
    q, k, v, beta = (np.asarray(x).astype(np.float64) for x in (q, k, v, beta))
    b, t, h, kd = q.shape
    hv = v.shape[2]
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    # value head j reads q, k head j // (HV // H)
    q, k = (np.repeat(x, hv // h, axis=2) for x in (q, k))
    if g is None:
        g = np.zeros((b, t, hv, kd))
    else:
        g = np.asarray(g).astype(np.float64)
        g = np.broadcast_to(g[..., None] if g.ndim == 3 else g, (b, t, hv, kd))
    s0 = (np.zeros((b, hv, kd, v.shape[3])) if initial_state is None
          else np.asarray(initial_state).astype(np.float64))
    if segment_ids is None:
        starts = np.zeros((b, t), bool)
    else:
        starts = np.asarray(token_starts(segment_index(jnp.asarray(segment_ids))))
    q, k, v, g = (np.moveaxis(x, 1, 2) for x in (q, k, v, g))
    return _Inputs(q, k, v, np.moveaxis(beta, 1, 2), g, s0, starts,
                   kd**-0.5 if scale is None else scale)


def delta_rule_recurrent(q, k, v, beta, g=None, *, scale=None, initial_state=None,
                         segment_ids=None, use_qk_l2norm=False):
    """The delta rule token by token, in float64: the contract itself.

    Args:
      q, k: [B, T, H, K], any float dtype (jax or NumPy arrays).
      v: [B, T, HV, V], HV a multiple of H.
      beta: [B, T, HV], any real.
      g: None, [B, T, HV] or [B, T, HV, K]: natural-log decay, g <= 0, -inf allowed (a reset).
      scale: defaults to K ** -0.5.
      initial_state: [B, HV, K, V] or None (zeros); it reaches each row's first segment only.
      segment_ids: [B, T] int or None: the state resets to zero where the id changes.
      use_qk_l2norm: l2-normalize q and k over K first (x / sqrt(sum x^2 + 1e-6)).
    Returns:
      o [B, T, HV, V] and final_state [B, HV, K, V] (the state after the last token), float64.
    """
    x = _prepare(q, k, v, beta, g, scale, initial_state, segment_ids, use_qk_l2norm)
    state = x.s0
    o = np.empty(x.v.shape)  # [B, HV, T, V]
    for t in range(x.q.shape[2]):
        k_t, beta_t = x.k[:, :, t], x.beta[:, :, t, None, None]  # [B, HV, K], [B, HV, 1, 1]
        state = np.where(x.starts[:, t, None, None, None], 0.0, state)
        # exp(-inf) = 0 exactly, and exp(g) <= 1 for every g <= 0: no overflow, no NaN
        decayed = np.exp(x.g[:, :, t])[..., None] * state
        # (I - beta k k^T) D S = D S - beta k (k^T D S), without forming the [K, K] matrix
        erased = decayed - beta_t * k_t[..., :, None] * (k_t[..., None, :] @ decayed)
        state = erased + beta_t * k_t[..., :, None] * x.v[:, :, t, None, :]
        o[:, :, t] = x.scale * np.einsum("bhkv,bhk->bhv", state, x.q[:, :, t])
    return np.moveaxis(o, 1, 2), state


def delta_rule_recurrent_jax(q, k, v, beta, g=None, *, scale=None, initial_state=None,
                             output_final_state=False, segment_ids=None, use_qk_l2norm=False):
    """`delta_rule_recurrent` in JAX, float64: a `lax.scan` over tokens, jittable and
    differentiable (the reference of every gradient).

    Takes the arguments of `ops.delta_rule` less the performance ones and returns
    (o [B, T, HV, V], final_state [B, HV, K, V] or None unless `output_final_state`) in float64.
    A gate of -inf zeroes the state exactly, and its gradient there is 0.
    """
    _check(q, k, v, beta, g, initial_state, segment_ids)
    scale = validation.check_scale("scale", scale)
    validation.check_bool("output_final_state", output_final_state)
    validation.check_bool("use_qk_l2norm", use_qk_l2norm)
    with jax.enable_x64(True):
        q, k, v, beta = (jnp.asarray(x, jnp.float64) for x in (q, k, v, beta))
        b, t, h, kd = q.shape
        hv, vd = v.shape[2], v.shape[3]
        if use_qk_l2norm:
            q, k = (x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)
                    for x in (q, k))
        # value head j reads q, k head j // (HV // H)
        q, k = (jnp.repeat(x, hv // h, axis=2) for x in (q, k))
        gates = (jnp.zeros((b, t, hv, 1), jnp.float64) if g is None
                 else jnp.asarray(g, jnp.float64).reshape(b, t, hv, -1))
        state = (jnp.zeros((b, hv, kd, vd), jnp.float64) if initial_state is None
                 else jnp.asarray(initial_state, jnp.float64))
        starts = (jnp.zeros((b, t), bool) if segment_ids is None
                  else token_starts(segment_index(jnp.asarray(segment_ids))))

        def step(state, xs):
            q_t, k_t, v_t, beta_t, g_t, start_t = xs  # [B, HV, K|V], [B, HV], [B, HV, Kg], [B]
            state = jnp.where(start_t[:, None, None, None], 0.0, state)
            decayed = jnp.exp(g_t)[..., None] * state
            # the new-value form: S = D S + k u^T, u = beta (v - (D S)^T k)
            u = beta_t[..., None] * (v_t - jnp.einsum("bhkv,bhk->bhv", decayed, k_t))
            state = decayed + k_t[..., :, None] * u[..., None, :]
            return state, jnp.einsum("bhkv,bhk->bhv", state, q_t)

        xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, beta, gates, starts))
        state, o = jax.lax.scan(step, state, xs)
        o = jnp.moveaxis(o, 0, 1) * (kd**-0.5 if scale is None else scale)
        return o, (state if output_final_state else None)


def _range_decays(g):
    """Every decay a chunk needs: [..., C, K] gates -> [..., C + 1, C + 1, K].

    Position 0 is the chunk's entry, position i + 1 its token i. Entry [p, r] is
    exp(sum of g over positions r+1 .. p) for r < p, and exp(0) = 1 (masked by the callers) else.
    With b the chunk-local running sum of g, [i+1, j+1] = exp(b_i - b_j), [i+1, 0] = exp(b_i),
    [C, j+1] = exp(b_last - b_j), [C, 0] = exp(b_last).

    Each exponent is a sum of gates over a range, so it is <= 0 and every decay lies in [0, 1].
    It is summed over its own range (a running sum over p started after r) rather than taken as a
    difference of two running sums: a -inf gate then gives -inf (never -inf - (-inf) = NaN), and
    a small range after gates of -1e3 loses no digits to cancellation.
    """
    c = g.shape[-2]
    gates = np.concatenate([np.zeros_like(g[..., :1, :]), g], axis=-2)  # [..., C+1 (p), K]
    pos = np.arange(c + 1)
    after = (pos[:, None] > pos[None, :])[:, :, None]  # [C+1 (p), C+1 (r), 1]
    terms = np.where(after, gates[..., :, None, :], 0.0)  # [..., p, r, K]
    return np.exp(np.cumsum(terms, axis=-3))


def _solve_unit_lower(a, rhs):
    """x with (I + a) x = rhs, a [..., C, C] strictly lower triangular, rhs [..., C, M]: forward
    substitution, row by row, so a pair that a cut decay zeroes couples nothing."""
    x = np.empty_like(rhs)
    for i in range(rhs.shape[-2]):
        x[..., i, :] = rhs[..., i, :] - np.einsum("...j,...jm->...m", a[..., i, :i], x[..., :i, :])
    return x


def _intra_chunk(q, k, v, beta, g):
    """What each chunk computes on its own, before any state is known.

    Args: q, k [..., C, K]; v [..., C, V]; beta [..., C]; g [..., C, K] (segment starts -inf).
    Returns:
      w [..., C, K], u0 [..., C, V]: the WY representation, (I + A) [u0, w] = beta [v, k e^b];
      scores [..., C, C]: M_ij = sum_k q_ik k_jk exp(b_ik - b_jk), j <= i;
      q_in [..., C, K] = q e^b; k_out [..., C, K] = k e^(b_last - b); decay [..., K] = e^b_last.
    """
    # every decay is exp of a sum of gates over a range of the chunk: <= 0 (_range_decays)
    decays = _range_decays(g)
    within = decays[..., 1:, 1:, :]  # [..., C (i), C (j), K]: exp(b_i - b_j), j <= i
    entry = decays[..., 1:, 0, :]  # [..., C, K]: exp(b_i)
    kk = np.tril(np.einsum("...ik,...jk,...ijk->...ij", k, k, within), -1)
    a = beta[..., :, None] * kk  # [..., C, C]: A_ij = beta_i (k_i e^(b_i - b_j)) . k_j, j < i
    rhs = beta[..., None] * np.concatenate([v, k * entry], axis=-1)  # [..., C, V + K]
    solved = _solve_unit_lower(a, rhs)
    u0, w = solved[..., :v.shape[-1]], solved[..., v.shape[-1]:]
    scores = np.tril(np.einsum("...ik,...jk,...ijk->...ij", q, k, within))
    return w, u0, scores, q * entry, k * decays[..., -1, 1:, :], decays[..., -1, 0, :]


def delta_rule_chunked(q, k, v, beta, g=None, *, scale=None, initial_state=None, segment_ids=None,
                       use_qk_l2norm=False, chunk_size=64):
    """The delta rule in chunks of `chunk_size` tokens (WY representation), in float64.

    The same function as `delta_rule_recurrent` (same arguments), computed as the chunked kernels
    compute it: per chunk a [C, C] unit-lower-triangular solve (the WY representation), the new
    values from the state entering the chunk, the outputs and the state leaving it.
    docs/delta_rule_math.md derives it.
    """
    x = _prepare(q, k, v, beta, g, scale, initial_state, segment_ids, use_qk_l2norm)
    if (isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer))
            or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}.")
    b, hv, t, _ = x.q.shape
    # A segment start is a gate of -inf on every key: exp(-inf) = 0 drops the state before it.
    g = np.where(x.starts[:, None, :, None], -np.inf, x.g)
    # Padding tokens with beta = 0 and g = 0 leave the state as it is (and join the last segment).
    pad = (-t) % chunk_size
    n = (t + pad) // chunk_size

    def chunks(y):  # [B, HV, T, ...] -> [B, HV, N, C, ...]
        y = np.pad(y, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (y.ndim - 3))
        return y.reshape((b, hv, n, chunk_size) + y.shape[3:])

    inputs = [chunks(y) for y in (x.q, x.k, x.v, x.beta, g)]
    state = x.s0  # [B, HV, K, V], entering chunk n
    o = np.empty((b, hv, n, chunk_size, x.v.shape[-1]))
    # One chunk at a time (the values do not depend on the order; memory stays one chunk's)
    for i in range(n):
        w, u0, scores, q_in, k_out, decay = _intra_chunk(*(y[:, :, i] for y in inputs))
        u = u0 - w @ state  # [B, HV, C, V]: the new values, once the state is known
        o[:, :, i] = x.scale * (q_in @ state + scores @ u)
        state = decay[..., None] * state + np.swapaxes(k_out, -1, -2) @ u
    o = o.reshape(b, hv, n * chunk_size, -1)[:, :, :t]
    return np.moveaxis(o, 1, 2), state
