"""Tiling plan of the GPU GLA kernels: tile sizes (user-tunable through BlockSizes), the padded
head dims, and the static geometry every kernel shares (docs/gpu_gla.md says how the defaults
were measured)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from gla_tpu.ops.common.backends import gpu_sm_count, mosaic_gpu_selected

CHUNK = 64  # the GPU kernels' chunk length (chunk_size=64; the result does not depend on it)
# Up to this many tokens without segments, the forward runs the token-by-token kernel
# (decoding); its backward is the chunked one's.
MAX_RECURRENT_T = 16
BLOCK_K = 64  # K tile
MAX_DIM = 512
VALUE_BLOCKS = (64, 128)
FORWARD_KERNELS = ("auto", "triton", "mosaic_gpu")
CHUNK_KERNELS = ("auto", "triton", "mosaic_gpu")
GROUP_SUMS = ("float32", "input")
STATE_BLOCK_VS = (32, 64)
STATE_PARTS = (1, 2)
OUTPUT_PARTS = (1, 2)
WARPS = (1, 2, 4, 8, 16)
MOSAIC_BLOCK_V = 64  # V tile of the Mosaic GPU forward (one block per V tile, head and batch)
MOSAIC_KEY_DIMS = (64, 128)  # padded K it takes (the state tile lives in registers)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of the GPU GLA kernels (performance only: every setting computes the same function;
    three fields move one rounding: mosaic_group_sums, mosaic_state_parts, mosaic_output_parts).

    Attributes:
      block_v: V tile of the state passes, outputs and dv (64 or 128; None: `value_block`, 128
        from V = 256 on, else 64). Clamped to the padded V.
      num_warps, num_warps_dqk: warps per program of every kernel but dq/dk/dg, and of that one.
      num_stages: software-pipelining stages of the Triton loops.
      forward_kernel: the forward of a call that is not differentiated, with per-head gates or
        none: "mosaic_gpu" (kernels_mosaic_forward.py, one kernel over the chunks in order),
        "triton" (the chunked kernels), or "auto": Mosaic GPU on a Hopper GPU where it applies
        (mosaic_forward_reason), else Triton. Training always runs the chunked kernels.
      mosaic_time_splits: segments of T the Mosaic GPU forward and the pair-level state passes
        run side by side (a power of two; None: `mosaic_time_splits`, from the GPU's SM count).
      chunk_kernel: the kernels of a chunked call, forward and backward: "mosaic_gpu" (the
        pair-level kernels on a Hopper GPU: kernels_mosaic_levels.py, kernels_mosaic_state.py,
        kernels_mosaic_grads.py; one speed for every gate, where mosaic_chunk_reason allows;
        per-head and absent gates read as [B, T, H]), "triton" (the chunked kernels), or
        "auto": the pair-level kernels on a Hopper GPU where they apply, except for a few
        tokens (decoding), else Triton. An undifferentiated call with per-head gates or none
        still runs the one-kernel forward (forward_kernel).
      mosaic_group_sums: K above 128 runs the pair-level state passes as groups of 128 keys, one
        after another in a block, each adding its outputs (o, or dv) to the sum of the groups
        before it, which goes through global memory: "input" (the input dtype; the default:
        half the bytes of "float32" for one more rounding of a partial sum), or "float32"
        (docs/gpu_gla.md, "Block sizes").
      mosaic_block_v: value columns per block of the pair-level state passes: 64, or 32 (twice
        the blocks, two to an SM; slower on an H100 at K = 128: docs/gpu_gla.md,
        "Block sizes").
      mosaic_state_parts: 16-bit parts of h per chunk that the differentiated forward stores for
        the backward's state term: 1 (hi alone; the default: the state term's first chunk of
        each row or time segment takes the float32 state entering it), or 2 (hi and lo, twice
        the bytes written and read back; docs/gpu_gla.md, "Block sizes").
      mosaic_output_parts: 16-bit parts of the state that the pair-level state passes' outputs
        take, o = qd h + A v forward and dv = kd dh + A^T do reversed: 1 (hi alone, the state
        rounded to the input dtype as XLA's chunked baseline rounds it; the default: one product
        and one rounding fewer per chunk, the forward 2-10% faster), or 2 (hi and lo, the
        float32 state's accuracy; docs/gpu_gla.md, "Block sizes").
    """

    block_v: int | None = None
    num_warps: int = 4
    num_warps_dqk: int = 4
    num_stages: int = 2
    forward_kernel: str = "auto"
    mosaic_time_splits: int | None = None
    chunk_kernel: str = "auto"
    mosaic_group_sums: str = "input"
    mosaic_block_v: int = 64
    mosaic_state_parts: int = 1
    mosaic_output_parts: int = 1

    def __post_init__(self):
        splits = self.mosaic_time_splits
        if splits is not None and not (isinstance(splits, int) and splits >= 1
                                       and splits & (splits - 1) == 0):
            raise ValueError(f"BlockSizes.mosaic_time_splits={splits!r} must be None or a power "
                             "of two >= 1.")
        for name, choices in (("forward_kernel", FORWARD_KERNELS), ("chunk_kernel", CHUNK_KERNELS),
                              ("mosaic_state_parts", STATE_PARTS),
                              ("mosaic_output_parts", OUTPUT_PARTS),
                              ("mosaic_block_v", STATE_BLOCK_VS), ("mosaic_group_sums", GROUP_SUMS),
                              ("num_warps", WARPS), ("num_warps_dqk", WARPS)):
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"BlockSizes.{name}={value!r} must be one of {choices}.")
        if self.block_v is not None and self.block_v not in VALUE_BLOCKS:
            raise ValueError(
                f"BlockSizes.block_v={self.block_v!r} must be None or one of {VALUE_BLOCKS}.")
        if not (isinstance(self.num_stages, int) and 1 <= self.num_stages <= 8):
            raise ValueError(f"BlockSizes.num_stages={self.num_stages!r} must be an int in [1, 8].")


