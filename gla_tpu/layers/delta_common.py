"""What the delta-rule layers (deltanet, gated_deltanet, kda) share, each step as fla computes it:

  q, k, v    layers.qkv: projections, SiLU short convolutions       [B, T, H, K], [B, T, HV, V]
  beta       sigmoid(x W_b) per value head (2 sigmoid with allow_neg_eigval)   [B, T, HV] float32
  g          -exp(A_log) * softplus(logits + dt_bias): the Mamba-2 style decay of Gated DeltaNet
             (per value head) and KDA (per value head and key channel), float32
  o, S       ops.delta_rule(q, k, v, beta, g, use_qk_l2norm=..., initial_state=S)
  y          (rms_norm_per_head(o) * act(output gate)) W_o     (fla's FusedRMSNormGated, o_norm)

Each layer's Config provides num_heads (H, q and k heads), v_heads (HV), head_k_dim (K),
head_v_dim (V), key_dim (H K), value_dim (HV V), qkv_spec(), allow_neg_eigval, norm_eps, mode,
chunk_size, backend and interpret (ops.delta_rule's: a Pallas backend in interpret mode).

Decoding state of every delta-rule layer: {"recurrent": [B, HV, K, V] float32} plus, with short
convolutions, {"conv_q": [B, w-1, key_dim], "conv_k": [B, w-1, key_dim], "conv_v": [B, w-1,
value_dim]} float32 (w = conv_size). fla's own recurrent state is [B, HV, V, K] in its
state_v_first layout, ours [B, HV, K, V]: ours = swapaxes(fla's, -1, -2).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gla_tpu import ops
from gla_tpu.layers import qkv
from gla_tpu.layers.basic import (
    check_input,
    check_positive,
    check_segment_ids,
    dense,
    gated_rms_norm,
)
from gla_tpu.ops.common import validation as checks
from gla_tpu.ops.common.backends import BACKENDS
from gla_tpu.ops.delta_rule.validation import CHUNK_SIZES, MODES

# fla's decay initialization (Mamba-2's): dt ~ logU(DT_MIN, DT_MAX), floored at DT_FLOOR,
# stored as dt_bias = softplus^-1(dt).
DT_MIN, DT_MAX, DT_FLOOR = 0.001, 0.1, 1e-4


class HeadDims:
    """The dims of Gated DeltaNet and KDA, from the Config fields d_model, num_heads, head_dim,
    num_v_heads, expand_v, use_short_conv, conv_size, conv_bias (a mixin of those Configs)."""

    @property
    def v_heads(self) -> int:
        """HV, the value heads (num_v_heads, default num_heads)."""
        return self.num_heads if self.num_v_heads is None else self.num_v_heads

    @property
    def head_k_dim(self) -> int:
        """K (head_dim, default d_model // num_heads)."""
        return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def head_v_dim(self) -> int:
        """V = K * expand_v."""
        return int(self.head_k_dim * self.expand_v)

    @property
    def key_dim(self) -> int:
        return self.num_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.head_v_dim

    def qkv_spec(self) -> qkv.Spec:
        """q, k, v projections with SiLU (inside the short convolutions when they are on)."""
        return qkv.Spec(d_model=self.d_model, dims=(self.key_dim, self.key_dim, self.value_dim),
                        activations=("silu", "silu", "silu"),
                        conv_size=self.conv_size if self.use_short_conv else None,
                        conv_bias=self.conv_bias)


def check_common(config) -> None:
    """Validates the fields every delta-rule Config has (ValueError naming the field)."""
    check_positive("d_model", config.d_model)
    check_positive("num_heads", config.num_heads)
    check_positive("conv_size", config.conv_size)
    for name in ("use_short_conv", "conv_bias", "allow_neg_eigval", "interpret"):
        checks.check_bool(name, getattr(config, name))
    if not config.norm_eps > 0:
        raise ValueError(f"norm_eps must be positive; got {config.norm_eps!r}.")
    checks.check_choice("mode", config.mode, MODES)
    checks.check_choice("chunk_size", config.chunk_size, (None, *CHUNK_SIZES))
    checks.check_choice("backend", config.backend, BACKENDS)


def check_head_dims(config) -> None:
    """Gated DeltaNet / KDA dims: head_dim (None: d_model // num_heads), head_v_dim = head_dim *
    expand_v a positive integer, num_v_heads (None: num_heads) a multiple of num_heads."""
    if config.head_dim is None:
        if config.d_model % config.num_heads:
            raise ValueError(f"d_model={config.d_model} must be a multiple of "
                             f"num_heads={config.num_heads} unless head_dim is given.")
    else:
        check_positive("head_dim", config.head_dim)
    if config.num_v_heads is not None:
        check_positive("num_v_heads", config.num_v_heads)
        if config.num_v_heads % config.num_heads:
            raise ValueError(f"num_v_heads={config.num_v_heads} must be a multiple of "
                             f"num_heads={config.num_heads}.")
    v = config.head_k_dim * config.expand_v
    if not v > 0 or v != int(v):
        raise ValueError(f"head_dim * expand_v = {config.head_k_dim} * {config.expand_v!r} must be "
                         "a positive integer (the value head dim).")


def init_decay(key, num_v_heads: int, dt_size: int, a_range: tuple[float, float]):
    """{"A_log": log A, A ~ U(a_range) [HV]; "dt_bias": softplus^-1(dt) [dt_size]}, float32, dt ~
    logU(0.001, 0.1) floored at 1e-4 (fla's initialization)."""
    k_a, k_dt = jax.random.split(key)
    a = jax.random.uniform(k_a, (num_v_heads,), jnp.float32, *a_range)
    # U(0, 16) can draw 0 exactly; keep log A finite.
    a = jnp.maximum(a, jnp.finfo(jnp.float32).tiny)
    u = jax.random.uniform(k_dt, (dt_size,), jnp.float32)
    dt = jnp.maximum(jnp.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)),
                     DT_FLOOR)
    # softplus^-1(dt) = log(exp(dt) - 1) = dt + log(1 - exp(-dt))
    return {"A_log": jnp.log(a), "dt_bias": dt + jnp.log(-jnp.expm1(-dt))}


