"""Chunked GLA on TPU ("chunk" and "fused_chunk" modes of the "mosaic_tpu" backend).

The wiring: pad T to a multiple of the chunk, compute the chunk-local gate sums b outside the
kernels (`chunk_local_cumsum`; Mosaic has no in-kernel cumsum), run the kernels of
`mosaic_tpu_chunk_kernels` under a `jax.custom_vjp` whose inputs are (q, k, v, b, initial state),
and let JAX's autodiff of the cumsum turn db into dg. docs/gla_mosaic_tpu.md derives
db = q*dq - k*dk + (at each chunk's last token) an "edge" row the backward kernels return beside
dq, dk, dv; d initial state comes from the kernel that materializes the state cotangents.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gla_tpu.ops.common.gating import (
    chunk_local_cumsum,
    pad_segment_index,
    pad_time,
    segment_index,
)
from gla_tpu.ops.gla import mosaic_tpu_chunk_kernels as kernels

CHUNK_MODES = ("chunk", "fused_chunk")
# K and V: any multiple of DIM_MULTIPLE in [DIM_MIN, DIM_MAX].
DIM_MULTIPLE, DIM_MIN, DIM_MAX = 64, 64, 512


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Performance knobs of the chunked kernels (chunk_size is semantics-free but user-facing).

    block_v: columns of V per grid step (None: all of V). The state block is [block_v, K] float32
      in VMEM; a smaller block gives more parallel grid steps and recomputes the [C, C] scores
      once per V block.
    """

    block_v: int | None = None

    def __post_init__(self):
        bv = self.block_v
        if bv is not None and (not isinstance(bv, int) or bv <= 0 or bv % 128):
            raise ValueError(f"block_v must be None or a positive multiple of 128; got {bv!r}.")

    def resolve_block_v(self, value_dim: int) -> int:
        if self.block_v is None or self.block_v >= value_dim:
            return value_dim
        if value_dim % self.block_v:
            raise ValueError(f"block_v={self.block_v} must divide V={value_dim}.")
        return self.block_v


def check_supported_chunk(problem) -> None:
    """Raises NotImplementedError for a problem the chunked kernels cannot take."""
    for name, d in (("K", problem.key_dim), ("V", problem.value_dim)):
        if d % DIM_MULTIPLE or not DIM_MIN <= d <= DIM_MAX:
            raise NotImplementedError(
                f"the 'mosaic_tpu' gla backend needs {name} to be a multiple of {DIM_MULTIPLE} "
                f"in [{DIM_MIN}, {DIM_MAX}]; got {name}={d}. backend='xla' takes any head dim."
            )
    if problem.mode not in CHUNK_MODES:
        raise NotImplementedError(f"mode={problem.mode!r} is not a chunked mode {CHUNK_MODES}.")


def chunked_gla(q, k, v, g, *, problem, initial_state, segment_ids, interpret,
                block_sizes: BlockSizes | None = None):
    """The "chunk" / "fused_chunk" GLA of the "mosaic_tpu" backend; see `gla_tpu.ops.gla`.

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K], [B, T, H] or None (log gates <= 0).
      problem: the validated GLAProblem (mode "chunk" or "fused_chunk").
      initial_state: [B, H, K, V] float32 or None; segment_ids: [B, T] int32 or None.
      interpret: False, True (TPU interpret mode, NaN-filled memory) or pltpu.InterpretParams.
      block_sizes: performance knobs.
    Returns:
      (o [B, T, H, V] in v's dtype, final state [B, H, K, V] float32 or None).
    """
    check_supported_chunk(problem)
    return _chunked_gla(q, k, v, g, initial_state, segment_ids, problem=problem,
                        interpret=interpret, block_sizes=block_sizes or BlockSizes())


# One jitted program per problem: padding, gate sums, layouts and kernels compile together.
@functools.partial(jax.jit, static_argnames=("problem", "interpret", "block_sizes"))
def _chunked_gla(q, k, v, g, initial_state, segment_ids, *, problem, interpret, block_sizes):
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    c = problem.chunk_size
    q_p, k_p, v_p = (pad_time(x, c) for x in (q, k, v))
    tp = q_p.shape[1]
    # Zero log gates in the padding: padded tokens (k = v = 0) change neither o nor the state.
    bsum = None if g is None else chunk_local_cumsum(pad_time(g, c), c)
    rel = None
    if segment_ids is not None:
        rel = _relative_segments(pad_segment_index(segment_index(segment_ids), c), c)
    cfg = kernels.KernelConfig(
        batch=b, seq_len=tp, num_heads=h, key_dim=kd, value_dim=vd, chunk=c,
        block_v=block_sizes.resolve_block_v(vd), gate_kind=problem.gate_kind,
        has_segments=rel is not None, has_initial_state=initial_state is not None,
        scale=float(problem.scale), dtype=jnp.dtype(q.dtype),
    )
    with jax.named_scope(f"gla_mosaic_tpu_{problem.mode}"):
        o, final = _core(cfg, problem.mode, interpret, q_p, k_p, v_p, bsum, initial_state, rel)
    return o[:, :t], (final if problem.output_final_state else None)


