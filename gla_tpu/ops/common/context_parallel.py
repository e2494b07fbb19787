"""What the context-parallel ops share (docs/scale_out.md): whether the carried state enters a
device's block, the exclusive scan of the blocks' states over the time axes, and its reverse for
the backward.

Every function runs inside `jax.shard_map` over the mesh's time axes: device p holds block p of
the time axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def block_enters(segment_ids, axes, batch: int):
    """[B] bool: whether the state carried from the blocks before enters this device's block
    (its first token continues the segment the previous block ended in; always on the first
    device, where the carried state is the initial state)."""
    if segment_ids is None:
        return jnp.ones((batch,), bool)
    p = lax.axis_index(axes)
    last_ids = lax.all_gather(segment_ids[:, -1], axes)  # [P, B]
    return jnp.logical_or(p == 0, segment_ids[:, 0] == last_ids[jnp.maximum(p - 1, 0)])


def entering_state(initial, block_states, carry, enters, axes, blocks: int):
    """The exclusive scan E_0 = initial, E_{j+1} = carry(j, [enters_j] E_j) + S_j.

    Args:
      initial: [B, H, K, V] the initial state (zeros for None), in the state dtype.
      block_states: S_p [B, H, K, V], this device's block's final state from a zero state.
      carry: (j, state) -> the state carried through block j (the block's transition).
      enters: [B] bool, this device's `block_enters`.
      axes, blocks: the time axes and the number of blocks P over them.
    Returns:
      (E_p [B, H, K, V] this device's entering state, zero where the carried state does not
      enter, and E_P, the final state after every block). One all-gather each of S_p and the
      flags; `carry` gathers what else it needs.
    """
    states = lax.all_gather(block_states, axes)  # [P, B, H, K, V]
    flags = lax.all_gather(enters, axes)  # [P, B]
    state, entering = initial, []
    for j in range(blocks):
        state = jnp.where(flags[j][:, None, None, None], state, 0.0)
        entering.append(state)
        state = carry(j, state) + states[j]
    return jnp.stack(entering)[lax.axis_index(axes)], state


def leaving_state_cotangent(entering_cotangent, carry, enters, final_cotangent, axes,
                            blocks: int):
    """The reverse of `entering_state`: the cotangent of the state leaving this device's block.

    With D_j the cotangent of E_j from block j's own outputs, and c_j the cotangent of the state
    after block j (c_{P-1} that of the final state E_P):
        c_{j-1} = [enters_j] (D_j + carry_j^T c_j),
    carry_j^T the transpose of the (linear) `carry(j, .)`.

    Args:
      entering_cotangent: D_p [B, H, K, V], this device's.
      carry, enters, axes, blocks: as `entering_state`'s.
      final_cotangent: [B, H, K, V], the cotangent of E_P (the same on every device).
    Returns:
      (c_p, c_{-1}): the cotangent of this device's leaving state, and that of the initial state.
      One all-gather each of D_p and the flags.
    """
    cotangents = lax.all_gather(entering_cotangent, axes)  # [P, B, H, K, V]
    flags = lax.all_gather(enters, axes)  # [P, B]
    after, leaving = final_cotangent, [None] * blocks
    for j in reversed(range(blocks)):
        leaving[j] = after
        (through,) = jax.linear_transpose(functools.partial(carry, j), after)(after)
        after = jnp.where(flags[j][:, None, None, None], cotangents[j] + through, 0.0)
    return jnp.stack(leaving)[lax.axis_index(axes)], after
