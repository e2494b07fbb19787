"""Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.)). The attention kind is a
config field:
  "softmax"         multi_head_attention (GQA, RoPE, optional sliding window and soft cap)
  "gla", "simple_gla", "linear"   gated_linear_attention with a per-key, per-head or no gate
  "gated_deltanet"  gated_deltanet (per-head decay)
  "kda"             kda (per-key decay)
  "deltanet"        deltanet (no decay)
`backend` and `interpret` (Pallas interpret mode) go to every kind's op.
Fields that the chosen kind does not use are ignored; `None` for expand_k, expand_v and
use_short_conv means the layer's own default (fla's). `attention_options` sets any other field of
the attention layer's Config, e.g. (("use_output_gate", False),) for a gla kind or
(("use_beta", False), ("qk_norm", "sum")) for deltanet.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_tpu.layers import deltanet, gated_deltanet, kda, mlp
from gla_tpu.layers import gated_linear_attention as gla_layer
from gla_tpu.layers import multi_head_attention as mha
from gla_tpu.layers.basic import check_positive, rms_norm, rms_norm_init
from gla_tpu.ops.common import validation as checks
from gla_tpu.ops.common.backends import BACKENDS

ATTENTION_KINDS = ("softmax", "gla", "simple_gla", "linear", "gated_deltanet", "kda", "deltanet")
_GATES = {"gla": "key", "simple_gla": "head", "linear": "none"}
_MODULES = {"softmax": mha, "gla": gla_layer, "simple_gla": gla_layer, "linear": gla_layer,
            "gated_deltanet": gated_deltanet, "kda": kda, "deltanet": deltanet}


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int
    num_heads: int
    attention: str = "softmax"  # one of ATTENTION_KINDS
    mlp_hidden: int | None = None  # default mlp.default_hidden(d_model)
    norm_eps: float = 1e-5
    backend: str = "auto"
    interpret: bool = False  # every kind: the Pallas backend's kernels in interpret mode (CPU)
    # softmax, and the k, v heads of the gla kinds
    num_kv_heads: int | None = None
    # softmax only
    rope_base: float | None = 10000.0
    window: int | None = None  # sliding window: the last `window` keys, the query's own included
    logits_soft_cap: float | None = None
    # softmax, gated_deltanet, kda: the head dim (None: d_model // num_heads)
    head_dim: int | None = None
    # recurrent kinds (None: the layer's default; gla kinds expand_k 0.5, expand_v 1;
    # deltanet 1, 1; gated_deltanet expand_v 2; kda expand_v 1)
    expand_k: float | None = None  # gla kinds, deltanet
    expand_v: float | None = None
    use_short_conv: bool | None = None  # None: off for the gla kinds, on for the delta rule
    conv_size: int = 4
    mode: str = "auto"
    # gla kinds only (fla's GLA defaults)
    gate_logit_normalizer: float = 16.0
    clamp_min: float | None = None
    feature_map: str | None = None
    # delta-rule kinds
    num_v_heads: int | None = None  # gated_deltanet, kda: value heads (GVA), default num_heads
    allow_neg_eigval: bool = False
    # More fields of the attention layer's Config, as (name, value) pairs (a dict is taken as
    # its sorted items); the names block sets from its own fields are not accepted here.
    attention_options: tuple[tuple[str, object], ...] = ()

    def __post_init__(self):
        check_positive("d_model", self.d_model)
        checks.check_choice("attention", self.attention, ATTENTION_KINDS)
        checks.check_choice("backend", self.backend, BACKENDS)
        checks.check_bool("interpret", self.interpret)
        if isinstance(self.attention_options, dict):
            object.__setattr__(self, "attention_options",
                               tuple(sorted(self.attention_options.items())))
        _check_options(self.attention_options)
        # Building the sub-configs validates every remaining field.
        self.attention_config()
        self.mlp_config()

    def attention_config(self):
        """The attention layer's Config (mha, gated_linear_attention, gated_deltanet, kda or
        deltanet)."""
        kind = self.attention
        if kind == "softmax":
            return self._layer_config(
                mha.Config, d_model=self.d_model, num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rope_base=self.rope_base,
                window=self.window, logits_soft_cap=self.logits_soft_cap, backend=self.backend,
                interpret=self.interpret)
        common = dict(d_model=self.d_model, num_heads=self.num_heads, norm_eps=self.norm_eps,
                      mode=self.mode, backend=self.backend, interpret=self.interpret,
                      conv_size=self.conv_size,
                      **_given(expand_v=self.expand_v, use_short_conv=self.use_short_conv))
        if kind in _GATES:
            return self._layer_config(
                gla_layer.Config, num_kv_heads=self.num_kv_heads, gate=_GATES[kind],
                gate_logit_normalizer=self.gate_logit_normalizer, clamp_min=self.clamp_min,
                feature_map=self.feature_map, **_given(expand_k=self.expand_k), **common)
        common["allow_neg_eigval"] = self.allow_neg_eigval
        if kind == "deltanet":
            return self._layer_config(deltanet.Config, **_given(expand_k=self.expand_k), **common)
        module = gated_deltanet if kind == "gated_deltanet" else kda
        return self._layer_config(module.Config, head_dim=self.head_dim,
                                  num_v_heads=self.num_v_heads, **common)

    def _layer_config(self, config_class, **fields):
        """config_class(**fields) with `attention_options` added (ValueError naming an option that
        block sets itself or that config_class lacks)."""
        options = dict(self.attention_options)
        names = {f.name for f in dataclasses.fields(config_class)}
        for name in options:
            if name in fields or (name in _BLOCK_FIELDS and name in names):
                raise ValueError(f"attention_options sets {name!r}, a field that block.Config "
                                 "sets itself: use block.Config's own field.")
            if name not in names:
                raise ValueError(
                    f"attention_options sets {name!r}, which the {self.attention!r} layer's "
                    f"Config ({config_class.__module__}) lacks; its fields: {sorted(names)}.")
        return config_class(**fields, **options)

    def mlp_config(self) -> mlp.Config:
        return mlp.Config(d_model=self.d_model, hidden=self.mlp_hidden)

    def attention_module(self):
        return _MODULES[self.attention]


# A layer field that block.Config also has is set through block's field, not attention_options.
_BLOCK_FIELDS = frozenset(f.name for f in dataclasses.fields(Config))


def _check_options(options) -> None:
    if not isinstance(options, tuple) or not all(
            isinstance(o, tuple) and len(o) == 2 and isinstance(o[0], str) for o in options):
        raise ValueError("attention_options must be a tuple of (name, value) pairs or a dict; "
                         f"got {options!r}.")
    names = [name for name, _ in options]
    if len(set(names)) != len(names):
        raise ValueError(f"attention_options names a field twice: {names}.")


def _given(**fields):
    """The fields that are not None (None: leave the layer's default)."""
    return {name: value for name, value in fields.items() if value is not None}


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
    """The attention layer's decoding state: a KV cache in `dtype` for `max_len` tokens (softmax),
    the recurrent state [B, H, K, V] float32 (gla kinds without short convolutions) or a dict
    {"recurrent", "conv_q", "conv_k", "conv_v"} (delta-rule kinds; gla kinds with convolutions)."""
    if config.attention == "softmax":
        return mha.init_state(config.attention_config(), batch, max_len, dtype)
    return config.attention_module().init_state(config.attention_config(), batch)


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
