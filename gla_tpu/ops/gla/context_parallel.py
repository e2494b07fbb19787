"""Context-parallel GLA: the time axis split over mesh axes (docs/scale_out.md derives it).

Per device p, on its block of n = T / P tokens (inside `jax.shard_map`):
1. the block's final state from a zero state, S_p = sum_t exp(sum_{s > t} g_s) k_t^T v_t over the
   tokens after the block's last segment start: one [K, n] x [n, V] product per head on the
   tensor cores (float32 accumulation), and its total log decay d_p = sum_t g_t [B, H, K];
2. all-gather of (S_p, d_p, flags) over the time axes: P x B x H x (K V + K) float32 values per
   device, whatever T is;
3. the exclusive scan E_0 = initial_state, E_{j+1} = [no segment starts inside block j]
   exp(d_j) [block j enters] E_j + S_j gives each device its entering state E_p and every device
   the final state E_P;
4. the single-device op from E_p (zero where the block's first token starts a new segment) gives
   the outputs, on whichever kernels the backend has.
One pass of the op per device, plus step 1. Where the backend has states-only kernel passes
(pallas_gpu's pair-level kernels), step 1 is its forward pass and the backward (a custom_vjp
per device) mirrors the forward: D_p = d(sum o . do)/dE_p by its reversed pass, one all-gather
of D_p, the reverse scan into the cotangent of the state leaving the block
(`common/context_parallel.leaving_state_cotangent`), and the op's own backward with (do, that
cotangent), which also gives dE_p. Elsewhere step 1 is the closed form below and autodiff runs
through it all (`common/sharding.sharded_call` takes `jax.vjp` of this function per device).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from gla_tpu.ops.common.chunk_cumsum import reverse_exclusive_cumsum
from gla_tpu.ops.common.context_parallel import (block_enters, entering_state,
                                                  leaving_state_cotangent)
from gla_tpu.ops.common.gates import floor_log_gates
from gla_tpu.ops.common.sharding import MeshLayout


def _state_dtype(dtype):
    return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


def block_decay(g, segment_ids, shape, dtype):
    """(d [B, H, K] in `dtype`, keeps [B]): the block's total log decay, and whether no segment
    starts inside it after its first token; shape: k's [B, n, H, K]."""
    b, _, h, kd = shape
    keeps = jnp.ones((b,), bool)
    if segment_ids is not None:
        keeps = jnp.all(segment_ids[:, 1:] == segment_ids[:, :-1], axis=1)
    if g is None:
        return jnp.zeros((b, h, kd), dtype), keeps
    g = g.astype(dtype)
    total = jnp.sum(g[..., None] if g.ndim == 3 else g, axis=1)  # [B, H, K or 1]
    return jnp.broadcast_to(total, (b, h, kd)), keeps


def zero_state_of_block(k, v, g, segment_ids):
    """(S [B, H, K, V], d [B, H, K], keeps [B]): the block's final state from a zero state, its
    total log decay, and whether no segment starts inside it after its first token.

    k [B, n, H, K], v [B, n, H, V] in the inputs' dtype; g None, [B, n, H] or [B, n, H, K],
    floored (common/gates.py)."""
    b, n, h, kd = k.shape
    sd = _state_dtype(k.dtype)
    total, keeps = block_decay(g, segment_ids, k.shape, sd)
    if g is None:
        to_end = jnp.zeros((b, n, h, 1), sd)
    else:
        g = g.astype(sd)
        g = g[..., None] if g.ndim == 3 else g  # [B, n, H, K or 1]
        to_end = reverse_exclusive_cumsum(g).astype(sd)  # [B, n, H, K or 1], every entry <= 0
    weight = jnp.exp(to_end)
    if segment_ids is not None:
        starts = segment_ids[:, 1:] != segment_ids[:, :-1]  # [B, n - 1]: a start at token t + 1
        # token t reaches the block's end iff no segment starts after it
        later = jnp.flip(jnp.cumsum(jnp.flip(starts.astype(jnp.int32), 1), axis=1), 1)
        reaches = jnp.concatenate([later == 0, jnp.ones((b, 1), bool)], axis=1)  # [B, n]
        weight = weight * reaches[:, :, None, None]
    decayed = k.astype(sd) * weight  # [B, n, H, K]
    if jnp.dtype(k.dtype).itemsize == 2:  # the tensor cores' operands, float32 accumulation
        state = jnp.einsum("bthk,bthv->bhkv", decayed.astype(k.dtype), v,
                           preferred_element_type=sd)
    else:
        state = jnp.einsum("bthk,bthv->bhkv", decayed, v.astype(sd),
                           precision=lax.Precision.HIGHEST)
    return state, total, keeps


