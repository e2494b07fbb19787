"""The "mosaic_tpu" flash attention backend (Pallas TPU kernels).

    entry.py    what the backend takes, and the call (layouts, dispatch); ring attention's blocks
    vjp.py      jax.custom_vjp wiring of the kernels
    kernels.py  forward, dq and dk/dv kernels and their pallas_call builders
    plan.py     BlockSizes, their resolution against a problem, VMEM and cost estimates
"""

from gla_tpu.ops.attention.mosaic_tpu.entry import (CAPABILITIES, attention_block,
                                                    attention_block_grads, check_supported,
                                                    flash_attention)
from gla_tpu.ops.attention.mosaic_tpu.plan import BlockSizes

__all__ = ["CAPABILITIES", "BlockSizes", "attention_block", "attention_block_grads",
           "check_supported", "flash_attention"]
