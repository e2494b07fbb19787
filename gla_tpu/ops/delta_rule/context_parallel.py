"""Context-parallel delta rule: the time axis split over mesh axes (docs/scale_out.md).

The delta rule's state update is affine in the entering state: over a block of n tokens,
S_out = M S_in + S_zero, with M [K, K] the block's transition (the product of the tokens'
(I - beta k k^T) diag(exp(g)), zero after a segment start) and S_zero the block's final state
from a zero state. Per device p, on its block (inside `jax.shard_map`):
1-2. one run of the single-device op on the values [v, 0] ([B, n, HV, V + K]) from the state
   [0, I] ([B, HV, K, V + K]) gives both: a value column evolves on its own (u's columns read
   only the state's), so the first V columns of its final state are S_zero [B, HV, K, V] (real
   values from a zero state) and the last K are M [B, HV, K, K] (zero values from the identity:
   S -> (I - beta k k^T) D S, the state part of the update). Where the backend does not take
   V + K value columns, two runs: from a zero state, and on zero values (V = K) from I;
3. all-gather of (S_zero, M, whether the carried state enters the block) over the time axes, in
   float32 (float64 for float64 inputs): P x B x HV x K x (V + K) values per device, whatever T
   is;
4. the exclusive scan E_0 = initial_state, E_{j+1} = M_j [enters_j] E_j + S_zero_j gives each
   device its entering state E_p and every device the final state E_P;
5. the op from E_p (zero where a segment starts at the block's first token) gives the outputs.
Two runs of the op per device (three where V + K is refused), on whichever kernels the backend
has. Autodiff runs through it
all (`common/sharding.sharded_call` takes `jax.vjp` of this function per device): the
all-gathers transpose to reduce-scatters, the scan to the reversed scan.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from gla_tpu.ops.common.context_parallel import block_enters, entering_state
from gla_tpu.ops.common.sharding import MeshLayout
from gla_tpu.ops.delta_rule.validation import state_dtype


def local_pass(run_local, layout: MeshLayout, takes_value_dim=lambda value_dim: True):
    """The per-device function of a context-parallel call.

    Args:
      run_local: (q, k, v, beta, g, initial_state, segment_ids, output_final_state) -> (o, final)
        on one device's block, the single-device op.
      layout: the mesh layout; layout.time_axes split T.
      takes_value_dim: whether the backend takes V + K value columns (the block's state and
        transition in one run).
    Returns:
      local(q, k, v, beta, g, initial_state, segment_ids) -> (o [B, n, HV, V], final
      [1, B, HV, K, V] float32: every device's copy of the final state, on a leading axis over
      the time axes).
    """
    axes, blocks = layout.time_axes, layout.time_shards

    def local(q, k, v, beta, g, initial_state, segment_ids):
        b, n, _, kd = q.shape
        hv, vd = v.shape[2], v.shape[3]
        sd = state_dtype(q.dtype)
        identity = jnp.broadcast_to(jnp.eye(kd, dtype=sd), (b, hv, kd, kd))
        no_values = jnp.zeros((b, n, hv, kd), v.dtype)
        if takes_value_dim(vd + kd):
            both = jnp.concatenate([jnp.zeros((b, hv, kd, vd), sd), identity], axis=-1)
            _, final = run_local(q, k, jnp.concatenate([v, no_values], axis=-1), beta, g, both,
                                 segment_ids, True)  # [B, HV, K, V + K]
            from_zero, transition = final[..., :vd], final[..., vd:]
        else:
            _, from_zero = run_local(q, k, v, beta, g, None, segment_ids, True)  # [B, HV, K, V]
            _, transition = run_local(q, k, no_values, beta, g, identity, segment_ids,
                                      True)  # [B, HV, K, K]
        transitions = lax.all_gather(transition.astype(sd), axes)  # [P, B, HV, K, K]

        def carry(j, state):  # through block j
            return jnp.einsum("bhij,bhjv->bhiv", transitions[j], state,
                              precision=lax.Precision.HIGHEST)

        initial = (jnp.zeros((b, hv, kd, vd), sd) if initial_state is None
                   else initial_state.astype(sd))
        enter, final = entering_state(initial, from_zero.astype(sd), carry,
                                      block_enters(segment_ids, axes, b), axes, blocks)
        o, _ = run_local(q, k, v, beta, g, enter, segment_ids, False)
        return o, final[None]

    return local
