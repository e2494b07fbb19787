"""Tiling plan of the Mosaic TPU flash attention: block sizes, their resolution against a
problem, VMEM footprints and the kernels' cost estimates (docs/attention_mosaic_tpu.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_tpu.ops.attention.mosaic_tpu import rows
from gla_tpu.ops.common.flops import attention_matmul_flops
from gla_tpu.ops.common.masks import window_bounds
from gla_tpu.ops.common.tpu import LANES, SUBLANES, target_tpu_info, tpu_interpret_params

# Sequence blocks are lane dims of the score tiles and of the lse/di/segment rows.
BLOCK_MULTIPLE = LANES

_BLOCK_FIELDS = (
    "block_q", "block_kv", "block_q_dq", "block_kv_dq", "block_q_dkv", "block_kv_dkv",
)
_TILE_FIELDS = _BLOCK_FIELDS + ("block_kv_compute",)
_FORWARD_TILE_FIELDS = ("block_q", "block_kv", "block_kv_compute")
_BACKWARD_TILE_FIELDS = ("block_q_dq", "block_kv_dq", "block_q_dkv", "block_kv_dkv")


# VMEM from which a chip with 128-wide MXUs takes the D = 256 forward in 1024 x 1024 tiles
# (BlockSizes.default): v5e (128 MiB) and v5p (64 MiB), not v4 (16 MiB).
_LARGE_VMEM_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the three kernels (performance only; results do not depend on them).

    Sequence lengths shorter than a block shrink it to the next power-of-two multiple of 128 that
    covers them; longer ones are padded up to a multiple of the blocks and masked. A tile left
    None takes the op's default for the chip and the problem (`BlockSizes.default`; on v5e / v5p
    also the forward's rule `_forward_tiles_128_wide` while block_q, block_kv and
    block_kv_compute are all None, and the backward's `_backward_tiles_128_wide` while its four
    tiles are), so setting one field leaves the others at their defaults.

    Attributes:
      block_q, block_kv: forward tile of queries and of keys fetched per grid step.
      block_kv_compute: keys per inner step of the forward (divides block_kv; equal to it for
        one step).
      block_q_dq, block_kv_dq: tiles of the dq kernel.
      block_q_dkv, block_kv_dkv: tiles of the dk/dv kernel.
      vmem_limit_bytes: scoped VMEM limit passed to Mosaic; None keeps the compiler's default.
      row_sum_on_mxu: whether the forward takes the softmax row sums on the MXU, as the extra
        128 output columns of p @ [ones | v], instead of reducing p on the VPU; bfloat16
        inputs only. None: on v6e at D <= 128, where those columns fit in the 256-wide MXU
        beside v's and p @ v alone leaves half the array idle (not on 7x, measured slower)
        (docs/attention_mosaic_tpu.md, "Base-2 exponentials and row sums on the MXU").
      forward_reads_rows: whether the forward reads q, k, v in the API's layout, every block
        holding all heads (`kernels.flash_forward_rows`), instead of head-major copies. None:
        wherever it applies (D = 128; bfloat16 or float32; H and Hkv even or 1), its blocks fit
        70% of the chip's VMEM (block_q, block_kv halved down to 512 until they do) and, on two
        TensorCores, the split is even (causal: an even batch);
        True where it applies; False never. (docs/attention_mosaic_tpu.md, "Layout"). Never
        on a chip that cannot be queried (`target_tpu_info()` None outside interpret mode,
        e.g. `jax.export` from a CPU host): there the head-major kernels at the
        generation-independent defaults compile on every generation.
      fused_backward: whether the backward runs in one kernel (`kernels.flash_dqkv`: dk, dv and
        dq from one pass over the score tiles, 5 block products instead of the two kernels' 7),
        which holds the kv head's dq for the whole sequence in VMEM. None: where the chip can be
        queried (or in interpret mode), its footprint (`fused_backward_vmem_bytes`) fits half
        the chip's VMEM and, on two TensorCores (v4, v5p), B * Hkv is even; True always
        (NotImplementedError where the footprint exceeds 75% of a known chip's VMEM); False
        never (docs/attention_mosaic_tpu.md, "The backward in one kernel").

    Example:
      >>> BlockSizes(block_q=256, block_kv=512, block_kv_compute=256)  # doctest: +ELLIPSIS
      BlockSizes(block_q=256, block_kv=512, block_kv_compute=256, ...)
    """

    block_q: int | None = None
    block_kv: int | None = None
    block_kv_compute: int | None = None
    block_q_dq: int | None = None
    block_kv_dq: int | None = None
    block_q_dkv: int | None = None
    block_kv_dkv: int | None = None
    vmem_limit_bytes: int | None = None
    row_sum_on_mxu: bool | None = None
    forward_reads_rows: bool | None = None
    fused_backward: bool | None = None

    def __post_init__(self):
        for name in _TILE_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"BlockSizes.{name} must be None or a positive int; got {value!r}.")
            if value % BLOCK_MULTIPLE:
                raise ValueError(
                    f"BlockSizes.{name}={value} must be a multiple of {BLOCK_MULTIPLE} "
                    "(sequence blocks are lane dims of the score tiles)."
                )
        if (self.block_kv_compute is not None and self.block_kv is not None
                and self.block_kv % self.block_kv_compute):
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
        if self.forward_reads_rows is not None and not isinstance(self.forward_reads_rows, bool):
            raise ValueError(f"BlockSizes.forward_reads_rows must be None, True or False; got "
                             f"{self.forward_reads_rows!r}.")
        if self.fused_backward is not None and not isinstance(self.fused_backward, bool):
            raise ValueError(f"BlockSizes.fused_backward must be None, True or False; got "
                             f"{self.fused_backward!r}.")

    @classmethod
    def default(cls, head_dim: int, mxu_width: int | None = None,
                vmem_bytes: int | None = None) -> "BlockSizes":
        """Defaults that compile for v4, v5e, v5p, v6e and 7x in bfloat16 within the default
        scoped VMEM limit (docs/attention_mosaic_tpu.md has the footprints), for a chip with
        `mxu_width`-wide MXUs and `vmem_bytes` of VMEM (None: unknown, e.g. off a TPU). On
        chips with 256-wide MXUs (v6e, 7x) all three kernels take 1024 x 1024 tiles: libtpu's
        static estimate puts the forward's 13-30% below 512 x 512 there, and the backward's cut
        forward+backward by 9% (D 128) to 31% (D 256) (docs/results/history.md,
        2026-11-22 and 2026-11-23). On 128-wide MXUs the tiles are 512 x 512, the forward's
        p @ v in 256-key steps at D = 256; there, on chips with 64 MiB of VMEM or more (v5e,
        v5p; not v4's 16), the D = 256 forward takes 1024 x 1024 tiles too (5-11% fewer cycles
        by the estimate, docs/results/history.md, "D = 256 forward tiles on 128-wide
        MXUs")."""
        sizes = cls(**{name: 512 for name in _BLOCK_FIELDS},
                    block_kv_compute=None if head_dim <= 128 else 256)
        if mxu_width is not None and mxu_width >= 256:
            sizes = dataclasses.replace(sizes, block_kv_compute=None, **{
                name: 1024 for name in _BLOCK_FIELDS})
        elif head_dim > 128 and vmem_bytes is not None and vmem_bytes >= _LARGE_VMEM_BYTES:
            sizes = dataclasses.replace(sizes, block_q=1024, block_kv=1024)
        return sizes

    def with_defaults(self, defaults: "BlockSizes") -> "BlockSizes":
        """These sizes with each tile left None taken from `defaults` (whose tiles are set;
        block_kv_compute may be None there: one step). A default block_kv_compute that does not
        divide a block_kv set here gives way to one step."""
        filled = {name: getattr(defaults, name) for name in _BLOCK_FIELDS
                  if getattr(self, name) is None}
        given = self.block_kv_compute
        if given is not None and "block_kv" in filled and filled["block_kv"] % given:
            raise ValueError(
                f"BlockSizes.block_kv_compute={given} must divide block_kv, which is left to "
                f"this chip's default {filled['block_kv']} here; set block_kv as well (a "
                f"multiple of {given}).")
        if self.block_kv_compute is None:
            block_kv = filled.get("block_kv", self.block_kv)
            step = defaults.block_kv_compute
            filled["block_kv_compute"] = None if step is None or block_kv % step else step
        return dataclasses.replace(self, **filled)

    def forward_tiles_set(self) -> bool:
        """Whether any of the forward's tiles (block_q, block_kv, block_kv_compute) is set."""
        return any(getattr(self, name) is not None for name in _FORWARD_TILE_FIELDS)


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
    itemsize: int  # bytes of an element of q, k, v
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
    vmem_limit_bytes: int | None  # the head-major kernels' (BlockSizes.vmem_limit_bytes)
    forward_vmem_limit_bytes: int | None  # the forward's: raised for the rows forward
    row_sum_on_mxu: bool  # forward: l from p @ [ones | v] (BlockSizes.row_sum_on_mxu)
    forward_reads_rows: bool  # forward on the API's layout (BlockSizes.forward_reads_rows)
    # the rows kernels fetch a row's first blocks during the previous row (one core runs the
    # whole grid in order: rows.RowStream)
    stream_across_rows: bool
    interpret: Any  # False or a pltpu.InterpretParams
    # (left, right) local window (causal: right 0) or None; validation.AttentionProblem.window
    window: tuple | None = None
    logits_soft_cap: float | None = None
    # the backward in one kernel (kernels.flash_dqkv; BlockSizes.fused_backward) and its
    # scoped VMEM limit
    fused_backward: bool = False
    fused_backward_vmem_limit_bytes: int | None = None

    @property
    def reach(self) -> tuple[int | None, int | None]:
        """(left, right) keys a query sees around its aligned position; None: unbounded."""
        return window_bounds(self.window, self.causal)

    @property
    def bounded(self) -> bool:
        """Whether some (q block, kv block) pairs see nothing by position (causal or a window):
        the kernels skip them."""
        return self.reach != (None, None)

    @property
    def masked(self) -> bool:
        """Whether the kernels mask scores: by position, segment or padded keys."""
        return self.bounded or self.has_segments or self.kv_padded

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


