"""custom_vjp wiring of the Mosaic TPU flash attention kernels.

Forward saves (q, k, v, o, lse) and the segment ids; the backward computes di = rowsum(o * do) once
and runs the dq and dk/dv kernels, which recompute p = exp(s - lse) block by block.
Arrays are head-major and padded as in `kernels.py`, except o (and so do), which is [B, Tp, H, D]
where D is a multiple of 128 (`token_major_output`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gla_tpu.ops.attention.mosaic_tpu.kernels import flash_dkv, flash_dq, flash_forward
from gla_tpu.ops.attention.mosaic_tpu.plan import KernelConfig


def token_major_output(cfg: KernelConfig) -> bool:
    """Whether the forward writes o token-major, [B, Tp, H, D] (its last two dims (H, D) as one
    H * D axis of (block, D) blocks, D a multiple of 128), instead of head-major [B, H, Tp, D]:
    the API's layout, with no transpose after the kernel."""
    return cfg.head_dim % 128 == 0


def _forward(cfg, q, k, v, q_seg, kv_seg):
    if not token_major_output(cfg):
        return flash_forward(cfg, q, k, v, q_seg, kv_seg)
    b, h, tp, d = q.shape
    o, lse = flash_forward(cfg, q, k, v, q_seg, kv_seg, token_major_out=True)
    return o.reshape(b, tp, h, d), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(cfg: KernelConfig, q, k, v, q_seg, kv_seg):
    """o from q [B, H, Tp, D], k, v [B, Hkv, Sp, D], segment rows or None: [B, Tp, H, D] where
    `token_major_output(cfg)`, else [B, H, Tp, D]."""
    o, _ = _forward(cfg, q, k, v, q_seg, kv_seg)
    return o


def _attention_fwd(cfg, q, k, v, q_seg, kv_seg):
    o, lse = _forward(cfg, q, k, v, q_seg, kv_seg)
    return o, (q, k, v, q_seg, kv_seg, o, lse)


def _attention_bwd(cfg, residuals, do):
    q, k, v, q_seg, kv_seg, o, lse = residuals
    with jax.named_scope("flash_bwd_di"):
        di = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    if token_major_output(cfg):
        di = jnp.swapaxes(di, 1, 2)  # [B, Tp, H] -> [B, H, Tp]
        do = jnp.swapaxes(do, 1, 2)  # the kernels read do head-major
    di_rows = di[:, :, None, :]  # [B, H, 1, Tp], as lse
    dq = flash_dq(cfg, q, k, v, do, lse, di_rows, q_seg, kv_seg)
    dk, dv = flash_dkv(cfg, q, k, v, do, lse, di_rows, q_seg, kv_seg)
    # Segment ids are integers: no cotangent.
    return dq, dk, dv, None, None


attention.defvjp(_attention_fwd, _attention_bwd)
