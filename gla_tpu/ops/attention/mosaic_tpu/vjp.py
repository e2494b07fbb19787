"""custom_vjp wiring of the Mosaic TPU flash attention kernels.

The custom_vjp takes and returns the API's [B, T, H, D] layout (padded to the blocks). The forward
reads that layout itself where `cfg.forward_reads_rows` (D = 128, blocks of all heads), and
head-major copies of q, k, v, made here, otherwise; the backward kernels read head-major copies of
q, k, v and do. o, dq, dk and dv are written in the API's layout where D is a multiple of 128
(`token_major_output`), head-major (then transposed) at D = 64. Forward saves q, k, v (head-major
where it made those copies), o, lse and the segment ids; the backward computes
di = rowsum(o * do) once and runs the one-kernel backward (`cfg.fused_backward`) or the dq and
dk/dv kernels, which recompute p = exp(s - lse) block by block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gla_tpu.ops.attention.mosaic_tpu.kernels import (
    flash_dkv,
    flash_dq,
    flash_dqkv,
    flash_forward,
    flash_forward_rows,
)
from gla_tpu.ops.attention.mosaic_tpu.plan import KernelConfig


def token_major_output(cfg: KernelConfig) -> bool:
    """Whether the kernels write o, dq, dk and dv token-major, [B, N, Hx, D] (their last two dims
    (Hx, D) as one Hx * D axis of (block, D) blocks, D a multiple of 128), instead of head-major
    [B, Hx, N, D]: the API's layout, with no transpose after the kernels."""
    return cfg.head_dim % 128 == 0


def _head_major(x):
    """[B, N, Hx, D] -> [B, Hx, N, D]."""
    return jnp.swapaxes(x, 1, 2)


def _api_layout(cfg: KernelConfig, x):
    """A kernel output -> [B, N, Hx, D]: a free reshape of [B, N, Hx * D], or a transpose."""
    if token_major_output(cfg):
        b, n, _ = x.shape
        return x.reshape(b, n, -1, cfg.head_dim)
    return _head_major(x)


def _forward(cfg, q, k, v, q_seg, kv_seg):
    """(o [B, Tp, H, D], lse [B, H, 1, Tp], the q, k, v the backward starts from: head-major
    copies where the forward made them, else q, k, v as given)."""
    if cfg.forward_reads_rows:
        o, lse = flash_forward_rows(cfg, q, k, v, q_seg, kv_seg)
        return o, lse, (q, k, v)
    qh, kh, vh = _head_major(q), _head_major(k), _head_major(v)
    o, lse = flash_forward(cfg, qh, kh, vh, q_seg, kv_seg,
                           token_major_out=token_major_output(cfg))
    return _api_layout(cfg, o), lse, (qh, kh, vh)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attention(cfg: KernelConfig, q, k, v, q_seg, kv_seg):
    """o [B, Tp, H, D] from q [B, Tp, H, D], k, v [B, Sp, Hkv, D] (padded), segment rows or None."""
    return _forward(cfg, q, k, v, q_seg, kv_seg)[0]


def _attention_fwd(cfg, q, k, v, q_seg, kv_seg):
    o, lse, qkv = _forward(cfg, q, k, v, q_seg, kv_seg)
    return o, (*qkv, q_seg, kv_seg, o, lse)


def _attention_bwd(cfg, residuals, do):
    """Residuals: q, k, v (head-major unless the forward read rows), the segment rows,
    o [B, Tp, H, D] and lse; do as o. Returns (dq, dk, dv) in the API's layout and no cotangent
    for the segment ids."""
    q, k, v, q_seg, kv_seg, o, lse = residuals
    with jax.named_scope("flash_bwd_di"):
        di = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, Tp, H]
    di_rows = jnp.swapaxes(di, 1, 2)[:, :, None, :]  # [B, H, 1, Tp], as lse
    qh, kh, vh = (_head_major(x) for x in (q, k, v)) if cfg.forward_reads_rows else (q, k, v)
    doh = _head_major(do)
    token_major = token_major_output(cfg)
    if cfg.fused_backward:
        dq, dk, dv = flash_dqkv(cfg, qh, kh, vh, doh, lse, di_rows, q_seg, kv_seg,
                                token_major_out=token_major)
    else:
        dq = flash_dq(cfg, qh, kh, vh, doh, lse, di_rows, q_seg, kv_seg,
                      token_major_out=token_major)
        dk, dv = flash_dkv(cfg, qh, kh, vh, doh, lse, di_rows, q_seg, kv_seg,
                           token_major_out=token_major)
    return _api_layout(cfg, dq), _api_layout(cfg, dk), _api_layout(cfg, dv), None, None


attention.defvjp(_attention_fwd, _attention_bwd)
