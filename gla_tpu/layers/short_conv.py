"""Causal depthwise 1-D convolution over time (fla's ShortConvolution), in plain jnp.

For each channel c, with weight w [width, C] and inputs x_t [C]:
  y_t = act( sum_{i=0}^{width-1} w[i] * x_{t - (width-1) + i}  (+ bias) )
so w[width-1] multiplies the current token and w[0] the oldest one; act is SiLU or the identity.
Inputs before the sequence start come from the decoding state (zeros without one).

fla's `ShortConvolution` is an `nn.Conv1d(C, C, width, groups=C)` whose `weight` has shape
[C, 1, width] (the same order in time: its last tap multiplies the current token):
  ours["weight"][i, c] = fla.weight[c, 0, i]       ours["bias"][c] = fla.bias[c]
fla keeps a decoding cache [B, C, width] whose last slot is the newest input; ours keeps only the
width-1 inputs the next token needs: state[b, j, c] = fla_cache[b, c, j + 1].

Decoding state: the last width-1 inputs [B, width-1, C] (oldest first). `init_state` makes it in
float32 by default (which holds bfloat16 and float16 inputs exactly); `apply` returns the new state
in the dtype of the state it was given. The sums run in float32 (float64 for float64 inputs), the
output is in x's dtype.

Segments: with segment_ids [B, T] a token reads only inputs of its own segment (a maximal run of
equal ids, as in ops.gla): the window is cut where the id changes. A given state precedes each
row's first segment only; the returned state holds the inputs of the row's last segment (zeros
before its start).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_tpu.layers.basic import (
    check_activation_sharding,
    check_positive,
    check_segment_ids,
    segment_positions,
)
from gla_tpu.ops.common import validation as checks

ACTIVATIONS = ("silu", None)


@dataclasses.dataclass(frozen=True)
class Config:
    channels: int
    width: int = 4
    activation: str | None = "silu"  # "silu" or None
    bias: bool = False

    def __post_init__(self):
        check_positive("channels", self.channels)
        check_positive("width", self.width)
        checks.check_choice("activation", self.activation, ACTIVATIONS)
        checks.check_bool("bias", self.bias)


def init(key, config: Config):
    """{"weight": [width, C]} (+ "bias": [C] zeros), float32.

    The weight is drawn as PyTorch draws a Conv1d's, U(-1/sqrt(width), 1/sqrt(width)) (its
    fan-in is width for a depthwise filter).
    """
    bound = config.width**-0.5
    params = {"weight": jax.random.uniform(key, (config.width, config.channels), jnp.float32,
                                           -bound, bound)}
    if config.bias:
        params["bias"] = jnp.zeros((config.channels,), jnp.float32)
    return params


def init_state(config: Config, batch: int, dtype=jnp.float32):
    """A zero state [B, width-1, C]: no inputs before the sequence start."""
    check_positive("batch", batch)
    return jnp.zeros((batch, config.width - 1, config.channels), dtype)


def apply(params, x, config: Config, *, state=None, segment_ids=None, sharding=None):
    """The causal convolution of x over time.

    Args:
      params: from `init`.
      x: [B, T, C] (any float dtype).
      config: the layer's Config.
      state: None (zeros before the start; no state returned) or [B, width-1, C], the last inputs
        of a previous call (from `init_state` or a previous `apply`).
      segment_ids: [B, T] int ids of packed sequences: the window stops at a change of id.
      sharding: None, or a NamedSharding over x's batch and time axes; the convolution is plain
        jnp, so under jit the partitioner shards it from x's own sharding.
    Returns:
      (y [B, T, C] in x's dtype, the new state [B, width-1, C] in the given state's dtype, or None
      without a state).

    Example:
      >>> cfg = Config(channels=8)
      >>> params = init(jax.random.key(0), cfg)
      >>> y, s = apply(params, jnp.ones((2, 5, 8)), cfg, state=init_state(cfg, 2))
      >>> y.shape, s.shape
      ((2, 5, 8), (2, 3, 8))
    """
    checks.check_array("x", x, rank=3, layout=f"[batch, time, channels={config.channels}]")
    checks.check_floating("x", x)
    b, t, c = x.shape
    if c != config.channels:
        raise ValueError(
            f"x must have last dim channels={config.channels}; got {checks.describe(x)}.")
    check_segment_ids(segment_ids, b, t)
    check_activation_sharding(sharding)
    w = config.width
    if state is not None:
        checks.check_array("state", state, rank=3, layout="[batch, width - 1, channels]")
        checks.check_shape("state", state, (b, w - 1, c), "[B, width - 1, C]")
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    with jax.named_scope(f"short_conv_width={w}"):
        prev = jnp.zeros((b, w - 1, c), dtype) if state is None else state.astype(dtype)
        xp = jnp.concatenate([prev, x.astype(dtype)], axis=1)  # [B, width-1+T, C]
        visible = _visibility(segment_ids, b, t, w)  # [width, B, T] bool or None
        weight = params["weight"].astype(dtype)
        y = jnp.zeros((b, t, c), dtype)
        # Tap i reads the input (width-1-i) steps back: xp[:, i : i + T].
        for i in range(w):
            term = xp[:, i:i + t] * weight[i][None, None, :]
            if visible is not None:
                term = jnp.where(visible[i][:, :, None], term, 0)
            y = y + term
        if config.bias:
            y = y + params["bias"].astype(dtype)[None, None, :]
        if config.activation == "silu":
            y = jax.nn.silu(y)
        new_state = None
        if state is not None:
            new_state = _tail(xp, segment_ids, b, t, w).astype(state.dtype)
    return y.astype(x.dtype), new_state


def _visibility(segment_ids, b: int, t: int, w: int):
    """[width, B, T] bool: tap i of token t is in its segment; None without segment_ids.

    Tap i reaches s = width-1-i steps back: in the row's first segment always (earlier steps are
    the given state), elsewhere iff s <= the token's position inside its segment.
    """
    if segment_ids is None:
        return None
    pos = segment_positions(segment_ids, b, t)  # [B, T]
    first = pos == jnp.arange(t, dtype=jnp.int32)[None, :]  # the row's first segment
    back = jnp.arange(w - 1, -1, -1, dtype=jnp.int32)  # [width]: steps back of each tap
    return jnp.logical_or(back[:, None, None] <= pos[None], first[None])


def _tail(xp, segment_ids, b: int, t: int, w: int):
    """The new state: the last width-1 inputs of xp [B, width-1+T, C], zeroed before the start of
    the row's last segment (unless that segment is the row's first, which continues the state)."""
    tail = xp[:, t:]  # [B, width-1, C]: inputs at times T-width+1 .. T-1
    if segment_ids is None:
        return tail
    pos = segment_positions(segment_ids, b, t)[:, -1]  # [B]: the last token's place in its segment
    first = pos == t - 1
    times = jnp.arange(t - w + 1, t, dtype=jnp.int32)  # [width-1]
    keep = jnp.logical_or(times[None, :] >= (t - 1 - pos)[:, None], first[:, None])  # [B, width-1]
    return jnp.where(keep[:, :, None], tail, 0)
