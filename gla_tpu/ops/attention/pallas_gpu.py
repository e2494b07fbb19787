"""The "pallas_gpu" attention backend: flash attention in Pallas on NVIDIA GPUs.

Forward and backward are three kernels: forward (o and log-sum-exp), dq, and dk/dv
(pallas_gpu_kernels.py, Triton lowering). On Hopper the forward is the Mosaic GPU kernel of
mosaic_gpu_forward.py (wgmma, TMA, warp specialization) where it applies, since it is the faster
one there; both forwards write the same o and lse, which the Triton backward consumes. This module
pads, picks the kernels and block sizes and wires them with `jax.custom_vjp`.
docs/gpu_backend.md explains the choices and the measured speed.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from gla_tpu.ops.common.backends import require_gpu_dtype
from gla_tpu.ops.attention import mosaic_gpu_forward
from gla_tpu.ops.attention import pallas_gpu_kernels as kernels
from gla_tpu.ops.attention.mosaic_gpu_forward import ForwardTiles
from gla_tpu.ops.common.gating import pad_time

HEAD_DIMS = (16, 32, 64, 128, 256)
FORWARD_KERNELS = ("auto", "mosaic_gpu", "triton")


def _power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of the three kernels (performance only). Every block is a power of two >= 16.

    `forward_kernel` picks the forward: "auto" takes the Mosaic GPU kernel on Hopper where it
    applies (head dim 64 / 128, bfloat16 / float16, no segment ids) and Triton elsewhere;
    "mosaic_gpu" insists on it (NotImplementedError where it does not apply), "triton" never uses it.
    `mosaic_forward` holds its tiles.
    """

    block_q: int = 128
    block_kv: int = 64
    block_q_dq: int = 128
    block_kv_dq: int = 32
    block_q_dkv: int = 32
    block_kv_dkv: int = 128
    num_warps: int = 8
    num_warps_dq: int = 8
    num_warps_dkv: int = 8
    num_stages: int = 3
    num_stages_bwd: int = 2
    forward_kernel: str = "auto"
    mosaic_forward: ForwardTiles = ForwardTiles()

    def __post_init__(self):
        if self.forward_kernel not in FORWARD_KERNELS:
            raise ValueError(f"BlockSizes.forward_kernel={self.forward_kernel!r} must be one of "
                             f"{FORWARD_KERNELS}.")
        if not isinstance(self.mosaic_forward, ForwardTiles):
            raise ValueError(f"BlockSizes.mosaic_forward={self.mosaic_forward!r} must be a "
                             "mosaic_gpu_forward.ForwardTiles.")
        for name in ("block_q", "block_kv", "block_q_dq", "block_kv_dq", "block_q_dkv",
                     "block_kv_dkv"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 16 and _power_of_two(value)):
                raise ValueError(f"BlockSizes.{name}={value!r} must be a power of two >= 16.")
        for name in ("num_warps", "num_warps_dq", "num_warps_dkv"):
            value = getattr(self, name)
            if value not in (1, 2, 4, 8, 16):
                raise ValueError(f"BlockSizes.{name}={value!r} must be one of 1, 2, 4, 8, 16.")
        for name in ("num_stages", "num_stages_bwd"):
            value = getattr(self, name)
            if not (isinstance(value, int) and 1 <= value <= 8):
                raise ValueError(f"BlockSizes.{name}={value!r} must be an int in [1, 8].")

    @property
    def largest_q(self) -> int:
        return max(self.block_q, self.block_q_dq, self.block_q_dkv)

    @property
    def largest_kv(self) -> int:
        return max(self.block_kv, self.block_kv_dq, self.block_kv_dkv)


