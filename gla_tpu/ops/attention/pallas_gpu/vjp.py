"""custom_vjp wiring of the GPU flash attention kernels.

The forward saves o and the base-2 log-sum-exp; the backward computes delta = rowsum(o * do)
once and runs the dq and dk/dv kernels (or, with plan.MosaicTiles.fused, the one-kernel Mosaic
GPU backward, whose float32 dq it scales and casts). Each side is Mosaic GPU where
plan.MosaicTiles names its tiles, Triton where it holds None. Arrays are [B, T, H, D], padded to the block multiples by
entry.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from gla_tpu.ops.attention.pallas_gpu import (kernels_mosaic_backward,
                                              kernels_mosaic_backward_fused,
                                              kernels_mosaic_forward,
                                              kernels_mosaic_forward_persistent)
from gla_tpu.ops.attention.pallas_gpu import kernels_triton as kernels


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def attention(q, k, v, q_seg, kv_seg, geo, sizes, tiles, interpret):
    """o [B, Tp, H, D] from q [B, Tp, H, D], k, v [B, Sp, Hkv, D], segment ids or None."""
    o, _ = forward(q, k, v, q_seg, kv_seg, geo, sizes, tiles.forward, interpret)
    return o


def forward(q, k, v, q_seg, kv_seg, geo, sizes, tiles, interpret):
    """(o [B, Tp, H, D] in q's dtype, base-2 lse [B, H, Tp] float32); `tiles`: the Mosaic GPU
    forward's, or None for the Triton one."""
    if tiles is not None:
        mosaic = kernels_mosaic_forward_persistent if tiles.persistent else kernels_mosaic_forward
        return mosaic.forward(q, k, v, q_seg, kv_seg, geo=geo, tiles=tiles, interpret=interpret)
    return kernels.forward(q, k, v, q_seg, kv_seg, geo=geo, block_q=sizes.block_q,
                           block_kv=sizes.block_kv, num_warps=sizes.num_warps,
                           num_stages=sizes.num_stages, interpret=interpret)


def _attention_fwd(q, k, v, q_seg, kv_seg, geo, sizes, tiles, interpret):
    o, lse = forward(q, k, v, q_seg, kv_seg, geo, sizes, tiles.forward, interpret)
    return o, (q, k, v, q_seg, kv_seg, o, lse)


def _attention_bwd(geo, sizes, tiles, interpret, residuals, do):
    q, k, v, q_seg, kv_seg, o, lse = residuals
    # delta_i = sum_d o_id do_id, [B, H, Tp]: one fused elementwise pass, left to XLA
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
    if tiles.fused:
        dq, dk, dv = kernels_mosaic_backward_fused.backward_fused(
            q, k, v, do, lse, delta, q_seg, kv_seg, geo=geo, tiles=tiles.backward,
            interpret=interpret)
        dq = (dq * geo.sm_scale).astype(q.dtype)  # one fused XLA pass over the float32 dq
    elif tiles.backward is not None:
        dq, dk, dv = mosaic_gradients(q, k, v, q_seg, kv_seg, do, lse, delta, geo,
                                      tiles.backward, interpret)
    else:
        dq, dk, dv = gradients(q, k, v, q_seg, kv_seg, do, lse, delta, geo, sizes, interpret)
    return dq, dk, dv, None, None


def mosaic_gradients(q, k, v, q_seg, kv_seg, do, lse, delta, geo, tiles, interpret, parts=1):
    """(dq, dk, dv) from the Mosaic GPU dq and dk/dv kernels (`tiles`: plan.BackwardTiles), in
    the inputs' dtype; parts = 2: each a [hi, lo] pair (kernels_mosaic_backward)."""
    common = dict(geo=geo, tiles=tiles, interpret=interpret, parts=parts)
    dq = kernels_mosaic_backward.backward_dq(q, k, v, do, lse, delta, q_seg, kv_seg, **common)
    if interpret:  # two GPU-interpreted kernels run side by side can deadlock: order them
        dq, q, k, v, do, lse, delta = lax.optimization_barrier((dq, q, k, v, do, lse, delta))
    dk, dv = kernels_mosaic_backward.backward_dkv(q, k, v, do, lse, delta, q_seg, kv_seg,
                                                  **common)
    return dq, dk, dv


def gradients(q, k, v, q_seg, kv_seg, do, lse, delta, geo, sizes, interpret, out_dtype=None):
    """(dq, dk, dv) from the base-2 lse and delta [B, H, Tp]: the dq and dk/dv kernels."""
    common = dict(geo=geo, num_stages=sizes.num_stages_bwd, interpret=interpret,
                  out_dtype=out_dtype)
    dq = kernels.backward_dq(q, k, v, q_seg, kv_seg, do, lse, delta, block_q=sizes.block_q_dq,
                             block_kv=sizes.block_kv_dq, num_warps=sizes.num_warps_dq, **common)
    dk, dv = kernels.backward_dkv(q, k, v, q_seg, kv_seg, do, lse, delta,
                                  block_q=sizes.block_q_dkv, block_kv=sizes.block_kv_dkv,
                                  num_warps=sizes.num_warps_dkv, **common)
    return dq, dk, dv


attention.defvjp(_attention_fwd, _attention_bwd)
