"""The "mosaic_tpu" GLA backend (Pallas TPU kernels): chunk, fused_chunk and fused_recurrent.

    entry.py                what the backend takes, and the call (gate sums, segments, dispatch)
    vjp.py                  jax.custom_vjp wiring of the kernels, chunked and recurrent
    kernels_chunk.py        the chunked kernels ("roles") and their pallas_call builder
    kernels_chunk_tile.py   the math of one chunk, shared by every chunked kernel
    kernels_recurrent.py    token-by-token forward and backward kernels
    kernels_decode.py       the T = 1 decode kernel
    plan.py                 BlockSizes, layouts, configs and VMEM budgets
"""

from gla_tpu.ops.gla.mosaic_tpu.entry import CAPABILITIES, check_supported, gla
from gla_tpu.ops.gla.mosaic_tpu.plan import BlockSizes

__all__ = ["CAPABILITIES", "BlockSizes", "check_supported", "gla"]
