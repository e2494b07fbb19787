"""custom_vjp wiring of the Mosaic TPU flash attention kernels.

Forward saves (q, k, v, o, lse) and the segment ids; the backward computes di = rowsum(o * do) once
and runs the dq and dk/dv kernels, which recompute p = exp(s - lse) block by block.
Arrays are head-major and padded as in `kernels.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gla_tpu.ops.attention.mosaic_tpu.kernels import flash_dkv, flash_dq, flash_forward
from gla_tpu.ops.attention.mosaic_tpu.plan import KernelConfig


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(cfg: KernelConfig, q, k, v, q_seg, kv_seg):
    """o [B, H, Tp, D] from q [B, H, Tp, D], k, v [B, Hkv, Sp, D], segment rows or None."""
    o, _ = flash_forward(cfg, q, k, v, q_seg, kv_seg)
    return o


def _attention_fwd(cfg, q, k, v, q_seg, kv_seg):
    o, lse = flash_forward(cfg, q, k, v, q_seg, kv_seg)
    return o, (q, k, v, q_seg, kv_seg, o, lse)


def _attention_bwd(cfg, residuals, do):
    q, k, v, q_seg, kv_seg, o, lse = residuals
    with jax.named_scope("flash_bwd_di"):
        di = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, H, Tp]
    di_rows = di[:, :, None, :]  # [B, H, 1, Tp], as lse
    dq = flash_dq(cfg, q, k, v, do, lse, di_rows, q_seg, kv_seg)
    dk, dv = flash_dkv(cfg, q, k, v, do, lse, di_rows, q_seg, kv_seg)
    # Segment ids are integers: no cotangent.
    return dq, dk, dv, None, None


attention.defvjp(_attention_fwd, _attention_bwd)