def target_default_blocks(head_dim: int, info) -> BlockSizes:
    """`BlockSizes.default` for the TPU `info` (a `pltpu.TpuInfo`, e.g. `target_tpu_info()`;
    None: no TPU, e.g. interpret mode)."""
    if info is None:
        return BlockSizes.default(head_dim)
    return BlockSizes.default(head_dim, info.mxu_column_size, info.vmem_capacity_bytes)


# Chips whose forward takes the row sums on the MXU by default (BlockSizes.row_sum_on_mxu): the
# 256-wide MXUs of v6e. 7x has MXUs as wide, but there libtpu's static estimate of the forward is
# 28% higher with them (B1 H8 T4096 D128 causal, the rows forward: 401,216 against 312,700
# cycles), and its profiler aborts on the head-major forward with them.
_MXU_ROW_SUM_GENERATIONS = (6,)


def _row_sum_on_mxu(requested: bool | None, dtype, head_dim: int, info) -> bool:
    """Resolves BlockSizes.row_sum_on_mxu for inputs of `dtype` on the chip `info` (a TpuInfo,
    None off a TPU)."""
    sixteen_bit = jnp.dtype(dtype).itemsize == 2
    if requested is None:
        return (sixteen_bit and info is not None and info.generation in _MXU_ROW_SUM_GENERATIONS
                and info.mxu_column_size >= LANES + head_dim)
    if requested and not sixteen_bit:
        # p @ [ones | v] in float32 would sum p at the MXU's float32 precision, not the VPU's.
        raise ValueError(
            f"BlockSizes.row_sum_on_mxu=True needs bfloat16 inputs; got "
            f"{jnp.dtype(dtype).name}. Leave it None (or False) for float32."
        )
    return requested


