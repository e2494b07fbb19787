"""The public `interpret` argument, as the Mosaic TPU backends pass it to pallas_call."""

from __future__ import annotations

from jax.experimental.pallas import tpu as pltpu


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
