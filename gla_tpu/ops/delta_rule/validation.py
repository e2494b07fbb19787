"""Validation of delta_rule's arguments into a normalized problem."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from gla_tpu.ops.common import validation as v

MODES = ("auto", "chunk", "fused_recurrent")
RESOLVED_MODES = MODES[1:]
GATE_KINDS = ("key", "head", "none")
CHUNK_SIZES = (64, 128)
# "auto" runs token by token up to this length (decoding, short prompts), chunked above it.
AUTO_RECURRENT_MAX_T = 16
# What each gate kind is, for messages: the shape of g picks the variant.
GATE_DESCRIPTIONS = {
    "none": "no gate (g=None: DeltaNet)",
    "head": "a per-head gate g [B, T, HV] (Gated DeltaNet)",
    "key": "a per-key gate g [B, T, HV, K] (KDA)",
}


@dataclasses.dataclass(frozen=True)
class DeltaRuleProblem(v.ChunkedProblem):
    """What every backend receives after validation."""

    batch: int
    seq_len: int  # T
    num_heads: int  # H: q and k heads
    num_value_heads: int  # HV, a multiple of H: value head j reads q, k head j // (HV // H)
    key_dim: int  # K
    value_dim: int  # V
    gate_kind: str  # "key" ([B, T, HV, K]: KDA), "head" ([B, T, HV]: Gated DeltaNet), "none"
    scale: float
    mode: str  # resolved: "chunk" or "fused_recurrent"
    chunk_size: int | None  # None until the backend's default is chosen (`with_chunk_size`)
    has_initial_state: bool
    output_final_state: bool
    has_segments: bool
    use_qk_l2norm: bool
    dtype: jnp.dtype  # of q, k, v

    @property
    def group(self) -> int:
        """Value heads per q/k head, HV // H."""
        return self.num_value_heads // self.num_heads

    def features(self) -> tuple[str, ...]:
        """The optional features this problem uses (common/capabilities.DELTA_RULE_FEATURES)."""
        used = {"segment_ids": self.has_segments, "initial_state": self.has_initial_state,
                "final_state": self.output_final_state,
                "grouped_value_heads": self.num_value_heads != self.num_heads,
                "qk_l2norm": self.use_qk_l2norm}
        return tuple(name for name, on in used.items() if on)


def state_dtype(dtype) -> jnp.dtype:
    """The dtype of the states and of every accumulation: float64 for float64 inputs (under
    jax_enable_x64), float32 for every other float dtype."""
    return jnp.dtype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


def gate_kind(g) -> str | None:
    """The variant g's rank picks ("none", "head", "key"), None for anything else."""
    if g is None:
        return "none"
    if hasattr(g, "shape") and hasattr(g, "dtype"):
        return {3: "head", 4: "key"}.get(len(g.shape))
    return None


def validate_delta_rule(q, k, v_, beta, g, *, scale, initial_state, output_final_state,
                        segment_ids, use_qk_l2norm, mode, chunk_size):
    """Returns (problem, initial_state in state_dtype | None, segment_ids int32 | None)."""
    for name, x in (("q", q), ("k", k), ("v", v_)):
        v.check_array(name, x, rank=4, layout="[batch, time, heads, dim]")
        v.check_floating(name, x)
        v.check_nonempty(name, x)
    b, t, h, kd = q.shape
    hv, vd = v_.shape[2], v_.shape[3]
    v.check_shape("k", k, (b, t, h, kd), "q's shape [B, T, H, K]")
    v.check_shape("v", v_, (b, t, hv, vd), "[B, T, HV, V] with q's B, T")
    if hv % h:
        raise ValueError(
            f"v's heads HV={hv} must be a multiple of q and k's heads H={h} (value head j reads "
            f"q, k head j // (HV // H)); got q {v.describe(q)}, v {v.describe(v_)}."
        )
    if not (q.dtype == k.dtype == v_.dtype):
        raise ValueError(
            f"q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v_.dtype}."
        )
    v.check_array("beta", beta, rank=3, layout="[B, T, HV]")
    v.check_floating("beta", beta)
    v.check_shape("beta", beta, (b, t, hv), "[B, T, HV]")
    kind = gate_kind(g)
    if kind is None:
        raise ValueError(
            "g must be None (DeltaNet), a per-head gate [B, T, HV] (Gated DeltaNet) or a per-key "
            f"gate [B, T, HV, K] (KDA); got {v.describe(g)}."
        )
    if kind != "none":
        v.check_floating("g", g)
        if kind == "key":
            v.check_shape("g", g, (b, t, hv, kd), "[B, T, HV, K] (per-key gate, KDA)")
        else:
            v.check_shape("g", g, (b, t, hv), "[B, T, HV] (per-head gate, Gated DeltaNet)")
    s = v.check_scale("scale", scale)
    if s is None:
        s = kd**-0.5
    if initial_state is not None:
        v.check_array("initial_state", initial_state, rank=4, layout="[batch, HV, K, V]")
        v.check_floating("initial_state", initial_state)
        v.check_shape("initial_state", initial_state, (b, hv, kd, vd), "[B, HV, K, V]")
        initial_state = initial_state.astype(state_dtype(q.dtype))
    v.check_bool("output_final_state", output_final_state)
    v.check_bool("use_qk_l2norm", use_qk_l2norm)
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
    problem = DeltaRuleProblem(
        batch=b, seq_len=t, num_heads=h, num_value_heads=hv, key_dim=kd, value_dim=vd,
        gate_kind=kind, scale=s, mode=mode, chunk_size=chunk_size,
        has_initial_state=initial_state is not None,
        output_final_state=bool(output_final_state), has_segments=segment_ids is not None,
        use_qk_l2norm=bool(use_qk_l2norm), dtype=jnp.dtype(v_.dtype),
    )
    return problem, initial_state, segment_ids
