"""DeltaNet (fla's `DeltaNet` layer), through `ops.delta_rule` without a gate.

With key_dim = d_model * expand_k and value_dim = d_model * expand_v split over H = num_heads:
  q, k = phi(conv(x W_q)), phi(conv(x W_k))    [B, T, H, K]   phi = qk_activation: "silu" inside
  v    = silu(conv(x W_v))                     [B, T, H, V]   the convolution, "relu", "elu"
                                                              (elu + 1) or "identity" after it
  q, k = qk_norm: "l2" (in ops.delta_rule, use_qk_l2norm=True) or "sum" (x / sum(x) over K)
  beta = sigmoid(x W_b)                        [B, T, H]      (use_beta=False: ones; times 2 with
                                                              allow_neg_eigval)
  o, S = ops.delta_rule(q, k, v, beta, initial_state=S)
         (S_t = (I - beta k k^T) S_{t-1} + beta k v^T, o_t = S_t^T q_t / sqrt(K))
  y    = (rms_norm_per_head(o) * silu(x W_g)) W_o     (use_gate=False, fla's default:
                                                       rms_norm_per_head(o) W_o)
conv is short_conv of width conv_size; without short convolutions the activations apply to x W
directly (v: silu; q, k: silu only for qk_activation "silu", as fla).

Decoding state: {"recurrent": [B, H, K, V] float32, "conv_q", "conv_k": [B, conv_size-1, key_dim],
"conv_v": [B, conv_size-1, value_dim]} (float32; no conv entries without short convolutions).

fla's state-dict keys -> ours (nn.Linear weight [out, in] -> ours [in, out] = W.T):
  q_proj.weight [key_dim, d] -> q_proj [d, key_dim]    k_proj.weight -> k_proj [d, key_dim]
  v_proj.weight [value_dim, d] -> v_proj [d, value_dim]   b_proj.weight [H, d] -> b_proj [d, H]
  g_proj.weight [value_dim, d] -> g_proj (use_gate)    o_norm.weight [V] -> o_norm["scale"] [V]
  o_proj.weight [d, value_dim] -> o_proj [value_dim, d]
  {q,k,v}_conv1d.weight [C, 1, w] -> {q,k,v}_conv1d["weight"] [w, C], ours[i, c] = fla[c, 0, i]
  {q,k,v}_conv1d.bias [C] -> {q,k,v}_conv1d["bias"] (conv_bias=True only)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_tpu.layers import delta_common, qkv
from gla_tpu.layers.basic import ExpandedDims, dense, dense_init, rms_norm_init
from gla_tpu.ops.common import validation as checks

QK_ACTIVATIONS = {
    "silu": None,  # inside the short convolution (or directly on x W_q, x W_k without it)
    "relu": jax.nn.relu,
    "elu": lambda x: jax.nn.elu(x) + 1.0,
    "identity": lambda x: x,
}
QK_NORMS = ("l2", "sum")


@dataclasses.dataclass(frozen=True)
class Config(ExpandedDims):
    d_model: int
    num_heads: int = 4
    expand_k: float = 1.0
    expand_v: float = 1.0
    use_beta: bool = True
    use_gate: bool = False  # the SiLU output gate g_proj
    use_short_conv: bool = True
    conv_size: int = 4
    conv_bias: bool = False
    allow_neg_eigval: bool = False
    qk_activation: str = "silu"  # a key of QK_ACTIVATIONS
    qk_norm: str = "l2"  # "l2" or "sum"
    norm_eps: float = 1e-5
    mode: str = "auto"
    chunk_size: int | None = None
    backend: str = "auto"
    interpret: bool = False  # run a Pallas backend's kernels in interpret mode (on CPU)

    def __post_init__(self):
        delta_common.check_common(self)
        checks.check_bool("use_beta", self.use_beta)
        checks.check_bool("use_gate", self.use_gate)
        checks.check_choice("qk_activation", self.qk_activation, tuple(QK_ACTIVATIONS))
        checks.check_choice("qk_norm", self.qk_norm, QK_NORMS)
        for name in ("expand_k", "expand_v"):
            total = self.d_model * getattr(self, name)
            if total != int(total) or int(total) <= 0 or int(total) % self.num_heads:
                raise ValueError(
                    f"d_model * {name} = {self.d_model} * {getattr(self, name)!r} must be a "
                    f"positive integer multiple of num_heads={self.num_heads}.")

    @property
    def v_heads(self) -> int:
        return self.num_heads

    def qkv_spec(self) -> qkv.Spec:
        qk = "silu" if self.qk_activation == "silu" else None
        return qkv.Spec(d_model=self.d_model, dims=(self.key_dim, self.key_dim, self.value_dim),
                        activations=(qk, qk, "silu"),
                        conv_size=self.conv_size if self.use_short_conv else None,
                        conv_bias=self.conv_bias)


def init(key, config: Config):
    """q_proj, k_proj [d, key_dim]; v_proj [d, value_dim]; b_proj [d, H] (use_beta); g_proj
    [d, value_dim] (use_gate); o_norm {"scale": [V]}; o_proj [value_dim, d]; with short
    convolutions q_conv1d, k_conv1d, v_conv1d {"weight": [conv_size, C]}. All float32."""
    k_qkv, k_b, k_g, k_o = jax.random.split(key, 4)
    d = config.d_model
    params = qkv.init(k_qkv, config.qkv_spec())
    if config.use_beta:
        params["b_proj"] = dense_init(k_b, d, config.num_heads)
    if config.use_gate:
        params["g_proj"] = dense_init(k_g, d, config.value_dim)
    params["o_norm"] = rms_norm_init(config.head_v_dim)
    params["o_proj"] = dense_init(k_o, config.value_dim, d)
    return params


def init_state(config: Config, batch: int):
    """Zero decoding state: {"recurrent": [B, H, K, V] float32, "conv_q", "conv_k", "conv_v"}."""
    return delta_common.init_state(config, batch)


def apply(params, x, config: Config, *, state=None, segment_ids=None, sharding=None):
    """DeltaNet over a sequence.

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
    with jax.named_scope("deltanet"):
        (q, k, v), conv_state = delta_common.project(params, x, config, state=state,
                                                     segment_ids=segment_ids)
        phi = QK_ACTIVATIONS[config.qk_activation]
        if phi is not None:
            q, k = phi(q), phi(k)
        if config.qk_norm == "sum":
            q, k = (a / jnp.sum(a, axis=-1, keepdims=True) for a in (q, k))
        if config.use_beta:
            beta = delta_common.beta(params, x, config)  # [B, T, H] float32
        else:
            beta = jnp.full((b, t, config.num_heads), 2.0 if config.allow_neg_eigval else 1.0,
                            jnp.float32)
        o, recurrent = delta_common.recurrence(q, k, v, beta, None, config, state=state,
                                               segment_ids=segment_ids, sharding=sharding,
                                               use_qk_l2norm=config.qk_norm == "l2")
        gate = dense(x, params["g_proj"]) if config.use_gate else None
        y = delta_common.output(params, o, gate, x, config, activation="swish")
    return y, delta_common.new_state(state, recurrent, conv_state)
