"""Tiling plan of the GPU flash attention: block sizes, which forward kernel runs, the geometry
every kernel shares, and the Mosaic GPU forward's tiles with their shared-memory check
(docs/gpu_attention.md, "Block sizes", says how the defaults were measured).
"""

from __future__ import annotations

import dataclasses
import math
import typing

import jax.numpy as jnp

from gla_tpu.ops.common.backends import mosaic_gpu_selected
from gla_tpu.ops.common.masks import window_bounds
from gla_tpu.ops.common.mosaic_gpu import SHARED_MEMORY_BYTES

CONSUMERS = 2  # consumer warpgroups per block
# alignment padding Mosaic GPU adds to the buffers below: it reported 232568 bytes for tiles
# (64, 128, 3) at head dim 128 and 232536 for (64, 192, 2), 2560 over the sum of the buffers
ALLOCATION_SLACK = 2560
# what the Mosaic GPU forward takes (other problems take the Triton forward)
MOSAIC_FORWARD_HEAD_DIMS = (64, 128, 256)
MOSAIC_FORWARD_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MOSAIC_BACKWARD_HEAD_DIMS = (64, 128, 256)
# From this head dim on, the dk/dv kernel's consumers split the roles (one accumulates dv, the
# other dk, over the same keys): one warpgroup's dk and dv at D = 256 would take 256 registers
# a thread.
SPLIT_DKV_ROLES_FROM_HEAD_DIM = 256


def splits_dkv_roles(head_dim: int) -> bool:
    """Whether the Mosaic GPU dk/dv kernel splits dk and dv between its consumers at this head
    dim (docs/gpu_attention.md, "Mosaic GPU backward")."""
    return head_dim >= SPLIT_DKV_ROLES_FROM_HEAD_DIM


@dataclasses.dataclass(frozen=True)
class ForwardTiles:
    """Tiles of the Mosaic GPU forward (performance only)."""

    block_q: int = 64  # query rows per consumer warpgroup: a block covers 2 * block_q rows
    block_kv: int = 128  # keys per pipeline step
    stages: int = 2  # K/V shared-memory slots in flight
    # one block per SM walking several query tiles, the K/V ring running on from one tile to the
    # next (kernels_mosaic_forward_persistent.py); ctas: how many blocks (None: the GPU's SMs)
    persistent: bool = False
    ctas: int | None = None

    def __post_init__(self):
        if self.block_q not in (64, 128):  # wgmma rows per warpgroup: multiples of 64
            raise ValueError(f"ForwardTiles.block_q={self.block_q!r} must be 64 or 128.")
        if self.block_kv not in (64, 128, 192, 256):
            raise ValueError(
                f"ForwardTiles.block_kv={self.block_kv!r} must be one of 64, 128, 192, 256.")
        if self.stages not in (2, 3, 4):
            raise ValueError(f"ForwardTiles.stages={self.stages!r} must be one of 2, 3, 4.")
        if not isinstance(self.persistent, bool):
            raise ValueError(f"ForwardTiles.persistent={self.persistent!r} must be a bool.")
        if self.ctas is not None and (isinstance(self.ctas, bool) or not isinstance(self.ctas, int)
                                      or self.ctas < 1):
            raise ValueError(f"ForwardTiles.ctas={self.ctas!r} must be None or a positive int.")

    @property
    def query_multiple(self) -> int:
        return CONSUMERS * self.block_q

    def separate_output(self, head_dim: int, itemsize: int = 2, segments: bool = False) -> bool:
        """Whether a persistent block stages o in tiles of its own, so that the next tile's q
        loads while this one's o is written: where they fit (not at head dim 256)."""
        return self.persistent and (self._bytes(head_dim, itemsize, segments, output_tiles=True)
                                    <= SHARED_MEMORY_BYTES)

    def shared_memory_bytes(self, head_dim: int, itemsize: int = 2,
                            segments: bool = False) -> int:
        """Shared memory of one block: q/o tiles, lse rows, the K/V ring and the barriers (and
        with segment ids the rows' ids and the key blocks' ids)."""
        return self._bytes(head_dim, itemsize, segments,
                           output_tiles=self.separate_output(head_dim, itemsize, segments))

    def _bytes(self, head_dim: int, itemsize: int, segments: bool, output_tiles: bool) -> int:
        q_o = (1 + output_tiles) * CONSUMERS * self.block_q * head_dim * itemsize
        lse = CONSUMERS * self.block_q * 4
        kv_ring = 2 * self.stages * self.block_kv * head_dim * itemsize
        barriers = 8 * (CONSUMERS + 4 * self.stages + 1)
        ids = segments * (_kib(4 * CONSUMERS * self.block_q) + _kib(4 * self.stages * self.block_kv)
                          + 8 * (CONSUMERS + self.stages))
        return q_o + lse + kv_ring + barriers + ids + ALLOCATION_SLACK


