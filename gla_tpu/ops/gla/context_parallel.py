"""Context-parallel GLA: the time axis split over mesh axes (docs/scale_out.md derives it).

Per device p, on its block of n_t = T / P tokens (inside `jax.shard_map`):
1. the single-device op from a zero state gives the block's final state S_p [B, H, K, V];
2. the block's total log decay d_p = sum_t g_t [B, H, K], and whether the carried state crosses
   the block (no segment starts in it, its first token included);
3. all-gather of (S_p, d_p, crosses_p) over the time axes, in float32: P x B x H x (K V + K)
   values per device, whatever T is;
4. the exclusive scan E_0 = initial_state, E_{j+1} = [crosses_j] exp(d_j) E_j + S_j gives each
   device its entering state E_p and every device the final state E_P;
5. the single-device op again from E_p (zero where the block's first token starts a new segment)
   gives the exact outputs.
Step 5 repeats the block's forward once more rather than correcting the outputs with
scale (q exp(b)) E_p; the outputs are then the kernel's own, rounded once. Autodiff runs through
it all (`common/sharding.sharded_call` takes `jax.vjp` of this function per device): the
all-gathers transpose to reduce-scatters, the scan to the reversed scan.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from gla_tpu.ops.common.sharding import MeshLayout


def local_pass(run_local, layout: MeshLayout):
    """The per-device function of a context-parallel call.

    Args:
      run_local: (q, k, v, g, initial_state, segment_ids, output_final_state) -> (o, final) on
        one device's block, the single-device op.
      layout: the mesh layout; layout.time_axes split T.
    Returns:
      local(q, k, v, g, initial_state, segment_ids) -> (o [B, n_t, H, V], final [1, B, H, K, V]
      float32: every device's copy of the final state, on a leading axis over the time axes).
    """
    axes, blocks = layout.time_axes, layout.time_shards

    def local(q, k, v, g, initial_state, segment_ids):
        b, _, h, kd = q.shape
        vd = v.shape[-1]
        p = lax.axis_index(axes)
        _, block_state = run_local(q, k, v, g, None, segment_ids, True)  # [B, H, K, V] f32
        if g is None:
            decay = jnp.zeros((b, h, kd), jnp.float32)
        else:
            decay = jnp.sum(g.astype(jnp.float32), axis=1)  # [B, H, K] or [B, H]
            if g.ndim == 3:
                decay = jnp.broadcast_to(decay[..., None], (b, h, kd))
        if segment_ids is None:
            enters = crosses = jnp.ones((b,), bool)
        else:
            last_ids = lax.all_gather(segment_ids[:, -1], axes)  # [P, B]
            previous_last = last_ids[jnp.maximum(p - 1, 0)]
            # the block's first token continues the segment the previous block ended in
            enters = jnp.logical_or(p == 0, segment_ids[:, 0] == previous_last)
            crosses = jnp.logical_and(enters, jnp.all(segment_ids == segment_ids[:, :1], axis=1))
        states = lax.all_gather(block_state, axes)  # [P, B, H, K, V]
        decays = lax.all_gather(decay, axes)  # [P, B, H, K]
        crossing = lax.all_gather(crosses, axes)  # [P, B]
        state = (jnp.zeros((b, h, kd, vd), jnp.float32) if initial_state is None
                 else initial_state.astype(jnp.float32))
        entering = []
        for j in range(blocks):
            entering.append(state)
            carried = jnp.exp(decays[j])[..., None] * state
            state = jnp.where(crossing[j][:, None, None, None], carried, 0.0) + states[j]
        enter = jnp.stack(entering)[p] * enters[:, None, None, None].astype(jnp.float32)
        o, _ = run_local(q, k, v, g, enter, segment_ids, False)
        return o, state[None]

    return local
