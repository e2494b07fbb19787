"""The "pallas_gpu" flash attention backend (Pallas on NVIDIA GPUs).

    entry.py                   what the backend takes, and the call (padding, kernel choice);
                               ring attention's blocks
    vjp.py                     jax.custom_vjp wiring of the kernels
    kernels_triton.py          forward, dq and dk/dv kernels (Triton lowering)
    kernels_mosaic_forward.py  the Hopper forward (Mosaic GPU: wgmma, TMA, warp specialization)
    kernels_mosaic_forward_persistent.py
                               the same forward as one block per SM over a list of tiles
    kernels_mosaic_backward.py the Hopper dq and dk/dv kernels (Mosaic GPU)
    plan.py                    BlockSizes, ForwardTiles, BackwardTiles, the shared geometry,
                               which kernels run, shared-memory check
"""

from gla_tpu.ops.attention.pallas_gpu.entry import (CAPABILITIES, attention_block,
                                                    attention_block_grads, check_supported,
                                                    flash_attention)
from gla_tpu.ops.attention.pallas_gpu.plan import (BackwardTiles, BlockSizes, ForwardTiles,
                                                   default_block_sizes)

__all__ = ["CAPABILITIES", "BackwardTiles", "BlockSizes", "ForwardTiles", "attention_block",
           "attention_block_grads", "check_supported", "default_block_sizes", "flash_attention"]
