"""Entry of the "pallas_gpu" attention backend: what it takes, and the call.

Forward and backward are three kernels: forward (o and log-sum-exp), dq, and dk/dv
(kernels_triton.py, Triton lowering). On Hopper the forward is the Mosaic GPU kernel of
kernels_mosaic_forward.py (wgmma, TMA, warp specialization) where it applies, since it is the
faster one there; both forwards write the same o and lse, which the Triton backward consumes.
This module pads and picks the kernels and block sizes (plan.py); vjp.py wires the kernels.
docs/gpu_backend.md explains the choices and the measured speed.
"""

from __future__ import annotations

import math

from gla_tpu.ops.attention.pallas_gpu import vjp
from gla_tpu.ops.attention.pallas_gpu.plan import (BlockSizes, Geometry, default_block_sizes,
                                                   mosaic_forward_tiles)
from gla_tpu.ops.common.capabilities import ATTENTION_FEATURES, Capabilities, Dims
from gla_tpu.ops.common.padding import pad_time

CAPABILITIES = Capabilities(
    op="flash_attention", backend="pallas_gpu",
    platform="CUDA GPU (H100/H200; CPU with interpret=True)",
    dtypes=("bfloat16", "float16", "float32"),
    dims=(("head_dim", Dims(values=(16, 32, 64, 128, 256))),), features=ATTENTION_FEATURES,
    notes="forward: Mosaic GPU (wgmma, TMA, warp specialization) on Hopper at head_dim 64 / 128 "
          "in bf16 / f16 without segment_ids, Triton elsewhere; dq and dk/dv kernels: Triton",
    block_sizes=BlockSizes,
)


def check_supported(problem, block_sizes) -> None:
    CAPABILITIES.check(problem, block_sizes)


def flash_attention(q, k, v, *, problem, q_segment_ids, kv_segment_ids, block_sizes, interpret):
    sizes = block_sizes or default_block_sizes(problem.head_dim, problem.dtype)
    tiles = mosaic_forward_tiles(problem, sizes, bool(interpret))
    t, s = problem.q_len, problem.kv_len
    mq, mk = sizes.largest_q, sizes.largest_kv
    if tiles is not None:  # every block size is a power of two, or 2 x 64 / 2 x 128 rows
        mq, mk = math.lcm(mq, tiles.query_multiple), math.lcm(mk, tiles.block_kv)
    geo = Geometry(
        q_len=t, kv_len=s, padded_q=-(-t // mq) * mq, padded_kv=-(-s // mk) * mk,
        group=problem.num_heads // problem.num_kv_heads, causal=problem.causal,
        offset=s - t, sm_scale=float(problem.sm_scale), has_segments=problem.has_segments,
    )
    qp = pad_time(q, mq)
    kp, vp = pad_time(k, mk), pad_time(v, mk)
    q_seg = kv_seg = None
    if problem.has_segments:
        q_seg = pad_time(q_segment_ids, mq)
        kv_seg = pad_time(kv_segment_ids, mk)
    o = vjp.attention(qp, kp, vp, q_seg, kv_seg, geo, sizes, tiles, bool(interpret))
    return o[:, :t]


