"""The "xla" GLA backend: plain JAX, differentiable by autodiff, float32 accumulation.

"chunk" and "fused_chunk" run one chunked algorithm (intra-chunk scores, a scan over the [K, V]
chunk-boundary states, inter-chunk outputs); "fused_recurrent" is a `lax.scan` over tokens.
docs/gla_math.md derives the chunked form and why every exponent here is <= 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gla_tpu.ops.common.capabilities import ANY_DIM, GLA_FEATURES, Capabilities
from gla_tpu.ops.common.chunk_cumsum import SUB_CHUNK, chunk_local_cumsum
from gla_tpu.ops.common.masks import lower_triangular
from gla_tpu.ops.common.padding import pad_segment_index, pad_time
from gla_tpu.ops.common.segments import (
    chunk_entry_segments,
    chunk_segment_masks,
    segment_index,
    token_keeps,
)
from gla_tpu.ops.gla.validation import CHUNK_SIZES, GATE_KINDS, RESOLVED_MODES


CAPABILITIES = Capabilities(
    op="gla", backend="xla", platform="any (plain JAX)",
    dtypes=("bfloat16", "float16", "float32", "float64"), dims=(("K", ANY_DIM), ("V", ANY_DIM)),
    features=GLA_FEATURES, modes=RESOLVED_MODES, gates=GATE_KINDS, chunk_sizes=CHUNK_SIZES,
    notes="chunked algorithm (chunk, fused_chunk) or a scan over tokens (fused_recurrent); "
          "autodiff",
)


def check_supported(problem, block_sizes) -> None:
    CAPABILITIES.check(problem, block_sizes)


def gla(q, k, v, g, *, problem, initial_state, segment_ids, block_sizes, interpret):
    del block_sizes, interpret
    b, t, h, _ = q.shape
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_index(segment_ids)
    # Gates as [B, T, H, Kg] float32 with Kg = K (per key) or 1 (per head / none).
    if g is None:
        gates = None
    else:
        gates = g.astype(jnp.float32)
        if gates.ndim == 3:
            gates = gates[..., None]
    with jax.named_scope(f"gla_xla_{problem.mode}"):
        if problem.mode == "fused_recurrent":
            o, final = _recurrent(q, k, v, gates, initial_state, seg, problem.scale)
        else:
            o, final = _chunked(q, k, v, gates, initial_state, seg, problem.scale,
                                problem.chunk_size)
    return o.astype(v.dtype), (final if problem.output_final_state else None)


def _recurrent(q, k, v, gates, s0, seg, scale):
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    keep = token_keeps(seg)
    state = jnp.zeros((b, h, kd, vd), jnp.float32) if s0 is None else s0
    if gates is None:
        gates = jnp.zeros((b, t, h, 1), jnp.float32)

    def step(state, xs):
        q_t, k_t, v_t, g_t, keep_t = xs  # [B, H, K] x2, [B, H, V], [B, H, Kg], [B]
        decay = jnp.where(keep_t[:, None, None], jnp.exp(g_t), 0.0)  # [B, H, Kg]
        kv = k_t.astype(jnp.float32)[..., :, None] * v_t.astype(jnp.float32)[..., None, :]
        state = decay[..., None] * state + kv
        o_t = jnp.einsum("bhk,bhkv->bhv", q_t.astype(jnp.float32), state)
        return state, o_t

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, gates, keep))
    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1) * scale, state


def _to_chunks(x, c):
    """[B, T, H, D] -> [B, H, N, C, D] with T = N * C."""
    b, t, h, d = x.shape
    return jnp.moveaxis(x.reshape(b, t // c, c, h, d), 3, 1)


def _chunked(q, k, v, gates, s0, seg, scale, c):
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    dt = q.dtype
    # Padding with zero k, v and zero log gates leaves outputs and the final state unchanged.
    q, k, v = (pad_time(x, c) for x in (q, k, v))
    seg = pad_segment_index(seg, c)
    n = q.shape[1] // c
    if gates is None:
        bcum = jnp.zeros((b, h, n, c, 1), jnp.float32)
    else:
        bcum = _to_chunks(chunk_local_cumsum(pad_time(gates, c), c), c)  # [B, H, N, C, Kg]
    qc, kc, vc = (_to_chunks(x, c) for x in (q, k, v))  # [B, H, N, C, K|V]
    segc = seg.reshape(b, 1, n, c)
    # [B, 1, N, C] reaches / in_last and [B, 1, N, 1] keep (common/segments.py)
    reaches, in_last, keep = chunk_segment_masks(
        segc, chunk_entry_segments(seg, c).reshape(b, 1, n, 1))

    # Intra-chunk: A[i, j] = sum_k q_ik k_jk exp(b_ik - b_jk), j <= i, same segment.
    scores = _intra_chunk_scores(qc, kc, bcum, dt)  # [B, H, N, C, C] float32
    same_seg = segc[..., :, None] == segc[..., None, :]
    scores = jnp.where(same_seg, scores, 0.0)
    o = jnp.einsum("bhncs,bhnsv->bhncv", scores.astype(dt), vc, preferred_element_type=jnp.float32)

    # Chunk-boundary states: S_{n+1} = keep_n * diag(exp(b_last)) S_n + sum_j k~_j^T v_j.
    b_last = bcum[..., -1:, :]  # [B, H, N, 1, Kg]
    k_tail = jnp.where(in_last[..., None], kc * jnp.exp(b_last - bcum), 0.0)
    contrib = jnp.einsum("bhnck,bhncv->bhnkv", k_tail.astype(dt), vc,
                         preferred_element_type=jnp.float32)
    carry_decay = jnp.where(keep, jnp.exp(b_last[..., 0, :]), 0.0)  # [B, H, N, Kg]

    def step(state, xs):
        decay_n, contrib_n = xs  # [B, H, Kg], [B, H, K, V]
        return decay_n[..., None] * state + contrib_n, state

    state0 = jnp.zeros((b, h, kd, vd), jnp.float32) if s0 is None else s0
    final, states_in = jax.lax.scan(
        step, state0, (jnp.moveaxis(carry_decay, 2, 0), jnp.moveaxis(contrib, 2, 0))
    )
    states_in = jnp.moveaxis(states_in, 0, 2)  # [B, H, N, K, V]: the state entering chunk n

    # Inter-chunk: (q_i * exp(b_i)) S_n for tokens the carried state reaches.
    q_head = jnp.where(reaches[..., None], qc * jnp.exp(bcum), 0.0)
    o = o + jnp.einsum("bhnck,bhnkv->bhncv", q_head.astype(dt), states_in.astype(dt),
                       preferred_element_type=jnp.float32)
    o = jnp.moveaxis(o, 1, 3).reshape(b, n * c, h, vd)[:, :t]
    return o * scale, final


def _intra_chunk_scores(qc, kc, bcum, dt):
    """Causal gated scores inside each chunk, [B, H, N, C, C] float32, zero above the diagonal."""
    c = qc.shape[-2]
    tri = lower_triangular(c)
    if bcum.shape[-1] == 1:
        # Per-head gate: one [C, C] decay matrix; masked before exp so no exponent is positive.
        diff = bcum[..., :, None, 0] - bcum[..., None, :, 0]
        decay = jnp.where(tri, jnp.exp(jnp.where(tri, diff, 0.0)), 0.0)
        qk = jnp.einsum("bhnik,bhnjk->bhnij", qc, kc, preferred_element_type=jnp.float32)
        return qk * decay
    return _per_key_scores(qc, kc, bcum, dt)


def _per_key_scores(qc, kc, bcum, dt):
    """Secondary chunking: sub-chunk pairs (I > J) factor through b at the start of I; the
    diagonal sub-chunks take the elementwise [c, c, K] form. All exponents are <= 0."""
    *lead, c, kd = qc.shape
    sub = min(SUB_CHUNK, c)
    ns = c // sub
    qs, ks, bs = (x.reshape(*lead, ns, sub, kd) for x in (qc, kc, bcum))
    ref = bs[..., :, :1, :]  # [.., ns, 1, K]: b at the first token of each query sub-chunk
    q_rel = qs * jnp.exp(bs - ref)  # exponent b_i - b_start(I) <= 0
    before = jnp.arange(ns)[:, None] > jnp.arange(ns)[None, :]  # [I, J]: J strictly before I
    # k_rel[I, J] = k_J * exp(b_start(I) - b_J), exponent <= 0 where J < I.
    expo = ref[..., :, None, :, :] - bs[..., None, :, :, :]  # [.., I, J, sub, K]
    mask_ij = before[:, :, None, None]
    k_rel = jnp.where(mask_ij, ks[..., None, :, :, :] * jnp.exp(jnp.where(mask_ij, expo, 0.0)), 0.0)
    off = jnp.einsum("...Iik,...IJjk->...IiJj", q_rel.astype(dt), k_rel.astype(dt),
                     preferred_element_type=jnp.float32)
    tri = lower_triangular(sub)[:, :, None]
    diff = bs[..., :, None, :] - bs[..., None, :, :]  # [.., ns, i, j, K]
    decay = jnp.where(tri, jnp.exp(jnp.where(tri, diff, 0.0)), 0.0)
    diag = jnp.einsum("...ik,...jk,...ijk->...ij", qs.astype(jnp.float32),
                      ks.astype(jnp.float32), decay)  # [.., ns, sub, sub]
    full = off + jnp.einsum("...Iij,IJ->...IiJj", diag, jnp.eye(ns, dtype=diag.dtype))
    return full.reshape(*lead, c, c)