@dataclasses.dataclass(frozen=True)
class ChunkGeometry:
    """Static facts of one chunked GLA call (hashable)."""

    chunk: int  # C
    block_k: int
    block_v: int
    key_dim: int  # padded K (a power of two >= block_k)
    value_dim: int  # padded V
    num_chunks: int  # N
    scale: float
    has_segments: bool
    num_warps: int = 4
    num_warps_dqk: int = 4
    num_stages: int = 2
    # dtype the state passes store h_n and dh_{n+1} in for the later kernels (the recurrence runs
    # in float32 either way)
    state_dtype: str = "float32"
    # dq's and dk's inter-chunk products on the float32 states (split bfloat16 for 16-bit
    # inputs) instead of states rounded to the input dtype
    exact_inter: bool = False
    # one gate per head and token (or none): the intra-chunk decay exp(b_r - b_x) is one number
    # per pair, applied to the [C, C] product (kernels_intra.py)
    per_head: bool = False
    # the undifferentiated forward runs kernels_mosaic_forward.py (plan.mosaic_forward), and the
    # pair-level state passes run (vjp.py), on this many segments of T side by side
    # (forward_mosaic.py)
    mosaic_forward: bool = False
    mosaic_splits: int = 1
    # per-key gates run the pair-level Mosaic GPU kernels, forward and backward (mosaic_chunk),
    # on key_groups groups of at most MOSAIC_GROUP_KEYS keys each
    mosaic_chunk: bool = False
    key_groups: int = 1
    # the key groups' partial output sums in the input dtype (BlockSizes.mosaic_group_sums);
    # these three default as BlockSizes does
    group_sums_16bit: bool = True
    # value columns per block of the pair-level state passes (BlockSizes.mosaic_block_v)
    state_block_v: int = 64
    # 16-bit parts of h stored for the backward (BlockSizes.mosaic_state_parts)
    state_parts: int = 1
    # 16-bit parts of the state the state passes' outputs take (BlockSizes.mosaic_output_parts)
    output_parts: int = 1


def compiler_params(geo: ChunkGeometry):
    return plgpu.CompilerParams(num_warps=geo.num_warps, num_stages=geo.num_stages)


def value_block(value_dim: int) -> int:
    """V tile: 128 from V = 256 on (the state passes, output and dv run faster than with 64 there;
    docs/gpu_gla.md has the measurement), else 64 (more programs for the state passes' chunk
    loop)."""
    return 128 if value_dim >= 256 else 64