def kernel_config(problem, block_sizes: BlockSizes | None, interpret, *,
                  rows_kernels: bool = True) -> KernelConfig:
    """Resolves block sizes against the problem (clamping to short sequences) and pads lengths.
    rows_kernels=False keeps every kernel head-major (ring attention's blocks)."""
    info = None if interpret else target_tpu_info()
    given = BlockSizes() if block_sizes is None else block_sizes
    # the forward's per-problem tile rule applies where its tiles are left to the defaults
    default_forward_tiles = not given.forward_tiles_set()
    bs = given.with_defaults(target_default_blocks(problem.head_dim, info))
    q_cap, kv_cap = _block_cap(problem.q_len), _block_cap(problem.kv_len)
    bq, bq_dq, bq_dkv = (min(b, q_cap) for b in (bs.block_q, bs.block_q_dq, bs.block_q_dkv))
    bkv, bkv_dq, bkv_dkv = (min(b, kv_cap) for b in (bs.block_kv, bs.block_kv_dq,
                                                     bs.block_kv_dkv))
    bkc = min(bs.block_kv_compute or bkv, bkv)
    if bkv % bkc:
        bkc = bkv
    row_sums = _row_sum_on_mxu(bs.row_sum_on_mxu, problem.dtype, problem.head_dim, info)
    vmem_limit = bs.vmem_limit_bytes
    # (not on a chip that cannot be queried: the safe defaults below are head-major)
    applies = rows_kernels and _rows_apply(problem) and (info is not None or bool(interpret))
    reads_rows = applies and bs.forward_reads_rows is not False
    # The rows kernels hold every head's blocks: their tiles are halved until they fit VMEM.
    fit = functools.partial(_fit_rows_blocks, problem, row_sums=row_sums,
                            budget=None if info is None else
                            int(info.vmem_capacity_bytes * _ROWS_VMEM_SHARE))
    if info is not None and not (info.num_cores == 1 or not problem.causal
                                 or problem.batch % 2 == 0):
        # Two TensorCores (v4, v5p megacore) split a parallel grid axis: at batch 1 the rows
        # forward's q blocks, whose causal work is unequal, and libtpu's estimate of such a
        # split does not show the slower core; the head-major kernels split over heads.
        reads_rows = reads_rows and bs.forward_reads_rows is True
    if reads_rows and bs.forward_reads_rows is None:
        tiles = (bq, bkv, bkc)
        if default_forward_tiles:
            tiles = _forward_tiles_128_wide(problem, info, True, *tiles)
        fitted = fit(*tiles)
        reads_rows = fitted is not None
        if reads_rows:
            bq, bkv, bkc = fitted
    if default_forward_tiles and rows_kernels and not reads_rows:
        bq, bkv, bkc = _forward_tiles_128_wide(problem, info, False, bq, bkv, bkc)
    if rows_kernels and not any(getattr(given, f) is not None for f in _BACKWARD_TILE_FIELDS):
        bq_dq, bkv_dq, bq_dkv, bkv_dkv = _backward_tiles_128_wide(
            problem, info, bq_dq, bkv_dq, bq_dkv, bkv_dkv)
    # The rows forward needs more than the compiler's default scoped limit: half as much again
    # as the model counts, within 75% of the chip's VMEM. The head-major kernels keep the
    # default (on v5e the backward's kernels estimated 10-20% slower under a 96 MiB limit).
    forward_vmem_limit = vmem_limit or (
        _scoped_vmem_limit(info, rows_vmem_bytes(
            bq, bkv, bkc, problem.num_heads, problem.num_kv_heads, problem.head_dim,
            jnp.dtype(problem.dtype).itemsize, row_sums, problem.has_segments))
        if reads_rows else None)
    q_mult = math.lcm(bq, bq_dq, bq_dkv)
    kv_mult = math.lcm(bkv, bkv_dq, bkv_dkv)
    q_len_padded = -(-problem.q_len // q_mult) * q_mult
    fused, fused_limit = _fused_backward(problem, info, bs.fused_backward, interpret,
                                         q_len_padded, bq_dkv, bkv_dkv, vmem_limit)
    return KernelConfig(
        batch=problem.batch, num_heads=problem.num_heads, num_kv_heads=problem.num_kv_heads,
        head_dim=problem.head_dim, q_len=problem.q_len, kv_len=problem.kv_len,
        q_len_padded=q_len_padded,
        kv_len_padded=-(-problem.kv_len // kv_mult) * kv_mult,
        itemsize=jnp.dtype(problem.dtype).itemsize,
        causal=problem.causal, sm_scale=float(problem.sm_scale),
        has_segments=problem.has_segments,
        block_q=bq, block_kv=bkv, block_kv_compute=bkc, block_q_dq=bq_dq, block_kv_dq=bkv_dq,
        block_q_dkv=bq_dkv, block_kv_dkv=bkv_dkv, vmem_limit_bytes=vmem_limit,
        forward_vmem_limit_bytes=forward_vmem_limit,
        row_sum_on_mxu=row_sums, forward_reads_rows=reads_rows,
        stream_across_rows=_one_core_in_order(info, interpret),
        interpret=tpu_interpret_params(interpret),
        window=problem.window, logits_soft_cap=problem.logits_soft_cap,
        fused_backward=fused, fused_backward_vmem_limit_bytes=fused_limit,
    )


def fused_backward_vmem_bytes(q_len_padded: int, bq: int, bkv: int, group: int, head_dim: int,
                              itemsize: int, segments: bool) -> int:
    """Scoped VMEM of the one-kernel backward (`kernels.flash_dqkv`): the dk/dv kernel's
    (`vmem_estimate_bytes`), k^T, and the group's dq over the whole padded sequence, a float32
    accumulator and the output block (double-buffered)."""
    dq = group * q_len_padded * head_dim * (4 + 2 * itemsize)
    k_t = head_dim * bkv * itemsize
    return vmem_estimate_bytes("dkv", bq, bkv, head_dim, itemsize, segments=segments) + dq + k_t


# The one-kernel backward runs where its footprint fits this share of the chip's VMEM (in
# interpret mode, off a TPU: of v4's 16 MiB, the smallest).
_FUSED_VMEM_SHARE = 0.5
_SMALLEST_VMEM_BYTES = 16 * 2**20


def _fused_backward(problem, info, requested, interpret, q_len_padded: int, bq: int, bkv: int,
                    vmem_limit):
    """(whether the backward runs in one kernel, its scoped VMEM limit or None), for
    BlockSizes.fused_backward = `requested`."""
    if requested is False:
        return False, None
    need = fused_backward_vmem_bytes(
        q_len_padded, bq, bkv, problem.num_heads // problem.num_kv_heads, problem.head_dim,
        jnp.dtype(problem.dtype).itemsize, problem.has_segments)
    if requested is None:
        if info is None and not interpret:  # a chip not known: the two kernels' safe defaults
            return False, None
        vmem = _SMALLEST_VMEM_BYTES if info is None else info.vmem_capacity_bytes
        if need > vmem * _FUSED_VMEM_SHARE:
            return False, None
        # two TensorCores split the (batch, kv head) axes: an odd count leaves one idle a while
        if info is not None and info.num_cores >= 2 and problem.batch * problem.num_kv_heads % 2:
            return False, None
    elif info is not None and need > info.vmem_capacity_bytes * _ROWS_VMEM_LIMIT_SHARE:
        raise NotImplementedError(
            f"BlockSizes.fused_backward=True: the one-kernel backward holds the kv head's dq for "
            f"the whole sequence in VMEM, {need / 2**20:.1f} MiB here (T padded to "
            f"{q_len_padded}, {problem.num_heads // problem.num_kv_heads} query heads per kv "
            f"head), over 75% of this chip's {info.vmem_capacity_bytes / 2**20:.0f} MiB; leave "
            f"fused_backward None (the two kernels where it does not fit) or False.")
    return True, vmem_limit or _scoped_vmem_limit(info, need)


def _one_core_in_order(info, interpret) -> bool:
    """Whether one core runs a kernel's whole grid in order: in interpret mode, and on chips of
    one TensorCore per device (v5e, v6e, 7x); not on megacore chips (v4, v5p), which split the
    parallel grid axes between two cores, nor on a chip not known."""
    if interpret:
        return True
    return info is not None and info.num_cores == 1


def _forward_tiles_128_wide(problem, info, reads_rows: bool, bq: int, bkv: int, bkc: int):
    """The forward's default tiles (block_q, block_kv, block_kv_compute) at 64 <= D <= 128 on
    chips with 128-wide MXUs and 64 MiB of VMEM or more (v5e, v5p), where the caller set none of
    them: 1024 x 1024 in 512-key steps for the head-major forward (at D = 128 it runs there where
    the rows forward does not apply: v5p causal at batch 1, odd H in bfloat16; at D < 128 always)
    and for the rows forward (`reads_rows`, D = 128) of a problem without a mask; elsewhere the
    BlockSizes defaults as resolved (bq, bkv, bkc). By libtpu's estimate (B1 H8 T4096): the
    head-major causal forward at D = 128 12% fewer cycles on v5p; at D = 64 full / causal 10% /
    4% fewer on v5e and 9% / 5% on v5p; the rows forward without a mask 6% (v5e) and 7% (v5p)
    fewer, but the rows forward with the causal mask 2% more on v5e, so it keeps 512 x 512
    (docs/results/history.md, "The head-major forward's tiles at D = 128 on v5e and v5p",
    "The rows forward's tiles without a mask" and "D = 64 tiles on v5e and v5p"). D < 64 keeps the
    defaults (not estimated). Ring attention's blocks keep the BlockSizes defaults. Applies where
    the caller left the forward's three tiles None (BlockSizes.forward_tiles_set)."""
    if (info is None or info.mxu_column_size > LANES or not 64 <= problem.head_dim <= LANES
            or info.vmem_capacity_bytes < _LARGE_VMEM_BYTES
            or (reads_rows and (problem.causal or problem.has_segments))):
        return bq, bkv, bkc
    bkv = min(1024, _block_cap(problem.kv_len))
    return min(1024, _block_cap(problem.q_len)), bkv, min(512, bkv)


def _backward_tiles_128_wide(problem, info, *tiles):
    """The dq and dk/dv kernels' default tiles (block_q_dq, block_kv_dq, block_q_dkv,
    block_kv_dkv) in 16-bit dtypes on chips with 128-wide MXUs and 64 MiB of VMEM or more:
    1024 x 1024
    - at D > 128 on two TensorCores per device (v5p), and on one (v5e) without a causal mask or
      segment ids;
    - at 64 <= D < 128 on two TensorCores per device (v5p);
    and at D = 128 on one TensorCore (v5e), for full attention only (`_full_on_one_core`), dq in
    512 x 4096 and dk/dv in 4096 x 512, each kernel taking its 4096-wide block in 1024-row
    sub-blocks by a loop (`backward_sub_block`; 2048 where 4096 would pad further than
    1024-blocks, `_wide_block`; not below T = 2048): 7% fewer backward cycles at B1 H8 T4096
    with the compile time unchanged (docs/results/history.md, "Wide backward blocks on v5e");
    elsewhere `tiles` as resolved (other D = 128 problems keep them). By libtpu's estimate (B1
    H8 T4096 forward+backward, bfloat16) the 1024-tiles take 5.3% (full) and 1.2% (causal) off
    at D = 256 on v5p, and 3.7% (full) off on v5e, where causal gains nothing (+2.7%; segment
    ids unmeasured); at
    D = 64 on v5p, 8.2% (full) and 4.8% (causal); v5e's dk/dv kernel at D = 64 does not
    profile, so it keeps 512 there. In float32 they outgrow the default scoped VMEM
    (docs/results/history.md, "D = 256 backward tiles on v5p" and "D = 64 tiles on v5e and
    v5p").
    Applies where the caller set none of the four; ring attention's blocks keep the BlockSizes
    defaults."""
    d = problem.head_dim
    if (info is None or info.mxu_column_size > LANES
            or info.vmem_capacity_bytes < _LARGE_VMEM_BYTES
            or jnp.dtype(problem.dtype).itemsize != 2 or d < 64):
        return tiles
    if d == LANES:
        q_wide, kv_wide = _wide_block(problem.q_len), _wide_block(problem.kv_len)
        if _full_on_one_core(problem, info) and q_wide and kv_wide:
            return 512, kv_wide, q_wide, 512
        return tiles
    two_cores = info.num_cores >= 2
    if not two_cores and (d < LANES or problem.causal or problem.has_segments):
        return tiles
    q_cap, kv_cap = _block_cap(problem.q_len), _block_cap(problem.kv_len)
    return min(1024, q_cap), min(1024, kv_cap), min(1024, q_cap), min(1024, kv_cap)


# The dq kernel's key blocks and the dk/dv kernel's query blocks of full attention on one
# TensorCore with 128-wide MXUs (v5e) at D = 128, widest first (`_wide_block`).
_WIDE_BLOCKS = (4096, 2048)


def _full_on_one_core(problem, info) -> bool:
    """Whether the problem is full attention (no causal mask, segment ids, window or soft cap)
    at D = 128 in a 16-bit dtype on a chip of one TensorCore per device (v5e; the caller checks
    the MXU width and VMEM): where the backward takes wide blocks."""
    return (info.num_cores == 1 and problem.head_dim == LANES
            and jnp.dtype(problem.dtype).itemsize == 2 and not problem.causal
            and not problem.has_segments and problem.window is None
            and problem.logits_soft_cap is None)


def _wide_block(length: int) -> int | None:
    """The widest of `_WIDE_BLOCKS` within `_block_cap(length)` that pads `length` no further
    than 1024-blocks do; None where none does (1024 tokens or fewer, or e.g. 3072)."""
    padded = -(-length // 1024) * 1024
    for block in _WIDE_BLOCKS:
        if block <= _block_cap(length) and padded % block == 0:
            return block
    return None


def _rows_apply(problem) -> bool:
    """Whether the rows kernels (`kernels.flash_forward_rows`, ...) take the problem: rows of
    128 lanes (D = 128), and each head's rows readable as strided 32-bit rows (float32;
    bfloat16 with one head or an even count, read as words of two rows)."""
    if problem.head_dim != LANES:
        return False
    dtype = jnp.dtype(problem.dtype)
    if dtype == jnp.float32:
        return True
    return dtype == jnp.bfloat16 and all(
        rows.num_heads_ok(dtype, h) for h in (problem.num_heads, problem.num_kv_heads))


# The rows kernels' blocks are not shrunk below this (to fit VMEM): smaller tiles than the
# head-major defaults are unmeasured, and there the head-major kernel is taken.
_ROWS_MIN_BLOCK = 512
# Their footprint (rows_vmem_bytes, which counts every block double-buffered) must fit
# this share of the chip's VMEM, under a scoped limit of the second share.
_ROWS_VMEM_SHARE = 0.7
_ROWS_VMEM_LIMIT_SHARE = 0.75


def _fit_rows_blocks(problem, bq: int, bkv: int, bkc: int, *, row_sums: bool,
                     budget: int | None):
    """(block_q, block_kv, block_kv_compute) of the rows forward within `budget` bytes of VMEM
    (None: any), halving the larger of the two blocks (not below 512); None if they do not
    fit."""
    while True:
        need = rows_vmem_bytes(bq, bkv, bkc, problem.num_heads, problem.num_kv_heads,
                               problem.head_dim, jnp.dtype(problem.dtype).itemsize, row_sums,
                               problem.has_segments)
        if budget is None or need <= budget:
            return bq, bkv, bkc
        if bq >= bkv and bq // 2 >= _ROWS_MIN_BLOCK and bq % (2 * BLOCK_MULTIPLE) == 0:
            bq //= 2
        elif bkv // 2 >= _ROWS_MIN_BLOCK and bkv % (2 * BLOCK_MULTIPLE) == 0:
            bkv //= 2
            bkc = min(bkc, bkv)
        else:
            return None


def _scoped_vmem_limit(info, need: int) -> int | None:
    """The scoped VMEM limit a kernel requests where its model counts `need` bytes (the rows
    forward, the one-kernel backward): 1.5x, at most 75% of the chip's VMEM (None off a
    TPU)."""
    if info is None:
        return None
    cap = int(info.vmem_capacity_bytes * _ROWS_VMEM_LIMIT_SHARE)
    return min(cap, -(-need * 3 // 2 // 2**20) * 2**20)


def rows_vmem_bytes(bq: int, bkv: int, bkc: int, heads: int, kv_heads: int, d: int,
                    itemsize: int, row_sums: bool = False, segments: bool = False) -> int:
    """VMEM of the rows forward (every head per block, `kernels.flash_forward_rows`): the two
    buffers of every head's blocks of q, k and v it fetches (rows.RowStream), o's
    double-buffered block, the lse rows (8 sublanes each), the per-head float32 state (m, l or
    the MXU row sums' columns, acc), o gathered in float32, and one head's temporaries (the
    heads run one after another)."""
    rows = lambda n: SUBLANES * n * 4  # noqa: E731  a [1, n] float32/int32 row block
    q_side, kv_side = bq * heads * d, bkv * kv_heads * d  # elements of all heads' rows
    seg = 2 * (rows(bq) + rows(bkv)) if segments else 0
    io = 2 * (q_side + 2 * kv_side) * itemsize + 2 * q_side * itemsize + 2 * heads * rows(bq)
    state = heads * bq * (2 * LANES + d) * 4
    state += bkc * (LANES + d) * itemsize if row_sums else 0  # vx
    return io + seg + state + q_side * 4 + bq * bkc * (2 * 4 + itemsize)


# Mosaic's own temporaries per element of a kernel's score tile ([bq, bkc] forward, [bq, bkv]
# backward), in bytes: the largest of what the compiler allocated beyond the pipelined blocks and
# the scratch over 83 compiled kernels (v4, v5e, v6e; D 64 to 256; bfloat16 and float32;
# causal, segment ids; tiles 256 to 1024), so that `vmem_estimate_bytes` bounds its count
# (docs/attention_mosaic_tpu.md, "VMEM footprint").
_TEMP_BYTES_PER_SCORE = {"fwd": 12, "dq": 10, "dkv": 14}


# The backward kernels' sub-blocks: a kv block of the dq kernel (a q block of the dk/dv kernel)
# wider than this is taken in sub-blocks of this many keys (queries) by a loop, so that the
# kernel's code, and its compile time, does not grow with the block.
BACKWARD_SUB_BLOCK = 1024


def backward_sub_block(block: int) -> int:
    """The rows a backward kernel takes of its `block` at a time (`BACKWARD_SUB_BLOCK`, or the
    block)."""
    sub = BACKWARD_SUB_BLOCK
    return sub if block > sub and block % sub == 0 else block


def vmem_estimate_bytes(kind: str, block_q: int, block_kv: int, head_dim: int, itemsize: int,
                        *, block_kv_compute: int | None = None, segments: bool = False,
                        row_sum_on_mxu: bool = False) -> int:
    """Scoped VMEM of one head-major kernel ("fwd", "dq", "dkv") from its tiles: every
    pipelined block twice (double-buffered; a [1, n] float32 / int32 row block takes n words),
    the scratch, and Mosaic's temporaries (`_TEMP_BYTES_PER_SCORE` per score element). An upper
    bound of the compiler's count, 1.0-3x it where measured (tests/backends/
    test_tpu_vmem_model.py pins it against compiled kernels)."""
    bq, bkv, d = block_q, block_kv, head_dim
    seg = 2 * (bq + bkv) * 4 if segments else 0
    if kind == "fwd":
        bkc = block_kv_compute or bkv
        # q, k, v in; o and the lse row out
        io = 2 * (bq + 2 * bkv) * d * itemsize + 2 * (bq * d * itemsize + bq * 4)
        if row_sum_on_mxu:  # m, [l | acc], vx = [ones | v]
            scratch = bq * LANES * 4 + bq * (LANES + d) * 4 + bkc * (LANES + d) * itemsize
        else:  # m, l, acc
            scratch = 2 * bq * LANES * 4 + bq * d * 4
        tile = bq * bkc
    elif kind in ("dq", "dkv"):
        # q, do, k, v and the lse and di rows in
        io = 2 * (2 * bq + 2 * bkv) * d * itemsize + 2 * 2 * bq * 4
        if kind == "dq":  # dq out, its float32 accumulator
            io += 2 * bq * d * itemsize
            scratch = bq * d * 4
        else:  # dk, dv out, their float32 accumulators
            io += 2 * 2 * bkv * d * itemsize
            scratch = 2 * bkv * d * 4
        # the score tile of one sub-block (backward_sub_block)
        tile = (bq * backward_sub_block(bkv) if kind == "dq"
                else backward_sub_block(bq) * bkv)
    else:
        raise ValueError(f"kind must be 'fwd', 'dq' or 'dkv'; got {kind!r}.")
    return io + seg + scratch + _TEMP_BYTES_PER_SCORE[kind] * tile


def kernel_vmem_bytes(cfg: KernelConfig, kind: str) -> int:
    """The scoped VMEM the plan counts for kernel `kind` ("fwd", "dq", "dkv", "dqkv") of `cfg`:
    the rows forward's model (`rows_vmem_bytes`) where the forward reads rows, the one-kernel
    backward's (`fused_backward_vmem_bytes`), else `vmem_estimate_bytes`."""
    itemsize = cfg.itemsize
    if kind == "fwd" and cfg.forward_reads_rows:
        return rows_vmem_bytes(cfg.block_q, cfg.block_kv, cfg.block_kv_compute, cfg.num_heads,
                               cfg.num_kv_heads, cfg.head_dim, itemsize, cfg.row_sum_on_mxu,
                               cfg.has_segments)
    if kind == "dqkv":
        return fused_backward_vmem_bytes(cfg.q_len_padded, cfg.block_q_dkv, cfg.block_kv_dkv,
                                         cfg.group, cfg.head_dim, itemsize, cfg.has_segments)
    tiles = {"fwd": (cfg.block_q, cfg.block_kv), "dq": (cfg.block_q_dq, cfg.block_kv_dq),
             "dkv": (cfg.block_q_dkv, cfg.block_kv_dkv)}
    if kind not in tiles:
        raise ValueError(f"kind must be 'fwd', 'dq', 'dkv' or 'dqkv'; got {kind!r}.")
    return vmem_estimate_bytes(kind, *tiles[kind], cfg.head_dim, itemsize,
                               block_kv_compute=cfg.block_kv_compute,
                               segments=cfg.has_segments, row_sum_on_mxu=cfg.row_sum_on_mxu)


def cost_estimate(cfg: KernelConfig, *, passes: int, arrays, out_shape) -> pl.CostEstimate:
    """Matmul FLOPs of one kernel over the visible score matrix (passes=1 forward, 2 dq, 3 dk/dv),
    one exponential per score, and the bytes of its operands."""
    flops = attention_matmul_flops(cfg.batch, cfg.q_len, cfg.kv_len, cfg.num_heads,
                                   cfg.head_dim, causal=cfg.causal, matmuls=passes + 1)
    trans = cfg.batch * cfg.num_heads * cfg.q_len * cfg.kv_len
    nbytes = sum(a.size * a.dtype.itemsize for a in arrays if a is not None)
    nbytes += sum(o.size * jnp.dtype(o.dtype).itemsize for o in out_shape)
    return pl.CostEstimate(flops=int(flops), transcendentals=int(trans), bytes_accessed=int(nbytes))
