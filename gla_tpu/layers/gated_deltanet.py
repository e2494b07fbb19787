"""Gated DeltaNet (fla's `GatedDeltaNet` layer), through `ops.delta_rule` with a per-head gate.

H = num_heads q/k heads of K = head_dim (default d_model // H), HV = num_v_heads value heads
(default H; a multiple of H, GVA: value head j reads q/k head j // (HV / H)) of V = K * expand_v:
  q, k = silu(conv(x W_q)), silu(conv(x W_k))  [B, T, H, K]   (conv: short_conv of width conv_size;
  v    = silu(conv(x W_v))                     [B, T, HV, V]   without it silu(x W) directly)
  beta = sigmoid(x W_b)                        [B, T, HV]      (2 sigmoid with allow_neg_eigval)
  g    = -exp(A_log) * softplus(x W_a + dt_bias)   [B, T, HV]  float32, g <= 0
  o, S = ops.delta_rule(q, k, v, beta, g, use_qk_l2norm=True, initial_state=S)
         (q, k l2-normalized per head; S_t = (I - beta k k^T) exp(g) S_{t-1} + beta k v^T)
  y    = (rms_norm_per_head(o) * silu(x W_g)) W_o      (use_gate=False: rms_norm_per_head(o) W_o)

Initialization as fla's: A_log = log A, A ~ U(0, 16) per value head; dt_bias = softplus^-1(dt),
dt ~ logU(0.001, 0.1) floored at 1e-4; o_norm scale ones; dense weights layers.basic.dense_init.

Decoding state: {"recurrent": [B, HV, K, V] float32, "conv_q", "conv_k": [B, conv_size-1, H K],
"conv_v": [B, conv_size-1, HV V]} (float32; no conv entries without short convolutions).

fla's state-dict keys -> ours (nn.Linear weight [out, in] -> ours [in, out] = W.T):
  q_proj.weight [H K, d]     -> q_proj [d, H K]        k_proj.weight -> k_proj [d, H K]
  v_proj.weight [HV V, d]    -> v_proj [d, HV V]       a_proj.weight [HV, d] -> a_proj [d, HV]
  b_proj.weight [HV, d]      -> b_proj [d, HV]         g_proj.weight [HV V, d] -> g_proj [d, HV V]
  o_proj.weight [d, HV V]    -> o_proj [HV V, d]       o_norm.weight [V] -> o_norm["scale"] [V]
  A_log [HV] -> A_log [HV]                             dt_bias [HV] -> dt_bias [HV]
  {q,k,v}_conv1d.weight [C, 1, w] -> {q,k,v}_conv1d["weight"] [w, C], ours[i, c] = fla[c, 0, i]
  {q,k,v}_conv1d.bias [C] -> {q,k,v}_conv1d["bias"] (conv_bias=True only)
"""

from __future__ import annotations

import dataclasses

import jax

from gla_tpu.layers import delta_common, qkv
from gla_tpu.layers.basic import dense, dense_init, rms_norm_init
from gla_tpu.ops.common import validation as checks

# fla's GatedDeltaNet draws A ~ U(0, 16) (KDA: U(1, 16)).
A_INIT_RANGE = (0.0, 16.0)


@dataclasses.dataclass(frozen=True)
class Config(delta_common.HeadDims):
    d_model: int
    num_heads: int = 4
    head_dim: int | None = None  # K; default d_model // num_heads
    num_v_heads: int | None = None  # HV; default num_heads
    expand_v: float = 2.0  # V = head_dim * expand_v
    use_gate: bool = True  # the SiLU output gate g_proj
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
        checks.check_bool("use_gate", self.use_gate)


def init(key, config: Config):
    """q_proj, k_proj [d, H K]; v_proj [d, HV V]; a_proj, b_proj [d, HV]; A_log, dt_bias [HV];
    g_proj [d, HV V] (use_gate); o_norm {"scale": [V]}; o_proj [HV V, d]; with short convolutions
    q_conv1d, k_conv1d, v_conv1d {"weight": [conv_size, C]}. All float32."""
    k_qkv, k_a, k_b, k_decay, k_g, k_o = jax.random.split(key, 6)
    d, hv = config.d_model, config.v_heads
    params = qkv.init(k_qkv, config.qkv_spec())
    params["a_proj"] = dense_init(k_a, d, hv)
    params["b_proj"] = dense_init(k_b, d, hv)
    params.update(delta_common.init_decay(k_decay, hv, hv, A_INIT_RANGE))
    if config.use_gate:
        params["g_proj"] = dense_init(k_g, d, config.value_dim)
    params["o_norm"] = rms_norm_init(config.head_v_dim)
    params["o_proj"] = dense_init(k_o, config.value_dim, d)
    return params


def init_state(config: Config, batch: int):
    """Zero decoding state: {"recurrent": [B, HV, K, V] float32, "conv_q", "conv_k", "conv_v"}."""
    return delta_common.init_state(config, batch)


def apply(params, x, config: Config, *, state=None, segment_ids=None, sharding=None):
    """Gated DeltaNet over a sequence.

    Args:
      params: from `init`.
      x: [B, T, d_model] activations (bfloat16 or float32).
      config: the layer's Config.
      state: None, or a decoding state from `init_state` / a previous call to continue from.
      segment_ids: [B, T] int ids for packed sequences: the recurrent state resets and the short
        convolutions stop where the id changes (a given state applies to each row's first segment).
      sharding: None, or a NamedSharding over x's batch and time axes, given to ops.delta_rule
        (a time axis runs it context parallel; docs/scale_out.md).
    Returns:
      (y [B, T, d_model] in x's dtype, the new decoding state, or None without a state).

    Example:
      >>> cfg = Config(d_model=64, num_heads=2, num_v_heads=4)
      >>> params = init(jax.random.key(0), cfg)
      >>> y, s = apply(params, jnp.ones((2, 16, 64)), cfg, state=init_state(cfg, 2))
    """
    delta_common.check_call(x, config, segment_ids)
    with jax.named_scope("gated_deltanet"):
        (q, k, v), conv_state = delta_common.project(params, x, config, state=state,
                                                     segment_ids=segment_ids)
        beta = delta_common.beta(params, x, config)  # [B, T, HV] float32
        g = delta_common.decay(dense(x, params["a_proj"]), params["A_log"],
                               params["dt_bias"])  # [B, T, HV] float32
        o, recurrent = delta_common.recurrence(q, k, v, beta, g, config, state=state,
                                               segment_ids=segment_ids, sharding=sharding)
        gate = dense(x, params["g_proj"]) if config.use_gate else None
        y = delta_common.output(params, o, gate, x, config, activation="swish")
    return y, delta_common.new_state(state, recurrent, conv_state)
