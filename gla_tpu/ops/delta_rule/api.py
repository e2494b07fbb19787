"""The public delta-rule op (DeltaNet, Gated DeltaNet, KDA) and its fla-named aliases."""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gla_tpu.ops.common import backends
from gla_tpu.ops.common.gates import floor_log_gates
from gla_tpu.ops.common.sharding import resolve_sharding, sharded_call
from gla_tpu.ops.common.validation import describe
from gla_tpu.ops.delta_rule import context_parallel
from gla_tpu.ops.delta_rule.validation import (
    GATE_DESCRIPTIONS,
    gate_kind,
    validate_delta_rule,
)

# Each backend is the module gla_tpu.ops.delta_rule.<backend> (common/backends.FAMILY_BACKENDS),
# implementing `check_supported(problem, block_sizes)` and
# `delta_rule(q, k, v, beta, g, *, problem, initial_state, segment_ids, block_sizes, interpret)
#  -> (o, final_state)`.


def delta_rule(
    q,
    k,
    v,
    beta,
    g=None,
    *,
    scale: float | None = None,
    initial_state=None,
    output_final_state: bool = False,
    segment_ids=None,
    use_qk_l2norm: bool = False,
    mode: str = "auto",
    chunk_size: int | None = None,
    block_sizes=None,
    backend: str = "auto",
    interpret=False,
    sharding=None,
):
    """The delta rule: DeltaNet (g None), Gated DeltaNet (per-head g), KDA (per-key g).

    Per batch row and value head, with state S [K, V] and D_t = diag(exp(g_t)):
      S_t = (I - beta_t k_t k_t^T) D_t S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t.

    Args:
      q, k: [B, T, H, K]; q, k, v share one floating dtype.
      v: [B, T, HV, V], HV a multiple of H: value head j reads q and k head j // (HV // H).
      beta: [B, T, HV], any real, any float dtype (the caller applies sigmoid or 2 * sigmoid).
      g: log decay (natural log, g <= 0, -inf allowed: a hard reset), any float dtype: None
        (DeltaNet), [B, T, HV] per head (Gated DeltaNet) or [B, T, HV, K] per key (KDA).
      scale: default K ** -0.5.
      initial_state: [B, HV, K, V], used in float32 (float64 for float64 inputs); applies to each
        row's first segment.
      output_final_state: also return the state after each row's last token.
      segment_ids: [B, T] int; the state resets to zero where the id changes.
      use_qk_l2norm: l2-normalize q and k over K first, x / sqrt(sum x^2 + 1e-6) (fla's
        use_qk_l2norm_in_kernel).
      mode: "chunk", "fused_recurrent" or "auto" (fused_recurrent for T <= 16, else chunk). Both
        modes compute the same function.
      chunk_size: 64 or 128 for mode "chunk"; None: the backend's default (xla: 64). The result
        does not depend on it beyond rounding.
      block_sizes: the backend's BlockSizes (performance only); None for "xla".
      backend: "auto", "mosaic_tpu", "pallas_gpu" or "xla". "mosaic_tpu" runs both modes (and a
        T = 1 decode kernel) at K, V in {64, 128, 256} in bfloat16 or float32; "pallas_gpu"
        runs mode "chunk", and "fused_recurrent" for T <= 16, on a Hopper GPU at K <= 128 in
        bfloat16 or float16; "auto" runs the
        platform's kernel backend where it takes the problem and "xla" elsewhere (with a
        one-time warning on a TPU or GPU).
      interpret: run a Pallas backend in interpret mode on CPU.
      sharding: None, or a `jax.sharding.NamedSharding` for q's [B, T, H, K] layout whose spec
        splits the batch and/or head dims (v, beta, g follow with their HV heads, so each
        device's value heads read its q, k heads): each device runs the op on its block
        (`jax.shard_map`, no communication). With None, q's own sharding is used where its type
        carries explicit mesh axes. A split time axis runs context parallel: per device one
        pass for the block's zero-state final state and [K, K] transition together, one
        all-gather of them, then the op from the true entering state (docs/scale_out.md).

    Returns:
      (o [B, T, HV, V] in v's dtype, final_state [B, HV, K, V] float32 (float64 for float64
      inputs) or None).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gla_tpu import ops
      >>> q = k = jnp.ones((1, 100, 2, 64))
      >>> v = jnp.ones((1, 100, 4, 32))
      >>> beta = jax.nn.sigmoid(jnp.ones((1, 100, 4)))
      >>> g = jax.nn.log_sigmoid(jnp.ones((1, 100, 4)))
      >>> o, s = ops.delta_rule(q, k, v, beta, g, use_qk_l2norm=True, output_final_state=True)
      >>> o.shape, s.shape
      ((1, 100, 4, 32), (1, 4, 64, 32))
    """
    problem, initial_state, segment_ids = validate_delta_rule(
        q, k, v, beta, g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, segment_ids=segment_ids,
        use_qk_l2norm=use_qk_l2norm, mode=mode, chunk_size=chunk_size,
    )
    g = floor_log_gates(g)  # -inf (a hard reset) and gates below -100 act as -100
    module, block_sizes = backends.dispatch("delta_rule", "delta_rule", backend, problem,
                                            block_sizes)
    chunk = module.CAPABILITIES.default_chunk_size(problem.key_dim)
    problem = problem.with_chunk_size(chunk)

    def run(q, k, v, beta, g, initial_state, segment_ids, problem=problem):
        return module.delta_rule(
            q, k, v, beta, g, problem=problem, initial_state=initial_state,
            segment_ids=segment_ids, block_sizes=block_sizes, interpret=interpret,
        )

    layout = resolve_sharding("delta_rule", sharding, q, batch=problem.batch,
                              heads=problem.num_heads, time=problem.seq_len)
    if layout is None:
        return run(q, k, v, beta, g, initial_state, segment_ids)

    def run_local(q, k, v, beta, g, initial_state, segment_ids,
                  output_final_state=output_final_state):
        local, initial_state, segment_ids = validate_delta_rule(
            q, k, v, beta, g, scale=problem.scale, initial_state=initial_state,
            output_final_state=output_final_state, segment_ids=segment_ids,
            use_qk_l2norm=use_qk_l2norm, mode=mode, chunk_size=chunk_size,
        )
        return run(q, k, v, beta, g, initial_state, segment_ids,
                   problem=local.with_chunk_size(chunk))

    spec = layout.spec("batch", "time", "heads", None)  # q, k, v, per-key g, o
    head_spec = layout.spec("batch", "time", "heads")  # beta, per-head g
    gate_spec = None if g is None else spec if g.ndim == 4 else head_spec
    state_spec = layout.spec("batch", "heads", None, None)
    args = (q, k, v, beta, g, initial_state, segment_ids)
    in_specs = (spec, spec, spec, head_spec, gate_spec,
                None if initial_state is None else state_spec,
                None if segment_ids is None else layout.spec("batch", "time"))
    if not layout.time_axes:
        return sharded_call(run_local, layout, args, in_specs,
                            (spec, state_spec if output_final_state else None))
    # Context parallelism: initial_state is read on every time shard, so its gradient is summed
    # over them; the final state comes out once per time shard and the last one's is returned.
    o, finals = sharded_call(
        context_parallel.local_pass(run_local, layout, functools.partial(
            _takes_value_dim, module, problem, block_sizes)), layout, args, in_specs,
        (spec, layout.spec("time", "batch", "heads", None, None)),
        grad_psum_axes=((), (), (), (), (), layout.time_axes, ()))
    if not output_final_state:
        return o, None
    if layout.explicit:
        # Explicit axes cannot slice one entry off the split time-shard axis: gather it first.
        finals = jax.reshard(finals, NamedSharding(layout.mesh, P(None, *state_spec)))
    return o, finals[-1]


