"""AdamW in plain JAX (decoupled weight decay on matrices only), with global-norm clipping.

optax.adamw is an equivalent drop-in where optax is installed; it is not a dependency.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Config:
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to leaves of rank >= 2 (not to norms and biases)
    clip_norm: float | None = 1.0  # global gradient norm bound, or None

    def __post_init__(self):
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1); got {getattr(self, name)!r}.")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be None or positive; got {self.clip_norm!r}.")


def init(params):
    """{"m", "v": zeros like params (float32), "count": int32 []}."""
    zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return {"m": zeros, "v": zeros, "count": jnp.zeros((), jnp.int32)}


def global_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                        for x in jax.tree_util.tree_leaves(tree)))


def update(params, grads, state, lr, config: Config = Config()):
    """One AdamW step: returns (new_params, new_state). `lr` may be a traced scalar (schedules)."""
    if config.clip_norm is not None:
        norm = global_norm(grads)
        factor = jnp.minimum(1.0, config.clip_norm / jnp.maximum(norm, 1e-12))
        grads = jax.tree_util.tree_map(lambda g: g * factor, grads)
    count = state["count"] + 1
    m = jax.tree_util.tree_map(lambda m, g: config.b1 * m + (1 - config.b1) * g, state["m"], grads)
    v = jax.tree_util.tree_map(lambda v, g: config.b2 * v + (1 - config.b2) * g * g,
                               state["v"], grads)
    c1 = 1 - config.b1 ** count.astype(jnp.float32)
    c2 = 1 - config.b2 ** count.astype(jnp.float32)

    def step(p, m, v):
        decay = config.weight_decay if p.ndim >= 2 else 0.0
        return p - lr * ((m / c1) / (jnp.sqrt(v / c2) + config.eps) + decay * p)

    new_params = jax.tree_util.tree_map(step, params, m, v)
    return new_params, {"m": m, "v": v, "count": count}
