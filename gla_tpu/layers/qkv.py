"""The q, k, v projections of the linear-attention layers, each optionally followed by a short
convolution, as fla's GatedLinearAttention, DeltaNet, GatedDeltaNet and KimiDeltaAttention do:

  with short convolutions:  q = act_q(conv_q(x W_q)),  k = act_k(conv_k(x W_k)),
                            v = act_v(conv_v(x W_v))
  without:                  q = act_q(x W_q), k = act_k(x W_k), v = act_v(x W_v)

act is SiLU or the identity per projection (inside the convolution, as fla's ShortConvolution
applies it). The convolutions' decoding states sit in the layer's state dict under "conv_q",
"conv_k", "conv_v" (short_conv: [B, width-1, channels], float32).
"""

from __future__ import annotations

import dataclasses

import jax

from gla_tpu.layers import short_conv
from gla_tpu.layers.basic import dense, dense_init

NAMES = ("q", "k", "v")
STATE_KEYS = tuple(f"conv_{n}" for n in NAMES)
_ACTIVATIONS = {"silu": jax.nn.silu, None: lambda x: x}


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a layer's q, k, v projections are (built by the layer's Config, not by users)."""

    d_model: int
    dims: tuple[int, int, int]  # output widths of the q, k, v projections
    activations: tuple[str | None, str | None, str | None]  # "silu" or None per projection
    conv_size: int | None  # the short convolutions' width; None: no convolutions
    conv_bias: bool = False
    proj_names: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj")

    def conv_config(self, i: int) -> short_conv.Config:
        return short_conv.Config(channels=self.dims[i], width=self.conv_size,
                                 activation=self.activations[i], bias=self.conv_bias)


def conv_name(i: int) -> str:
    """fla's module name of projection i's convolution: "q_conv1d", "k_conv1d", "v_conv1d"."""
    return f"{NAMES[i]}_conv1d"


def init(key, spec: Spec):
    """{proj_names[i]: [d_model, dims[i]]} and the convolutions of `init_convs`, float32."""
    k_proj, k_conv = jax.random.split(key)
    params = {name: dense_init(k, spec.d_model, spec.dims[i])
              for i, (name, k) in enumerate(zip(spec.proj_names, jax.random.split(k_proj, 3)))}
    params.update(init_convs(k_conv, spec))
    return params


def init_convs(key, spec: Spec):
    """{"q_conv1d", "k_conv1d", "v_conv1d": {"weight": [width, dims[i]]}} (layers.short_conv), or
    {} without convolutions."""
    if spec.conv_size is None:
        return {}
    return {conv_name(i): short_conv.init(k, spec.conv_config(i))
            for i, k in enumerate(jax.random.split(key, 3))}


def init_state(spec: Spec, batch: int):
    """{"conv_q", "conv_k", "conv_v": zeros [B, width-1, dims[i]] float32}, or {} without
    convolutions."""
    if spec.conv_size is None:
        return {}
    return {STATE_KEYS[i]: short_conv.init_state(spec.conv_config(i), batch) for i in range(3)}


def apply(params, x, spec: Spec, *, state=None, segment_ids=None):
    """(q, k, v) flat [B, T, dims[i]] in x's dtype, and the new convolution states.

    Args:
      params: from `init`.
      x: [B, T, d_model].
      spec: the layer's Spec.
      state: None, or the layer's state dict (its "conv_q", "conv_k", "conv_v" entries are read).
      segment_ids: [B, T] int ids of packed sequences (the convolutions stop at a change of id).
    Returns:
      ((q, k, v), a dict {"conv_q", "conv_k", "conv_v"} of new states, {} without convolutions or
      None without a state).
    """
    outputs, new_state = [], {}
    for i, name in enumerate(spec.proj_names):
        y = dense(x, params[name])
        if spec.conv_size is None:
            outputs.append(_ACTIVATIONS[spec.activations[i]](y))
            continue
        y, s = short_conv.apply(params[conv_name(i)], y, spec.conv_config(i),
                                state=None if state is None else state[STATE_KEYS[i]],
                                segment_ids=segment_ids)
        outputs.append(y)
        new_state[STATE_KEYS[i]] = s
    return tuple(outputs), (None if state is None else new_state)
