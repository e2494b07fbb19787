"""The "mosaic_tpu" delta-rule backend (Pallas TPU kernels): mode "chunk".

    entry.py                what the backend takes, and the call (padding, gate sums, segments)
    vjp.py                  jax.custom_vjp wiring of the kernels
    kernels_chunk.py        the forward and backward kernels, on GLA's chunk grid
    kernels_chunk_tile.py   the math of one chunk: the WY representation on GLA's chunk math
    plan.py                 BlockSizes
"""

from gla_tpu.ops.delta_rule.mosaic_tpu.entry import CAPABILITIES, check_supported, delta_rule
from gla_tpu.ops.delta_rule.mosaic_tpu.plan import BlockSizes

__all__ = ["CAPABILITIES", "BlockSizes", "check_supported", "delta_rule"]
