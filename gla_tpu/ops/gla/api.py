"""The public gated linear attention op and its fla-named aliases."""

from __future__ import annotations

import functools

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gla_tpu.ops.common import backends
from gla_tpu.ops.common.gates import floor_log_gates
from gla_tpu.ops.common.sharding import resolve_sharding, sharded_call
from gla_tpu.ops.gla import context_parallel
from gla_tpu.ops.gla.validation import validate_gla

# Each backend is the module gla_tpu.ops.gla.<backend>, implementing
# `check_supported(problem, block_sizes)` and
# `gla(q, k, v, g, *, problem, initial_state, segment_ids, block_sizes, interpret)
#  -> (o, final_state)`.


def gla(
    q,
    k,
    v,
    g=None,
    *,
    scale: float | None = None,
    initial_state=None,
    output_final_state: bool = False,
    segment_ids=None,
    mode: str = "auto",
    chunk_size: int | None = None,
    block_sizes=None,
    backend: str = "auto",
    interpret=False,
    sharding=None,
):
    """Gated linear attention.

    Per batch row and head, with state S [K, V]:
      S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t,   o_t = scale * q_t S_t.

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V]; q, k, v share one floating dtype.
      g: log forget gate (natural log, g <= 0): [B, T, H, K] per key (GLA), [B, T, H] per head
        (simple GLA), or None (linear attention). Any float dtype; used in float32.
      scale: default K ** -0.5.
      initial_state: [B, H, K, V], used in float32; applies to each row's first segment.
      output_final_state: also return the state after each row's last token.
      segment_ids: [B, T] int; the state resets to zero where the id changes.
      mode: "chunk", "fused_chunk", "fused_recurrent" or "auto" (recurrent for T <= 16, else
        chunk). All modes compute the same function.
      chunk_size: 64 or 128, for the chunked modes; None: the backend's default (mosaic_tpu:
        128 for K <= 256, where the compiler estimates it cheaper, else 64; pallas_gpu and xla:
        64). The result does not depend on it beyond rounding.
      block_sizes: the backend's BlockSizes (performance only), or None for its defaults.
      backend: "auto", "mosaic_tpu", "pallas_gpu" or "xla".
      interpret: run a Pallas backend in interpret mode on CPU.
      sharding: None, or a `jax.sharding.NamedSharding` for q's [B, T, H, K] layout whose spec
        splits the batch and/or head dims: each device runs the op on its block
        (`jax.shard_map`, no communication); k, v, g, segment_ids, initial_state and the outputs
        follow q. With None, q's own sharding is used where its type carries explicit mesh axes.
        A split time axis runs context parallel: each device's block state from a zero state,
        one all-gather of the blocks' [B, H, K, V] states, and one run of the op from the state
        entering each block (docs/scale_out.md).

    Returns:
      (o [B, T, H, V] in v's dtype, final_state [B, H, K, V] float32 or None).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gla_tpu import ops
      >>> q = k = v = jnp.ones((1, 100, 2, 64))
      >>> g = jax.nn.log_sigmoid(jnp.ones((1, 100, 2, 64)))
      >>> o, s = ops.gla(q, k, v, g, output_final_state=True, backend="xla")
      >>> o.shape, s.shape
      ((1, 100, 2, 64), (1, 2, 64, 64))
    """
    problem, initial_state, segment_ids = validate_gla(
        q, k, v, g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, segment_ids=segment_ids, mode=mode,
        chunk_size=chunk_size,
    )
    g = floor_log_gates(g)  # -inf (a hard reset) and gates below -100 act as -100
    module, block_sizes = backends.dispatch("gla", "gla", backend, problem, block_sizes)
    chunk = module.CAPABILITIES.default_chunk_size(problem.key_dim)
    problem = problem.with_chunk_size(chunk)

    def run(q, k, v, g, initial_state, segment_ids, problem=problem):
        return module.gla(
            q, k, v, g, problem=problem, initial_state=initial_state, segment_ids=segment_ids,
            block_sizes=block_sizes, interpret=interpret,
        )

    layout = resolve_sharding("gla", sharding, q, batch=problem.batch, heads=problem.num_heads,
                              time=problem.seq_len)
    if layout is None:
        return run(q, k, v, g, initial_state, segment_ids)

    def run_local(q, k, v, g, initial_state, segment_ids, output_final_state=output_final_state):
        local, initial_state, segment_ids = validate_gla(
            q, k, v, g, scale=problem.scale, initial_state=initial_state,
            output_final_state=output_final_state, segment_ids=segment_ids, mode=mode,
            chunk_size=chunk_size,
        )
        return run(q, k, v, g, initial_state, segment_ids, problem=local.with_chunk_size(chunk))

    def states_pass(kind, x, y, g, segment_ids):
        """The backend's states-only pass of context parallelism on a block, or None."""
        fn = getattr(module, f"block_{kind}", None)
        if fn is None:
            return None
        local, _, segment_ids = validate_gla(
            x, x, y, g, scale=problem.scale, initial_state=None, output_final_state=False,
            segment_ids=segment_ids, mode=mode, chunk_size=chunk_size)
        return fn(x, y, g, problem=local.with_chunk_size(chunk), segment_ids=segment_ids,
                  block_sizes=block_sizes, interpret=interpret)

    spec = layout.spec("batch", "time", "heads", None)  # q, k, v, per-key g, o
    gate_spec = None if g is None else spec if g.ndim == 4 else layout.spec("batch", "time",
                                                                             "heads")
    state_spec = layout.spec("batch", "heads", None, None)
    args = (q, k, v, g, initial_state, segment_ids)
    in_specs = (spec, spec, spec, gate_spec, None if initial_state is None else state_spec,
                None if segment_ids is None else layout.spec("batch", "time"))
    if not layout.time_axes:
        return sharded_call(run_local, layout, args, in_specs,
                            (spec, state_spec if output_final_state else None))
    # Context parallelism: initial_state is read on every time shard, so its gradient is summed
    # over them; the final state comes out once per time shard and the last one's is returned.
    o, finals = sharded_call(
        context_parallel.local_pass(run_local, layout, problem.scale, states_pass), layout, args, in_specs,
        (spec, layout.spec("time", "batch", "heads", None, None)),
        grad_psum_axes=((), (), (), (), layout.time_axes, ()))
    if not output_final_state:
        return o, None
    if layout.explicit:
        # Explicit axes cannot slice one entry off the split time-shard axis: gather it first
        # (P states more, only for the final state on an Explicit mesh).
        finals = jax.reshard(finals, NamedSharding(layout.mesh, P(None, *state_spec)))
    return o, finals[-1]


def _with_mode(mode: str):
    @functools.wraps(gla)
    def op(q, k, v, g=None, **kwargs):
        if "mode" in kwargs:
            raise ValueError(
                f"mode is fixed to {mode!r} by this alias; got mode={kwargs['mode']!r}.")
        return gla(q, k, v, g, mode=mode, **kwargs)

    op.__name__ = op.__qualname__ = f"{mode}_gla"
    op.__doc__ = f"`gla` with mode={mode!r} (flash-linear-attention's name)."
    return op


chunk_gla = _with_mode("chunk")
fused_chunk_gla = _with_mode("fused_chunk")
fused_recurrent_gla = _with_mode("fused_recurrent")
