"""Entry of the "pallas_gpu" GLA backend: what it takes, and the call.

Every mode runs chunked kernels (docs/gpu_gla.md, "Which kernels run": "fused_chunk" and
"fused_recurrent" compute the same function and the chunked path is the fastest correct one
written for the GPU): on Hopper the pair-level Mosaic GPU kernels where they apply, else the
Triton ones; a few tokens without segments run the token-by-token forward. This module pads T,
K and V, prepares the gates (segment ids as reset gates for the pair-level kernels) and builds
the segment masks in XLA; vjp.py wires the kernels, plan.py holds the tiles.
"""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp

from gla_tpu.ops.common.capabilities import GLA_FEATURES, Capabilities, Dims
from gla_tpu.ops.common.padding import pad_last, pad_segment_index, pad_time
from gla_tpu.ops.common.segments import (
    chunk_entry_segments,
    chunk_segment_masks,
    segment_index,
    token_starts,
)
from gla_tpu.ops.gla.pallas_gpu import vjp
from gla_tpu.ops.gla.pallas_gpu.plan import (
    CHUNK,
    MAX_DIM,
    MAX_RECURRENT_T,
    BlockSizes,
    chunk_geometry,
    mosaic_chunk,
    mosaic_forward,
    padded_dim,
)
from gla_tpu.ops.gla.validation import GATE_KINDS, RESOLVED_MODES

CAPABILITIES = Capabilities(
    op="gla", backend="pallas_gpu", platform="CUDA GPU (H100/H200; CPU with interpret=True)",
    dtypes=("bfloat16", "float16", "float32"),
    dims=(("K", Dims(high=MAX_DIM)), ("V", Dims(high=MAX_DIM))),
    features=GLA_FEATURES, modes=RESOLVED_MODES, gates=GATE_KINDS, chunk_sizes=(CHUNK,),
    notes="on Hopper, modes chunk and fused_chunk run pair-level Mosaic GPU kernels, forward "
          "and backward incl. dg, one speed for every gate (16-bit, segment ids as gates that "
          "reset the state; K above 128 as groups of 128 keys; per-head and no gates read as "
          "one gate per head and token), and an undifferentiated call with per-head "
          "or no gates one Mosaic GPU forward; elsewhere the chunked Triton kernels "
          "(fused_recurrent with float32-accurate state products in its backward); T <= 16 "
          "without segments: a token-by-token forward",
    block_sizes=BlockSizes,
)


def check_supported(problem, block_sizes) -> None:
    CAPABILITIES.check(problem, block_sizes)


def segment_masks(seg, chunk: int):
    """seg [B, Tp] running segment index -> (reach [B, Tp], last [B, Tp], keep [B, N],
    start [B, Tp]) float32; start is 1.0 at the first token of every segment but the first."""
    b, tp = seg.shape
    n = tp // chunk
    reach, last, keep = chunk_segment_masks(seg.reshape(b, n, chunk),
                                            chunk_entry_segments(seg, chunk)[:, :, None])
    f32 = jnp.float32
    return (reach.reshape(b, tp).astype(f32), last.reshape(b, tp).astype(f32),
            keep[:, :, 0].astype(f32), token_starts(seg).astype(f32))


# The log gate the pair-level kernels see at the first token of a segment (but a row's first):
# every exponent they take is a range sum of gates (R g, docs/gla_math.md), and a range that
# crosses a segment start then sums to at most this, whose exponential is exactly 0 in float32
# (below -104), bfloat16 and float16. The state is reset there and nothing else changes: a range
# inside one segment never holds the start's gate. -1e3 is within the gate strengths the kernels
# are tested at (about -800 a token), exact in bfloat16 (the kernels' two-part gates), and a
# chunk of 64 such starts sums to -6.4e4, far from float32's range.
RESET_LOG_GATE = -1000.0


def reset_at_segment_starts(gates, start):
    """gates [B, Tp, H, K] or [B, Tp, H] float32 with RESET_LOG_GATE where start [B, Tp] is 1:
    segment_ids as gates. The gate at a segment start multiplies a state the reset zeroes, so its
    gradient is 0, which autodiff of the `where` gives."""
    start = start.reshape(start.shape + (1,) * (gates.ndim - 2))
    return jnp.where(start > 0, RESET_LOG_GATE, gates)


