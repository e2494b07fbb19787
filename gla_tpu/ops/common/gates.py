"""Log forget gates at their floor: a gate below GATE_FLOOR, -inf (log 0, a hard reset) included,
acts as GATE_FLOOR.

exp(GATE_FLOOR) = 4e-44 is a reset at every precision: what it keeps of the state is 16 orders
below float32's rounding of the terms it is added to, 27 below float64's (and 0 on a TPU, which
flushes float32 denormals). Every decay is exp of a sum of gates, and the gradient with respect to
a gate at the floor is such an exp times other factors, so the floor changes outputs and gradients
by nothing the dtypes can hold. Without it, a -inf gate turns the difference of two running sums
into -inf - (-inf) = NaN; a floor of -100 rather than lower keeps the chunk-local running sums
small, where float32 rounds their differences finely (at -1e3 per reset, float32 decays after two
resets in one chunk carry 1e-4 relative errors).
"""

from __future__ import annotations

import jax.numpy as jnp

GATE_FLOOR = -100.0


def floor_log_gates(g):
    """g (None, or an array of log gates) with every entry below GATE_FLOOR set to it."""
    if g is None:
        return None
    return jnp.where(g < GATE_FLOOR, jnp.asarray(GATE_FLOOR, g.dtype), g)