def _takes_value_dim(module, problem, block_sizes, value_dim: int) -> bool:
    """Whether the backend takes `problem` with `value_dim` value columns from an initial state
    (context parallelism's state-and-transition run)."""
    wider = dataclasses.replace(problem, value_dim=value_dim, has_initial_state=True,
                                output_final_state=True)
    try:
        module.check_supported(wider, block_sizes)
    except NotImplementedError:
        return False
    return True


def _alias(mode: str, variant: str, name: str):
    """fla's function `name`: `delta_rule` with `mode` fixed and the gate of `variant` ("none",
    "head", "key") in fla's positional order, (q, k, v, beta) or (q, k, v, g, beta)."""

    def check(g, kwargs):
        if "mode" in kwargs:
            raise ValueError(
                f"mode is fixed to {mode!r} by {name}; got mode={kwargs['mode']!r}.")
        if gate_kind(g) != variant:
            raise ValueError(
                f"{name} takes {GATE_DESCRIPTIONS[variant]}; got g={describe(g)}. "
                "ops.delta_rule takes every gate shape.")

    if variant == "none":
        def op(q, k, v, beta, **kwargs):
            check(kwargs.get("g"), kwargs)
            return delta_rule(q, k, v, beta, mode=mode, **kwargs)
    else:
        def op(q, k, v, g, beta, **kwargs):
            check(g, kwargs)
            return delta_rule(q, k, v, beta, g, mode=mode, **kwargs)

    params = inspect.signature(delta_rule).parameters
    positional = ("q", "k", "v", "beta") if variant == "none" else ("q", "k", "v", "g", "beta")
    op.__signature__ = inspect.Signature(
        [params[n].replace(default=inspect.Parameter.empty) for n in positional]
        + [p for n, p in params.items() if n not in positional + ("g", "mode")])
    op.__name__ = op.__qualname__ = name
    op.__doc__ = (f"`delta_rule` with mode={mode!r} and {GATE_DESCRIPTIONS[variant]}, arguments "
                  "in flash-linear-attention's order (its name).")
    return op


chunk_delta_rule = _alias("chunk", "none", "chunk_delta_rule")
chunk_gated_delta_rule = _alias("chunk", "head", "chunk_gated_delta_rule")
chunk_kda = _alias("chunk", "key", "chunk_kda")
fused_recurrent_delta_rule = _alias("fused_recurrent", "none", "fused_recurrent_delta_rule")
fused_recurrent_gated_delta_rule = _alias("fused_recurrent", "head",
                                          "fused_recurrent_gated_delta_rule")
fused_recurrent_kda = _alias("fused_recurrent", "key", "fused_recurrent_kda")
