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
    window: int | tuple[int, int] | None = None  # local_window_size
    soft_cap: float | None = None  # logits_soft_cap

    def options(self) -> dict:
        """flash_attention's keyword arguments of the case's semantics."""
        return dict(causal=self.causal, local_window_size=self.window,
                    logits_soft_cap=self.soft_cap)

    def __repr__(self):
        # window and soft_cap only where set: the repr seeds each case's inputs
        # (parity.case_seed), and the cases written before the fields keep their draws
        names = [f.name for f in dataclasses.fields(self)
                 if f.name not in ("window", "soft_cap") or getattr(self, f.name) is not None]
        return f"AttentionCase({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"


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


@dataclasses.dataclass(frozen=True)
class DeltaRuleCase:
    batch: int
    seq_len: int  # T
    num_heads: int  # H (q, k)
    num_value_heads: int  # HV (v, beta, g, states), a multiple of H
    key_dim: int  # K
    value_dim: int  # V
    gate: str = "key"  # "key" (KDA), "head" (Gated DeltaNet) or "none" (DeltaNet)
    # "logsigmoid": g = logsigmoid(x) / gate_strength; "kimi": Kimi Linear's
    # g = -exp(A_log) * softplus(x + dt_bias), A_log = log U(1, 16) per head, dt_bias ~ N(0, 1)
    # per head (and key, for KDA); x ~ N(0, 1)
    gate_law: str = "logsigmoid"
    gate_strength: float = 1.0
    initial_state: bool = False
    segments: bool = False
    output_final_state: bool = True
    use_qk_l2norm: bool = True


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


def delta_rule_gates(key, gate: str, shape, *, law: str = "logsigmoid", strength: float = 1.0):
    """Log decays of one gate kind for `shape` [B, T, HV] (+ [K] for "key"), float32, or None for
    "none": logsigmoid(x) / strength, or Kimi Linear's -exp(A_log) * softplus(x + dt_bias)."""
    if gate == "none":
        return None
    kx, ka, kb = jax.random.split(key, 3)
    x = jax.random.normal(kx, shape, jnp.float32)
    if law == "logsigmoid":
        return jax.nn.log_sigmoid(x) / strength
    if law != "kimi":
        raise ValueError(f"law must be 'logsigmoid' or 'kimi'; got {law!r}.")
    a_log = jnp.log(jax.random.uniform(ka, shape[2:3], jnp.float32, 1.0, 16.0))  # [HV]
    a = jnp.exp(a_log).reshape((1, 1, -1) + (1,) * (len(shape) - 3))
    dt_bias = jax.random.normal(kb, (1, 1) + tuple(shape[2:]), jnp.float32)
    return -a * jax.nn.softplus(x + dt_bias)


def make_delta_rule_inputs(case: DeltaRuleCase, key, dtype=jnp.float32,
                           gate_dtype=jnp.float32) -> dict:
    """Returns {"q", "k", "v", "beta", "g", "initial_state", "segment_ids"} for delta_rule's
    arguments: q, k, v ~ N(0, 1) (without use_qk_l2norm the keys are drawn with unit norm, as
    models pass them: with |k|^2 ~ K the recurrence grows geometrically), beta = 2 * sigmoid(x) in
    (0, 2), gates of `case.gate_law`, segments with a one-token segment at token 3 where T > 4."""
    kq, kk, kv, kb, kg, ks0, kseg = jax.random.split(key, 7)
    b, t, h, hv = case.batch, case.seq_len, case.num_heads, case.num_value_heads
    q = jax.random.normal(kq, (b, t, h, case.key_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, t, h, case.key_dim), jnp.float32)
    if not case.use_qk_l2norm:
        k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(kv, (b, t, hv, case.value_dim), jnp.float32).astype(dtype)
    beta = 2.0 * jax.nn.sigmoid(jax.random.normal(kb, (b, t, hv), jnp.float32))
    gshape = (b, t, hv) + ((case.key_dim,) if case.gate == "key" else ())
    g = delta_rule_gates(kg, case.gate, gshape, law=case.gate_law, strength=case.gate_strength)
    s0 = None
    if case.initial_state:
        s0 = jax.random.normal(ks0, (b, hv, case.key_dim, case.value_dim), jnp.float32)
    seg = None
    if case.segments:
        starts = jax.random.bernoulli(kseg, 1.0 / 8.0, (b, t))
        if t > 4:
            starts = starts.at[:, 3:5].set(True)  # token 3 is a segment of its own
        seg = jnp.cumsum(starts.astype(jnp.int32), axis=1, dtype=jnp.int32)
    return {"q": q, "k": k.astype(dtype), "v": v, "beta": beta,
            "g": None if g is None else g.astype(gate_dtype), "initial_state": s0,
            "segment_ids": seg}
