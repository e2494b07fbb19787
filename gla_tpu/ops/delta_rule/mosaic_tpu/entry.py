"""Entry of the "mosaic_tpu" delta-rule backend: what it takes, and the call.

Mode "chunk": pad T to a multiple of the chunk (padded tokens have beta = 0 and g = 0 and leave
the state unchanged), l2-normalize q and k when asked (in XLA, differentiated by autodiff), the
segment index relative to each chunk's entering state, then run vjp.chunked; the kernels take
the gates' range sums themselves. Mode "fused_recurrent": at T = 1 the decode kernel; else GLA's
token-by-token kernels with the delta update (gla/mosaic_tpu/kernels_recurrent.py, `delta=True`)
and the per-token segment keep. docs/delta_rule_mosaic_tpu.md describes the kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gla_tpu.ops.common.capabilities import DELTA_RULE_FEATURES, Capabilities, Dims
from gla_tpu.ops.common.padding import pad_segment_index, pad_time
from gla_tpu.ops.common.segments import relative_segments, segment_index, token_keeps
from gla_tpu.ops.delta_rule.mosaic_tpu import vjp
from gla_tpu.ops.common.tpu import target_tpu_info, tpu_interpret_params
from gla_tpu.ops.delta_rule.mosaic_tpu.plan import BlockSizes, decode_block_h, inverse_chunks
from gla_tpu.ops.delta_rule.reference import l2_normalize
from gla_tpu.ops.delta_rule.validation import GATE_KINDS
from gla_tpu.ops.gla.mosaic_tpu import vjp as gla_vjp
from gla_tpu.ops.gla.mosaic_tpu.plan import ChunkConfig, chunks_per_grid_step, recurrent_plan

# K and V: 64, 128 or 256 (the sizes the compile tests cover; the state [V, K] float32 and one
# chunk's blocks stay in VMEM).
HEAD_DIMS = Dims(values=(64, 128, 256))

CAPABILITIES = Capabilities(
    op="delta_rule", backend="mosaic_tpu", platform="TPU; CPU with interpret=True",
    dtypes=("bfloat16", "float32"), dims=(("K", HEAD_DIMS), ("V", HEAD_DIMS)),
    features=DELTA_RULE_FEATURES, modes=("chunk", "fused_recurrent"), gates=GATE_KINDS,
    chunk_sizes=(64,),
    notes="chunked kernels (chunk): one sequential forward kernel (WY representation by "
          "block-diagonal inverses) and one reverse backward kernel incl. dbeta and dg; "
          "token-by-token kernels (fused_recurrent), forward and backward; the T = 1 step: a "
          "decode kernel (backward through XLA)",
    block_sizes=BlockSizes,
)


def check_supported(problem, block_sizes) -> None:
    CAPABILITIES.check(problem, block_sizes)
    if problem.mode == "fused_recurrent":
        if problem.seq_len > 1:
            recurrent_plan(problem, (block_sizes or BlockSizes()).recurrent(), delta=True)
        elif _decode_block_h(problem) is None:
            raise NotImplementedError(
                f"the 'mosaic_tpu' delta_rule decode kernel fits no block of value heads for "
                f"HV={problem.num_value_heads}, H={problem.num_heads}, K={problem.key_dim}, "
                f"V={problem.value_dim} in VMEM. backend='xla' takes it.")


def _decode_block_h(problem):
    return decode_block_h(problem.num_value_heads, problem.group, problem.key_dim,
                          problem.value_dim)


def delta_rule(q, k, v, beta, g, *, problem, initial_state, segment_ids, block_sizes, interpret):
    """The "mosaic_tpu" delta rule; see `gla_tpu.ops.delta_rule` (arguments validated, g
    floored). Returns (o [B, T, HV, V] in v's dtype, final state [B, HV, K, V] float32 or None)."""
    block_sizes = block_sizes or BlockSizes()
    if problem.mode == "fused_recurrent" and problem.seq_len == 1:
        return _decode(q, k, v, beta, g, initial_state, problem=problem,
                       interpret=tpu_interpret_params(interpret))
    if problem.mode == "fused_recurrent":
        return _recurrent(q, k, v, beta, g, initial_state, segment_ids, problem=problem,
                          interpret=tpu_interpret_params(interpret),
                          block_sizes=block_sizes.recurrent())
    return _chunked(q, k, v, beta, g, initial_state, segment_ids, problem=problem,
                    interpret=interpret, block_sizes=block_sizes)


@functools.partial(jax.jit, static_argnames=("problem", "interpret"))
def _decode(q, k, v, beta, g, initial_state, *, problem, interpret):
    """One token: the decode kernel on [B, ., D] views of the [B, 1, ., D] inputs."""
    b, _, h, kd = q.shape
    hv, vd = problem.num_value_heads, problem.value_dim
    if problem.use_qk_l2norm:  # kept in float32, as the "xla" step takes them
        q, k = (l2_normalize(x.astype(jnp.float32)) for x in (q, k))
    gates = None
    if g is not None:
        gates = g.astype(jnp.float32).reshape(b, hv, kd if g.ndim == 4 else 1)
    s0 = None if initial_state is None else initial_state.astype(jnp.float32)
    o, final = vjp.decode(problem.group, _decode_block_h(problem), problem.gate_kind,
                          float(problem.scale), problem.output_final_state, interpret,
                          q.reshape(b, h, kd), k.reshape(b, h, kd), v.reshape(b, hv, vd),
                          beta.astype(jnp.float32).reshape(b, hv, 1), gates, s0)
    return o.reshape(b, 1, hv, vd), final


@functools.partial(jax.jit, static_argnames=("problem", "interpret", "block_sizes"))
def _recurrent(q, k, v, beta, g, initial_state, segment_ids, *, problem, interpret, block_sizes):
    """T > 1 token by token: GLA's time-blocked kernels with the delta update."""
    plan = recurrent_plan(problem, block_sizes, delta=True)
    if problem.use_qk_l2norm:  # kept in float32, as the "xla" recurrence takes them
        q, k = (l2_normalize(x.astype(jnp.float32)) for x in (q, k))
    gates = None if g is None else g.astype(jnp.float32)
    keep = None
    if plan.cfg.has_keep:  # [B, T]: 0 where a new segment starts
        keep = token_keeps(segment_index(segment_ids)).astype(jnp.float32)
    s0 = None if initial_state is None else initial_state.astype(jnp.float32)
    core = gla_vjp.recurrent(plan, interpret)
    with jax.named_scope("delta_rule_mosaic_tpu_fused_recurrent"):
        o, final = core(q, k, v, gates, keep, s0, beta.astype(jnp.float32))
    return o, (final if problem.output_final_state else None)


@functools.partial(jax.jit, static_argnames=("problem", "interpret", "block_sizes"))
def _chunked(q, k, v, beta, g, initial_state, segment_ids, *, problem, interpret, block_sizes):
    b, t, h, kd = q.shape
    hv, vd = problem.num_value_heads, problem.value_dim
    c = problem.chunk_size
    dt = jnp.dtype(q.dtype)
    if problem.use_qk_l2norm:
        q, k = (l2_normalize(x.astype(jnp.float32)).astype(dt) for x in (q, k))
    q_p, k_p, v_p = (pad_time(x, c) for x in (q, k, v))
    beta_p = pad_time(beta.astype(jnp.float32), c)
    tp = q_p.shape[1]
    gates = None if g is None else pad_time(g.astype(jnp.float32), c)
    rel = None
    if segment_ids is not None:
        rel = relative_segments(pad_segment_index(segment_index(segment_ids), c), c)
    cfg = ChunkConfig(
        batch=b, seq_len=tp, num_heads=hv, key_dim=kd, value_dim=vd, chunk=c, block_v=vd,
        gate_kind=problem.gate_kind, has_segments=rel is not None,
        has_initial_state=initial_state is not None, scale=float(problem.scale), dtype=dt,
        chunks_per_step=chunks_per_grid_step(tp // c, c, kd, vd),
        profiler_safe=block_sizes.profiler_safe, group=problem.group,
    )
    info = target_tpu_info()
    pack = inverse_chunks(block_sizes, c, cfg.chunks_per_step,
                          None if info is None else info.mxu_column_size)
    s0 = None if initial_state is None else initial_state.astype(jnp.float32)
    with jax.named_scope("delta_rule_mosaic_tpu_chunk"):
        o, final = vjp.chunked(cfg, pack, interpret, q_p, k_p, v_p, beta_p, gates, s0, rel)
    return o[:, :t], (final if problem.output_final_state else None)
