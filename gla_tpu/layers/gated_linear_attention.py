"""The gated linear attention layer as flash-linear-attention (fla) defines it, through `ops.gla`.

With key_dim = d_model * expand_k and value_dim = d_model * expand_v split over num_heads:
  q, k = phi(x W_q), phi(x W_k)             [B, T, H, K]  (phi: optional feature map)
  v = x W_v                                  [B, T, H, V]
  g = max(logsigmoid(gate(x)) / gate_logit_normalizer, clamp_min)
      gate "key":  gate(x) = (x W_g1) W_g2 + b_g2   low rank d_model -> 16 -> key_dim  [B, T, H, K]
      gate "head": gate(x) = x W_g + b_g            d_model -> num_heads (simple GLA)  [B, T, H]
      gate "none": no decay (linear attention)
  o, S = ops.gla(q, k, v, g, initial_state=S)   S: [B, H, K, V] float32
  y = (rms_norm_per_head(o) * swish(x W_r)) W_o  (without the output gate: rms_norm_per_head(o) W_o)

Decoding state: the recurrent state S. `apply` with a state feeds it as `initial_state` and
returns the final state; one token at a time runs ops.gla's "fused_recurrent" mode.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_tpu import ops
from gla_tpu.layers.basic import (
    check_input,
    check_positive,
    check_segment_ids,
    dense,
    dense_init,
    rms_norm,
    rms_norm_init,
)
from gla_tpu.ops.common import validation as checks
from gla_tpu.ops.common.backends import BACKENDS
from gla_tpu.ops.gla.validation import CHUNK_SIZES, MODES

GATES = ("key", "head", "none")
FEATURE_MAPS = {
    "relu": jax.nn.relu,
    "swish": jax.nn.silu,
    "elu_p1": lambda x: jax.nn.elu(x) + 1.0,
}


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int
    num_heads: int = 4
    expand_k: float = 0.5
    expand_v: float = 1.0
    gate: str = "key"  # "key" (GLA), "head" (simple GLA) or "none" (linear attention)
    gate_low_rank_dim: int = 16
    gate_logit_normalizer: float = 16.0
    clamp_min: float | None = None  # lower bound on g (a negative number), or None
    use_output_gate: bool = True
    feature_map: str | None = None  # None or a key of FEATURE_MAPS
    norm_eps: float = 1e-5
    mode: str = "auto"
    chunk_size: int | None = None
    backend: str = "auto"

    def __post_init__(self):
        check_positive("d_model", self.d_model)
        check_positive("num_heads", self.num_heads)
        check_positive("gate_low_rank_dim", self.gate_low_rank_dim)
        checks.check_choice("gate", self.gate, GATES)
        checks.check_choice("feature_map", self.feature_map, (None, *FEATURE_MAPS))
        checks.check_choice("mode", self.mode, MODES)
        checks.check_choice("chunk_size", self.chunk_size, (None, *CHUNK_SIZES))
        checks.check_choice("backend", self.backend, BACKENDS)
        for name in ("expand_k", "expand_v"):
            total = self.d_model * getattr(self, name)
            if total != int(total) or int(total) <= 0 or int(total) % self.num_heads:
                raise ValueError(
                    f"d_model * {name} = {self.d_model} * {getattr(self, name)} must be a positive "
                    f"integer multiple of num_heads={self.num_heads}."
                )
        if not self.gate_logit_normalizer > 0:
            raise ValueError(
                f"gate_logit_normalizer must be positive; got {self.gate_logit_normalizer!r}."
            )
        if self.clamp_min is not None and not self.clamp_min <= 0:
            raise ValueError(
                f"clamp_min must be None or <= 0 (g is a log gate); got {self.clamp_min!r}."
            )

    @property
    def key_dim(self) -> int:
        return int(self.d_model * self.expand_k)

    @property
    def value_dim(self) -> int:
        return int(self.d_model * self.expand_v)

    @property
    def head_k_dim(self) -> int:
        return self.key_dim // self.num_heads

    @property
    def head_v_dim(self) -> int:
        return self.value_dim // self.num_heads


def simple_gla_config(d_model: int, num_heads: int = 4, **kwargs) -> Config:
    """Simple GLA: one scalar gate per head and token, from a d_model -> num_heads projection."""
    return Config(d_model=d_model, num_heads=num_heads, gate="head", **kwargs)


def linear_attention_config(d_model: int, num_heads: int = 4, **kwargs) -> Config:
    """Linear attention: the same layer without a forget gate."""
    return Config(d_model=d_model, num_heads=num_heads, gate="none", **kwargs)


def init(key, config: Config):
    """A dict of float32 arrays: wq, wk [d_model, key_dim]; wv [d_model, value_dim]; the gate's
    weights (gate "key": w_gate_a [d_model, 16], w_gate_b [16, key_dim], b_gate [key_dim];
    gate "head": w_gate [d_model, H], b_gate [H]); w_out_gate [d_model, value_dim] with the output
    gate; norm {"scale": [head_v_dim]}; wo [value_dim, d_model]."""
    keys = iter(jax.random.split(key, 8))
    d, kd, vd = config.d_model, config.key_dim, config.value_dim
    params = {"wq": dense_init(next(keys), d, kd), "wk": dense_init(next(keys), d, kd),
              "wv": dense_init(next(keys), d, vd)}
    if config.gate == "key":
        params["w_gate_a"] = dense_init(next(keys), d, config.gate_low_rank_dim)
        params["w_gate_b"] = dense_init(next(keys), config.gate_low_rank_dim, kd)
        params["b_gate"] = jnp.zeros((kd,), jnp.float32)
    elif config.gate == "head":
        params["w_gate"] = dense_init(next(keys), d, config.num_heads)
        params["b_gate"] = jnp.zeros((config.num_heads,), jnp.float32)
    if config.use_output_gate:
        params["w_out_gate"] = dense_init(next(keys), d, vd)
    params["norm"] = rms_norm_init(config.head_v_dim)
    params["wo"] = dense_init(next(keys), vd, d)
    return params


def init_state(config: Config, batch: int):
    """A zero recurrent state [B, H, K, V] float32."""
    check_positive("batch", batch)
    return jnp.zeros((batch, config.num_heads, config.head_k_dim, config.head_v_dim), jnp.float32)


def log_gate(params, x, config: Config):
    """The log forget gate g <= 0 in float32: [B, T, H, K] ("key"), [B, T, H] ("head") or None."""
    b, t, _ = x.shape
    if config.gate == "none":
        return None
    if config.gate == "key":
        logits = dense(dense(x, params["w_gate_a"]), params["w_gate_b"], params["b_gate"])
        shape = (b, t, config.num_heads, config.head_k_dim)
    else:
        logits = dense(x, params["w_gate"], params["b_gate"])
        shape = (b, t, config.num_heads)
    g = jax.nn.log_sigmoid(logits.astype(jnp.float32)) / config.gate_logit_normalizer
    if config.clamp_min is not None:
        g = jnp.maximum(g, config.clamp_min)
    return g.reshape(shape)


def apply(params, x, config: Config, *, state=None, segment_ids=None, sharding=None):
    """Gated linear attention over a sequence.

    Args:
      params: from `init`.
      x: [B, T, d_model] activations (bfloat16 or float32).
      config: the layer's Config.
      state: None, or the recurrent state [B, H, K, V] (from `init_state` or a previous call),
        used as ops.gla's initial_state; the final state is then returned.
      segment_ids: [B, T] int ids for packed sequences: the state resets where the id changes
        (a given state applies to each row's first segment).
      sharding: None, or a NamedSharding over x's batch and time axes, e.g.
        NamedSharding(mesh, P("data", "seq")): ops.gla runs batch-sharded and, with a time axis,
        context parallel (docs/scale_out.md).
    Returns:
      (y [B, T, d_model] in x's dtype, the final state [B, H, K, V] float32, or None without state).

    Example:
      >>> cfg = Config(d_model=64, num_heads=4)
      >>> params = init(jax.random.key(0), cfg)
      >>> y, s = apply(params, jnp.ones((2, 16, 64), jnp.bfloat16), cfg, state=init_state(cfg, 2))
    """
    check_input("x", x, config.d_model)
    b, t, _ = x.shape
    check_segment_ids(segment_ids, b, t)
    h, kd, vd = config.num_heads, config.head_k_dim, config.head_v_dim
    with jax.named_scope(f"gated_linear_attention_{config.gate}"):
        q = dense(x, params["wq"])
        k = dense(x, params["wk"])
        if config.feature_map is not None:
            phi = FEATURE_MAPS[config.feature_map]
            q, k = phi(q), phi(k)
        q, k = q.reshape(b, t, h, kd), k.reshape(b, t, h, kd)
        v = dense(x, params["wv"]).reshape(b, t, h, vd)
        g = log_gate(params, x, config)
        # All modes compute the same function; one token is cheapest token by token.
        mode = "fused_recurrent" if t == 1 else config.mode
        o, new_state = ops.gla(
            q, k, v, g, initial_state=state, output_final_state=state is not None,
            segment_ids=segment_ids, mode=mode, chunk_size=config.chunk_size,
            backend=config.backend, sharding=sharding,
        )  # o: [B, T, H, V] in x's dtype
        o = rms_norm(params["norm"], o.astype(jnp.float32), eps=config.norm_eps)
        if config.use_output_gate:
            r = dense(x, params["w_out_gate"]).astype(jnp.float32).reshape(b, t, h, vd)
            o = o * jax.nn.silu(r)
        y = dense(o.astype(x.dtype).reshape(b, t, h * vd), params["wo"])
    return y, new_state