def decay(logits, a_log, dt_bias):
    """g = -exp(A_log) * softplus(logits + dt_bias) <= 0 in float32.

    Args:
      logits: [B, T, HV] (Gated DeltaNet) or [B, T, HV, K] (KDA), any float dtype.
      a_log: [HV]; dt_bias: [HV] or [HV, K] (the trailing shape of logits).
    """
    z = logits.astype(jnp.float32) + dt_bias.astype(jnp.float32)[None, None]
    a = jnp.exp(a_log.astype(jnp.float32)).reshape(a_log.shape + (1,) * (logits.ndim - 3))
    return -a[None, None] * jax.nn.softplus(z)


def beta(params, x, config):
    """sigmoid(x W_b) [B, T, HV] float32 (times 2 with allow_neg_eigval: beta in (0, 2))."""
    b = jax.nn.sigmoid(dense(x, params["b_proj"]).astype(jnp.float32))
    return 2.0 * b if config.allow_neg_eigval else b


def init_state(config, batch: int):
    """{"recurrent": zeros [B, HV, K, V] float32} plus the zero short-convolution states."""
    check_positive("batch", batch)
    recurrent = jnp.zeros((batch, config.v_heads, config.head_k_dim, config.head_v_dim),
                          jnp.float32)
    return {"recurrent": recurrent, **qkv.init_state(config.qkv_spec(), batch)}


def check_call(x, config, segment_ids) -> None:
    check_input("x", x, config.d_model)
    check_segment_ids(segment_ids, x.shape[0], x.shape[1])


def project(params, x, config, *, state, segment_ids):
    """(q [B, T, H, K], k [B, T, H, K], v [B, T, HV, V]) in x's dtype, and the new convolution
    states (layers.qkv)."""
    b, t, _ = x.shape
    (q, k, v), conv_state = qkv.apply(params, x, config.qkv_spec(), state=state,
                                      segment_ids=segment_ids)
    q = q.reshape(b, t, config.num_heads, config.head_k_dim)
    k = k.reshape(b, t, config.num_heads, config.head_k_dim)
    v = v.reshape(b, t, config.v_heads, config.head_v_dim)
    return (q, k, v), conv_state


def recurrence(q, k, v, beta_, g, config, *, state, segment_ids, sharding, use_qk_l2norm=True):
    """ops.delta_rule from the state's "recurrent" entry: (o [B, T, HV, V] in v's dtype, the new
    recurrent state [B, HV, K, V] float32, or None without a state)."""
    # All modes compute the same function; one token is cheapest token by token.
    mode = "fused_recurrent" if q.shape[1] == 1 else config.mode
    return ops.delta_rule(
        q, k, v, beta_, g, initial_state=None if state is None else state["recurrent"],
        output_final_state=state is not None, segment_ids=segment_ids,
        use_qk_l2norm=use_qk_l2norm, mode=mode, chunk_size=config.chunk_size,
        backend=config.backend, interpret=config.interpret, sharding=sharding)


def output(params, o, gate, x, config, *, activation: str = "swish"):
    """y = (rms_norm_per_head(o) * activation(gate)) W_o, or rms_norm_per_head(o) W_o when gate
    is None: [B, T, d_model] in x's dtype.

    Args:
      o: [B, T, HV, V]; gate: None or [B, T, HV * V] (any float dtype).
    """
    b, t, hv, dv = o.shape
    if gate is not None:
        gate = gate.reshape(b, t, hv, dv)
    o = gated_rms_norm(params["o_norm"], o, gate, activation=activation, eps=config.norm_eps)
    return dense(o.astype(x.dtype).reshape(b, t, hv * dv), params["o_proj"])


def new_state(state, recurrent, conv_state):
    """The layer's returned state: None without a given state, else {"recurrent", conv ...}."""
    if state is None:
        return None
    return {"recurrent": recurrent, **conv_state}