def entering_cotangent_of_block(q, do, g, segment_ids, scale):
    """D [B, H, K, V]: the cotangent of the state entering the block from the block's own
    outputs, d(sum_t o_t . do_t)/dE = sum_t scale exp(G_t) q_t^T do_t over the tokens of the
    block's first segment, G_t = sum_{s <= t} g_s the gates from the block's start through t
    ([B, H, K] rows scaled per key). The mirror of `zero_state_of_block`.

    q [B, n, H, K], do [B, n, H, V]; g None, [B, n, H] or [B, n, H, K], floored."""
    b, n, h, kd = q.shape
    sd = _state_dtype(q.dtype)
    if g is None:
        from_start = jnp.zeros((b, n, h, 1), sd)
    else:
        g = g.astype(sd)
        g = g[..., None] if g.ndim == 3 else g  # [B, n, H, K or 1]
        # the sum over s < t is the reversed sequence's sum over later entries; then g_t itself
        before = jnp.flip(reverse_exclusive_cumsum(jnp.flip(g, 1)), 1).astype(sd)
        from_start = before + g  # every entry <= 0
    weight = jnp.exp(from_start)
    if segment_ids is not None:
        starts = segment_ids[:, 1:] != segment_ids[:, :-1]  # [B, n - 1]: a start at token t + 1
        first = jnp.concatenate([jnp.ones((b, 1), bool),
                                 jnp.cumsum(starts.astype(jnp.int32), axis=1) == 0], axis=1)
        weight = weight * first[:, :, None, None]  # token t reads E iff no start in (0, t]
    lifted = q.astype(sd) * weight * jnp.asarray(scale, sd)  # [B, n, H, K]
    if jnp.dtype(q.dtype).itemsize == 2:  # the tensor cores' operands, float32 accumulation
        return jnp.einsum("bthk,bthv->bhkv", lifted.astype(q.dtype), do.astype(q.dtype),
                          preferred_element_type=sd)
    return jnp.einsum("bthk,bthv->bhkv", lifted, do.astype(sd), precision=lax.Precision.HIGHEST)


