"""custom_vjp wiring of the GPU GLA kernels.

Forward: the chunk-local gate sums b (a triangular product), the state pass, the intra-chunk
scores and the outputs. Backward: the reversed state pass, dA, then dq, dk, dg and dv. The gate
gradient comes from dL/db_t = q_t dq_t - k_t dk_t summed backwards within the chunk plus what
later chunks add through h_{n+1}, rewritten so that no two terms cancel (docs/gpu_gla.md
derives it; kernels_intra.chunk_dqk computes it). A few tokens without segments run the
token-by-token forward (decoding) with the chunked backward.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from gla_tpu.ops.common.chunk_cumsum import chunk_local_cumsum
from gla_tpu.ops.common.padding import pad_time
from gla_tpu.ops.gla.pallas_gpu import (
    forward_mosaic,
    kernels_intra,
    kernels_mosaic_grads,
    kernels_mosaic_levels,
    kernels_mosaic_state,
    kernels_output,
    kernels_recurrent,
    kernels_state,
    time_split,
)
from gla_tpu.ops.gla.pallas_gpu.kernels_mosaic_state import Pass


def _by_grid(kernel, bounded, *operands, **static):
    """kernel(*operands, **static) with one program per chunk when every chunk is bounded
    (all_bounded=True), else one per sub-chunk of rows; chosen at run time (XLA's conditional:
    on GPU it reads the predicate back to the host once per call). Per-head gates (bounded None)
    take one program per chunk whatever their strength."""
    if bounded is None:
        return kernel(*operands, **static, all_bounded=True)
    return lax.cond(jnp.all(bounded > 0),
                    functools.partial(kernel, **static, all_bounded=True),
                    functools.partial(kernel, **static, all_bounded=False), *operands)


def _gate_sums(g, geo):
    """Chunk-local sums of gates g [B, Tp, H, K]; per-head gates are summed once per head."""
    if geo.per_head:
        b = chunk_local_cumsum(g[..., 0], geo.chunk, method="triangular")
        return jnp.broadcast_to(b[..., None], g.shape)
    return chunk_local_cumsum(g, geo.chunk, method="triangular")


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11))
def chunked(q, k, v, g, s0, seg, reach, last, keep, start, geo, interpret):
    """(o [B, Tp, H, V], final state [B, H, K, V] float32) from inputs padded to whole chunks and
    padded K, V (entry.py); gates g [B, Tp, H, K] float32. Not differentiated, per-head gates
    may run the one Mosaic GPU kernel (geo.mosaic_forward); training runs the chunked ones."""
    if geo.mosaic_forward:
        return forward_mosaic.forward(q, k, v, g[..., 0], s0, geo=geo, interpret=interpret)
    out, _ = _chunked_fwd(q, k, v, g, s0, seg, reach, last, keep, start, geo, interpret)
    return out


def _chunked_fwd(q, k, v, g, s0, seg, reach, last, keep, start, geo, interpret):
    b = _gate_sums(g, geo)  # [B, Tp, H, K] float32
    states, final = kernels_state.state_pass(k, v, b, last, keep, s0, geo=geo, reverse=False,
                                             interpret=interpret)
    # [B, H, N]: chunks whose intra products take one whole-chunk product (kernels_intra.py);
    # per-head gates always do
    bounded = None if geo.per_head else kernels_intra.bounded_chunks(b, geo.chunk)
    a = _by_grid(kernels_intra.intra_scores, bounded, q, k, b, seg, bounded, geo=geo,
                 interpret=interpret)
    o = kernels_output.chunk_output(q, b, reach, a, v, states, geo=geo, interpret=interpret)
    residuals = (q, k, v, b, s0, seg, reach, last, keep, start, a, states, bounded)
    return (o, final), residuals


def _chunked_bwd(geo, interpret, residuals, cotangents):
    q, k, v, b, s0, seg, reach, last, keep, start, a, states, bounded = residuals
    do, dfinal = cotangents
    do = do.astype(v.dtype)
    dfinal = dfinal.astype(jnp.float32)
    dstates, ds0 = kernels_state.state_pass(q, do, b, reach, keep, dfinal, geo=geo,
                                            reverse=True, interpret=interpret)
    da, da_t = kernels_intra.chunk_da(do, v, seg, geo=geo, interpret=interpret)
    dq, dk, dg = _by_grid(kernels_intra.chunk_dqk, bounded, q, k, v, do, b, da, da_t, reach, last,
                          start, keep, states, dstates, bounded, geo=geo, interpret=interpret)
    dv = kernels_output.chunk_dv(k, b, last, a, do, dstates, geo=geo, interpret=interpret)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv, dg, None if s0 is None else ds0,
            None, None, None, None, None)


chunked.defvjp(_chunked_fwd, _chunked_bwd)


# The pair-level Mosaic GPU kernels (per-key gates, plan.mosaic_chunk). Forward: prep (A, qd, kd,
# the chunk decays, from the gates themselves), then the state pass with outputs; training also
# stores each chunk's entering state (two 16-bit parts). Backward: the reversed state pass (dh per
# chunk, dv, the state term of dg, d initial_state), then dq, dk, dg per chunk and key slab.
_INFERENCE = Pass(reverse=False, outputs=True, store_parts=0, state_term=False)
_TRAINING = Pass(reverse=False, outputs=True, store_parts=2, state_term=False)
_REVERSED = Pass(reverse=True, outputs=True, store_parts=1, state_term=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def mosaic_chunked(q, k, v, g, s0, geo, interpret):
    """(o [B, Tp, H, V], final state [B, H * G, K / G, V] float32) by the pair-level kernels,
    from inputs padded as for `chunked` (gates float32, segment ids already folded into them:
    entry.reset_at_segment_starts). q, k [B, Tp, H * G, K / G] hold G = geo.key_groups groups
    of keys as virtual heads (state rows are separable by key: the state passes sum the
    groups' outputs); v [B, Tp, H, V]; g [B, Tp, H * G, K / G] per key, or [B, Tp, H * G] per
    head (and for no gate), which the kernels read as such, dg summed over K inside them. Not
    differentiated, per-head gates may run the one Mosaic GPU forward (geo.mosaic_forward,
    G = 1)."""
    if geo.mosaic_forward:
        return forward_mosaic.forward(q, k, v, g, s0, geo=geo, interpret=interpret)
    return _mosaic_forward(q, k, v, g, s0, geo, interpret, _INFERENCE)[0]


def _state_pass_split(x, y, last, s0, *, w, a, h_parts=None, h_first=None, p, splits,
                      interpret):
    """kernels_mosaic_state.state_pass over P segments of T side by side (more blocks where B H
    V / 64 cannot fill the GPU; time_split.py): a states-only pass from zero per segment, a scan
    of those into each segment's starting state, then the full pass. Returns what state_pass
    returns, the last state that of the whole T, then the state each (folded) batch row starts
    from ([B * P, H, K, V] float32; s0, maybe None, without a split). h_first: that of a
    forward, for the reversed pass's state term (state_pass)."""
    if splits == 1:
        return list(kernels_mosaic_state.state_pass(x, y, last, s0, w=w, a=a, h_parts=h_parts,
                                                    h_first=h_first, p=p,
                                                    interpret=interpret)) + [s0]
    bsz, _, h, kd = last.shape
    vd = y.shape[3]
    split = functools.partial(time_split.fold, splits=splits)
    states_only = dataclasses.replace(p, outputs=False, store_parts=0, state_term=False)
    local = kernels_mosaic_state.state_pass(split(x), split(y), split(last), None,
                                            p=states_only, interpret=interpret)[-1]
    decay = _segment_decays(last, splits)
    start = jnp.zeros((bsz, h, kd, vd), jnp.float32) if s0 is None else s0
    s_in = time_split.segment_starts(local, decay, start, reverse=p.reverse)
    h_parts = None if h_parts is None else tuple(split(x) for x in h_parts)
    *outs, final = kernels_mosaic_state.state_pass(split(x), split(y), split(last), s_in,
                                                   w=split(w), a=split(a), h_parts=h_parts,
                                                   h_first=h_first, p=p, interpret=interpret)
    final = final.reshape(bsz, splits, *final.shape[1:])[:, 0 if p.reverse else -1]
    return [time_split.unfold(out, splits) for out in outs] + [final, s_in]


def _segment_decays(last, splits: int):
    """Each of the P segments' decay, exp of its chunks' summed gates: last [B, N, H, K] (the
    gates' sum over each chunk) -> [B, P, H, K]."""
    bsz, n, h, kd = last.shape
    return jnp.exp(jnp.sum(last.reshape(bsz, splits, n // splits, h, kd), axis=2))


def mosaic_last_state(q, k, y, g, geo, interpret, *, reverse: bool):
    """The last state of a states-only pass from zero, by the pair-level kernels (prep, then
    kernels_mosaic_state.state_pass without outputs), on inputs padded and grouped as for
    `mosaic_chunked`. Forward over (k decayed, y = v): the block's own final state
    S = sum_t exp(gates after t) k_t^T v_t; reversed over (q decayed and scaled, y = do): the
    cotangent of the state entering the block from its outputs, sum_t scale exp(gates through
    t) q_t^T do_t (context parallelism's two passes, ops/gla/context_parallel.py). T splits as
    the state passes do (geo.mosaic_splits), the segments joined in XLA. Returns
    [B, H * G, K / G, V] float32."""
    _, qd, kd, last = kernels_mosaic_levels.prep(q, k, g, scale=geo.scale, interpret=interpret)
    x = qd if reverse else kd
    p = dataclasses.replace(_configured(_REVERSED if reverse else _INFERENCE, geo),
                            outputs=False, store_parts=0, state_term=False)
    splits = geo.mosaic_splits
    if splits == 1:
        return kernels_mosaic_state.state_pass(x, y, last, None, p=p, interpret=interpret)[-1]
    split = functools.partial(time_split.fold, splits=splits)
    local = kernels_mosaic_state.state_pass(split(x), split(y), split(last), None, p=p,
                                            interpret=interpret)[-1]
    decay = _segment_decays(last, splits)
    local = local.reshape(last.shape[0], splits, *local.shape[1:])
    state = jnp.zeros(local.shape[:1] + local.shape[2:], jnp.float32)
    for s in (reversed(range(splits)) if reverse else range(splits)):
        state = decay[:, s, ..., None] * state + local[:, s]
    return state


def _configured(p, geo):
    """The state pass `p` as geo asks: its key groups, their partial sums, its value tile, the
    parts of h the training pass stores and the state term reads, the parts of the state its
    outputs take."""
    one_part = geo.state_parts == 1
    return dataclasses.replace(
        p, groups=geo.key_groups, sums_16bit=geo.group_sums_16bit, block_v=geo.state_block_v,
        store_parts=min(p.store_parts, 1) if one_part else p.store_parts,
        term_parts=1 if one_part else p.term_parts, out_parts=geo.output_parts)


def state_passes(geo):
    """(inference, training, reversed): the three state passes as a call of geometry `geo` runs
    them (for benchmarks that time each kernel alone)."""
    return tuple(_configured(p, geo) for p in (_INFERENCE, _TRAINING, _REVERSED))


def _mosaic_forward(q, k, v, g, s0, geo, interpret, p):
    # last: b at each chunk's last token, [B, N, H, K] float32
    a, qd, kd, last = kernels_mosaic_levels.prep(q, k, g, scale=geo.scale, interpret=interpret)
    o, *parts, final, starts = _state_pass_split(
        kd, v, last, s0, w=qd, a=a, p=_configured(p, geo),
        splits=geo.mosaic_splits, interpret=interpret)
    # one stored part of h: the state term takes each row's first chunk from `starts` (float32)
    return (o, final), (a, qd, kd, last, tuple(parts), starts if geo.state_parts == 1 else None)


def _mosaic_fwd(q, k, v, g, s0, geo, interpret):
    # symbolic_zeros: each array comes as (value, perturbed); the cotangents below may be
    # symbolic zeros, so an unused final state costs no zeros array and no read in the backward
    q, k, v, g, s0 = custom_vjp_primal_tree_values((q, k, v, g, s0))
    out, saved = _mosaic_forward(q, k, v, g, s0, geo, interpret, _TRAINING)
    return out, (q, k, v, g, s0, *saved)


def _dense(cotangent, dtype):
    """A cotangent as an array of `dtype` (a symbolic zero as zeros)."""
    if isinstance(cotangent, SymbolicZero):
        return jnp.zeros(cotangent.shape, dtype)
    return cotangent.astype(dtype)


def _mosaic_bwd(geo, interpret, residuals, cotangents):
    q, k, v, g, s0, a, qd, kd, last, h_parts, h_first = residuals
    do, dfinal = cotangents
    do = _dense(do, v.dtype)
    # no cotangent of the final state: the reversed pass starts from zero in registers
    dfinal = None if isinstance(dfinal, SymbolicZero) else dfinal.astype(jnp.float32)
    dv, dh, term, ds0, _ = _state_pass_split(
        qd, do, last, dfinal, w=kd, a=a, h_parts=h_parts, h_first=h_first,
        p=_configured(_REVERSED, geo), splits=geo.mosaic_splits,
        interpret=interpret)
    dq, dk, dg = kernels_mosaic_grads.chunk_grads(q, k, v, do, g, last, h_parts[0], dh, term,
                                                  scale=geo.scale, interpret=interpret,
                                                  groups=geo.key_groups)
    return dq, dk, dv, dg, None if s0 is None else ds0


mosaic_chunked.defvjp(_mosaic_fwd, _mosaic_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def few_tokens(q, k, v, g, s0, geo, interpret):
    """The recurrence token by token; T (a power of two <= MAX_RECURRENT_T) is padded with zero
    tokens by the caller, which leave the state unchanged."""
    return kernels_recurrent.recurrent_forward(q, k, v, g, s0, scale=geo.scale, interpret=interpret)


def _few_tokens_fwd(q, k, v, g, s0, geo, interpret):
    return few_tokens(q, k, v, g, s0, geo, interpret), (q, k, v, g, s0)


def _few_tokens_bwd(geo, interpret, residuals, cotangents):
    """The chunked backward on the inputs padded to one chunk."""
    q, k, v, g, s0 = residuals
    t = q.shape[1]

    def on_whole_chunk(q, k, v, g, s0):
        padded = [pad_time(x, geo.chunk) for x in (q, k, v, g)]
        o, final = chunked(*padded, s0, None, None, None, None, None, geo, interpret)
        return o[:, :t], final

    _, vjp = jax.vjp(on_whole_chunk, q, k, v, g, s0)
    return vjp(cotangents)


few_tokens.defvjp(_few_tokens_fwd, _few_tokens_bwd)
