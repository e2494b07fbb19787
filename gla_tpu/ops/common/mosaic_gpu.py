"""Pieces the Mosaic GPU kernels share (attention forward and backward, GLA forward)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def interpret_params(interpret):
    """`plgpu.kernel`'s interpret argument from a kernel's: the GPU interpreter's defaults for
    True, an `InterpretGPUParams` as given, None (compiled) for False or None."""
    return plgpu.InterpretGPUParams() if interpret is True else (interpret or None)


def ring_producer(load, *, steps, stages: int, free) -> None:
    """A producer warpgroup's loop over a ring of `stages` shared-memory slots.

    load(step, slot) issues the TMA copies of pipeline step `step` into `slot` (they arrive on
    the slot's ready barrier). The ring is filled, then each later step waits until every barrier
    in `free` (a tuple of per-slot barrier arrays the consumers arrive on) releases its slot.
    The last releases are awaited too, so that every thread sees every phase of its barriers, as
    the GPU interpreter checks. `steps` may be a Python int or a traced int32."""
    def wait_free(slot):
        for barrier in free:
            plgpu.barrier_wait(barrier.at[slot])

    for step in range(stages):  # fill the ring
        pl.when(step < steps)(lambda step=step: load(jnp.int32(step), step))

    def refill(step, _):
        slot = lax.rem(step, jnp.int32(stages))
        wait_free(slot)
        load(step, slot)

    lax.fori_loop(stages, steps, refill, None)

    def drain(step, _):
        wait_free(lax.rem(step, jnp.int32(stages)))

    lax.fori_loop(jnp.maximum(steps - stages, 0), steps, drain, None)


def ring_continue(load, *, start, steps, stages: int, free) -> None:
    """A producer's steps [start, start + steps) of a ring that runs on from one work item to the
    next (a persistent kernel): global step g goes to slot g mod stages once the consumers have
    released that slot's previous step (g >= stages). load(i, slot) issues the item's local step
    i. start and steps may be traced int32; `ring_drain` ends the ring."""
    def step(i, _):
        g = start + i
        slot = lax.rem(g, jnp.int32(stages))

        @pl.when(g >= stages)
        def _():
            for barrier in free:
                plgpu.barrier_wait(barrier.at[slot])

        load(i, slot)

    lax.fori_loop(0, steps, step, None)


def ring_drain(total, *, stages: int, free) -> None:
    """Waits for the releases of a ring's last min(total, stages) steps (total: every step it
    loaded), so that every thread sees every phase of its barriers."""
    def drain(g, _):
        for barrier in free:
            plgpu.barrier_wait(barrier.at[lax.rem(g, jnp.int32(stages))])

    lax.fori_loop(jnp.maximum(total - stages, 0), total, drain, None)


# shared-memory tiles that wgmma and TMA read: (8, 64) tiles, 128-byte swizzle (16-bit dtypes)
SHARED_MEMORY_BYTES = 232448  # per block on Hopper (227 KiB), the most Mosaic GPU grants
SMEM_ALIGNMENT = 1024  # Pallas places each shared-memory buffer at a multiple of this
SWIZZLED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
# the same with a 64-byte swizzle, for a wgmma operand whose contraction (rows) is only 32 long:
# wgmma contracts a swizzled operand in groups of swizzle / 2 elements
SWIZZLED_64 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64))
# float32 tiles in 128-byte rows: (8, 32) tiles, 128-byte swizzle (fewer bank conflicts than
# plain rows for the wgmma accumulator's layout)
SWIZZLED_F32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def release_step(slot, ready, free) -> None:
    """A consumer's turn at a ring step it does not compute: wait for the slot's loads (every
    barrier in `ready`), then release it (every barrier in `free`), so that the producer can
    refill it and every thread sees every barrier phase."""
    for barrier in ready:
        plgpu.barrier_wait(barrier.at[slot])
    for barrier in free:
        plgpu.barrier_arrive(barrier.at[slot])
