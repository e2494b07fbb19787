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
One pass of the op per device, plus step 1's product. Autodiff runs through it all
(`common/sharding.sharded_call` takes `jax.vjp` of this function per device): the op's own
backward gives d E_p, the all-gathers transpose to reduce-scatters, the scan runs reversed.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from gla_tpu.ops.common.chunk_cumsum import reverse_exclusive_cumsum
from gla_tpu.ops.common.context_parallel import block_enters, entering_state
from gla_tpu.ops.common.gates import floor_log_gates
from gla_tpu.ops.common.sharding import MeshLayout


def _state_dtype(dtype):
    return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


def zero_state_of_block(k, v, g, segment_ids):
    """(S [B, H, K, V], d [B, H, K], keeps [B]): the block's final state from a zero state, its
    total log decay, and whether no segment starts inside it after its first token.

    k [B, n, H, K], v [B, n, H, V] in the inputs' dtype; g None, [B, n, H] or [B, n, H, K],
    floored (common/gates.py)."""
    b, n, h, kd = k.shape
    sd = _state_dtype(k.dtype)
    if g is None:
        to_end = jnp.zeros((b, n, h, 1), sd)
        total = jnp.zeros((b, h, kd), sd)
    else:
        g = g.astype(sd)
        g = g[..., None] if g.ndim == 3 else g  # [B, n, H, K or 1]
        to_end = reverse_exclusive_cumsum(g).astype(sd)  # [B, n, H, K or 1], every entry <= 0
        total = jnp.broadcast_to(jnp.sum(g, axis=1), (b, h, kd))
    weight = jnp.exp(to_end)
    keeps = jnp.ones((b,), bool)
    if segment_ids is not None:
        starts = segment_ids[:, 1:] != segment_ids[:, :-1]  # [B, n - 1]: a start at token t + 1
        # token t reaches the block's end iff no segment starts after it
        later = jnp.flip(jnp.cumsum(jnp.flip(starts.astype(jnp.int32), 1), axis=1), 1)
        reaches = jnp.concatenate([later == 0, jnp.ones((b, 1), bool)], axis=1)  # [B, n]
        weight = weight * reaches[:, :, None, None]
        keeps = jnp.logical_not(jnp.any(starts, axis=1))
    decayed = k.astype(sd) * weight  # [B, n, H, K]
    if jnp.dtype(k.dtype).itemsize == 2:  # the tensor cores' operands, float32 accumulation
        state = jnp.einsum("bthk,bthv->bhkv", decayed.astype(k.dtype), v,
                           preferred_element_type=sd)
    else:
        state = jnp.einsum("bthk,bthv->bhkv", decayed, v.astype(sd),
                           precision=lax.Precision.HIGHEST)
    return state, total, keeps


def local_pass(run_local, layout: MeshLayout):
    """The per-device function of a context-parallel call.

    Args:
      run_local: (q, k, v, g, initial_state, segment_ids, output_final_state) -> (o, final) on
        one device's block, the single-device op.
      layout: the mesh layout; layout.time_axes split T.
    Returns:
      local(q, k, v, g, initial_state, segment_ids) -> (o [B, n, H, V], final [1, B, H, K, V]
      float32: every device's copy of the final state, on a leading axis over the time axes).
    """
    axes, blocks = layout.time_axes, layout.time_shards

    def local(q, k, v, g, initial_state, segment_ids):
        b, _, h, kd = q.shape
        vd = v.shape[-1]
        sd = _state_dtype(q.dtype)
        block_state, decay, keeps = zero_state_of_block(k, v, floor_log_gates(g), segment_ids)
        decays = lax.all_gather(decay, axes)  # [P, B, H, K]
        keeping = lax.all_gather(keeps, axes)  # [P, B]

        def carry(j, state):  # through block j: its decay, or nothing after a segment start
            kept = jnp.exp(decays[j])[..., None] * state
            return jnp.where(keeping[j][:, None, None, None], kept, 0.0)

        initial = (jnp.zeros((b, h, kd, vd), sd) if initial_state is None
                   else initial_state.astype(sd))
        enter, final = entering_state(initial, block_state, carry,
                                      block_enters(segment_ids, axes, b), axes, blocks)
        o, _ = run_local(q, k, v, g, enter, segment_ids, False)
        return o, final[None]

    return local
