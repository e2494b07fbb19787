"""The "mosaic_tpu" attention backend: softmax flash attention as Pallas TPU (Mosaic) kernels.

Forward and backward (dq; dk/dv) kernels live in `mosaic_tpu_kernels.py`, the custom_vjp wiring in
`mosaic_tpu_vjp.py`; this module holds the performance knobs (`BlockSizes`), the capability check
and the layout step: [B, T, H, D] inputs become head-major [B, H, Tp, D] copies padded to the block
grid, so that every block's last two dims are (block, D) with D the full dim (D = 64 included).
Design, VMEM footprints and roofline: docs/attention_mosaic_tpu.md.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from gla_tpu.ops.attention import mosaic_tpu_vjp
from gla_tpu.ops.attention.mosaic_tpu_kernels import NUM_LANES, KernelConfig
from gla_tpu.ops.common.gating import pad_time
from gla_tpu.ops.common.tpu_interpret import tpu_interpret_params

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# Sequence blocks are lane dims of the score tiles and of the lse/di/segment rows.
BLOCK_MULTIPLE = NUM_LANES

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

    @classmethod
    def default(cls, head_dim: int) -> "BlockSizes":
        """Defaults that compile for v4, v5e, v5p, v6e and 7x in bfloat16 within the default
        scoped VMEM limit (docs/attention_mosaic_tpu.md has the footprints)."""
        if head_dim <= 128:
            return cls()
        return cls(block_q=512, block_kv=512, block_kv_compute=256, block_q_dq=256,
                   block_kv_dq=512, block_q_dkv=512, block_kv_dkv=256)


def check_supported(problem, block_sizes) -> None:
    """Raises NotImplementedError for a problem this backend cannot take, ValueError for bad knobs."""
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise ValueError(
            "block_sizes for backend='mosaic_tpu' must be None or "
            f"gla_tpu.ops.attention.mosaic_tpu.BlockSizes; got {block_sizes!r}."
        )
    if problem.head_dim not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(
            f"the 'mosaic_tpu' flash_attention kernel takes head_dim in {SUPPORTED_HEAD_DIMS}; "
            f"got head_dim={problem.head_dim}. backend='xla' takes any head_dim."
        )
    if jnp.dtype(problem.dtype) not in SUPPORTED_DTYPES:
        raise NotImplementedError(
            "the 'mosaic_tpu' flash_attention kernel takes bfloat16 or float32 inputs; got "
            f"{jnp.dtype(problem.dtype).name}. backend='xla' takes any floating dtype."
        )


def _block_cap(length: int) -> int:
    """The smallest power-of-two multiple of 128 that covers `length`."""
    return BLOCK_MULTIPLE * (1 << max(0, math.ceil(math.log2(-(-length // BLOCK_MULTIPLE)))))


def kernel_config(problem, block_sizes: BlockSizes | None, interpret) -> KernelConfig:
    """Resolves block sizes against the problem (clamping to short sequences) and pads lengths."""
    bs = block_sizes if block_sizes is not None else BlockSizes.default(problem.head_dim)
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
        interpret=tpu_interpret_params(interpret),
    )


def _head_major(x, length_padded: int):
    """[B, T, H, D] -> [B, H, Tp, D], zero-padded along time."""
    return pad_time(jnp.swapaxes(x, 1, 2), length_padded, axis=2)


def _segment_rows(seg, length_padded: int):
    """[B, T] int32 -> [B, 1, Tp] (padding is masked by position, its id does not matter)."""
    return pad_time(seg, length_padded, axis=1)[:, None, :]


def flash_attention(q, k, v, *, problem, q_segment_ids, kv_segment_ids, block_sizes, interpret):
    """Backend entry called by `gla_tpu.ops.flash_attention` after validation.

    Args:
      q: [B, T, H, D]; k, v: [B, S, Hkv, D] (bfloat16 or float32, D in SUPPORTED_HEAD_DIMS).
      problem: the validated AttentionProblem.
      q_segment_ids, kv_segment_ids: [B, T], [B, S] int32, or both None.
      block_sizes: BlockSizes or None for `BlockSizes.default(D)`.
      interpret: False, True (TPU interpret mode, NaN-filled uninitialized memory) or
        a pltpu.InterpretParams.
    Returns:
      o: [B, T, H, D] in q's dtype.
    """
    check_supported(problem, block_sizes)
    cfg = kernel_config(problem, block_sizes, interpret)
    qh = _head_major(q, cfg.q_len_padded)  # [B, H, Tp, D]
    kh = _head_major(k, cfg.kv_len_padded)  # [B, Hkv, Sp, D]
    vh = _head_major(v, cfg.kv_len_padded)
    q_seg = kv_seg = None
    if problem.has_segments:
        q_seg = _segment_rows(q_segment_ids, cfg.q_len_padded)  # [B, 1, Tp]
        kv_seg = _segment_rows(kv_segment_ids, cfg.kv_len_padded)  # [B, 1, Sp]
    o = mosaic_tpu_vjp.attention(cfg, qh, kh, vh, q_seg, kv_seg)  # [B, H, Tp, D]
    return jnp.swapaxes(o[:, :, : problem.q_len], 1, 2)
