"""Pallas (Triton lowering) kernel of the GLA chunk-state pass on GPU, forward and reversed.

One program per (batch, head, K block, V block) loops over the chunks: forward
h_{n+1} = keep_n exp(B_n) h_n + (k exp(B_n - b) last)^T v, or reversed for the backward
dh_n = keep_n exp(B_n) dh_{n+1} + (q exp(b) reach scale)^T do: one kernel, two directions.
Notation of kernels_intra.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from gla_tpu.ops.common.products import accurate_product
from gla_tpu.ops.gla.pallas_gpu.plan import ChunkGeometry, compiler_params


def _state_kernel(x_ref, y_ref, b_ref, w_ref, keep_ref, init_ref, states_ref, final_ref, *,
                  geo: ChunkGeometry, reverse: bool):
    c = geo.chunk
    if init_ref is None:
        h = jnp.zeros((geo.block_k, geo.block_v), jnp.float32)
    else:
        h = init_ref[...]

    def body(step, h):
        n = geo.num_chunks - 1 - step if reverse else step
        rows = pl.ds(n * c, c)
        states_ref[n, :, :] = h.astype(states_ref.dtype)
        b = b_ref[rows, :]  # [C, BK]
        b_last = b_ref[pl.ds(n * c + c - 1, 1), :]  # [1, BK]
        x = x_ref[rows, :]
        if reverse:
            weight = jnp.exp(b) * geo.scale  # exp(b) <= 1
        else:
            weight = jnp.exp(b_last - b)  # exponent <= 0
        if w_ref is not None:
            weight = weight * w_ref[rows][:, None]
        decay = jnp.exp(b_last)  # [1, BK]
        if keep_ref is not None:
            decay = decay * keep_ref[pl.ds(n, 1)][:, None]
        # the gated operand stays float32 (split-bfloat16 product: measured no slower than a
        # bfloat16 one, the pass being latency-bound)
        xw = x.astype(jnp.float32) * weight
        return h * decay.T + accurate_product(xw, y_ref[rows, :], "tn", x.dtype)

    h = lax.fori_loop(0, geo.num_chunks, body, h)
    final_ref[...] = h
    if not reverse:
        states_ref[geo.num_chunks, :, :] = h.astype(states_ref.dtype)


def state_pass(x, y, b, w, keep, init, *, geo: ChunkGeometry, reverse: bool, interpret):
    """x [B, Tp, H, K], y [B, Tp, H, V], b [B, Tp, H, K] f32, w [B, Tp] | None, keep [B, N] | None,
    init [B, H, K, V] f32 | None -> (states, final [B, H, K, V] f32): states [B, H, N + 1, K, V]
    forward (entering each chunk, then the final state), [B, H, N, K, V] reversed (the gradient
    of the state leaving each chunk), in geo.state_dtype; `final` is float32."""
    bsz, tp, h, _ = x.shape
    bk, bv = geo.block_k, geo.block_v
    grid = (bsz, h, geo.key_dim // bk, geo.value_dim // bv)
    x_spec = pl.BlockSpec((None, tp, None, bk), lambda bi, hi, ki, vi: (bi, 0, hi, ki))
    y_spec = pl.BlockSpec((None, tp, None, bv), lambda bi, hi, ki, vi: (bi, 0, hi, vi))
    w_spec = None if w is None else pl.BlockSpec((None, tp), lambda bi, hi, ki, vi: (bi, 0))
    keep_spec = None if keep is None else pl.BlockSpec((None, geo.num_chunks),
                                                       lambda bi, hi, ki, vi: (bi, 0))
    kv_spec = pl.BlockSpec((None, None, bk, bv), lambda bi, hi, ki, vi: (bi, hi, ki, vi))
    init_spec = None if init is None else kv_spec
    n_states = geo.num_chunks + (0 if reverse else 1)
    states_spec = pl.BlockSpec((None, None, n_states, bk, bv),
                               lambda bi, hi, ki, vi: (bi, hi, 0, ki, vi))
    kernel = functools.partial(_state_kernel, geo=geo, reverse=reverse)
    direction = "reverse" if reverse else "forward"
    with jax.named_scope(f"gla_state_pass_{direction}_block_k={bk}_block_v={bv}"):
        return pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=[x_spec, y_spec, x_spec, w_spec, keep_spec, init_spec],
            out_specs=[states_spec, kv_spec],
            out_shape=[
                jax.ShapeDtypeStruct((bsz, h, n_states, geo.key_dim, geo.value_dim),
                                     geo.state_dtype),
                jax.ShapeDtypeStruct((bsz, h, geo.key_dim, geo.value_dim), jnp.float32),
            ],
            compiler_params=compiler_params(geo),
            interpret=interpret,
            name=f"gla_state_pass_{direction}",
        )(x, y, b, w, keep, init)


