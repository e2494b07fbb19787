"""Context-parallel GLA: the time axis split over mesh axes (docs/scale_out.md derives it).

Per device p, on its block of n = T / P tokens (inside `jax.shard_map`):
1. the single-device op from a zero state gives the block's outputs o' and final state S_p;
2. the block's total log decay d_p = sum_t g_t [B, H, K], and whether the carried state crosses
   the block (no segment starts in it, its first token included);
3. all-gather of (S_p, d_p, crosses_p) over the time axes, in float32: P x B x H x (K V + K)
   values per device, whatever T is;
4. the exclusive scan E_0 = initial_state, E_{j+1} = [crosses_j] exp(d_j) E_j + S_j gives each
   device its entering state E_p and every device the final state E_P;
5. the outputs take what E_p adds: o = o' + scale (q exp(b)) E_p for the tokens the entering
   state reaches (those before the block's first segment start), b the running sum of g inside
   the block (every exponent <= 0), in float32 and rounded once to the output dtype.
Autodiff runs through it all (`common/sharding.sharded_call` takes `jax.vjp` of this function per
device): the all-gathers transpose to reduce-scatters, the scan to the reversed scan.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from gla_tpu.ops.common.sharding import MeshLayout


def local_pass(run_local, layout: MeshLayout, scale: float):
    """The per-device function of a context-parallel call.

    Args:
      run_local: (q, k, v, g, initial_state, segment_ids, output_final_state) -> (o, final) on
        one device's block, the single-device op.
      layout: the mesh layout; layout.time_axes split T.
      scale: the op's output scale.
    Returns:
      local(q, k, v, g, initial_state, segment_ids) -> (o [B, n, H, V], final [1, B, H, K, V]
      float32: every device's copy of the final state, on a leading axis over the time axes).
    """
    axes, blocks = layout.time_axes, layout.time_shards

    def local(q, k, v, g, initial_state, segment_ids):
        b, n, h, kd = q.shape
        vd = v.shape[-1]
        p = lax.axis_index(axes)
        o_block, block_state = run_local(q, k, v, g, None, segment_ids, True)
        if g is None:
            running = jnp.zeros((b, n, h, kd), jnp.float32)
        else:
            running = jnp.cumsum(g.astype(jnp.float32), axis=1)  # [B, n, H, K] or [B, n, H]
            if g.ndim == 3:
                running = jnp.broadcast_to(running[..., None], (b, n, h, kd))
        decay = running[:, -1]  # [B, H, K]
        if segment_ids is None:
            enters = crosses = jnp.ones((b,), bool)
            reach = jnp.ones((b, n), bool)
        else:
            last_ids = lax.all_gather(segment_ids[:, -1], axes)  # [P, B]
            previous_last = last_ids[jnp.maximum(p - 1, 0)]
            # the block's first token continues the segment the previous block ended in
            enters = jnp.logical_or(p == 0, segment_ids[:, 0] == previous_last)
            starts = jnp.concatenate(
                [jnp.logical_not(enters)[:, None], segment_ids[:, 1:] != segment_ids[:, :-1]],
                axis=1)  # [B, n] a segment starts at the token
            reach = jnp.cumsum(starts.astype(jnp.int32), axis=1) == 0
            crosses = reach[:, -1]
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
        enter = jnp.stack(entering)[p]  # [B, H, K, V]
        q_decayed = q.astype(jnp.float32) * jnp.exp(running) * reach[:, :, None, None]
        carried_out = jnp.einsum("bthk,bhkv->bthv", q_decayed, enter,
                                 precision=lax.Precision.HIGHEST)
        o = (o_block.astype(jnp.float32) + scale * carried_out).astype(o_block.dtype)
        return o, state[None]

    return local
