"""The gated linear attention layer as flash-linear-attention (fla) defines it, through `ops.gla`.

With key_dim = d_model * expand_k and value_dim = d_model * expand_v split over num_heads (K and V
per head), and Hkv = num_kv_heads key/value heads (default num_heads):
  q = phi(c_q(x W_q))                        [B, T, H, K]    (phi: optional feature map)
  k = phi(c_k(x W_k)), v = c_v(x W_v)        [B, T, Hkv, K], [B, T, Hkv, V], then each kv head
                                             repeated H / Hkv times (head i reads kv head
                                             i // (H / Hkv))
      c: with use_short_conv, silu(causal depthwise conv of width conv_size) (layers.short_conv);
      without, the identity
  g = max(logsigmoid(gate(x)) / gate_logit_normalizer, clamp_min)
      gate "key":  gate(x) = (x W_g1) W_g2 + b_g2   low rank d_model -> 16 -> Hkv K  [B, T, Hkv, K],
                   repeated like k
      gate "head": gate(x) = x W_g + b_g            d_model -> num_heads (simple GLA)  [B, T, H]
      gate "none": no decay (linear attention)
  o, S = ops.gla(q, k, v, g, initial_state=S)   S: [B, H, K, V] float32 (backend, interpret)
  y = (rms_norm_per_head(o) * swish(x W_r)) W_o  (without the output gate: rms_norm_per_head(o) W_o)

Decoding state: without short convolutions the recurrent state S [B, H, K, V] float32 itself;
with them a dict {"recurrent": S, "conv_q": [B, conv_size-1, key_dim], "conv_k": [B, conv_size-1,
Hkv K], "conv_v": [B, conv_size-1, Hkv V]} (the convolutions' last inputs, float32). `apply` with
a state continues from it and returns the new one; one token at a time runs ops.gla's
"fused_recurrent" mode.

fla's state-dict keys (nn.Linear weights are [out, in]; ours are [in, out]):
  q_proj.weight [key_dim, d] -> wq = W.T      k_proj.weight -> wk      v_proj.weight -> wv
  gk_proj.0.weight [16, d] -> w_gate_a = W.T   gk_proj.1.weight -> w_gate_b
  gk_proj.1.bias -> b_gate
  g_proj.weight -> w_out_gate    g_norm_swish_gate.weight (or g_norm.weight) -> norm["scale"]
  o_proj.weight -> wo            {q,k,v}_conv1d.weight [C, 1, w] -> {q,k,v}_conv1d["weight"][i, c]
                                 = W[c, 0, i] (layers.short_conv)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_tpu import ops
from gla_tpu.layers import qkv
from gla_tpu.layers.basic import (
    ExpandedDims,
    check_input,
    check_positive,
    check_segment_ids,
    dense,
    dense_init,
    gated_rms_norm,
    repeat_heads,
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
class Config(ExpandedDims):
    d_model: int
    num_heads: int = 4
    num_kv_heads: int | None = None  # default num_heads; fewer share k, v (and a "key" gate)
    expand_k: float = 0.5
    expand_v: float = 1.0
    gate: str = "key"  # "key" (GLA), "head" (simple GLA) or "none" (linear attention)
    gate_low_rank_dim: int = 16
    gate_logit_normalizer: float = 16.0
    clamp_min: float | None = None  # lower bound on g (a negative number), or None
    use_output_gate: bool = True
    feature_map: str | None = None  # None or a key of FEATURE_MAPS
    use_short_conv: bool = False  # SiLU short convolutions on q, k, v (fla's default is off)
    conv_size: int = 4
    conv_bias: bool = False
    norm_eps: float = 1e-5
    mode: str = "auto"
    chunk_size: int | None = None
    backend: str = "auto"
    interpret: bool = False  # run a Pallas backend's kernels in interpret mode (on CPU)

    def __post_init__(self):
        check_positive("d_model", self.d_model)
        check_positive("num_heads", self.num_heads)
        check_positive("gate_low_rank_dim", self.gate_low_rank_dim)
        if self.num_kv_heads is not None:
            check_positive("num_kv_heads", self.num_kv_heads)
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                                 f"num_kv_heads={self.num_kv_heads}.")
        checks.check_bool("use_short_conv", self.use_short_conv)
        checks.check_bool("conv_bias", self.conv_bias)
        check_positive("conv_size", self.conv_size)
        checks.check_choice("gate", self.gate, GATES)
        checks.check_choice("feature_map", self.feature_map, (None, *FEATURE_MAPS))
        checks.check_choice("mode", self.mode, MODES)
        checks.check_choice("chunk_size", self.chunk_size, (None, *CHUNK_SIZES))
        checks.check_choice("backend", self.backend, BACKENDS)
        checks.check_bool("interpret", self.interpret)
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
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def qkv_spec(self) -> qkv.Spec:
        """The q, k, v projections (k and v at kv_heads heads) and their short convolutions."""
        act = "silu" if self.use_short_conv else None
        return qkv.Spec(
            d_model=self.d_model,
            dims=(self.key_dim, self.kv_heads * self.head_k_dim, self.kv_heads * self.head_v_dim),
            activations=(act, act, act), conv_size=self.conv_size if self.use_short_conv else None,
            conv_bias=self.conv_bias, proj_names=("wq", "wk", "wv"))


def simple_gla_config(d_model: int, num_heads: int = 4, **kwargs) -> Config:
    """Simple GLA: one scalar gate per head and token, from a d_model -> num_heads projection."""
    return Config(d_model=d_model, num_heads=num_heads, gate="head", **kwargs)


def linear_attention_config(d_model: int, num_heads: int = 4, **kwargs) -> Config:
    """Linear attention: the same layer without a forget gate."""
    return Config(d_model=d_model, num_heads=num_heads, gate="none", **kwargs)


def init(key, config: Config):
    """A dict of float32 arrays: wq [d_model, key_dim]; wk [d_model, Hkv K]; wv [d_model, Hkv V];
    the gate's weights (gate "key": w_gate_a [d_model, 16], w_gate_b [16, Hkv K], b_gate [Hkv K];
    gate "head": w_gate [d_model, H], b_gate [H]); w_out_gate [d_model, value_dim] with the output
    gate; norm {"scale": [head_v_dim]}; wo [value_dim, d_model]; with short convolutions
    q_conv1d, k_conv1d, v_conv1d ({"weight": [conv_size, channels]}, layers.short_conv)."""
    all_keys = jax.random.split(key, 8)
    # The convolutions take the last key, so the other parameters do not depend on use_short_conv.
    keys, conv_key = iter(all_keys[:7]), all_keys[7]
    d, spec = config.d_model, config.qkv_spec()
    kd, kvd, vd = spec.dims[1], spec.dims[2], config.value_dim
    params = {"wq": dense_init(next(keys), d, config.key_dim), "wk": dense_init(next(keys), d, kd),
              "wv": dense_init(next(keys), d, kvd)}
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
    params.update(qkv.init_convs(conv_key, spec))  # {} without short convolutions
    return params


def init_state(config: Config, batch: int):
    """A zero decoding state: the recurrent state [B, H, K, V] float32, or with short convolutions
    {"recurrent": that, "conv_q", "conv_k", "conv_v": zeros [B, conv_size-1, channels] float32}."""
    check_positive("batch", batch)
    recurrent = jnp.zeros((batch, config.num_heads, config.head_k_dim, config.head_v_dim),
                          jnp.float32)
    if not config.use_short_conv:
        return recurrent
    return {"recurrent": recurrent, **qkv.init_state(config.qkv_spec(), batch)}


def log_gate(params, x, config: Config):
    """The log forget gate g <= 0 in float32: [B, T, Hkv, K] ("key"), [B, T, H] ("head") or None."""
    b, t, _ = x.shape
    if config.gate == "none":
        return None
    if config.gate == "key":
        logits = dense(dense(x, params["w_gate_a"]), params["w_gate_b"], params["b_gate"])
        shape = (b, t, config.kv_heads, config.head_k_dim)
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
      state: None, or the decoding state (from `init_state` or a previous call): the recurrent
        state [B, H, K, V] used as ops.gla's initial_state, or with short convolutions the dict
        {"recurrent", "conv_q", "conv_k", "conv_v"}; the new state is then returned.
      segment_ids: [B, T] int ids for packed sequences: the state resets where the id changes
        and the convolutions stop there (a given state applies to each row's first segment).
      sharding: None, or a NamedSharding over x's batch and time axes, e.g.
        NamedSharding(mesh, P("data", "seq")): ops.gla runs batch-sharded and, with a time axis,
        context parallel (docs/scale_out.md).
    Returns:
      (y [B, T, d_model] in x's dtype, the new state (as `init_state` makes it), or None without
      state).

    Example:
      >>> cfg = Config(d_model=64, num_heads=4)
      >>> params = init(jax.random.key(0), cfg)
      >>> y, s = apply(params, jnp.ones((2, 16, 64), jnp.bfloat16), cfg, state=init_state(cfg, 2))
    """
    check_input("x", x, config.d_model)
    b, t, _ = x.shape
    check_segment_ids(segment_ids, b, t)
    h, hkv, kd, vd = config.num_heads, config.kv_heads, config.head_k_dim, config.head_v_dim
    groups = h // hkv
    if config.use_short_conv:
        recurrent = None if state is None else state["recurrent"]
    else:
        recurrent = state
    with jax.named_scope(f"gated_linear_attention_{config.gate}"):
        (q, k, v), conv_state = qkv.apply(params, x, config.qkv_spec(), state=state,
                                          segment_ids=segment_ids)
        if config.feature_map is not None:
            phi = FEATURE_MAPS[config.feature_map]
            q, k = phi(q), phi(k)
        q = q.reshape(b, t, h, kd)
        k = repeat_heads(k.reshape(b, t, hkv, kd), groups)  # [B, T, H, K]
        v = repeat_heads(v.reshape(b, t, hkv, vd), groups)  # [B, T, H, V]
        g = log_gate(params, x, config)
        if config.gate == "key":
            g = repeat_heads(g, groups)  # [B, T, H, K]
        # All modes compute the same function; one token is cheapest token by token.
        mode = "fused_recurrent" if t == 1 else config.mode
        o, new_recurrent = ops.gla(
            q, k, v, g, initial_state=recurrent, output_final_state=state is not None,
            segment_ids=segment_ids, mode=mode, chunk_size=config.chunk_size,
            backend=config.backend, interpret=config.interpret, sharding=sharding,
        )  # o: [B, T, H, V] in x's dtype
        r = None
        if config.use_output_gate:
            r = dense(x, params["w_out_gate"]).reshape(b, t, h, vd)
        o = gated_rms_norm(params["norm"], o, r, activation="swish", eps=config.norm_eps)
        y = dense(o.astype(x.dtype).reshape(b, t, h * vd), params["wo"])
    if state is None or not config.use_short_conv:
        return y, new_recurrent
    return y, {"recurrent": new_recurrent, **conv_state}
