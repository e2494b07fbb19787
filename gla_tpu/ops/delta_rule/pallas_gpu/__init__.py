"""The "pallas_gpu" delta-rule backend (Mosaic GPU kernels, Hopper): mode "chunk".

    entry.py                    what the backend takes, and the call
    kernels_mosaic_operands.py  the per-chunk WY operands (forward), one Mosaic GPU kernel
    vjp.py                      jax.custom_vjp of the chunk-serial state passes
(the kernels: GLA's state pass with Pass.delta, gla/pallas_gpu/kernels_mosaic_state.py)
"""

from gla_tpu.ops.delta_rule.pallas_gpu.entry import CAPABILITIES, check_supported, delta_rule

__all__ = ["CAPABILITIES", "check_supported", "delta_rule"]