def _relative_segments(seg, c):
    """[B, T] running segment index -> index minus that of the token before each chunk."""
    b, t = seg.shape
    before = jnp.concatenate([seg[:, :1], seg[:, c - 1:-1:c]], axis=1)  # [B, N]
    rel = seg.reshape(b, t // c, c) - before[:, :, None]
    return rel.reshape(b, t)


def _kernel_arrays(cfg, q, k, v, bsum, s0, rel):
    """Arrays in the layouts the kernels read (docs/gla_mosaic_tpu.md)."""
    arrays = {"q": kernels.seq_pack(q), "k": kernels.seq_pack(k), "v": kernels.seq_pack(v)}
    if cfg.gate_kind == "key":
        arrays["b"] = kernels.seq_pack(bsum)
    elif cfg.gate_kind == "head":
        bh = jnp.transpose(bsum, (0, 2, 1))  # [B, H, T]
        arrays["bcol"] = bh[..., None]
        arrays["brow"] = bh.reshape(cfg.batch, cfg.num_heads, cfg.num_chunks, 1, cfg.chunk)
    if rel is not None:
        arrays["segcol"] = rel[..., None]
        arrays["segrow"] = rel.reshape(cfg.batch, cfg.num_chunks, 1, cfg.chunk)
    if s0 is not None:
        arrays["s0"] = _transpose_state(s0)
    return arrays


def _transpose_state(s):
    return jnp.swapaxes(s, -1, -2)  # [B, H, K, V] <-> [B, H, V, K]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _core(cfg, mode, interpret, q, k, v, bsum, s0, rel):
    (o, final), _ = _core_fwd(cfg, mode, interpret, q, k, v, bsum, s0, rel)
    return o, final


def _core_fwd(cfg, mode, interpret, q, k, v, bsum, s0, rel):
    arrays = _kernel_arrays(cfg, q, k, v, bsum, s0, rel)
    if mode == "fused_chunk":
        out = kernels.run(cfg, "fused_fwd", arrays, interpret=interpret)
    else:
        states = kernels.run(cfg, "states", arrays, interpret=interpret)
        out = kernels.run(cfg, "outputs", {**arrays, "states": states["states"]},
                          interpret=interpret)
        out["final"] = states["final"]
    o = kernels.seq_unpack(out["o"], cfg.num_heads, cfg.value_dim)
    final = _transpose_state(out["final"])
    return (o, final), (q, k, v, bsum, s0, rel)


def _core_bwd(cfg, mode, interpret, residuals, cotangents):
    q, k, v, bsum, s0, rel = residuals
    do, dfinal = cotangents
    arrays = _kernel_arrays(cfg, q, k, v, bsum, s0, rel)
    arrays["do"] = kernels.seq_pack(do.astype(cfg.dtype))
    arrays["dfinal"] = _transpose_state(dfinal.astype(jnp.float32))
    dstates = kernels.run(cfg, "dstates", arrays, interpret=interpret)
    arrays["dstates"] = dstates["dstates"]
    if mode == "fused_chunk":
        grads = kernels.run(cfg, "bwd_fused", arrays, interpret=interpret)
    else:
        arrays["states"] = kernels.run(cfg, "states", arrays, interpret=interpret)["states"]
        grads = kernels.run(cfg, "bwd_chunk", arrays, interpret=interpret)
    # Partial sums over V blocks, head-major float32 -> [B, T, H, K].
    dq, dk = (jnp.transpose(jnp.sum(grads[x], axis=0), (0, 2, 1, 3)) for x in ("dq", "dk"))
    dv = kernels.seq_unpack(grads["dv"], cfg.num_heads, cfg.value_dim)
    db = None if bsum is None else _gate_sum_grad(cfg, q, k, dq, dk, _rows(grads["edge"]))
    ds0 = None if s0 is None else _transpose_state(dstates["ds0"])
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), db, ds0, None)


def _rows(x):
    """[nV, B, H, N, 1, K] per-V-block rows -> [B, N, H, K] summed over V blocks."""
    return jnp.transpose(jnp.sum(x, axis=(0, 4)), (0, 2, 1, 3))


def _gate_sum_grad(cfg, q, k, dq, dk, edge):
    """d loss / d b for the chunk-local gate sums b (docs/gla_mosaic_tpu.md, "dg").

    Every term of o and of the states carries b as a factor exp(b_i) of q_i, exp(-b_j) of k_j, or
    exp(b_last) of the whole state leaving a chunk; so db_t = q_t dq_t - k_t dk_t, plus at each
    chunk's last token `edge` ([B, N, H, K]), which equals <S_out, dS_out> summed over V.
    """
    b, t, h = cfg.batch, cfg.seq_len, cfg.num_heads
    n, c = cfg.num_chunks, cfg.chunk
    u = q.astype(jnp.float32) * dq - k.astype(jnp.float32) * dk  # [B, T, H, K]
    if cfg.gate_kind == "head":
        u = jnp.sum(u, axis=-1, keepdims=True)
        edge = jnp.sum(edge, axis=-1, keepdims=True)
    u = u.reshape(b, n, c, h, u.shape[-1])
    last_row = u[:, :, -1] + edge
    db = jnp.concatenate([u[:, :, :-1], last_row[:, :, None]], axis=2).reshape(b, t, h, -1)
    return db if cfg.gate_kind == "key" else db[..., 0]


_core.defvjp(_core_fwd, _core_bwd)
