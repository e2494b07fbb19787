"""The "pallas_gpu" GLA backend: the chunked algorithm in Pallas kernels (Triton lowering).

Every mode runs the chunked kernels of pallas_gpu_kernels.py (docs/gpu_backend.md says why:
"fused_chunk" and "fused_recurrent" compute the same function and the chunked path is the fastest
correct one written for the GPU). This module pads, prepares gates and segment masks in XLA and
wires the kernels with `jax.custom_vjp`; the gate gradient comes from dL/db_t = q_t dq_t - k_t dk_t
summed backwards within the chunk plus what later chunks add through h_{n+1}, rewritten so that
no two terms cancel (docs/gpu_backend.md derives it; pallas_gpu_kernels.chunk_dqk computes it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gla_tpu.ops.common.backends import require_gpu_dtype
from gla_tpu.ops.common.gating import (
    pad_segment_index,
    pad_time,
    segment_index,
)
from gla_tpu.ops.gla import pallas_gpu_kernels as kernels
from gla_tpu.ops.gla import pallas_gpu_recurrent as recurrent

CHUNK = 64  # chunk length on GPU, whatever `chunk_size` asks (the result does not depend on it)
# Up to this many tokens without segments, the forward runs the token-by-token kernel
# (decoding); its backward is the chunked one's.
MAX_RECURRENT_T = 16
BLOCK_K = 64  # K tile
MAX_DIM = 512


def value_block(value_dim: int) -> int:
    """V tile: 128 from V = 256 on (state passes, output and dv ran 1.3-1.4x faster than with 64 at
    V = 512 on the H200), else 64 (more programs for the state passes' chunk loop)."""
    return 128 if value_dim >= 256 else 64


def chunk_geometry(padded_len: int, key_dim: int, value_dim: int, *, scale: float,
                   has_segments: bool, exact_inter: bool) -> kernels.ChunkGeometry:
    """The kernels' tiles for padded T, K and V (powers of two >= 64). `exact_inter` (mode
    "fused_recurrent") keeps dq's and dk's products with the float32 states float32-accurate, as
    that mode's XLA baseline is a float32 recurrence; modes "chunk" and "fused_chunk" round the
    states to the input dtype there, as XLA's chunked baseline and fla's chunk_gla do
    (docs/gpu_backend.md)."""
    return kernels.ChunkGeometry(
        chunk=CHUNK, block_k=BLOCK_K, block_v=value_block(value_dim), key_dim=key_dim,
        value_dim=value_dim, num_chunks=-(-padded_len // CHUNK), scale=scale,
        has_segments=has_segments, exact_inter=exact_inter,
    )


def check_supported(problem) -> None:
    for name, dim in (("K", problem.key_dim), ("V", problem.value_dim)):
        if dim > MAX_DIM:
            raise NotImplementedError(
                f"the 'pallas_gpu' gla takes {name} <= {MAX_DIM}; got {name}={dim}. "
                "backend='xla' takes it."
            )
    require_gpu_dtype("gla", problem.dtype)


def _padded_dim(d: int) -> int:
    return max(BLOCK_K, 1 << (d - 1).bit_length())


def _pad_last(x, size: int):
    pad = size - x.shape[-1]
    if pad == 0:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def segment_masks(seg, chunk: int):
    """seg [B, Tp] running segment index -> (reach [B, Tp], last [B, Tp], keep [B, N],
    start [B, Tp]) float32; start is 1.0 at the first token of every segment but the first."""
    b, tp = seg.shape
    n = tp // chunk
    segc = seg.reshape(b, n, chunk)
    prev_seg = jnp.concatenate([seg[:, :1], seg[:, chunk - 1 : -1 : chunk]], axis=1)  # [B, N]
    last_seg = segc[:, :, -1]
    reach = (segc == prev_seg[:, :, None]).reshape(b, tp).astype(jnp.float32)
    last = (segc == last_seg[:, :, None]).reshape(b, tp).astype(jnp.float32)
    keep = (last_seg == prev_seg).astype(jnp.float32)
    start = jnp.concatenate([jnp.zeros((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    return reach, last, keep, start.astype(jnp.float32)


def gla(q, k, v, g, *, problem, initial_state, segment_ids, interpret):
    check_supported(problem)
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    kp, vp = _padded_dim(kd), _padded_dim(vd)
    if g is None:
        gates = jnp.zeros((b, t, h, kd), jnp.float32)
    elif g.ndim == 3:
        gates = jnp.broadcast_to(g.astype(jnp.float32)[..., None], (b, t, h, kd))
    else:
        gates = g.astype(jnp.float32)
    # zero q, k, v and zero log gates past T or past K, V leave outputs and states unchanged
    few_tokens = t <= MAX_RECURRENT_T and segment_ids is None
    time_block = 1 << (t - 1).bit_length() if few_tokens else CHUNK
    qp, kp_, gp = (pad_time(_pad_last(x, kp), time_block) for x in (q, k, gates))
    vpad = pad_time(_pad_last(v, vp), time_block)
    s0 = None
    if initial_state is not None:
        s0 = jnp.pad(initial_state, [(0, 0), (0, 0), (0, kp - kd), (0, vp - vd)])
    seg = reach = last = keep = start = None
    if segment_ids is not None:
        seg = pad_segment_index(segment_index(segment_ids), CHUNK)
        reach, last, keep, start = segment_masks(seg, CHUNK)
    geo = chunk_geometry(qp.shape[1], kp, vp, scale=float(problem.scale),
                         has_segments=segment_ids is not None,
                         exact_inter=problem.mode == "fused_recurrent")
    with jax.named_scope(f"gla_pallas_gpu_{problem.mode}"):
        if few_tokens:
            o, final = _few_tokens(qp, kp_, vpad, gp, s0, geo, bool(interpret))
        else:
            o, final = _chunked(qp, kp_, vpad, gp, s0, seg, reach, last, keep, start, geo,
                                bool(interpret))
    o = o[:, :t, :, :vd]
    final = final[:, :, :kd, :vd] if problem.output_final_state else None
    return o, final


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11))
def _chunked(q, k, v, g, s0, seg, reach, last, keep, start, geo, interpret):
    out, _ = _chunked_fwd(q, k, v, g, s0, seg, reach, last, keep, start, geo, interpret)
    return out


def chunk_cumsum(g, chunk: int):
    """[B, Tp, H, K] float32 log gates -> their running sum restarted at every chunk, as one
    product with a lower-triangular matrix of ones in float32 (0.14 ms where XLA's cumsum takes
    0.22 at (4, 4096, 16, 128) on the H200)."""
    bsz, tp, h, kd = g.shape
    ones = jnp.tril(jnp.ones((chunk, chunk), jnp.float32))
    gc = g.reshape(bsz, tp // chunk, chunk, h, kd)
    b = jnp.einsum("ts,bnshk->bnthk", ones, gc, precision=jax.lax.Precision.HIGHEST)
    return b.reshape(g.shape)


def _chunked_fwd(q, k, v, g, s0, seg, reach, last, keep, start, geo, interpret):
    b = chunk_cumsum(g, geo.chunk)  # [B, Tp, H, K] float32
    states, final = kernels.state_pass(k, v, b, last, keep, s0, geo=geo, reverse=False,
                                       interpret=interpret)
    bounded = kernels.bounded_chunks(b, geo.chunk)  # [B, H, N]: one product per chunk applies
    a = kernels.intra_scores(q, k, b, seg, bounded, geo=geo, interpret=interpret)
    o = kernels.chunk_output(q, b, reach, a, v, states, geo=geo, interpret=interpret)
    residuals = (q, k, v, b, s0, seg, reach, last, keep, start, a, states, bounded)
    return (o, final), residuals


def _chunked_bwd(geo, interpret, residuals, cotangents):
    q, k, v, b, s0, seg, reach, last, keep, start, a, states, bounded = residuals
    do, dfinal = cotangents
    do = do.astype(v.dtype)
    dfinal = dfinal.astype(jnp.float32)
    dstates, ds0 = kernels.state_pass(q, do, b, reach, keep, dfinal, geo=geo, reverse=True,
                                      interpret=interpret)
    da = kernels.chunk_da(do, v, seg, geo=geo, interpret=interpret)
    dq, dk, dg = kernels.chunk_dqk(q, k, v, do, b, da, reach, last, start, keep, states, dstates,
                                   bounded, geo=geo, interpret=interpret)
    dv = kernels.chunk_dv(k, b, last, a, do, dstates, geo=geo, interpret=interpret)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv, dg, None if s0 is None else ds0,
            None, None, None, None, None)


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _few_tokens(q, k, v, g, s0, geo, interpret):
    """The recurrence token by token; T (a power of two <= MAX_RECURRENT_T) is padded with zero
    tokens by the caller, which leave the state unchanged."""
    return recurrent.recurrent_forward(q, k, v, g, s0, scale=geo.scale, interpret=interpret)


def _few_tokens_fwd(q, k, v, g, s0, geo, interpret):
    return _few_tokens(q, k, v, g, s0, geo, interpret), (q, k, v, g, s0)


def _few_tokens_bwd(geo, interpret, residuals, cotangents):
    """The chunked backward on the inputs padded to one chunk."""
    q, k, v, g, s0 = residuals
    t = q.shape[1]

    def chunked(q, k, v, g, s0):
        padded = [pad_time(x, geo.chunk) for x in (q, k, v, g)]
        o, final = _chunked(*padded, s0, None, None, None, None, None, geo, interpret)
        return o[:, :t], final

    _, vjp = jax.vjp(chunked, q, k, v, g, s0)
    return vjp(cotangents)


_few_tokens.defvjp(_few_tokens_fwd, _few_tokens_bwd)
