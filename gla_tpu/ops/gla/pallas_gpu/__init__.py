"""The "pallas_gpu" GLA backend (Pallas on NVIDIA GPUs): the chunked algorithm for every mode
(Triton), a token-by-token forward for decoding (Triton), and on Hopper a Mosaic GPU forward for
per-head gates when the call is not differentiated, and (asked for by BlockSizes.chunk_kernel)
Mosaic GPU kernels for per-key gates, forward and backward, at one speed for every gate.

    entry.py              what the backend takes, and the call (padding, gates, segment masks)
    vjp.py                jax.custom_vjp wiring of the kernels
    kernels_state.py      the chunk-state pass, forward and reversed
    kernels_intra.py      intra-chunk scores, dA, and dq / dk / dg
    kernels_output.py     outputs and dv
    kernels_recurrent.py  the few-token (decode) forward
    kernels_mosaic_forward.py  the per-head-gate forward in one Mosaic GPU kernel (Hopper)
    forward_mosaic.py     that forward, split in time where its blocks cannot fill the GPU
    kernels_mosaic_levels.py   per-key gates by pair levels: shared pieces, and A, qd, kd
    kernels_mosaic_state.py    the chunk-serial state pass of those kernels, forward and reversed
    kernels_mosaic_grads.py    their dq, dk, dg per chunk and key slab
    plan.py               ChunkGeometry, tiles, padded head dims
"""

from gla_tpu.ops.gla.pallas_gpu.entry import (
    CAPABILITIES,
    block_entering_cotangent,
    block_zero_state,
    check_supported,
    gla,
)
from gla_tpu.ops.gla.pallas_gpu.plan import BlockSizes

# block_zero_state and block_entering_cotangent: context parallelism's states-only passes, which
# ops.gla looks up on the backend module (ops/gla/context_parallel.py)
__all__ = ["CAPABILITIES", "BlockSizes", "block_entering_cotangent", "block_zero_state",
           "check_supported", "gla"]
