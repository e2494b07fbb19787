"""SwiGLU feed-forward layer: y = (silu(x W_gate) * (x W_up)) W_down."""

from __future__ import annotations

import dataclasses

import jax

from gla_tpu.layers.basic import check_input, check_positive, dense, dense_init


def default_hidden(d_model: int) -> int:
    """8/3 d_model rounded up to a multiple of 8: the parameter count of a 4x two-matrix MLP."""
    return -(-(8 * d_model) // 3 // 8) * 8


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int
    hidden: int | None = None  # default: default_hidden(d_model)

    def __post_init__(self):
        check_positive("d_model", self.d_model)
        if self.hidden is not None:
            check_positive("hidden", self.hidden)

    @property
    def hidden_dim(self) -> int:
        return default_hidden(self.d_model) if self.hidden is None else self.hidden


def init(key, config: Config):
    """{"w_gate", "w_up": [d_model, hidden], "w_down": [hidden, d_model]}, float32."""
    k1, k2, k3 = jax.random.split(key, 3)
    d, f = config.d_model, config.hidden_dim
    return {"w_gate": dense_init(k1, d, f), "w_up": dense_init(k2, d, f),
            "w_down": dense_init(k3, f, d)}


def apply(params, x, config: Config):
    """[B, T, d_model] -> [B, T, d_model] in x's dtype.

    Example:
      >>> cfg = Config(d_model=64)
      >>> y = apply(init(jax.random.key(0), cfg), jnp.ones((2, 8, 64), jnp.bfloat16), cfg)
    """
    check_input("x", x, config.d_model)
    with jax.named_scope("swiglu_mlp"):
        h = jax.nn.silu(dense(x, params["w_gate"])) * dense(x, params["w_up"])
        return dense(h, params["w_down"])
