"""Kimi Delta Attention (fla's `KimiDeltaAttention` layer), through `ops.delta_rule` with a
per-key gate.

H = num_heads q/k heads of K = head_dim (default d_model // H), HV = num_v_heads value heads
(default H; a multiple of H, GVA) of V = K * expand_v:
  q, k = silu(conv(x W_q)), silu(conv(x W_k))  [B, T, H, K]   (conv: short_conv of width conv_size;
  v    = silu(conv(x W_v))                     [B, T, HV, V]   without it silu(x W) directly)
  beta = sigmoid(x W_b)                        [B, T, HV]      (2 sigmoid with allow_neg_eigval)
  f    = (x W_f0) W_f1                         [B, T, HV, K]   low rank d_model -> V -> HV K
  g    = -exp(A_log[h]) * softplus(f + dt_bias)    [B, T, HV, K]   float32, g <= 0
  o, S = ops.delta_rule(q, k, v, beta, g, use_qk_l2norm=True, initial_state=S)
         (S_t = (I - beta k k^T) diag(exp(g)) S_{t-1} + beta k v^T)
  y    = (rms_norm_per_head(o) * sigmoid((x W_g0) W_g1 + b_g1)) W_o   low rank d_model -> V -> HV V

Initialization as fla's: A_log = log A, A ~ U(1, 16) per value head; dt_bias [HV K] =
softplus^-1(dt), dt ~ logU(0.001, 0.1) floored at 1e-4; g_proj_bias zeros; o_norm scale ones.

Decoding state: {"recurrent": [B, HV, K, V] float32, "conv_q", "conv_k": [B, conv_size-1, H K],
"conv_v": [B, conv_size-1, HV V]} (float32; no conv entries without short convolutions).

fla's state-dict keys -> ours (nn.Linear weight [out, in] -> ours [in, out] = W.T):
  q_proj.weight [H K, d]     -> q_proj [d, H K]        k_proj.weight -> k_proj [d, H K]
  v_proj.weight [HV V, d]    -> v_proj [d, HV V]       b_proj.weight [HV, d] -> b_proj [d, HV]
  f_proj.0.weight [V, d]     -> f_proj_a [d, V]
  f_proj.1.weight [HV K, V]  -> f_proj_b [V, HV K]
  g_proj.0.weight [V, d]     -> g_proj_a [d, V]
  g_proj.1.weight [HV V, V]  -> g_proj_b [V, HV V]
  g_proj.1.bias [HV V]       -> g_proj_bias [HV V]     o_norm.weight [V] -> o_norm["scale"] [V]
  o_proj.weight [d, HV V]    -> o_proj [HV V, d]
  A_log [HV] -> A_log [HV]                             dt_bias [HV K] -> dt_bias [HV K]
  {q,k,v}_conv1d.weight [C, 1, w] -> {q,k,v}_conv1d["weight"] [w, C], ours[i, c] = fla[c, 0, i]
  {q,k,v}_conv1d.bias [C] -> {q,k,v}_conv1d["bias"] (conv_bias=True only)
fla's safe_gate / lower_bound gate variant is not provided.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_tpu.layers import delta_common, qkv
from gla_tpu.layers.basic import dense, dense_init, rms_norm_init

A_INIT_RANGE = (1.0, 16.0)


@dataclasses.dataclass(frozen=True)
class Config(delta_common.HeadDims):
    d_model: int
    num_heads: int = 4
    head_dim: int | None = None  # K; default d_model // num_heads
    num_v_heads: int | None = None  # HV; default num_heads
    expand_v: float = 1.0  # V = head_dim * expand_v
    use_short_conv: bool = True
    conv_size: int = 4
    conv_bias: bool = False
    allow_neg_eigval: bool = False
    norm_eps: float = 1e-5
    mode: str = "auto"
    chunk_size: int | None = None
    backend: str = "auto"
    interpret: bool = False  # run a Pallas backend's kernels in interpret mode (on CPU)

    def __post_init__(self):
        delta_common.check_common(self)
        delta_common.check_head_dims(self)

    @property
    def gate_dim(self) -> int:
        """HV K: one decay per value head and key channel."""
        return self.v_heads * self.head_k_dim


def init(key, config: Config):
    """q_proj, k_proj [d, H K]; v_proj [d, HV V]; b_proj [d, HV]; f_proj_a [d, V], f_proj_b
    [V, HV K]; A_log [HV]; dt_bias [HV K]; g_proj_a [d, V], g_proj_b [V, HV V], g_proj_bias
    [HV V]; o_norm {"scale": [V]}; o_proj [HV V, d]; with short convolutions q_conv1d, k_conv1d,
    v_conv1d {"weight": [conv_size, C]}. All float32."""
    keys = jax.random.split(key, 8)
    d, hv, dv = config.d_model, config.v_heads, config.head_v_dim
    params = qkv.init(keys[0], config.qkv_spec())
    params["b_proj"] = dense_init(keys[1], d, hv)
    params["f_proj_a"] = dense_init(keys[2], d, dv)
    params["f_proj_b"] = dense_init(keys[3], dv, config.gate_dim)
    params.update(delta_common.init_decay(keys[4], hv, config.gate_dim, A_INIT_RANGE))
    params["g_proj_a"] = dense_init(keys[5], d, dv)
    params["g_proj_b"] = dense_init(keys[6], dv, config.value_dim)
    params["g_proj_bias"] = jnp.zeros((config.value_dim,), jnp.float32)
    params["o_norm"] = rms_norm_init(dv)
    params["o_proj"] = dense_init(keys[7], config.value_dim, d)
    return params


def init_state(config: Config, batch: int):
    """Zero decoding state: {"recurrent": [B, HV, K, V] float32, "conv_q", "conv_k", "conv_v"}."""
    return delta_common.init_state(config, batch)


def apply(params, x, config: Config, *, state=None, segment_ids=None, sharding=None):
    """Kimi Delta Attention over a sequence.

    Args:
      params: from `init`.
      x: [B, T, d_model] activations (bfloat16 or float32).
      config: the layer's Config.
      state: None, or a decoding state from `init_state` / a previous call to continue from.
      segment_ids: [B, T] int ids for packed sequences: the recurrent state resets and the short
        convolutions stop where the id changes (a given state applies to each row's first segment).
      sharding: None, or a NamedSharding over x's batch and time axes, given to ops.delta_rule.
    Returns:
      (y [B, T, d_model] in x's dtype, the new decoding state, or None without a state).

    Example:
      >>> cfg = Config(d_model=64, num_heads=4)
      >>> params = init(jax.random.key(0), cfg)
      >>> y, _ = apply(params, jnp.ones((2, 16, 64)), cfg)
    """
    delta_common.check_call(x, config, segment_ids)
    b, t, _ = x.shape
    hv, dk = config.v_heads, config.head_k_dim
    with jax.named_scope("kda"):
        (q, k, v), conv_state = delta_common.project(params, x, config, state=state,
                                                     segment_ids=segment_ids)
        beta = delta_common.beta(params, x, config)  # [B, T, HV] float32
        f = dense(dense(x, params["f_proj_a"]), params["f_proj_b"]).reshape(b, t, hv, dk)
        g = delta_common.decay(f, params["A_log"],
                               params["dt_bias"].reshape(hv, dk))  # [B, T, HV, K] float32
        o, recurrent = delta_common.recurrence(q, k, v, beta, g, config, state=state,
                                               segment_ids=segment_ids, sharding=sharding)
        gate = dense(dense(x, params["g_proj_a"]), params["g_proj_b"], params["g_proj_bias"])
        y = delta_common.output(params, o, gate, x, config, activation="sigmoid")
    return y, delta_common.new_state(state, recurrent, conv_state)
