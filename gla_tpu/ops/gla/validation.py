"""Validation of gla's arguments into a normalized problem."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from gla_tpu.ops.common import validation as v

MODES = ("auto", "chunk", "fused_chunk", "fused_recurrent")
RESOLVED_MODES = MODES[1:]
GATE_KINDS = ("key", "head", "none")
CHUNK_SIZES = (64, 128)
# "auto" runs token by token up to this length (decoding, short prompts), chunked above it.
AUTO_RECURRENT_MAX_T = 16


@dataclasses.dataclass(frozen=True)
class GLAProblem(v.ChunkedProblem):
    """What every backend receives after validation."""

    batch: int
    seq_len: int  # T
    num_heads: int  # H
    key_dim: int  # K
    value_dim: int  # V
    gate_kind: str  # "key" ([B, T, H, K]), "head" ([B, T, H]) or "none"
    scale: float
    mode: str  # resolved: "chunk", "fused_chunk" or "fused_recurrent"
    chunk_size: int | None  # None until the backend's default is chosen (`with_chunk_size`)
    has_initial_state: bool
    output_final_state: bool
    has_segments: bool
    dtype: jnp.dtype

    def features(self) -> tuple[str, ...]:
        """The optional features this problem uses (common/capabilities.GLA_FEATURES)."""
        used = {"segment_ids": self.has_segments, "initial_state": self.has_initial_state,
                "final_state": self.output_final_state}
        return tuple(name for name, on in used.items() if on)


def validate_gla(q, k, v_, g, *, scale, initial_state, output_final_state, segment_ids, mode,
                 chunk_size):
    """Returns (problem, initial_state float32 | None, segment_ids int32 | None)."""
    for name, x in (("q", q), ("k", k), ("v", v_)):
        v.check_array(name, x, rank=4, layout="[batch, time, heads, dim]")
        v.check_floating(name, x)
        v.check_nonempty(name, x)
    b, t, h, kd = q.shape
    vd = v_.shape[3]
    v.check_shape("k", k, (b, t, h, kd), "q's shape [B, T, H, K]")
    v.check_shape("v", v_, (b, t, h, vd), "[B, T, H, V] with q's B, T, H")
    if not (q.dtype == k.dtype == v_.dtype):
        raise ValueError(
            f"q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v_.dtype}."
        )
    if g is None:
        kind = "none"
    else:
        if not (hasattr(g, "shape") and hasattr(g, "dtype")) or g.ndim not in (3, 4):
            raise ValueError(
                "g must be None, a per-head gate [B, T, H] or a per-key gate [B, T, H, K]; "
                f"got {v.describe(g)}."
            )
        v.check_floating("g", g)
        if g.ndim == 4:
            v.check_shape("g", g, (b, t, h, kd), "[B, T, H, K] (per-key gate)")
            kind = "key"
        else:
            v.check_shape("g", g, (b, t, h), "[B, T, H] (per-head gate)")
            kind = "head"
    s = v.check_scale("scale", scale)
    if s is None:
        s = kd**-0.5
    if initial_state is not None:
        v.check_array("initial_state", initial_state, rank=4, layout="[batch, heads, K, V]")
        v.check_floating("initial_state", initial_state)
        v.check_shape("initial_state", initial_state, (b, h, kd, vd), "[B, H, K, V]")
        initial_state = initial_state.astype(jnp.float32)
    v.check_bool("output_final_state", output_final_state)
    if segment_ids is not None:
        v.check_array("segment_ids", segment_ids, rank=2, layout="[batch, time]")
        v.check_integer("segment_ids", segment_ids)
        v.check_shape("segment_ids", segment_ids, (b, t), "[B, T]")
        segment_ids = segment_ids.astype(jnp.int32)
    v.check_choice("mode", mode, MODES)
    if chunk_size is not None:
        v.check_choice("chunk_size", chunk_size, CHUNK_SIZES + (None,))
        chunk_size = int(chunk_size)
    if mode == "auto":
        mode = "fused_recurrent" if t <= AUTO_RECURRENT_MAX_T else "chunk"
    problem = GLAProblem(
        batch=b, seq_len=t, num_heads=h, key_dim=kd, value_dim=vd, gate_kind=kind, scale=s,
        mode=mode, chunk_size=chunk_size, has_initial_state=initial_state is not None,
        output_final_state=bool(output_final_state), has_segments=segment_ids is not None,
        dtype=jnp.dtype(v_.dtype),
    )
    return problem, initial_state, segment_ids