def chunk_geometry(padded_len: int, key_dim: int, value_dim: int, *, scale: float,
                   has_segments: bool, exact_inter: bool, per_head: bool = False,
                   mosaic_forward: bool = False, mosaic_chunk: bool = False, batch: int = 1,
                   heads: int = 1, block_sizes: BlockSizes = BlockSizes()) -> ChunkGeometry:
    """The kernels' tiles for padded T, K and V (powers of two >= 64). `exact_inter` (mode
    "fused_recurrent") keeps dq's and dk's products with the float32 states float32-accurate, as
    that mode's XLA baseline is a float32 recurrence; modes "chunk" and "fused_chunk" round the
    states to the input dtype there, as XLA's chunked baseline and fla's chunk_gla do
    (docs/gpu_gla.md)."""
    block_v = min(block_sizes.block_v or value_block(value_dim), value_dim)
    num_chunks = -(-padded_len // CHUNK)
    splits = 1
    groups = max(1, key_dim // MOSAIC_GROUP_KEYS) if mosaic_chunk else 1
    if mosaic_forward or mosaic_chunk:
        # the state passes' blocks: one per value tile, head and batch row (a block walks the
        # key groups in turn)
        tile = block_sizes.mosaic_block_v if mosaic_chunk else MOSAIC_BLOCK_V
        splits = block_sizes.mosaic_time_splits or mosaic_time_splits(
            batch * heads * (value_dim // tile), num_chunks)
    return ChunkGeometry(
        chunk=CHUNK, block_k=BLOCK_K, block_v=block_v, key_dim=key_dim,
        value_dim=value_dim, num_chunks=num_chunks, scale=scale,
        has_segments=has_segments, num_warps=block_sizes.num_warps,
        num_warps_dqk=block_sizes.num_warps_dqk, num_stages=block_sizes.num_stages,
        exact_inter=exact_inter, per_head=per_head, mosaic_forward=mosaic_forward,
        mosaic_splits=splits, mosaic_chunk=mosaic_chunk,
        key_groups=groups, group_sums_16bit=block_sizes.mosaic_group_sums == "input",
        state_block_v=block_sizes.mosaic_block_v, state_parts=block_sizes.mosaic_state_parts,
        output_parts=block_sizes.mosaic_output_parts,
    )


MIN_SEGMENT_CHUNKS = 4  # a segment of the split Mosaic GPU forward has at least this many chunks


def mosaic_time_splits(blocks: int, num_chunks: int) -> int:
    """Segments of T for the Mosaic GPU forward: doubled while twice the blocks still fit in one
    wave over the SMs and a segment keeps MIN_SEGMENT_CHUNKS chunks (docs/gpu_gla.md)."""
    sms, splits = gpu_sm_count(), 1
    while blocks * splits * 2 <= sms and num_chunks // (splits * 2) >= MIN_SEGMENT_CHUNKS:
        splits *= 2
    return splits


def mosaic_forward_reason(*, per_head: bool, has_segments: bool, dtype, key_dim: int):
    """Why the Mosaic GPU forward cannot take a problem (None: it can); key_dim is padded K."""
    if not per_head:
        return "per-key gates"
    if has_segments:
        return "segment_ids"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (it takes bfloat16 and float16)"
    if key_dim not in MOSAIC_KEY_DIMS:
        return f"padded K = {key_dim} (it takes {MOSAIC_KEY_DIMS})"
    return None


def mosaic_forward(block_sizes: BlockSizes, interpret: bool, **problem) -> bool:
    """Whether an undifferentiated chunked forward runs the Mosaic GPU kernel
    (backends.mosaic_gpu_selected: "auto" on a Hopper GPU outside interpret mode, "mosaic_gpu"
    anywhere it applies)."""
    return mosaic_gpu_selected(block_sizes.forward_kernel, mosaic_forward_reason(**problem),
                               interpret)


MOSAIC_CHUNK_KEY_DIMS = (64, 128, 256, 512)  # padded K the pair-level kernels take
MOSAIC_CHUNK_VALUE_DIMS = (64, 128, 256, 512)  # padded V
# keys per state tile of the pair-level kernels (registers); a larger K runs as K / 128 groups of
# keys, virtual heads whose outputs are summed (vjp.mosaic_chunked)
MOSAIC_GROUP_KEYS = 128


def mosaic_chunk_reason(*, dtype, key_dim: int, value_dim: int, exact_inter: bool):
    """Why the pair-level Mosaic GPU kernels cannot take a problem (None: they can); key_dim and
    value_dim are the padded K and V. Per-head and absent gates take them as [B, T, H] gates;
    segment ids as gates that reset the state (entry.reset_at_segment_starts)."""
    if exact_inter:
        return ("mode 'fused_recurrent' (its backward's float32-accurate state products; modes "
                "'chunk' and 'fused_chunk' take them)")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (it takes bfloat16 and float16)"
    if key_dim not in MOSAIC_CHUNK_KEY_DIMS or value_dim not in MOSAIC_CHUNK_VALUE_DIMS:
        return (f"padded K = {key_dim}, V = {value_dim} (it takes K in {MOSAIC_CHUNK_KEY_DIMS}, "
                f"V in {MOSAIC_CHUNK_VALUE_DIMS})")
    return None


def mosaic_chunk(block_sizes: BlockSizes, interpret: bool, *, few_tokens: bool,
                 **problem) -> bool:
    """Whether a chunked call (forward and backward) runs the pair-level Mosaic GPU kernels
    (backends.mosaic_gpu_selected: "auto" on a Hopper GPU outside interpret mode, "mosaic_gpu"
    anywhere they apply). "auto" leaves a few tokens (decoding) to the token-by-token forward."""
    if few_tokens and block_sizes.chunk_kernel == "auto":
        return False
    return mosaic_gpu_selected(block_sizes.chunk_kernel, mosaic_chunk_reason(**problem),
                               interpret, field="chunk_kernel")


def padded_dim(d: int) -> int:
    """K or V as the kernels take it: the next power of two, at least BLOCK_K (zero-padded)."""
    return max(BLOCK_K, 1 << (d - 1).bit_length())