class _Prepared(typing.NamedTuple):
    """The inputs padded (T to the chunk or the few-token block, K and V to the kernels' dims)
    and the path's choices; for the pair-level path also grouped and reset (`pair_level`)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    gates: jax.Array
    s0: jax.Array | None
    seg: tuple | None  # (seg, reach, last, keep, start), the Triton kernels' segment masks
    geo: object
    few_tokens: bool
    pair_level: bool
    per_head: bool


def _prepare(q, k, v, g, *, problem, initial_state, segment_ids, block_sizes, interpret):
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    kp, vp = padded_dim(kd), padded_dim(vd)
    # per-key gates [B, T, H, K]; per-head (and absent) gates [B, T, H], broadcast over K below
    # for the kernels that need it
    gates = jnp.zeros((b, t, h), jnp.float32) if g is None else g.astype(jnp.float32)
    # zero q, k, v and zero log gates past T or past K, V leave outputs and states unchanged
    few_tokens = t <= MAX_RECURRENT_T and segment_ids is None
    time_block = 1 << (t - 1).bit_length() if few_tokens else CHUNK
    qp, kp_ = (pad_time(pad_last(x, kp), time_block) for x in (q, k))
    gp = pad_time(gates if gates.ndim == 3 else pad_last(gates, kp), time_block)
    vpad = pad_time(pad_last(v, vp), time_block)
    s0 = None
    if initial_state is not None:
        s0 = jnp.pad(initial_state, [(0, 0), (0, 0), (0, kp - kd), (0, vp - vd)])
    masks = start = None
    if segment_ids is not None:
        seg = pad_segment_index(segment_index(segment_ids), CHUNK)
        masks = (seg, *segment_masks(seg, CHUNK))
        start = masks[-1]
    block_sizes = block_sizes or BlockSizes()
    per_head = g is None or g.ndim == 3
    use_mosaic = not few_tokens and mosaic_forward(
        block_sizes, bool(interpret), per_head=per_head, has_segments=segment_ids is not None,
        dtype=q.dtype, key_dim=kp)
    use_mosaic_chunk = mosaic_chunk(
        block_sizes, bool(interpret), few_tokens=few_tokens, dtype=q.dtype, key_dim=kp,
        value_dim=vp,
        exact_inter=problem.mode == "fused_recurrent")
    geo = chunk_geometry(qp.shape[1], kp, vp, scale=float(problem.scale),
                         has_segments=segment_ids is not None,
                         exact_inter=problem.mode == "fused_recurrent", per_head=per_head,
                         mosaic_forward=use_mosaic, mosaic_chunk=use_mosaic_chunk, batch=b,
                         heads=h, block_sizes=block_sizes)
    if use_mosaic_chunk:
        if start is not None:
            gp = reset_at_segment_starts(gp, start)
        qp, kp_, gp, vpad = (pad_time(x, CHUNK * geo.mosaic_splits)
                             for x in (qp, kp_, gp, vpad))
        # groups of keys as virtual heads [B, Tp, H * G, K / G] (zero-copy reshapes); a
        # per-head gate is every group's
        heads, keys = h * geo.key_groups, kp // geo.key_groups
        qp, kp_ = (x.reshape(*x.shape[:2], heads, keys) for x in (qp, kp_))
        gp = (jnp.repeat(gp, geo.key_groups, axis=2) if per_head
              else gp.reshape(*gp.shape[:2], heads, keys))
        s0 = None if s0 is None else s0.reshape(b, heads, keys, vp)
    return _Prepared(qp, kp_, vpad, gp, s0, masks, geo, few_tokens, use_mosaic_chunk, per_head)


def gla(q, k, v, g, *, problem, initial_state, segment_ids, block_sizes, interpret):
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    x = _prepare(q, k, v, g, problem=problem, initial_state=initial_state,
                 segment_ids=segment_ids, block_sizes=block_sizes, interpret=interpret)
    with jax.named_scope(f"gla_pallas_gpu_{problem.mode}"):
        if x.pair_level:
            o, final = vjp.mosaic_chunked(x.q, x.k, x.v, x.gates, x.s0, x.geo, bool(interpret))
            final = final.reshape(b, h, -1, final.shape[-1])
        else:
            gp = x.gates
            if x.per_head:  # zero log gates past K, as for per-key gates
                gp = pad_last(jnp.broadcast_to(gp[..., None], x.q.shape[:3] + (kd,)),
                              x.q.shape[-1])
            if x.few_tokens:
                o, final = vjp.few_tokens(x.q, x.k, x.v, gp, x.s0, x.geo, bool(interpret))
            else:
                o, final = vjp.chunked(x.q, x.k, x.v, gp, x.s0, *(x.seg or (None,) * 5),
                                       x.geo, bool(interpret))
    o = o[:, :t, :, :vd]
    final = final[:, :, :kd, :vd] if problem.output_final_state else None
    return o, final


# Context parallelism's two states-only passes (ops/gla/context_parallel.py), where the
# pair-level kernels run the problem; None elsewhere (the caller's closed forms then).


def block_zero_state(k, v, g, *, problem, segment_ids, block_sizes, interpret):
    """S [B, H, K, V] float32: the block's last state from a zero state (segment ids reset it),
    by a states-only pass of the pair-level kernels; None where they do not run this problem."""
    x = _prepare(k, k, v, g, problem=problem, initial_state=None, segment_ids=segment_ids,
                 block_sizes=block_sizes, interpret=interpret)
    if not x.pair_level:
        return None
    state = vjp.mosaic_last_state(x.k, x.k, x.v, x.gates, x.geo, bool(interpret), reverse=False)
    b, _, h, kd = k.shape
    return state.reshape(b, h, -1, state.shape[-1])[:, :, :kd, :v.shape[-1]]


def block_entering_cotangent(q, do, g, *, problem, segment_ids, block_sizes, interpret):
    """D [B, H, K, V] float32: the cotangent of the state entering the block from its outputs'
    cotangent `do` [B, T, H, V], by a reversed states-only pass of the pair-level kernels; None
    where they do not run this problem."""
    x = _prepare(q, q, do.astype(q.dtype), g, problem=problem, initial_state=None,
                 segment_ids=segment_ids, block_sizes=block_sizes, interpret=interpret)
    if not x.pair_level:
        return None
    state = vjp.mosaic_last_state(x.q, x.q, x.v, x.gates, x.geo, bool(interpret), reverse=True)
    b, _, h, kd = q.shape
    return state.reshape(b, h, -1, state.shape[-1])[:, :, :kd, :do.shape[-1]]
