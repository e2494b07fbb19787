"""TPU facts every Mosaic kernel shares, and the public `interpret` argument as they pass it on."""

from __future__ import annotations

from jax.experimental.pallas import tpu as pltpu

# A vreg holds [SUBLANES, LANES] 32-bit values: the last two dims of a block must be multiples of
# (SUBLANES, LANES) or equal the array's.
LANES = 128
SUBLANES = 8


def tpu_interpret_params(interpret):
    """False/None -> False (compile for TPU); True -> TPU interpret mode with uninitialized memory
    filled with NaN, so an output or scratch element a kernel never writes shows up as NaN; a
    `pltpu.InterpretParams` is used as given."""
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    if interpret is True:
        return pltpu.InterpretParams(uninitialized_memory="nan")
    if interpret is False or interpret is None:
        return False
    raise ValueError(
        "interpret must be a bool or a jax.experimental.pallas.tpu.InterpretParams for "
        f"backend='mosaic_tpu'; got {interpret!r}."
    )


def target_tpu_info():
    """`pltpu.TpuInfo` of the TPU being compiled for (a TPU device, or the abstract mesh of a
    deviceless compile), or None where there is none (CPU, interpret mode)."""
    try:
        return pltpu.get_tpu_info()
    except Exception:  # noqa: BLE001 - no TPU target: callers take generation-independent paths
        return None