@dataclasses.dataclass(frozen=True)
class BackwardTiles:
    """Tiles of the Mosaic GPU backward (performance only), for both of its kernels: the dq
    kernel's consumers own block_q query rows each and stream key blocks of block_kv; the dk/dv
    kernel's own block_kv keys each and stream query blocks of block_q. At head dim 256 the dk/dv
    kernel's consumers share a tile of 2 x block_kv keys instead (splits_dkv_roles), and
    block_kv must be 32."""

    block_q: int = 64
    block_kv: int = 64
    stages: int = 2  # streamed blocks in flight

    def __post_init__(self):
        if self.block_q not in (64, 128):
            raise ValueError(f"BackwardTiles.block_q={self.block_q!r} must be 64 or 128 (wgmma "
                             "rows per warpgroup).")
        if self.block_kv not in (32, 64, 128):
            raise ValueError(f"BackwardTiles.block_kv={self.block_kv!r} must be 32, 64 or 128 "
                             "(32 at head dim 256 only).")
        if self.stages not in (2, 3, 4):
            raise ValueError(f"BackwardTiles.stages={self.stages!r} must be one of 2, 3, 4.")

    def check_head_dim(self, head_dim: int) -> None:
        """ValueError when the dk/dv kernel's tile does not suit the head dim: wgmma needs 64
        rows a warpgroup, which the role split (head dim 256) gets from the whole 2 x 32-key
        tile, and the other head dims from 64 or 128 keys per consumer."""
        if splits_dkv_roles(head_dim) and self.block_kv != 32:
            raise ValueError(f"BlockSizes.mosaic_backward={self} at head dim {head_dim}: "
                             "block_kv must be 32 (the dk/dv kernel's two consumers share a "
                             "64-key tile there).")
        if not splits_dkv_roles(head_dim) and self.block_kv == 32:
            raise ValueError(f"BlockSizes.mosaic_backward={self} at head dim {head_dim}: "
                             "block_kv must be 64 or 128 (32 serves head dim 256 only).")

    def shared_memory_bytes(self, head_dim: int, itemsize: int = 2,
                            segments: bool = False) -> int:
        """The larger of the two kernels' shared memory, buffer by buffer as
        kernels_mosaic_backward allocates it (small vectors take 1 KiB each, as Mosaic GPU aligns
        them; 8 bytes a barrier). Matches Mosaic GPU's count at head dims 64 / 128 / 256, with and
        without segment ids."""
        bq, bkv, stages = self.block_q, self.block_kv, self.stages
        tile = head_dim * itemsize  # bytes of one [D] row
        # dq: own q, do; the ring's k, v (and with 32-key blocks a second copy of k, with its
        # small vectors packed: lse and delta in one buffer, the ids in another)
        copy = bkv < 64
        dq = 2 * CONSUMERS * bq * tile + (2 + copy) * stages * bkv * tile
        if copy:
            dq += _kib(2 * CONSUMERS * bq * 4)
            dq += segments * _kib((CONSUMERS + stages) * max(bq, bkv) * 4)
        else:
            dq += 2 * _kib(CONSUMERS * bq * 4)
            dq += segments * (_kib(CONSUMERS * bq * 4) + _kib(stages * bkv * 4))
        dq += 8 * (4 * CONSUMERS + (3 + copy) * stages + segments * (CONSUMERS + stages))
        # dk/dv: own k, v (2 x block_kv keys, one owner, under the role split); the ring's q, do,
        # lse, delta (and ids)
        split = splits_dkv_roles(head_dim)
        owners = 1 if split else CONSUMERS
        dkv = 2 * CONSUMERS * bkv * tile + 2 * stages * bq * tile + 2 * _kib(stages * bq * 4)
        dkv += segments * (_kib(CONSUMERS * bkv * 4) + _kib(stages * bq * 4))
        dkv += 8 * (2 * owners + 5 * stages + split + segments * (owners + stages))
        return max(dq, dkv)


