"""Causal softmax multi-head attention with GQA, RoPE, an optional sliding window and logit soft
cap, through `ops.flash_attention`.

Sliding window: with `window` = w a query sees the last w keys, itself included (key position j
with i - w < j <= i), i.e. ops.flash_attention(causal=True, local_window_size=(w - 1, 0)), whose
window reaches `left` keys before the query's aligned position and `right` after it.

Decoding state: a fixed-size KV cache {"k", "v": [B, max_len, Hkv, D], "pos": int32 []} holding
the keys (after RoPE) and values of the `pos` tokens seen so far; every row of the batch advances
in lockstep. A call with T new tokens writes them to slots [pos, pos + T) and attends over the
cache with a slot mask (kv segment id 1 for filled slots, 0 for the rest; query id 1), so unfilled
slots are never seen:
- T == 1 (a decoding step): causal=False, since every filled slot precedes the query.
- T > 1 (a prompt continued from a cache): the cache is rolled so that the newest token sits in
  the last slot; then the bottom-right aligned causal rule of `ops.flash_attention`
  (query i sees key j iff j <= i + S - T) is exactly "key position <= query position".
With a window, T == 1 also masks the slots before pos + 1 - window (kv segment id 0), and T > 1
passes the same local_window_size, which on the rolled cache counts back from the query's own
slot. The cache keeps all max_len slots either way.
The caller keeps pos + T <= max_len (`init_state` sizes the cache); past it the write is clamped.
Both paths run ops.flash_attention on config.backend, in interpret mode with config.interpret.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_tpu import ops
from gla_tpu.layers.basic import (
    check_input,
    check_positive,
    check_segment_ids,
    dense,
    dense_init,
    rotary,
    segment_positions,
)
from gla_tpu.ops.common import validation as checks
from gla_tpu.ops.common.backends import BACKENDS
from gla_tpu.ops.common.segments import segment_index


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int
    num_heads: int
    num_kv_heads: int | None = None  # default num_heads; fewer gives GQA/MQA
    head_dim: int | None = None  # default d_model // num_heads
    rope_base: float | None = 10000.0  # None: no rotary embedding
    window: int | None = None  # sliding window: a query sees the last `window` keys (itself too)
    logits_soft_cap: float | None = None  # c: scores become c * tanh(scores / c)
    backend: str = "auto"
    interpret: bool = False  # run a Pallas backend's kernels in interpret mode (on CPU)

    def __post_init__(self):
        check_positive("d_model", self.d_model)
        check_positive("num_heads", self.num_heads)
        if self.num_kv_heads is not None:
            check_positive("num_kv_heads", self.num_kv_heads)
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.kv_heads}."
            )
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} must be a multiple of num_heads={self.num_heads} "
                "unless head_dim is given."
            )
        if self.head_dim is not None:
            check_positive("head_dim", self.head_dim)
        if self.rope_base is not None and self.dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim; got {self.dim}.")
        checks.check_choice("backend", self.backend, BACKENDS)
        checks.check_bool("interpret", self.interpret)
        if self.window is not None:
            check_positive("window", self.window)
        if self.logits_soft_cap is not None:
            checks.check_scale("logits_soft_cap", self.logits_soft_cap)

    @property
    def local_window_size(self) -> tuple[int, int] | None:
        """ops.flash_attention's (left, right) for `window`: w - 1 keys back, none ahead."""
        return None if self.window is None else (self.window - 1, 0)

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def dim(self) -> int:
        return self.d_model // self.num_heads if self.head_dim is None else self.head_dim


def init(key, config: Config):
    """{"wq": [d_model, H*D], "wk", "wv": [d_model, Hkv*D], "wo": [H*D, d_model]}, float32."""
    kq, kk, kv, ko = jax.random.split(key, 4)
    d, hd, kvd = config.d_model, config.num_heads * config.dim, config.kv_heads * config.dim
    return {"wq": dense_init(kq, d, hd), "wk": dense_init(kk, d, kvd),
            "wv": dense_init(kv, d, kvd), "wo": dense_init(ko, hd, d)}


def init_state(config: Config, batch: int, max_len: int, dtype=jnp.bfloat16):
    """An empty KV cache for `max_len` tokens, in the activations' dtype."""
    check_positive("batch", batch)
    check_positive("max_len", max_len)
    shape = (batch, max_len, config.kv_heads, config.dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
            "pos": jnp.zeros((), jnp.int32)}