def local_pass(run_local, layout: MeshLayout, scale, states_pass=None):
    """The per-device function of a context-parallel call.

    Forward: the block's state from zero, one all-gather, the scan into the entering state E_p,
    and one run of the op from E_p. Where the backend has states-only passes for the block
    (`states_pass` returns arrays), S_p comes from its forward pass and the backward is a rule of
    its own (a custom_vjp): D_p from its reversed pass, one all-gather, the reverse scan into the
    cotangent of the state leaving the block, and the op's own backward taking it with do.
    Elsewhere S_p is `zero_state_of_block`'s closed form and autodiff differentiates it all.

    Args:
      run_local: (q, k, v, g, initial_state, segment_ids, output_final_state) -> (o, final) on
        one device's block, the single-device op.
      layout: the mesh layout; layout.time_axes split T.
      scale: the op's query scale.
      states_pass: None, or (kind, x, y, g, segment_ids) -> the backend's states-only pass on
        the block, or None where it has none for it: kind "zero_state" (x = k, y = v) gives S_p,
        "entering_cotangent" (x = q, y = do) D_p, both [B, H, K, V] float32.
    Returns:
      local(q, k, v, g, initial_state, segment_ids) -> (o [B, n, H, V], final [1, B, H, K, V]
      float32: every device's copy of the final state, on a leading axis over the time axes).
    """
    axes, blocks = layout.time_axes, layout.time_shards

    def carry_of(decays, keeping):
        def carry(j, state):  # through block j: its decay, or nothing after a segment start
            kept = jnp.exp(decays[j])[..., None] * state
            return jnp.where(keeping[j][:, None, None, None], kept, 0.0)
        return carry

    def scan(block_state, decay, keeps, initial, enters, shape):
        """(E_p, E_P, the gathered decays and flags) from this block's S_p and decay."""
        b, h, kd, vd = shape
        sd = block_state.dtype
        decays = lax.all_gather(decay, axes)  # [P, B, H, K]
        keeping = lax.all_gather(keeps, axes)  # [P, B]
        start = jnp.zeros((b, h, kd, vd), sd) if initial is None else initial.astype(sd)
        enter, final = entering_state(start, block_state, carry_of(decays, keeping), enters,
                                      axes, blocks)
        return enter, final, decays, keeping

    def local(q, k, v, g, initial_state, segment_ids):
        b, _, h, kd = q.shape
        shape = (b, h, kd, v.shape[-1])
        sd = _state_dtype(q.dtype)
        gates = floor_log_gates(g)
        enters = block_enters(segment_ids, axes, b)
        stopped = [None if x is None else lax.stop_gradient(x) for x in (k, v, gates)]
        block_state = (None if states_pass is None
                       else states_pass("zero_state", *stopped, segment_ids))
        if block_state is None:  # the closed form, differentiated
            block_state, decay, keeps = zero_state_of_block(k, v, gates, segment_ids)
            enter, final, _, _ = scan(block_state, decay, keeps, initial_state, enters, shape)
            o, _ = run_local(q, k, v, g, enter, segment_ids, False)
            return o, final[None]
        block_state = block_state.astype(sd)
        has_initial = initial_state is not None
        k_shape = k.shape  # static

        def entering(g, initial, block_state, segment_ids, enters):
            decay, keeps = block_decay(floor_log_gates(g), segment_ids, k_shape, sd)
            return scan(block_state, decay, keeps, initial, enters, shape)

        # what the backward reads is passed in, not closed over: it is traced apart
        @jax.custom_vjp
        def attend(q, k, v, g, initial, block_state, segment_ids, enters):
            enter, final, _, _ = entering(g, initial, block_state, segment_ids, enters)
            o, _ = run_local(q, k, v, g, enter, segment_ids, False)
            return o, final[None]

        def forward(q, k, v, g, initial, block_state, segment_ids, enters):
            enter, final, decays, keeping = entering(g, initial, block_state, segment_ids,
                                                     enters)
            (o, _), pullback = jax.vjp(
                lambda q, k, v, g, e: run_local(q, k, v, g, e, segment_ids, True),
                q, k, v, g, enter)
            return (o, final[None]), (pullback, decays, keeping, q, g, segment_ids, enters)

        def attend_bwd(residuals, cotangents):
            pullback, decays, keeping, q, g, segment_ids, enters = residuals
            do, dfinal = cotangents
            own = states_pass("entering_cotangent", q, do, floor_log_gates(g), segment_ids)
            # the final state's cotangent reaches the copy that leaves the call (one device)
            dfinal = lax.psum(dfinal[0].astype(sd), axes)
            leaving, _ = leaving_state_cotangent(own.astype(sd), carry_of(decays, keeping),
                                                 enters, dfinal, axes, blocks)
            dq, dk, dv, dg, denter = pullback((do, leaving.astype(jnp.float32)))
            # the initial state enters the first block only (summed over the time axes outside)
            dinitial = None
            if has_initial:
                first = lax.axis_index(axes) == 0
                dinitial = jnp.where(first, denter, 0.0).astype(initial_state.dtype)
            return dq, dk, dv, dg, dinitial, None, None, None

        attend.defvjp(forward, attend_bwd)
        return attend(q, k, v, g, initial_state, block_state, segment_ids, enters)

    return local