def default_block_sizes(head_dim: int, dtype) -> BlockSizes:
    """Tiles that fit Hopper's 227 KiB of shared memory per block at this head dim and dtype."""
    wide = jnp.dtype(dtype).itemsize == 4
    if head_dim <= 64:
        sizes = BlockSizes(128, 64, 128, 32, 32, 128, num_warps=4, num_warps_dq=4,
                           num_warps_dkv=4, num_stages=3, num_stages_bwd=3)
    elif head_dim <= 128:
        # the best of a sweep on the H200 (docs/gpu_backend.md): forward 128x128, 8 warps,
        # 3 stages; both backward kernels 64x64 with 4 warps, 2 stages
        sizes = BlockSizes(128, 128, 64, 64, 64, 64, num_warps=8, num_warps_dq=4,
                           num_warps_dkv=4, num_stages=3, num_stages_bwd=2)
    else:
        sizes = BlockSizes(64, 32, 64, 32, 32, 64, num_warps=8, num_warps_dq=8,
                           num_warps_dkv=8, num_stages=2, num_stages_bwd=1)
    if wide:
        sizes = dataclasses.replace(
            sizes, block_q=max(16, sizes.block_q // 2), block_kv=max(16, sizes.block_kv // 2),
            block_q_dq=max(16, sizes.block_q_dq // 2), block_kv_dkv=max(16, sizes.block_kv_dkv // 2),
            num_stages=min(sizes.num_stages, 2), num_stages_bwd=1)
    return sizes


def check_supported(problem, block_sizes) -> None:
    if problem.head_dim not in HEAD_DIMS:
        raise NotImplementedError(
            f"the 'pallas_gpu' flash_attention takes head dims {HEAD_DIMS}; got D={problem.head_dim}. "
            "backend='xla' takes any head dim."
        )
    require_gpu_dtype("flash_attention", problem.dtype)
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise NotImplementedError(
            f"block_sizes={block_sizes!r} is not a pallas_gpu BlockSizes; pass "
            "gla_tpu.ops.attention.pallas_gpu.BlockSizes(...) or None."
        )


def _is_hopper() -> bool:
    try:
        device = jax.local_devices(backend="gpu")[0]
    except RuntimeError:  # no GPU backend
        return False
    return str(getattr(device, "compute_capability", "")).startswith("9.")


def mosaic_forward_tiles(problem, sizes: BlockSizes, interpret: bool) -> ForwardTiles | None:
    """The Mosaic GPU forward's tiles when it runs this problem, None when Triton does.

    "auto" takes it on a Hopper GPU only (in interpret mode it stays with Triton, whose CPU
    interpreter is the tested default); "mosaic_gpu" takes it anywhere it applies.
    """
    if sizes.forward_kernel == "triton":
        return None
    reason = mosaic_gpu_forward.unsupported_reason(problem.head_dim, problem.dtype,
                                                   problem.has_segments)
    if sizes.forward_kernel == "mosaic_gpu":
        if reason is not None:
            raise NotImplementedError(
                f"BlockSizes(forward_kernel='mosaic_gpu') cannot take {reason}; "
                "forward_kernel='auto' or 'triton' can.")
    elif reason is not None or interpret or not _is_hopper():
        return None
    mosaic_gpu_forward.check_tiles(sizes.mosaic_forward, problem.head_dim)
    return sizes.mosaic_forward


def flash_attention(q, k, v, *, problem, q_segment_ids, kv_segment_ids, block_sizes, interpret):
    check_supported(problem, block_sizes)
    sizes = block_sizes or default_block_sizes(problem.head_dim, problem.dtype)
    tiles = mosaic_forward_tiles(problem, sizes, bool(interpret))
    t, s = problem.q_len, problem.kv_len
    mq, mk = sizes.largest_q, sizes.largest_kv
    if tiles is not None:  # every block size is a power of two, or 2 x 64 / 2 x 128 rows
        mq, mk = math.lcm(mq, tiles.query_multiple), math.lcm(mk, tiles.block_kv)
    geo = kernels.Geometry(
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
    o = _attention(qp, kp, vp, q_seg, kv_seg, geo, sizes, tiles, bool(interpret))
    return o[:, :t]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attention(q, k, v, q_seg, kv_seg, geo, sizes, tiles, interpret):
    o, _ = _forward(q, k, v, q_seg, kv_seg, geo, sizes, tiles, interpret)
    return o


def _forward(q, k, v, q_seg, kv_seg, geo, sizes, tiles, interpret):
    if tiles is not None:
        return mosaic_gpu_forward.forward(q, k, v, geo=geo, tiles=tiles, interpret=interpret)
    return kernels.forward(q, k, v, q_seg, kv_seg, geo=geo, block_q=sizes.block_q,
                           block_kv=sizes.block_kv, num_warps=sizes.num_warps,
                           num_stages=sizes.num_stages, interpret=interpret)


def _attention_fwd(q, k, v, q_seg, kv_seg, geo, sizes, tiles, interpret):
    o, lse = _forward(q, k, v, q_seg, kv_seg, geo, sizes, tiles, interpret)
    return o, (q, k, v, q_seg, kv_seg, o, lse)


def _attention_bwd(geo, sizes, tiles, interpret, residuals, do):
    q, k, v, q_seg, kv_seg, o, lse = residuals
    # delta_i = sum_d o_id do_id, [B, H, Tp]: one fused elementwise pass, left to XLA
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
    common = dict(geo=geo, num_stages=sizes.num_stages_bwd, interpret=interpret)
    dq = kernels.backward_dq(q, k, v, q_seg, kv_seg, do, lse, delta, block_q=sizes.block_q_dq,
                             block_kv=sizes.block_kv_dq, num_warps=sizes.num_warps_dq, **common)
    dk, dv = kernels.backward_dkv(q, k, v, q_seg, kv_seg, do, lse, delta,
                                  block_q=sizes.block_q_dkv, block_kv=sizes.block_kv_dkv,
                                  num_warps=sizes.num_warps_dkv, **common)
    return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
