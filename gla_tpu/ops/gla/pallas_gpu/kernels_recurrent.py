"""Pallas (Triton lowering) kernel of the GLA and delta-rule recurrences over a few tokens, for
decoding on GPU.

Per (batch, value head): GLA: S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t ([K, V]); the delta rule
(with beta): S' = diag(exp(g_t)) S_{t-1}, u_t = beta_t (v_t - k_t S'), S_t = S' + k_t^T u_t;
both: o_t = scale q_t S_t. One program per (batch, value head, V block) holds the float32 state
tile [K, BV] in registers across the tokens (unrolled for T <= 16, a `fori_loop` beyond), so the
state is read once and written once. With a single query row the [1, K] x [K, BV] products are
elementwise multiplies and sums over K (`tl.dot` needs M >= 16, and Mosaic GPU's wgmma 64 rows);
every product is float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

DIMS = (64, 128, 256, 512)  # the caller pads K and V to one of these
TILE_ELEMENTS = 8192  # float32 elements of the state tile [K, BV] (registers of 4 warps)
NUM_WARPS = 4
MAX_UNROLL = 16  # tokens unrolled statically; more run in a fori_loop


def block_v(key_dim: int, value_dim: int, tile_elements: int = TILE_ELEMENTS) -> int:
    """BV: tile_elements / K, at most V (at the default 8192: K=64 -> 128, K=128 -> 64,
    K=256 -> 32, K=512 -> 16)."""
    return min(value_dim, tile_elements // key_dim)


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s0_ref, o_ref, final_ref, *, num_tokens: int,
            scale: float):
    # q_ref, k_ref, g_ref [T, K]; v_ref, o_ref [T, BV]; beta_ref [T, 1] f32 (delta rule) or None;
    # s0_ref, final_ref [K, BV] (f32)
    if s0_ref is None:
        s = jnp.zeros(final_ref.shape, jnp.float32)
    else:
        s = s0_ref[...]

    def step(t, s):
        tok = pl.ds(t, 1)
        q = q_ref[tok, :].astype(jnp.float32)  # [1, K]
        k = k_ref[tok, :].astype(jnp.float32)  # [1, K]
        g = g_ref[tok, :]  # [1, K] f32, <= 0
        v = v_ref[tok, :].astype(jnp.float32)  # [1, BV]
        s = jnp.exp(g).T * s  # [K, BV]
        if beta_ref is not None:  # the delta rule's correction of v by the state's prediction
            v = beta_ref[tok, :] * (v - jnp.sum(k.T * s, axis=0, keepdims=True))  # [1, BV]
        s = s + k.T * v
        o = jnp.sum(q.T * s, axis=0, keepdims=True) * scale  # [1, BV]
        o_ref[tok, :] = o.astype(o_ref.dtype)
        return s

    if num_tokens <= MAX_UNROLL:
        for t in range(num_tokens):
            s = step(t, s)
    else:
        s = lax.fori_loop(0, num_tokens, step, s)
    final_ref[...] = s


def recurrent_forward(q, k, v, gates, s0, *, scale: float, interpret: bool, beta=None,
                      group: int = 1, tile_elements: int = TILE_ELEMENTS,
                      num_warps: int = NUM_WARPS):
    """q, k [B, T, H, K] (any float dtype, read as float32); v [B, T, HV, V] (HV = H * group);
    gates [B, T, HV, K] f32 log gates; s0 [B, HV, K, V] f32 or None (zeros); beta [B, T, HV] (the
    delta rule) or None (GLA) -> (o [B, T, HV, V] in v's dtype, final [B, HV, K, V] f32). Value
    head j reads q, k head j // group. K and V must be 64, 128, 256 or 512, T a power of two.
    The state tile [K, BV] holds about `tile_elements` float32 across `num_warps` warps."""
    bsz, num_tokens, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[-1]
    for name, dim in (("K", key_dim), ("V", value_dim)):
        if dim not in DIMS:
            raise ValueError(f"recurrent_forward takes {name} in {DIMS} (pad first); "
                             f"got {name}={dim}")
    if (k.shape != q.shape or value_heads != heads * group
            or gates.shape != (bsz, num_tokens, value_heads, key_dim)
            or v.shape[:2] != q.shape[:2]
            or (beta is not None and beta.shape != v.shape[:3])):
        raise ValueError(f"shapes disagree (group {group}): q {q.shape}, k {k.shape}, "
                         f"v {v.shape}, gates {gates.shape}, "
                         f"beta {None if beta is None else beta.shape}")
    if s0 is not None and s0.shape != (bsz, value_heads, key_dim, value_dim):
        raise ValueError(f"s0 must be {(bsz, value_heads, key_dim, value_dim)}; got {s0.shape}")
    gates = gates.astype(jnp.float32)
    if s0 is not None:
        s0 = s0.astype(jnp.float32)
    if beta is not None:
        beta = beta.astype(jnp.float32)[..., None]  # [B, T, HV, 1]

    bv = block_v(key_dim, value_dim, tile_elements)
    grid = (bsz, value_heads, value_dim // bv)
    qk_spec = pl.BlockSpec((None, num_tokens, None, key_dim),
                           lambda b, h, j: (b, 0, h // group, 0))
    g_spec = pl.BlockSpec((None, num_tokens, None, key_dim), lambda b, h, j: (b, 0, h, 0))
    beta_spec = pl.BlockSpec((None, num_tokens, None, 1), lambda b, h, j: (b, 0, h, 0))
    y_spec = pl.BlockSpec((None, num_tokens, None, bv), lambda b, h, j: (b, 0, h, j))
    state_spec = pl.BlockSpec((None, None, key_dim, bv), lambda b, h, j: (b, h, 0, j))
    kernel = functools.partial(_kernel, num_tokens=num_tokens, scale=float(scale))
    name = "gla_recurrent_decode" if beta is None else "delta_rule_recurrent_decode"
    with jax.named_scope(f"{name}_block_v={bv}"):
        o, final = pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=[qk_spec, qk_spec, y_spec, g_spec, None if beta is None else beta_spec,
                      None if s0 is None else state_spec],
            out_specs=[y_spec, state_spec],
            out_shape=[
                jax.ShapeDtypeStruct((bsz, num_tokens, value_heads, value_dim), v.dtype),
                jax.ShapeDtypeStruct((bsz, value_heads, key_dim, value_dim), jnp.float32),
            ],
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
            interpret=interpret,
            name=name,
        )(q, k, v, gates, beta, s0)
    return o, final
