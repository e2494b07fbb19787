"""Building blocks shared by the layers: dense projections, RMSNorm, rotary embeddings, checks.

Mixed precision throughout the layers: parameters are stored in float32 and cast to the
activations' dtype at each matmul; norms, gates, softmax statistics and recurrent states are
computed in float32 and cast back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gla_tpu.ops.common import validation as checks


def dense_init(key, d_in: int, d_out: int, *, scale: float = 1.0):
    """[d_in, d_out] float32 weight, truncated normal with std `scale / sqrt(d_in)`.

    Example:
      >>> w = dense_init(jax.random.key(0), 64, 128)
      >>> w.shape, w.dtype
      ((64, 128), dtype('float32'))
    """
    std = scale * d_in**-0.5
    # The truncated normal on [-2, 2] has std 0.8796; divide it out so `std` is exact.
    return jax.random.truncated_normal(key, -2.0, 2.0, (d_in, d_out), jnp.float32) * (std / 0.8796)


def broadcast_last(v, ndim: int):
    """A [d] vector as [1, ..., 1, d] of rank `ndim` (rank promotion is explicit here)."""
    return v.reshape((1,) * (ndim - 1) + v.shape)


def dense(x, w, b=None):
    """x @ w (+ b) in x's dtype: [..., d_in] x [d_in, d_out] -> [..., d_out]."""
    y = jnp.einsum("...i,io->...o", x, w.astype(x.dtype))
    if b is not None:
        y = y + broadcast_last(b.astype(x.dtype), y.ndim)
    return y


def rms_norm_init(dim: int):
    """{"scale": ones [dim] float32}."""
    return {"scale": jnp.ones((dim,), jnp.float32)}


def rms_norm(params, x, *, eps: float = 1e-5):
    """x / rms(x) * scale over the last axis, computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (x32 * inv * broadcast_last(params["scale"], x.ndim)).astype(x.dtype)


GATE_ACTIVATIONS = {"swish": jax.nn.silu, "sigmoid": jax.nn.sigmoid}


def gated_rms_norm(params, o, gate, *, activation: str = "swish", eps: float = 1e-5):
    """rms_norm(o) * activation(gate) in float32 (fla's FusedRMSNormGated), in o's dtype.

    Args:
      params: {"scale": [D]} from `rms_norm_init(D)`.
      o: [..., D], e.g. a head's output [B, T, H, D]; the norm runs over the last axis.
      gate: None (no gate: rms_norm only) or an array of o's shape, any float dtype.
      activation: "swish" (x * sigmoid(x)) or "sigmoid".
    Returns:
      [..., D] in o's dtype.
    """
    y = rms_norm(params, o.astype(jnp.float32), eps=eps)
    if gate is not None:
        y = y * GATE_ACTIVATIONS[activation](gate.astype(jnp.float32))
    return y.astype(o.dtype)


def repeat_heads(x, repeats: int):
    """[B, T, Hkv, D] -> [B, T, Hkv * repeats, D]: head i of the result is head i // repeats."""
    return x if repeats == 1 else jnp.repeat(x, repeats, axis=2)


def rotary(x, positions, *, base: float = 10000.0):
    """Rotary position embedding (half-split pairs: dim i rotates with dim i + D/2).

    Args:
      x: [B, T, H, D], D even.
      positions: [B, T] int positions of the tokens.
      base: the frequency base; pair i turns by position * base ** (-2 i / D).
    Returns:
      [B, T, H, D] in x's dtype (the rotation itself runs in float32).
    """
    d = x.shape[-1]
    half = d // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * (2.0 / d))  # [D/2]
    angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq[None, None, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)  # [B, T, 1, D/2]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def segment_positions(segment_ids, batch: int, length: int):
    """[B, T] int32 position of each token inside its segment (a maximal run of equal ids).

    With segment_ids None every row is one segment and positions are 0..T-1.
    """
    t = jnp.arange(length, dtype=jnp.int32)[None, :]
    if segment_ids is None:
        return jnp.broadcast_to(t, (batch, length))
    starts = jnp.concatenate(
        [jnp.ones((batch, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    start_pos = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)
    return t - start_pos


def check_input(name: str, x, d_model: int) -> None:
    """x must be a floating [B, T, d_model] array (ValueError otherwise)."""
    checks.check_array(name, x, rank=3, layout=f"[batch, time, d_model={d_model}]")
    checks.check_floating(name, x)
    if x.shape[-1] != d_model:
        raise ValueError(
            f"{name} must have last dim d_model={d_model}; got {checks.describe(x)}."
        )


def check_segment_ids(segment_ids, batch: int, length: int) -> None:
    """segment_ids must be None or an integer [B, T] array (ValueError otherwise)."""
    if segment_ids is None:
        return
    checks.check_array("segment_ids", segment_ids, rank=2, layout="[batch, time]")
    checks.check_integer("segment_ids", segment_ids)
    checks.check_shape("segment_ids", segment_ids, (batch, length), "[B, T] of the input")


def check_activation_sharding(sharding) -> None:
    """`sharding` must be None or a NamedSharding whose spec names at most the batch and time
    axes of [B, T, ...] activations (ValueError otherwise)."""
    if sharding is None:
        return
    if not isinstance(sharding, jax.sharding.NamedSharding):
        raise ValueError(
            "sharding must be None or a jax.sharding.NamedSharding for the [batch, time] axes; "
            f"got {sharding!r}.")
    if len(sharding.spec) > 2:
        raise ValueError(
            f"sharding's spec {sharding.spec} has {len(sharding.spec)} entries; the layers take "
            "the batch and time axes only, e.g. P('data', 'seq').")


def check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int; got {value!r}.")


class ExpandedDims:
    """The dims of a layer whose key and value widths are d_model * expand_k / expand_v, split
    over num_heads (GLA, DeltaNet): a mixin of their Configs."""

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
