"""Tiling plan of the GPU GLA kernels: the static geometry every kernel shares, tile sizes and
the padded head dims (docs/gpu_backend.md says how they were measured)."""

from __future__ import annotations

import dataclasses

from jax.experimental.pallas import triton as plgpu

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


def compiler_params(geo: ChunkGeometry):
    return plgpu.CompilerParams(num_warps=geo.num_warps, num_stages=geo.num_stages)


CHUNK = 64  # chunk length on GPU, whatever `chunk_size` asks (the result does not depend on it)
# Up to this many tokens without segments, the forward runs the token-by-token kernel
# (decoding); its backward is the chunked one's.
MAX_RECURRENT_T = 16
BLOCK_K = 64  # K tile
MAX_DIM = 512


def value_block(value_dim: int) -> int:
    """V tile: 128 from V = 256 on (state passes, output and dv ran 1.3-1.4x faster than with 64 at
    V = 512 on the H200), else 64 (more programs for the state passes' chunk loop)."""
    return 128 if value_dim >= 256 else 64


def chunk_geometry(padded_len: int, key_dim: int, value_dim: int, *, scale: float,
                   has_segments: bool, exact_inter: bool) -> ChunkGeometry:
    """The kernels' tiles for padded T, K and V (powers of two >= 64). `exact_inter` (mode
    "fused_recurrent") keeps dq's and dk's products with the float32 states float32-accurate, as
    that mode's XLA baseline is a float32 recurrence; modes "chunk" and "fused_chunk" round the
    states to the input dtype there, as XLA's chunked baseline and fla's chunk_gla do
    (docs/gpu_backend.md)."""
    return ChunkGeometry(
        chunk=CHUNK, block_k=BLOCK_K, block_v=value_block(value_dim), key_dim=key_dim,
        value_dim=value_dim, num_chunks=-(-padded_len // CHUNK), scale=scale,
        has_segments=has_segments, exact_inter=exact_inter,
    )


def padded_dim(d: int) -> int:
    return max(BLOCK_K, 1 << (d - 1).bit_length())


