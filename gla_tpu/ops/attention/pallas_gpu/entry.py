"""Entry of the "pallas_gpu" attention backend: what it takes, and the call.

Forward and backward are three kernels: forward (o and log-sum-exp), dq, and dk/dv
(kernels_triton.py, Triton lowering). On Hopper the Mosaic GPU kernels (wgmma, TMA, warp
specialization) of kernels_mosaic_forward.py and kernels_mosaic_backward.py take their place
where they apply, since they are the faster ones there; both forwards write the same o and lse,
which either backward consumes. Ring attention's block gradients (float32) come from the same
kernels: the Mosaic GPU pair writes each gradient in two parts of the input dtype.
This module pads and picks the kernels and block sizes (plan.py); vjp.py wires the kernels.
docs/gpu_attention.md explains the choices and the measured speed.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from gla_tpu.ops.attention.pallas_gpu import vjp
from gla_tpu.ops.attention.pallas_gpu.plan import (BlockSizes, Geometry, default_block_sizes,
                                                   mosaic_tiles)
from gla_tpu.ops.common.base2 import LN_2
from gla_tpu.ops.common.capabilities import ATTENTION_FEATURES, Capabilities, Dims
from gla_tpu.ops.common.padding import pad_time


CAPABILITIES = Capabilities(
    op="flash_attention", backend="pallas_gpu",
    platform="CUDA GPU (H100/H200; CPU with interpret=True)",
    dtypes=("bfloat16", "float16", "float32"),
    dims=(("head_dim", Dims(values=(16, 32, 64, 128, 256))),), features=ATTENTION_FEATURES,
    notes="forward: Mosaic GPU (wgmma, TMA, warp specialization; persistent, one block per SM) "
          "on Hopper at head_dim 64 / 128 / 256 in bf16 / f16, Triton elsewhere; dq and dk/dv "
          "kernels: Mosaic GPU on Hopper under the same conditions, Triton elsewhere; blocks "
          "outside the causal mask or the window skipped",
    block_sizes=BlockSizes,
)


# The Mosaic GPU kernels' TMA copies tile a [B, T, H, D] array's T in rows of 8 (SWIZZLED): an
# unpadded array's T must be a multiple of it (Mosaic GPU refuses the copy otherwise)
TMA_ROWS = 8


def check_supported(problem, block_sizes) -> None:
    CAPABILITIES.check(problem, block_sizes)


def _prepare(q, k, v, problem, q_segment_ids, kv_segment_ids, block_sizes, interpret,
             empty_row_lse=0.0, may_skip_padding=False):
    """Block sizes, the Mosaic GPU kernels' tiles (plan.MosaicTiles), geometry, and the inputs
    padded to it (q, k, v left as they come where `may_skip_padding`, BlockSizes.mosaic_unpadded
    and both sides run Mosaic GPU kernels, whose TMA copies read zeros past an array's end, and
    T and S are multiples of TMA_ROWS)."""
    sizes = block_sizes or default_block_sizes(problem.head_dim, problem.dtype)
    tiles = mosaic_tiles(problem, sizes, bool(interpret))
    t, s = problem.q_len, problem.kv_len
    # every block size is a power of two, or 2 x 64 / 2 x 128 rows
    mq = math.lcm(sizes.largest_q, tiles.query_multiple)
    mk = math.lcm(sizes.largest_kv, tiles.key_multiple)
    geo = Geometry(
        q_len=t, kv_len=s, padded_q=-(-t // mq) * mq, padded_kv=-(-s // mk) * mk,
        group=problem.num_heads // problem.num_kv_heads, causal=problem.causal,
        offset=s - t, sm_scale=float(problem.sm_scale), has_segments=problem.has_segments,
        window=problem.window, soft_cap=problem.logits_soft_cap, empty_row_lse=empty_row_lse,
    )
    q_seg = kv_seg = None
    if problem.has_segments:
        q_seg = pad_time(q_segment_ids, mq)
        kv_seg = pad_time(kv_segment_ids, mk)
    if (may_skip_padding and sizes.mosaic_unpadded and tiles.forward is not None
            and tiles.backward is not None and t % TMA_ROWS == 0 and s % TMA_ROWS == 0):
        return sizes, tiles, geo, (q, k, v, q_seg, kv_seg)
    padded = (pad_time(q, mq), pad_time(k, mk), pad_time(v, mk), q_seg, kv_seg)
    return sizes, tiles, geo, padded


def flash_attention(q, k, v, *, problem, q_segment_ids, kv_segment_ids, block_sizes, interpret):
    sizes, tiles, geo, padded = _prepare(q, k, v, problem, q_segment_ids, kv_segment_ids,
                                         block_sizes, interpret, may_skip_padding=True)
    o = vjp.attention(*padded, geo, sizes, tiles, bool(interpret))
    return o[:, : problem.q_len]


# The blocks of ring attention (ops/attention/ring.py): one (query block, key block) pair.


def attention_block(q, k, v, *, problem, q_segment_ids, kv_segment_ids, block_sizes, interpret):
    """o [B, T, H, D] float32 over this block's keys (rounded to q's dtype by the kernel first)
    and lse [B, H, T] float32, natural log, -inf for a row that sees no key of the block; as
    `xla.attention_block`."""
    # a row that sees no key of the block gets lse = -inf (o = 0): no weight in the ring's merge
    sizes, tiles, geo, padded = _prepare(q, k, v, problem, q_segment_ids, kv_segment_ids,
                                         block_sizes, interpret, empty_row_lse=-jnp.inf)
    o, lse2 = vjp.forward(*padded, geo, sizes, tiles.forward, bool(interpret))
    lse = lse2[:, :, : problem.q_len] * LN_2
    return o[:, : problem.q_len].astype(jnp.float32), lse


def attention_block_grads(q, k, v, do, lse, delta, *, problem, q_segment_ids, kv_segment_ids,
                          block_sizes, interpret):
    """This block's float32 dq [B, T, H, D], dk, dv [B, S, Hkv, D] given the whole attention's
    lse and delta [B, H, T]; as `xla.attention_block_grads`."""
    sizes, tiles, geo, (qp, kp, vp, q_seg, kv_seg) = _prepare(
        q, k, v, problem, q_segment_ids, kv_segment_ids, block_sizes, interpret)
    tp = geo.padded_q
    # base-2 lse; +inf (p = 0) for a row that sees no key anywhere; padded rows have do = 0
    lse2 = pad_time(jnp.where(jnp.isfinite(lse), lse / LN_2, jnp.inf), tp, axis=2)
    args = (qp, kp, vp, q_seg, kv_seg, pad_time(do, tp), lse2, pad_time(delta, tp, axis=2))
    if tiles.backward is not None:
        dq, dk, dv = vjp.mosaic_gradients(*args, geo, tiles.backward, bool(interpret), parts=2)
        # each in two parts of q's dtype (hi + lo), summed in float32: 16 bits of mantissa
        dq, dk, dv = (hi.astype(jnp.float32) + lo.astype(jnp.float32) for hi, lo in (dq, dk, dv))
    else:
        dq, dk, dv = vjp.gradients(*args, geo, sizes, bool(interpret), out_dtype=jnp.float32)
    return dq[:, : problem.q_len], dk[:, : problem.kv_len], dv[:, : problem.kv_len]
