"""Tiling plan of the Mosaic TPU flash attention: block sizes, their resolution against a
problem, VMEM footprints and the kernels' cost estimates (docs/attention_mosaic_tpu.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_tpu.ops.common.flops import attention_matmul_flops
from gla_tpu.ops.common.tpu import LANES, SUBLANES, target_tpu_info, tpu_interpret_params

# Sequence blocks are lane dims of the score tiles and of the lse/di/segment rows.
BLOCK_MULTIPLE = LANES

_BLOCK_FIELDS = (
    "block_q", "block_kv", "block_q_dq", "block_kv_dq", "block_q_dkv", "block_kv_dkv",
)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the three kernels (performance only; results do not depend on them).

    Sequence lengths shorter than a block shrink it to the next power-of-two multiple of 128 that
    covers them; longer ones are padded up to a multiple of the blocks and masked.

    Attributes:
      block_q, block_kv: forward tile of queries and of keys fetched per grid step.
      block_kv_compute: keys per inner step of the forward (divides block_kv); None = block_kv.
      block_q_dq, block_kv_dq: tiles of the dq kernel.
      block_q_dkv, block_kv_dkv: tiles of the dk/dv kernel.
      vmem_limit_bytes: scoped VMEM limit passed to Mosaic; None keeps the compiler's default.
      row_sum_on_mxu: whether the forward takes the softmax row sums on the MXU, as the extra
        128 output columns of p @ [ones | v], instead of reducing p on the VPU; bfloat16
        inputs only. None: where those columns fit in the MXU's width beside v's, i.e. at
        D <= 128 on 256-wide MXUs (v6e, 7x), where p @ v alone leaves half the array idle
        (docs/attention_mosaic_tpu.md, "Base-2 exponentials and row sums on the MXU").

    Example:
      >>> BlockSizes(block_q=256, block_kv=512, block_kv_compute=256)  # doctest: +ELLIPSIS
      BlockSizes(block_q=256, block_kv=512, block_kv_compute=256, ...)
    """

    block_q: int = 512
    block_kv: int = 512
    block_kv_compute: int | None = None
    block_q_dq: int = 512
    block_kv_dq: int = 512
    block_q_dkv: int = 512
    block_kv_dkv: int = 512
    vmem_limit_bytes: int | None = None
    row_sum_on_mxu: bool | None = None

    def __post_init__(self):
        for name in _BLOCK_FIELDS + ("block_kv_compute",):
            value = getattr(self, name)
            if value is None and name == "block_kv_compute":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"BlockSizes.{name} must be a positive int; got {value!r}.")
            if value % BLOCK_MULTIPLE:
                raise ValueError(
                    f"BlockSizes.{name}={value} must be a multiple of {BLOCK_MULTIPLE} "
                    "(sequence blocks are lane dims of the score tiles)."
                )
        if self.block_kv_compute is not None and self.block_kv % self.block_kv_compute:
            raise ValueError(
                f"BlockSizes.block_kv={self.block_kv} must be a multiple of "
                f"block_kv_compute={self.block_kv_compute}."
            )
        limit = self.vmem_limit_bytes
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit <= 0):
            raise ValueError(
                f"BlockSizes.vmem_limit_bytes must be None or a positive int; got {limit!r}."
            )
        if self.row_sum_on_mxu is not None and not isinstance(self.row_sum_on_mxu, bool):
            raise ValueError(
                f"BlockSizes.row_sum_on_mxu must be None, True or False; got "
                f"{self.row_sum_on_mxu!r}."
            )

    @classmethod
    def default(cls, head_dim: int, mxu_width: int | None = None) -> "BlockSizes":
        """Defaults that compile for v4, v5e, v5p, v6e and 7x in bfloat16 within the default
        scoped VMEM limit (docs/attention_mosaic_tpu.md has the footprints). On chips with
        256-wide MXUs (v6e, 7x) all three kernels take 1024 x 1024 tiles: libtpu's static
        estimate puts the forward's 13-30% below 512 x 512 there, and the backward's cut
        forward+backward by 9% (D 128) to 31% (D 256) (docs/benchmarks.md)."""
        if head_dim <= 128:
            sizes = cls()
        else:
            sizes = cls(block_q=512, block_kv=512, block_kv_compute=256, block_q_dq=256,
                        block_kv_dq=512, block_q_dkv=512, block_kv_dkv=256)
        if mxu_width is not None and mxu_width >= 256:
            sizes = dataclasses.replace(sizes, block_kv_compute=None, **{
                name: 1024 for name in _BLOCK_FIELDS})
        return sizes


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static description of one call: problem semantics plus resolved (clamped) block sizes."""

    batch: int
    num_heads: int  # H
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    q_len: int  # T, unpadded
    kv_len: int  # S, unpadded
    q_len_padded: int  # Tp
    kv_len_padded: int  # Sp
    causal: bool
    sm_scale: float
    has_segments: bool
    block_q: int
    block_kv: int
    block_kv_compute: int
    block_q_dq: int
    block_kv_dq: int
    block_q_dkv: int
    block_kv_dkv: int
    vmem_limit_bytes: int | None
    row_sum_on_mxu: bool  # forward: l from p @ [ones | v] (BlockSizes.row_sum_on_mxu)
    interpret: Any  # False or a pltpu.InterpretParams

    @property
    def group(self) -> int:
        """Query heads per kv head (G)."""
        return self.num_heads // self.num_kv_heads

    @property
    def offset(self) -> int:
        """Bottom-right causal shift: query i sees key j iff j <= i + offset."""
        return self.kv_len - self.q_len

    @property
    def kv_padded(self) -> bool:
        return self.kv_len_padded != self.kv_len


def _block_cap(length: int) -> int:
    """The smallest power-of-two multiple of 128 that covers `length`."""
    return BLOCK_MULTIPLE * (1 << max(0, math.ceil(math.log2(-(-length // BLOCK_MULTIPLE)))))


def _target_mxu_width() -> int | None:
    """The MXU width of the TPU being compiled for; None where there is none (CPU)."""
    info = target_tpu_info()
    return None if info is None else info.mxu_column_size


def _row_sum_on_mxu(requested: bool | None, dtype, head_dim: int, mxu_width: int | None) -> bool:
    """Resolves BlockSizes.row_sum_on_mxu for inputs of `dtype` on an MXU `mxu_width` wide."""
    sixteen_bit = jnp.dtype(dtype).itemsize == 2
    if requested is None:
        return sixteen_bit and mxu_width is not None and mxu_width >= LANES + head_dim
    if requested and not sixteen_bit:
        # p @ [ones | v] in float32 would sum p at the MXU's float32 precision, not the VPU's.
        raise ValueError(
            f"BlockSizes.row_sum_on_mxu=True needs bfloat16 inputs; got "
            f"{jnp.dtype(dtype).name}. Leave it None (or False) for float32."
        )
    return requested


def kernel_config(problem, block_sizes: BlockSizes | None, interpret) -> KernelConfig:
    """Resolves block sizes against the problem (clamping to short sequences) and pads lengths."""
    bs = block_sizes
    mxu_width = None if interpret else _target_mxu_width()
    if bs is None:
        bs = BlockSizes.default(problem.head_dim, mxu_width)
    q_cap, kv_cap = _block_cap(problem.q_len), _block_cap(problem.kv_len)
    bq, bq_dq, bq_dkv = (min(b, q_cap) for b in (bs.block_q, bs.block_q_dq, bs.block_q_dkv))
    bkv, bkv_dq, bkv_dkv = (min(b, kv_cap) for b in (bs.block_kv, bs.block_kv_dq,
                                                     bs.block_kv_dkv))
    bkc = min(bs.block_kv_compute or bkv, bkv)
    if bkv % bkc:
        bkc = bkv
    q_mult = math.lcm(bq, bq_dq, bq_dkv)
    kv_mult = math.lcm(bkv, bkv_dq, bkv_dkv)
    return KernelConfig(
        batch=problem.batch, num_heads=problem.num_heads, num_kv_heads=problem.num_kv_heads,
        head_dim=problem.head_dim, q_len=problem.q_len, kv_len=problem.kv_len,
        q_len_padded=-(-problem.q_len // q_mult) * q_mult,
        kv_len_padded=-(-problem.kv_len // kv_mult) * kv_mult,
        causal=problem.causal, sm_scale=float(problem.sm_scale),
        has_segments=problem.has_segments,
        block_q=bq, block_kv=bkv, block_kv_compute=bkc, block_q_dq=bq_dq, block_kv_dq=bkv_dq,
        block_q_dkv=bq_dkv, block_kv_dkv=bkv_dkv, vmem_limit_bytes=bs.vmem_limit_bytes,
        row_sum_on_mxu=_row_sum_on_mxu(bs.row_sum_on_mxu, problem.dtype, problem.head_dim,
                                       mxu_width),
        interpret=tpu_interpret_params(interpret),
    )


def vmem_estimate_bytes(kind: str, block_q: int, block_kv: int, head_dim: int, itemsize: int,
                        *, block_kv_compute: int | None = None, segments: bool = False) -> int:
    """VMEM footprint of one kernel from its block sizes (docs/attention_mosaic_tpu.md).

    Counts double-buffered input/output blocks, scratch, and the float32 [block_q, block_kv]
    temporaries the body keeps live (s, p, dp, ds) plus p's cast to the input dtype. A [1, n] row
    occupies 8 sublanes. Mosaic may reuse temporaries, so this is an upper-bound-style estimate.
    """
    bq, bkv, d = block_q, block_kv, head_dim
    rows = lambda n: SUBLANES * n * 4  # noqa: E731  a [1, n] float32/int32 row block
    seg = 2 * (rows(bq) + rows(bkv)) if segments else 0
    if kind == "fwd":
        bkc = block_kv_compute or bkv
        io = 2 * (bq * d + 2 * bkv * d) * itemsize + 2 * (bq * d * itemsize + rows(bq))
        scratch = 2 * bq * LANES * 4 + bq * d * 4
        temps = bq * bkc * (2 * 4 + itemsize)
    elif kind == "dq":
        io = 2 * (2 * bq * d + 2 * bkv * d) * itemsize + 2 * 2 * rows(bq) + 2 * bq * d * itemsize
        scratch = bq * d * 4
        temps = bq * bkv * (4 * 4 + itemsize)
    elif kind == "dkv":
        io = 2 * (2 * bq * d + 2 * bkv * d) * itemsize + 2 * 2 * rows(bq)
        io += 2 * 2 * bkv * d * itemsize
        scratch = 2 * bkv * d * 4
        temps = bq * bkv * (4 * 4 + itemsize)
    else:
        raise ValueError(f"kind must be 'fwd', 'dq' or 'dkv'; got {kind!r}.")
    return io + scratch + temps + seg


def cost_estimate(cfg: KernelConfig, *, passes: int, arrays, out_shape) -> pl.CostEstimate:
    """Matmul FLOPs of one kernel over the visible score matrix (passes=1 forward, 2 dq, 3 dk/dv),
    one exponential per score, and the bytes of its operands."""
    flops = attention_matmul_flops(cfg.batch, cfg.q_len, cfg.kv_len, cfg.num_heads,
                                   cfg.head_dim, causal=cfg.causal, matmuls=passes + 1)
    trans = cfg.batch * cfg.num_heads * cfg.q_len * cfg.kv_len
    nbytes = sum(a.size * a.dtype.itemsize for a in arrays if a is not None)
    nbytes += sum(o.size * jnp.dtype(o.dtype).itemsize for o in out_shape)
    return pl.CostEstimate(flops=int(flops), transcendentals=int(trans), bytes_accessed=int(nbytes))
