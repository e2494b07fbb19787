"""The "pallas_gpu" flash attention backend (Pallas on NVIDIA GPUs).

    entry.py                   what the backend takes, and the call (padding, kernel choice);
                               ring attention's blocks
    vjp.py                     jax.custom_vjp wiring of the kernels
    kernels_triton.py          forward, dq and dk/dv kernels (Triton lowering)
    kernels_mosaic_forward.py  the Hopper forward (Mosaic GPU: wgmma, TMA, warp specialization)
    plan.py                    BlockSizes, ForwardTiles, the shared geometry, shared-memory check
"""

from gla_tpu.ops.attention.pallas_gpu.entry import (CAPABILITIES, attention_block,
                                                    attention_block_grads, check_supported,
                                                    flash_attention)
from gla_tpu.ops.attention.pallas_gpu.plan import BlockSizes, ForwardTiles, default_block_sizes

__all__ = ["CAPABILITIES", "BlockSizes", "ForwardTiles", "attention_block",
           "attention_block_grads", "check_supported", "default_block_sizes", "flash_attention"]
