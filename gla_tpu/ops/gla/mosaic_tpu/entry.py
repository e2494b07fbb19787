"""Entry of the "mosaic_tpu" GLA backend: what it takes, and the call, dispatched by mode.

"chunk" and "fused_chunk": pad T to a multiple of the chunk, compute the chunk-local gate sums b
outside the kernels (Mosaic has no in-kernel cumsum) and the segment index relative to each
chunk's entering state, then run vjp.chunked. "fused_recurrent": the per-token segment keep, then
vjp.recurrent. Kernels: kernels_chunk.py (+ kernels_chunk_tile.py), kernels_recurrent.py,
kernels_decode.py; layouts and blocks: plan.py. docs/gla_mosaic_tpu.md and
docs/gla_mosaic_tpu_recurrent.md describe the kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gla_tpu.ops.common.capabilities import GLA_FEATURES, Capabilities, Dims
from gla_tpu.ops.common.chunk_cumsum import chunk_local_cumsum
from gla_tpu.ops.common.padding import pad_segment_index, pad_time
from gla_tpu.ops.common.segments import relative_segments, segment_index, token_keeps
from gla_tpu.ops.common.tpu import target_tpu_info, tpu_interpret_params
from gla_tpu.ops.gla.mosaic_tpu import vjp
from gla_tpu.ops.gla.mosaic_tpu.plan import (
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    BlockSizes,
    ChunkConfig,
    chunks_per_grid_step,
    recurrent_plan,
)
from gla_tpu.ops.gla.validation import GATE_KINDS, RESOLVED_MODES

CAPABILITIES = Capabilities(
    op="gla", backend="mosaic_tpu", platform="TPU; CPU with interpret=True",
    # float16 has no native TPU matmul path; the kernels are tested and compiled in these two
    dtypes=("bfloat16", "float32"),
    dims=(("K", Dims(multiple=MIN_HEAD_DIM, low=MIN_HEAD_DIM, high=MAX_HEAD_DIM)),
          ("V", Dims(multiple=MIN_HEAD_DIM, low=MIN_HEAD_DIM, high=MAX_HEAD_DIM))),
    # chunk 128 by default up to K = 256: the compiler's static estimate puts it 21-40% below
    # chunk 64 at K = V = 128; at K = V = 512 it would not fit v4's VMEM (docs/gla_mosaic_tpu.md)
    features=GLA_FEATURES, modes=RESOLVED_MODES, gates=GATE_KINDS, chunk_sizes=(64, 128),
    default_chunks=((256, 128),),
    notes="chunked kernels (chunk, fused_chunk) and token-by-token kernels (fused_recurrent, "
          "a T = 1 decode kernel); forward and backward incl. dg",
    block_sizes=BlockSizes,
)


# chunk_size=128 above this K needs more than 16 MiB of scoped VMEM (v4's): the compiler runs
# out at K = V = 512 (docs/gla_mosaic_tpu.md, "Chunk size").
CHUNK_128_MAX_K_SMALL_VMEM = 256
SMALL_VMEM_BYTES = 32 * 2**20


def check_supported(problem, block_sizes) -> None:
    CAPABILITIES.check(problem, block_sizes)
    if (problem.mode != "fused_recurrent" and problem.chunk_size == 128
            and problem.key_dim > CHUNK_128_MAX_K_SMALL_VMEM):
        info = target_tpu_info()
        if info is not None and info.vmem_capacity_bytes < SMALL_VMEM_BYTES:
            raise NotImplementedError(
                f"the 'mosaic_tpu' gla runs chunk_size=128 for K <= {CHUNK_128_MAX_K_SMALL_VMEM} "
                f"on {info.chip_version} ({info.vmem_capacity_bytes // 2**20} MiB of VMEM); got "
                f"K={problem.key_dim}. chunk_size=64 or backend='xla' takes it.")
    if problem.mode == "fused_recurrent":
        # NotImplementedError when no block sizes fit the VMEM budget
        recurrent_plan(problem, block_sizes or BlockSizes())


def gla(q, k, v, g, *, problem, initial_state, segment_ids, block_sizes, interpret):
    """The "mosaic_tpu" GLA; see `gla_tpu.ops.gla` (arguments already validated and checked).

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K], [B, T, H] or None (log gates <= 0).
      problem: the validated GLAProblem.
      initial_state: [B, H, K, V] float32 or None; segment_ids: [B, T] int32 or None.
      block_sizes: BlockSizes or None.
      interpret: False, True (TPU interpret mode, NaN-filled memory) or pltpu.InterpretParams.
    Returns:
      (o [B, T, H, V] in v's dtype, final state [B, H, K, V] float32 or None).
    """
    block_sizes = block_sizes or BlockSizes()
    if problem.mode == "fused_recurrent":
        return _fused_recurrent(q, k, v, g, problem=problem, initial_state=initial_state,
                                segment_ids=segment_ids, interpret=interpret,
                                block_sizes=block_sizes)
    return _chunked_gla(q, k, v, g, initial_state, segment_ids, problem=problem,
                        interpret=interpret, block_sizes=block_sizes)


# One jitted program per problem: padding, gate sums, layouts and kernels compile together.
@functools.partial(jax.jit, static_argnames=("problem", "interpret", "block_sizes"))
def _chunked_gla(q, k, v, g, initial_state, segment_ids, *, problem, interpret, block_sizes):
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    c = problem.chunk_size
    q_p, k_p, v_p = (pad_time(x, c) for x in (q, k, v))
    tp = q_p.shape[1]
    # Zero log gates in the padding: padded tokens (k = v = 0) change neither o nor the state.
    # Per-key gates go to the kernels as they are (they take the chunk-local sums themselves);
    # per-head sums are one product with a triangle of ones per chunk (the matrix units; XLA's
    # cumsum on TPU is a slow reduce-window, docs/gla_mosaic_tpu.md).
    gates = None
    if problem.gate_kind == "key":
        gates = pad_time(g.astype(jnp.float32), c)
    elif problem.gate_kind == "head":
        gates = chunk_local_cumsum(pad_time(g, c), c, method="triangular")
    rel = None
    if segment_ids is not None:
        rel = relative_segments(pad_segment_index(segment_index(segment_ids), c), c)
    cfg = ChunkConfig(
        batch=b, seq_len=tp, num_heads=h, key_dim=kd, value_dim=vd, chunk=c,
        block_v=block_sizes.resolve_block_v(vd), gate_kind=problem.gate_kind,
        has_segments=rel is not None, has_initial_state=initial_state is not None,
        scale=float(problem.scale), dtype=jnp.dtype(q.dtype),
        chunks_per_step=chunks_per_grid_step(tp // c, c, kd, vd),
        profiler_safe=block_sizes.profiler_safe,
    )
    with jax.named_scope(f"gla_mosaic_tpu_{problem.mode}"):
        o, final = vjp.chunked(cfg, problem.mode, interpret, q_p, k_p, v_p, gates,
                               initial_state, rel)
    return o[:, :t], (final if problem.output_final_state else None)


def _fused_recurrent(q, k, v, g, *, problem, initial_state, segment_ids, interpret, block_sizes):
    plan = recurrent_plan(problem, block_sizes)
    gates = None if g is None else g.astype(jnp.float32)
    keep = None
    if plan.cfg.has_keep:
        # [B, T]: 0 where a new segment starts
        keep = token_keeps(segment_index(segment_ids)).astype(jnp.float32)
    core = vjp.recurrent(plan, tpu_interpret_params(interpret))
    o, final = core(q, k, v, gates, keep, initial_state, None)
    return o, (final if problem.output_final_state else None)
