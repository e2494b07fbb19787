"""Random problems for parity tests and benchmarks: shape specs and input builders.

A case is a frozen dataclass of sizes and flags; `make_*_inputs(case, key, dtype)` draws fresh
random arrays for it (never zeros). Hypothesis strategies over these live in `strategies.py`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Gate strengths (docs/testing.md): g = logsigmoid(x) / strength; 0.1 gives decays near -7 per
# step.
GATE_STRENGTHS = (0.1, 1.0, 16.0)


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    batch: int
    q_len: int  # T
    kv_len: int  # S
    num_heads: int  # H
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    causal: bool = False
    segments: str = "none"  # "none", "shared" (one [B, T] array, T == S) or "pair"


@dataclasses.dataclass(frozen=True)
class GLACase:
    batch: int
    seq_len: int  # T
    num_heads: int  # H
    key_dim: int  # K
    value_dim: int  # V
    gate: str = "key"  # "key", "head" or "none"
    gate_strength: float = 1.0  # g = logsigmoid(x + gate_shift) / gate_strength, x ~ N(0, 1)
    gate_shift: float = 0.0
    initial_state: bool = False
    segments: bool = False
    output_final_state: bool = True

    def __repr__(self):
        # gate_shift only where it is set: the repr seeds each case's inputs (parity.case_seed),
        # and the cases written before the field keep their draws
        names = [f.name for f in dataclasses.fields(self)
                 if f.name != "gate_shift" or self.gate_shift]
        return f"GLACase({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"


def random_segment_ids(key, batch: int, length: int, *, mean_len: float = 8.0):
    """[B, T] int32 nondecreasing ids with segments of random length, one-token ones included."""
    starts = jax.random.bernoulli(key, 1.0 / mean_len, (batch, length)).astype(jnp.int32)
    return jnp.cumsum(starts, axis=1, dtype=jnp.int32)


def make_attention_inputs(case: AttentionCase, key, dtype=jnp.float32) -> dict:
    """Returns {"q", "k", "v", "segment_ids"} for flash_attention's keyword arguments."""
    kq, kk, kv, ks, ks2 = jax.random.split(key, 5)
    b, t, s = case.batch, case.q_len, case.kv_len
    q = jax.random.normal(kq, (b, t, case.num_heads, case.head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, s, case.num_kv_heads, case.head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s, case.num_kv_heads, case.head_dim), jnp.float32).astype(dtype)
    seg = None
    if case.segments == "shared":
        seg = random_segment_ids(ks, b, t)
    elif case.segments == "pair":
        # Few ids per row, not sorted, so some queries see no key at all.
        seg = (jax.random.randint(ks, (b, t), 0, 3), jax.random.randint(ks2, (b, s), 0, 3))
    return {"q": q, "k": k, "v": v, "segment_ids": seg}


def make_gla_inputs(case: GLACase, key, dtype=jnp.float32, gate_dtype=jnp.float32) -> dict:
    """Returns {"q", "k", "v", "g", "initial_state", "segment_ids"} for gla's arguments."""
    kq, kk, kv, kg, ks0, kseg = jax.random.split(key, 6)
    b, t, h = case.batch, case.seq_len, case.num_heads
    shape_k = (b, t, h, case.key_dim)
    q = jax.random.normal(kq, shape_k, jnp.float32).astype(dtype)
    k = jax.random.normal(kk, shape_k, jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, t, h, case.value_dim), jnp.float32).astype(dtype)
    g = None
    if case.gate != "none":
        gshape = shape_k if case.gate == "key" else (b, t, h)
        x = jax.random.normal(kg, gshape, jnp.float32) + case.gate_shift
        g = (jax.nn.log_sigmoid(x) / case.gate_strength).astype(gate_dtype)
    s0 = None
    if case.initial_state:
        s0 = jax.random.normal(ks0, (b, h, case.key_dim, case.value_dim), jnp.float32)
    seg = random_segment_ids(kseg, b, t) if case.segments else None
    return {"q": q, "k": k, "v": v, "g": g, "initial_state": s0, "segment_ids": seg}