def _kib(nbytes: int) -> int:
    """A small shared-memory buffer's size as Mosaic GPU allocates it (aligned to 1 KiB)."""
    return -(-nbytes // 1024) * 1024


def check_tiles(tiles: ForwardTiles | BackwardTiles, head_dim: int,
                segments: bool = False) -> None:
    """ValueError when the tiles do not fit in a Hopper block's shared memory at this head dim
    (with segment ids: their ids too)."""
    if isinstance(tiles, BackwardTiles):
        tiles.check_head_dim(head_dim)
    need = tiles.shared_memory_bytes(head_dim, segments=segments)
    if need > SHARED_MEMORY_BYTES:
        field = "mosaic_forward" if isinstance(tiles, ForwardTiles) else "mosaic_backward"
        raise ValueError(
            f"BlockSizes.{field}={tiles} needs {need} bytes of shared memory at head dim "
            f"{head_dim}; a Hopper block has {SHARED_MEMORY_BYTES}. Use fewer stages or a smaller "
            "block_kv.")


def mosaic_forward_unsupported_reason(head_dim: int, dtype, has_segments: bool) -> str | None:
    """Why the Mosaic GPU forward cannot take a problem (None when it can)."""
    if head_dim not in MOSAIC_FORWARD_HEAD_DIMS:
        return f"head dim {head_dim} (it takes {MOSAIC_FORWARD_HEAD_DIMS})"
    if jnp.dtype(dtype) not in MOSAIC_FORWARD_DTYPES:
        return f"dtype {jnp.dtype(dtype).name} (it takes bfloat16 and float16)"
    return None


def mosaic_backward_unsupported_reason(head_dim: int, dtype, has_segments: bool) -> str | None:
    """Why the Mosaic GPU backward cannot take a problem (None when it can)."""
    if head_dim not in MOSAIC_BACKWARD_HEAD_DIMS:
        return f"head dim {head_dim} (it takes {MOSAIC_BACKWARD_HEAD_DIMS})"
    return mosaic_forward_unsupported_reason(head_dim, dtype, has_segments)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static facts every kernel needs (hashable: a custom_vjp non-differentiable argument)."""

    q_len: int  # true T
    kv_len: int  # true S
    padded_q: int  # T rounded up to the largest query block
    padded_kv: int  # S rounded up to the largest key block
    group: int  # H // Hkv
    causal: bool
    offset: int  # bottom-right causal shift, S - T
    sm_scale: float
    has_segments: bool
    # (left, right) local window (AttentionProblem.window; a ring block's sides may be negative)
    window: tuple[int | None, int | None] | None = None
    soft_cap: float | None = None  # logits soft cap c: scores c * tanh(s / c)
    # the base-2 lse the forwards write for a row that sees no key: 0 for the op (its o is 0 and
    # its gradients vanish either way), -inf for a ring block (the merge then gives it no weight)
    empty_row_lse: float = 0.0

    @property
    def reach(self) -> tuple[int | None, int | None]:
        """(left, right) key reach around a row's aligned position; None: unbounded."""
        return window_bounds(self.window, self.causal)


FORWARD_KERNELS = ("auto", "mosaic_gpu", "triton")


def _power_of_two(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of the three kernels (performance only). Every block is a power of two >= 16.

    `forward_kernel` picks the forward: "auto" takes the Mosaic GPU kernel on Hopper where it
    applies (head dim 64 / 128 / 256, bfloat16 / float16) and is the faster one (the persistent
    kernel, the default tiles, everywhere; the per-tile kernel not at head dim 128 with T and
    S <= 1024), Triton elsewhere;
    "mosaic_gpu" insists on it (NotImplementedError where it does not apply), "triton" never uses it.
    `mosaic_forward` holds its tiles. `backward_kernel` and `mosaic_backward` do the same for the
    backward's dq and dk/dv kernels (the Mosaic GPU pair takes head dim 64 / 128 / 256).
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
    mosaic_forward: ForwardTiles = ForwardTiles(persistent=True)
    backward_kernel: str = "auto"
    mosaic_backward: BackwardTiles = BackwardTiles()
    # where the forward and the backward are both Mosaic GPU kernels, hand them q, k, v as they
    # come, without padding T and S to the tiles: the TMA loads past an array's end read zeros
    # and its stores past the end are dropped (T and S multiples of 8)
    mosaic_unpadded: bool = True
    # the backward in one Mosaic GPU kernel (kernels_mosaic_backward_fused: dk, dv and dq added
    # with the TMA unit's reduce-add, 5 products a block pair instead of 7): True insists on it
    # (NotImplementedError where it does not apply: the Triton backward, head dim 256,
    # mosaic_backward.block_kv != 64), False takes the dq and dk/dv kernels, None ("auto")
    # decides by FUSED_BACKWARD_AUTO
    fused_backward: bool | None = None

    def __post_init__(self):
        if self.fused_backward is not None and not isinstance(self.fused_backward, bool):
            raise ValueError(f"BlockSizes.fused_backward={self.fused_backward!r} must be None, "
                             "True or False.")
        if not isinstance(self.mosaic_unpadded, bool):
            raise ValueError(f"BlockSizes.mosaic_unpadded={self.mosaic_unpadded!r} must be a bool.")
        for name in ("forward_kernel", "backward_kernel"):
            if getattr(self, name) not in FORWARD_KERNELS:
                raise ValueError(f"BlockSizes.{name}={getattr(self, name)!r} must be one of "
                                 f"{FORWARD_KERNELS}.")
        for name, kind in (("mosaic_forward", ForwardTiles), ("mosaic_backward", BackwardTiles)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"BlockSizes.{name}={getattr(self, name)!r} must be a "
                                 f"pallas_gpu.{kind.__name__}.")
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
        # the best of a sweep on a GPU (docs/gpu_attention.md): forward 128x128, 8 warps,
        # 3 stages; both backward kernels 64x64 with 4 warps, 2 stages
        sizes = BlockSizes(128, 128, 64, 64, 64, 64, num_warps=8, num_warps_dq=4,
                           num_warps_dkv=4, num_stages=3, num_stages_bwd=2)
    else:
        # Mosaic GPU forward at D = 256: 64 keys a step, two slots (the q/o tiles and the K/V
        # ring take 197 KiB of the 227); backward: dq streams 32-key blocks (225 KiB with its
        # second copy of k), dk/dv splits its consumers' roles over 64-key tiles (193 KiB)
        sizes = BlockSizes(64, 32, 64, 32, 32, 64, num_warps=8, num_warps_dq=8,
                           num_warps_dkv=8, num_stages=2, num_stages_bwd=1,
                           mosaic_forward=ForwardTiles(64, 64, 2, persistent=True),
                           mosaic_backward=BackwardTiles(64, 32, 2))
    if wide:
        sizes = dataclasses.replace(
            sizes, block_q=max(16, sizes.block_q // 2), block_kv=max(16, sizes.block_kv // 2),
            block_q_dq=max(16, sizes.block_q_dq // 2), block_kv_dkv=max(16, sizes.block_kv_dkv // 2),
            num_stages=min(sizes.num_stages, 2), num_stages_bwd=1)
    return sizes


# With per-tile Mosaic GPU tiles (ForwardTiles(persistent=False)), "auto" leaves short sequences
# at head dim 128 to the Triton forward, faster there on an H100 (2026-11-23,
# docs/results/history.md): T = S = 512 full 0.228 against 0.246 ms; T = S = 1024 full 0.370
# against 0.432, causal 0.262 against 0.269; from T = S = 2048 on the Mosaic one wins (0.275
# against 0.336 full). The persistent forward beats both there (H200, 2026-11-29: T = 1024
# causal 0.159 ms against Triton's 0.260, full 0.259 against 0.363; T = 512 full 0.145 against
# 0.224), so with it "auto" takes Mosaic GPU at every length.
AUTO_TRITON_FORWARD_MAX_LEN = 1024
AUTO_TRITON_FORWARD_HEAD_DIM = 128


def _auto_prefers_triton_forward(problem) -> bool:
    return (problem.head_dim == AUTO_TRITON_FORWARD_HEAD_DIM
            and max(problem.q_len, problem.kv_len) <= AUTO_TRITON_FORWARD_MAX_LEN)


def mosaic_forward_tiles(problem, sizes: BlockSizes, interpret: bool) -> ForwardTiles | None:
    """The Mosaic GPU forward's tiles when it runs this problem, None when Triton does
    (backends.mosaic_gpu_selected: "auto" on a Hopper GPU outside interpret mode, except, with
    per-tile tiles, at head dim 128 with T and S <= 1024; "mosaic_gpu" anywhere it applies)."""
    if (sizes.forward_kernel == "auto" and not sizes.mosaic_forward.persistent
            and _auto_prefers_triton_forward(problem)):
        return None
    reason = mosaic_forward_unsupported_reason(problem.head_dim, problem.dtype,
                                               problem.has_segments)
    if not mosaic_gpu_selected(sizes.forward_kernel, reason, interpret):
        return None
    check_tiles(sizes.mosaic_forward, problem.head_dim, problem.has_segments)
    return sizes.mosaic_forward




def mosaic_backward_tiles(problem, sizes: BlockSizes, interpret: bool) -> BackwardTiles | None:
    """The Mosaic GPU backward's tiles when it runs this problem's gradients, None when the
    Triton dq and dk/dv kernels do (the same rule as the forward, by `backward_kernel`)."""
    reason = mosaic_backward_unsupported_reason(problem.head_dim, problem.dtype,
                                                problem.has_segments)
    if not mosaic_gpu_selected(sizes.backward_kernel, reason, interpret, "backward_kernel"):
        return None
    check_tiles(sizes.mosaic_backward, problem.head_dim, problem.has_segments)
    return sizes.mosaic_backward


class MosaicTiles(typing.NamedTuple):
    """Which Mosaic GPU kernels a call runs (their tiles), None for the Triton ones; `fused`:
    the backward is the one-kernel Mosaic GPU backward (with `backward`'s tiles)."""

    forward: ForwardTiles | None
    backward: BackwardTiles | None
    fused: bool = False

    @property
    def query_multiple(self) -> int:
        """What the padded query length must be a multiple of for them."""
        return math.lcm(*[CONSUMERS * t.block_q for t in (self.forward, self.backward)
                          if t is not None], 1)

    @property
    def key_multiple(self) -> int:
        """What the padded key length must be a multiple of for them."""
        keys = [self.forward.block_kv] if self.forward is not None else []
        if self.backward is not None:
            keys.append(CONSUMERS * self.backward.block_kv)
        return math.lcm(*keys, 1)


# The head dims at which fused_backward=None takes the one-kernel backward (outside interpret
# mode), from the H100 measurements in docs/gpu_attention.md ("One-kernel backward"): fwd+bwd
# 0.92x / 0.92x / 0.99x the two kernels' time at D = 64 ((4,16,4096) full, (2,16,8192) full,
# (4,16,4096) causal), 1.6x-1.8x at D = 128 (register pressure), so D = 64 only.
FUSED_BACKWARD_AUTO_HEAD_DIMS = (64,)
FUSED_BACKWARD_HEAD_DIMS = (64, 128)


def fused_backward_unsupported_reason(head_dim: int, tiles: BackwardTiles | None) -> str | None:
    """Why the one-kernel Mosaic GPU backward cannot take a problem (None when it can)."""
    if tiles is None:
        return "a problem the Mosaic GPU backward does not take (the Triton backward runs)"
    if head_dim not in FUSED_BACKWARD_HEAD_DIMS:
        return f"head dim {head_dim} (it takes {FUSED_BACKWARD_HEAD_DIMS})"
    if tiles.block_kv != 64:
        return (f"mosaic_backward.block_kv={tiles.block_kv} (it takes 64: its dq product "
                "contracts over the block's 2 x 64 keys)")
    return None


def fused_backward_shared_memory_bytes(tiles: BackwardTiles, head_dim: int, itemsize: int = 2,
                                       segments: bool = False) -> int:
    """Shared memory of the one-kernel backward, buffer by buffer as
    kernels_mosaic_backward_fused allocates it: k and v of the block's 2 x block_kv keys, the
    ring's q, do, lse and delta, two ds^T tiles [2 x block_kv, block_q], the float32 dq staging
    tile, the barriers (and the ids), and the forward's alignment margin."""
    bq, bkv, stages = tiles.block_q, tiles.block_kv, tiles.stages
    tile = head_dim * itemsize
    n = 2 * CONSUMERS * bkv * tile + 2 * stages * bq * tile + 2 * _kib(stages * bq * 4)
    n += 2 * CONSUMERS * bkv * bq * itemsize + bq * head_dim * 4
    n += segments * (_kib(CONSUMERS * bkv * 4) + _kib(stages * bq * 4))
    n += 8 * (2 * CONSUMERS + 5 * stages + 3 + segments * (CONSUMERS + stages))
    # not compared with Mosaic GPU's own count yet: the forward's margin
    return n + ALLOCATION_SLACK


def fused_backward(problem, sizes: BlockSizes, backward: BackwardTiles | None,
                   interpret: bool = False) -> bool:
    """Whether the call's backward is the one-kernel Mosaic GPU backward (BlockSizes.
    fused_backward; None: at FUSED_BACKWARD_AUTO_HEAD_DIMS where it applies and its shared memory
    fits, not in interpret mode)."""
    choice = sizes.fused_backward
    if choice is False:
        return False
    reason = fused_backward_unsupported_reason(problem.head_dim, backward)
    if reason is None:
        need = fused_backward_shared_memory_bytes(backward, problem.head_dim,
                                                  segments=problem.has_segments)
        if need > SHARED_MEMORY_BYTES:
            reason = (f"mosaic_backward={backward} at head dim {problem.head_dim}: it needs "
                      f"{need} bytes of shared memory, a Hopper block has {SHARED_MEMORY_BYTES}"
                      " (use fewer stages)")
    if choice is None:
        return (reason is None and not interpret
                and problem.head_dim in FUSED_BACKWARD_AUTO_HEAD_DIMS)
    if reason is not None:
        raise NotImplementedError(f"BlockSizes(fused_backward=True) cannot take {reason}; "
                                  "fused_backward=None or False can.")
    return True


def mosaic_tiles(problem, sizes: BlockSizes, interpret: bool) -> MosaicTiles:
    backward = mosaic_backward_tiles(problem, sizes, interpret)
    return MosaicTiles(mosaic_forward_tiles(problem, sizes, interpret), backward,
                       fused_backward(problem, sizes, backward, interpret))
