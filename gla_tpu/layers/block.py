"""Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.)); the attention kind is a
config field: "softmax" (multi_head_attention), "gla", "simple_gla" or "linear"
(gated_linear_attention with a per-key, per-head or no gate)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_tpu.layers import gated_linear_attention as gla_layer
from gla_tpu.layers import mlp
from gla_tpu.layers import multi_head_attention as mha
from gla_tpu.layers.basic import check_positive, rms_norm, rms_norm_init
from gla_tpu.ops.common import validation as checks
from gla_tpu.ops.common.backends import BACKENDS

ATTENTION_KINDS = ("softmax", "gla", "simple_gla", "linear")
_GATES = {"gla": "key", "simple_gla": "head", "linear": "none"}


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int
    num_heads: int
    attention: str = "softmax"  # one of ATTENTION_KINDS
    mlp_hidden: int | None = None  # default mlp.default_hidden(d_model)
    norm_eps: float = 1e-5
    backend: str = "auto"
    # softmax only
    num_kv_heads: int | None = None
    rope_base: float | None = 10000.0
    # linear kinds only (fla's GLA defaults)
    expand_k: float = 0.5
    expand_v: float = 1.0
    gate_logit_normalizer: float = 16.0
    clamp_min: float | None = None
    feature_map: str | None = None
    mode: str = "auto"

    def __post_init__(self):
        check_positive("d_model", self.d_model)
        checks.check_choice("attention", self.attention, ATTENTION_KINDS)
        checks.check_choice("backend", self.backend, BACKENDS)
        # Building the sub-configs validates every remaining field.
        self.attention_config()
        self.mlp_config()

    def attention_config(self) -> mha.Config | gla_layer.Config:
        if self.attention == "softmax":
            return mha.Config(d_model=self.d_model, num_heads=self.num_heads,
                              num_kv_heads=self.num_kv_heads, rope_base=self.rope_base,
                              backend=self.backend)
        return gla_layer.Config(
            d_model=self.d_model, num_heads=self.num_heads, expand_k=self.expand_k,
            expand_v=self.expand_v, gate=_GATES[self.attention],
            gate_logit_normalizer=self.gate_logit_normalizer, clamp_min=self.clamp_min,
            feature_map=self.feature_map, norm_eps=self.norm_eps, mode=self.mode,
            backend=self.backend,
        )

    def mlp_config(self) -> mlp.Config:
        return mlp.Config(d_model=self.d_model, hidden=self.mlp_hidden)

    def attention_module(self):
        return mha if self.attention == "softmax" else gla_layer


def init(key, config: Config):
    """{"attn_norm", "attn", "mlp_norm", "mlp"}, float32."""
    ka, km = jax.random.split(key)
    return {
        "attn_norm": rms_norm_init(config.d_model),
        "attn": config.attention_module().init(ka, config.attention_config()),
        "mlp_norm": rms_norm_init(config.d_model),
        "mlp": mlp.init(km, config.mlp_config()),
    }


def init_state(config: Config, batch: int, max_len: int, dtype=jnp.bfloat16):
    """The attention layer's decoding state: a KV cache (softmax) or a recurrent state."""
    if config.attention == "softmax":
        return mha.init_state(config.attention_config(), batch, max_len, dtype)
    return gla_layer.init_state(config.attention_config(), batch)


def apply(params, x, config: Config, *, state=None, segment_ids=None, sharding=None):
    """[B, T, d_model] -> ([B, T, d_model] in x's dtype, the attention layer's new state or None).

    `state`, `segment_ids` and `sharding` go to the attention layer (see its `apply`).
    """
    with jax.named_scope(f"block_{config.attention}"):
        h = rms_norm(params["attn_norm"], x, eps=config.norm_eps)
        a, new_state = config.attention_module().apply(
            params["attn"], h, config.attention_config(), state=state, segment_ids=segment_ids,
            sharding=sharding,
        )
        x = x + a
        h = rms_norm(params["mlp_norm"], x, eps=config.norm_eps)
        x = x + mlp.apply(params["mlp"], h, config.mlp_config())
    return x, new_state
