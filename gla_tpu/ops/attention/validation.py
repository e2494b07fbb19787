"""Validation of flash_attention's arguments into a normalized problem."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from gla_tpu.ops.common import validation as v
from gla_tpu.ops.common.masks import window_bounds


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    """What every backend receives after validation (shapes in the [B, T, H, D] layout)."""

    batch: int
    q_len: int  # T
    kv_len: int  # S
    num_heads: int  # H
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    causal: bool
    sm_scale: float
    has_segments: bool
    dtype: jnp.dtype
    # (left, right) key reach around the query's aligned position (common/masks.py); a side of
    # None is unbounded; None: no window.
    window: tuple[int | None, int | None] | None = None
    logits_soft_cap: float | None = None  # c: scores become c * tanh(s / c)

    def sizes(self) -> dict[str, int]:
        """The head dims a backend's capabilities constrain."""
        return {"head_dim": self.head_dim}

    def features(self) -> tuple[str, ...]:
        """The optional features this problem uses (common/capabilities.ATTENTION_FEATURES)."""
        used = {"causal": self.causal, "gqa": self.num_heads != self.num_kv_heads,
                "segment_ids": self.has_segments, "local_window": self.window is not None,
                "logits_soft_cap": self.logits_soft_cap is not None}
        return tuple(name for name, on in used.items() if on)


def _window(local_window_size, causal: bool):
    """The validated window as (left, right) with causal's right = 0, or None."""
    value = local_window_size
    if value is None:
        return None
    pair = value if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) != 2 or not all(
            isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 0
            for x in pair):
        raise ValueError(
            "local_window_size must be None, an int w >= 0 (the pair (w, w)) or a pair "
            f"(left, right) of ints >= 0; got {value!r}.")
    return window_bounds((int(pair[0]), int(pair[1])), causal)


def validate_attention(q, k, v_, *, causal, sm_scale, segment_ids, local_window_size=None,
                       logits_soft_cap=None):
    """Returns (problem, q_segment_ids [B, T] int32 | None, kv_segment_ids [B, S] int32 | None)."""
    for name, x in (("q", q), ("k", k), ("v", v_)):
        v.check_array(name, x, rank=4, layout="[batch, time, heads, head_dim]")
        v.check_floating(name, x)
        v.check_nonempty(name, x)
    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    v.check_shape("k", k, (b, s, hkv, d), "[B, S, Hkv, D] with q's B and D")
    v.check_shape("v", v_, (b, s, hkv, d), "k's shape [B, S, Hkv, D]")
    if h % hkv:
        raise ValueError(
            f"q's heads H={h} must be a multiple of k/v's heads Hkv={hkv} (GQA/MQA need H % Hkv == 0)."
        )
    if not (q.dtype == k.dtype == v_.dtype):
        raise ValueError(
            f"q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v_.dtype}."
        )
    v.check_bool("causal", causal)
    window = _window(local_window_size, bool(causal))
    soft_cap = v.check_scale("logits_soft_cap", logits_soft_cap)
    scale = v.check_scale("sm_scale", sm_scale)
    if scale is None:
        scale = d**-0.5
    q_seg = kv_seg = None
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            if len(segment_ids) != 2:
                raise ValueError(
                    "segment_ids must be None, one [B, T] int array (when T == S) or a pair "
                    f"(q_segment_ids [B, T], kv_segment_ids [B, S]); got a sequence of length {len(segment_ids)}."
                )
            q_seg, kv_seg = segment_ids
        else:
            if t != s:
                raise ValueError(
                    f"a single segment_ids array needs T == S; got T={t}, S={s}. Pass a pair "
                    "(q_segment_ids [B, T], kv_segment_ids [B, S]) instead."
                )
            q_seg = kv_seg = segment_ids
        for name, x, n in (("segment_ids (queries)", q_seg, t), ("segment_ids (keys)", kv_seg, s)):
            v.check_array(name, x, rank=2, layout="[batch, time]")
            v.check_integer(name, x)
            v.check_shape(name, x, (b, n), "[B, T] for queries, [B, S] for keys")
        q_seg = q_seg.astype(jnp.int32)
        kv_seg = kv_seg.astype(jnp.int32)
    problem = AttentionProblem(
        batch=b, q_len=t, kv_len=s, num_heads=h, num_kv_heads=hkv, head_dim=d,
        causal=bool(causal), sm_scale=scale, has_segments=q_seg is not None,
        dtype=jnp.dtype(q.dtype), window=window, logits_soft_cap=soft_cap,
    )
    return problem, q_seg, kv_seg