def apply(params, x, config: Config, *, state=None, segment_ids=None, sharding=None):
    """Causal self-attention.

    Args:
      params: from `init`.
      x: [B, T, d_model] activations (bfloat16 or float32).
      config: the layer's Config.
      state: None for a full sequence, or a KV cache from `init_state` / a previous call.
      segment_ids: [B, T] int ids for packed sequences (full sequence only): a token attends only
        within its segment, a maximal run of equal ids; RoPE positions restart per segment.
      sharding: None, or a NamedSharding over x's batch (and time) axes for the full-sequence
        path: ops.flash_attention runs batch-sharded, and as ring attention over a split time
        axis (T a multiple of twice its device count; docs/scale_out.md).
    Returns:
      (y [B, T, d_model] in x's dtype, the updated cache or None).

    Example:
      >>> cfg = Config(d_model=64, num_heads=4, num_kv_heads=2)
      >>> params = init(jax.random.key(0), cfg)
      >>> y, _ = apply(params, jnp.ones((2, 16, 64), jnp.bfloat16), cfg)
    """
    check_input("x", x, config.d_model)
    b, t, _ = x.shape
    check_segment_ids(segment_ids, b, t)
    if state is not None and segment_ids is not None:
        raise ValueError("segment_ids are for the full-sequence forward; pass state=None with them.")
    h, hkv, d = config.num_heads, config.kv_heads, config.dim
    with jax.named_scope("multi_head_attention"):
        q = dense(x, params["wq"]).reshape(b, t, h, d)
        k = dense(x, params["wk"]).reshape(b, t, hkv, d)
        v = dense(x, params["wv"]).reshape(b, t, hkv, d)
        if state is None:
            positions = segment_positions(segment_ids, b, t)
        else:
            positions = jnp.broadcast_to(state["pos"] + jnp.arange(t, dtype=jnp.int32), (b, t))
        if config.rope_base is not None:
            q = rotary(q, positions, base=config.rope_base)
            k = rotary(k, positions, base=config.rope_base)
        if state is None:
            seg = None if segment_ids is None else segment_index(segment_ids)
            o = ops.flash_attention(q, k, v, causal=True, segment_ids=seg,
                                    local_window_size=config.local_window_size,
                                    logits_soft_cap=config.logits_soft_cap,
                                    backend=config.backend, interpret=config.interpret,
                                    sharding=sharding)
            new_state = None
        else:
            o, new_state = _attend_with_cache(q, k, v, state, config)
        y = dense(o.reshape(b, t, h * d), params["wo"])
    return y, new_state


def _attend_with_cache(q, k, v, state, config: Config):
    b, t = q.shape[:2]
    max_len = state["k"].shape[1]
    if t > max_len:
        raise ValueError(f"{t} new tokens do not fit a KV cache of max_len={max_len}.")
    pos = state["pos"]
    start = (0, pos, 0, 0)
    k_cache = jax.lax.dynamic_update_slice(state["k"], k.astype(state["k"].dtype), start)
    v_cache = jax.lax.dynamic_update_slice(state["v"], v.astype(state["v"].dtype), start)
    filled = pos + t
    slots = jnp.arange(max_len, dtype=jnp.int32)
    keys, values = k_cache.astype(q.dtype), v_cache.astype(q.dtype)
    window = None
    if t == 1:
        kv_ids = slots < filled
        if config.window is not None:
            kv_ids = jnp.logical_and(kv_ids, slots >= filled - config.window)
        causal = False
    else:
        # Slot filled - 1 moves to max_len - 1; the unfilled slots wrap to the front.
        shift = max_len - filled
        keys = jnp.roll(keys, shift, axis=1)
        values = jnp.roll(values, shift, axis=1)
        kv_ids = slots >= shift
        causal = True
        window = config.local_window_size
    kv_ids = jnp.broadcast_to(kv_ids.astype(jnp.int32)[None, :], (b, max_len))
    q_ids = jnp.ones((b, t), jnp.int32)
    o = ops.flash_attention(q, keys, values, causal=causal, segment_ids=(q_ids, kv_ids),
                            local_window_size=window, logits_soft_cap=config.logits_soft_cap,
                            backend=config.backend, interpret=config.interpret)
    return o, {"k": k_cache, "v": v_cache, "pos": filled}
