"""The rows layout of the Mosaic TPU attention kernels at D = 128: every head of a token block in
one block, fetched by the kernel itself (docs/attention_mosaic_tpu.md, "Layout").

`[B, N, Hx, 128]` is `[B, N * Hx, 128]` by a free reshape (`rows_view`): row t * Hx + h holds
token t of head h, and a block of `n * Hx` rows holds every head of n tokens, contiguous in HBM.
The kernels read one head's rows of such a block with a strided load at a traced head index, so
their heads run in a loop (`each_head`) and their code, and so their compile time, does not grow
with the head count.

Mosaic reads strided rows of a 16-bit type only at static offsets, but a 32-bit word of a 16-bit
array holds rows 2r (low half) and 2r + 1 (high half): a strided read of words gives one head's
rows in one half (JAX's ragged paged attention reads its interleaved k/v heads this way). A
bitcast view of a VMEM block takes strided reads only at offsets aligned to its tiles, while a
uint32 buffer of its own takes them anywhere; so the kernels DMA the blocks themselves from a
uint32 view of the HBM array into uint32 VMEM buffers (`RowStream`), double-buffered, the next
block's copy in flight while the current one is computed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_tpu.ops.common.tpu import SUBLANES


def rows_view(x):
    """[B, N, Hx, 128] -> [B, N * Hx, 128] rows (a free reshape)."""
    b, n, hx, d = x.shape
    return x.reshape(b, n * hx, d)


def reads_words(dtype, heads: int, interpret) -> bool:
    """Whether blocks of `heads` heads of `dtype` are fetched and read as 32-bit words: 16-bit
    data with several (an even number of) heads, compiled (interpret mode has no ref bitcast and
    reads 16-bit rows strided as they are)."""
    return not interpret and jnp.dtype(dtype).itemsize == 2 and heads > 1


def each_head(heads: int, head_step: Callable) -> None:
    """Runs head_step(h) for h < heads as a loop over a traced head index: the kernel's code does
    not grow with the head count, and each head's temporaries are freed before the next's."""
    pl.loop(0, heads)(head_step)


def halves_to_rows(words, odd, dtype):
    """The bfloat16 rows held in the low (odd = 0) or high (odd = 1; an int or a traced int32)
    halves of uint32 words, as [n, 128] `dtype` (float32 bit patterns with the low 16 bits
    cleared, then cast: exact)."""
    if isinstance(odd, int):
        bits = words & jnp.uint32(0xFFFF0000) if odd else words << 16
    else:
        shift = (16 * (1 - odd)).astype(jnp.uint32)
        bits = (words << shift) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Operand:
    """An operand that a rows kernel fetches itself: `hbm` [B, N * heads, 128] (memory space
    ANY) in blocks of `block` tokens of every head."""

    hbm: Any
    heads: int
    block: int
    dtype: Any
    words: bool  # fetched and read as 32-bit words (`reads_words`)

    @property
    def buffer_rows(self) -> int:
        """Rows of one block in its VMEM buffer (words: two 16-bit rows per row)."""
        rows = self.block * self.heads
        return rows // 2 if self.words else rows

    def copy(self, b, block, buffers, sems, slot):
        """The DMA of block `block` of batch row `b` into buffer `slot`."""
        src = self.hbm.bitcast(jnp.uint32) if self.words else self.hbm
        start = pl.multiple_of(block * self.buffer_rows, SUBLANES)
        return pltpu.make_async_copy(src.at[b, pl.ds(start, self.buffer_rows)],
                                     buffers.at[slot], sems.at[slot])

    def read(self, buffer, head, start: int, size: int):
        """Rows start..start+size of `head` (an int or a traced int32) from a block in `buffer`
        ([buffer_rows, 128]): [size, 128] in the operand's dtype."""
        if self.heads == 1:
            return buffer[pl.ds(start, size), :]
        if not self.words:
            return buffer[pl.ds(start * self.heads + head, size, stride=self.heads), :]
        pairs = self.heads // 2
        words = buffer[pl.ds(start * pairs + head // 2, size, stride=pairs), :]
        return halves_to_rows(words, head % 2, self.dtype)


def operand(x_hbm, heads: int, block: int, interpret) -> Operand:
    """The Operand of a [B, N * heads, 128] ref fetched in blocks of `block` tokens."""
    return Operand(x_hbm, heads, block, x_hbm.dtype,
                   reads_words(x_hbm.dtype, heads, interpret))


def buffer_scratch(dtype, heads: int, block: int, interpret) -> list:
    """The scratch of one fetched operand (`RowStream`): two VMEM buffers of a block and their
    DMA semaphores."""
    words = reads_words(dtype, heads, interpret)
    rows = block * heads // (2 if words else 1)
    return [pltpu.VMEM((2, rows, 128), jnp.uint32 if words else dtype),
            pltpu.SemaphoreType.DMA((2,))]


def stream_scratch(operands, interpret) -> list:
    """The scratch of a RowStream over `operands` = [(dtype, heads, block)] in the order of
    its operands (row operands first): their buffers and semaphores, then its state in SMEM."""
    scratch = []
    for dtype, heads, block in operands:
        scratch += buffer_scratch(dtype, heads, block, interpret)
    return scratch + [pltpu.SMEM((3,), jnp.int32)]


@dataclasses.dataclass(frozen=True)
class RowStream:
    """Double-buffered DMAs of a rows kernel's operands over its grid (b, r, s): `row_operands`
    are fetched at block r (they stay for the row's steps), `step_operands` at block s. A step
    computes where `visible(r) = (lo, hi)` has lo <= s <= hi; the others fetch nothing.

    Within a row the next step's blocks are in flight while a step computes. With
    `across_rows` (one core runs the whole grid in order) the last step of a row also starts the
    next row's first blocks; on two cores sharing the grid's parallel axes (v4, v5p) each row's
    first blocks are fetched when its first step starts. State in SMEM: the buffer slot of the
    step blocks, that of the row blocks, and whether the current step's blocks are in flight."""

    row_operands: tuple
    step_operands: tuple
    buffers: tuple  # per operand (row operands first): (buffers [2, rows, 128], sems [2])
    state: Any  # SMEM int32 [3]
    visible: Callable
    across_rows: bool
    # the grid's step axis counts from each row's lo (a windowed grid, blocks.kv_steps) rather
    # than from block 0
    steps_from_lo: bool = False

    def run(self, compute) -> None:
        """compute(read) at each visible step, read(operand index, head, start, size) giving
        rows of the step's blocks (operands indexed as row_operands + step_operands)."""
        b, r, step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        lo, hi = self.visible(r)
        s = lo + step if self.steps_from_lo else step  # the step's block
        state = self.state
        if self.across_rows:
            @pl.when((b == 0) & (r == 0) & (step == 0))
            def _init():
                state[0] = 0
                state[1] = 0
                state[2] = 0

        @pl.when((lo <= s) & (s <= hi))
        def _step():
            first = s == lo
            if self.across_rows:
                step_slot, row_slot, ready = state[0], state[1], state[2] == 1
            else:
                step_slot, row_slot, ready = lax.rem(s - lo, 2), 0, jnp.logical_not(first)

            @pl.when(ready)
            def _wait():
                self._copies(self.step_operands, b, s, step_slot, "wait")
                pl.when(first)(lambda: self._copies(self.row_operands, b, r, row_slot, "wait"))

            @pl.when(jnp.logical_not(ready))
            def _fetch():
                rows = lambda: self._copies(self.row_operands, b, r, row_slot, "start")  # noqa
                pl.when(first)(rows)
                self._copies(self.step_operands, b, s, step_slot, "start")
                pl.when(first)(lambda: self._copies(self.row_operands, b, r, row_slot, "wait"))
                self._copies(self.step_operands, b, s, step_slot, "wait")

            self._prefetch(b, r, s, hi, step_slot, row_slot)

            def read(index, head, start, size):
                ops = self.row_operands + self.step_operands
                slot = row_slot if index < len(self.row_operands) else step_slot
                buffers, _ = self.buffers[index]
                return ops[index].read(buffers.at[slot], head, start, size)

            compute(read)

    def _prefetch(self, b, r, s, hi, step_slot, row_slot) -> None:
        """Starts the copies of the blocks the next visible step computes on, where known."""
        within = s < hi
        pl.when(within)(lambda: self._copies(self.step_operands, b, s + 1, 1 - step_slot,
                                             "start"))
        if not self.across_rows:
            return
        rows, batch = pl.num_programs(1), pl.num_programs(0)
        next_r = jnp.where(r + 1 < rows, r + 1, 0)
        next_b = jnp.where(r + 1 < rows, b, b + 1)
        next_lo, next_hi = self.visible(next_r)
        across = jnp.logical_not(within) & (next_b < batch) & (next_lo <= next_hi)

        @pl.when(across)
        def _next_row():
            self._copies(self.row_operands, next_b, next_r, 1 - row_slot, "start")
            self._copies(self.step_operands, next_b, next_lo, 1 - step_slot, "start")

        self.state[0] = jnp.where(within | across, 1 - step_slot, step_slot)
        self.state[1] = jnp.where(across, 1 - row_slot, row_slot)
        self.state[2] = (within | across).astype(jnp.int32)

    def _copies(self, operands, b, block, slot, action: str) -> None:
        offset = 0 if operands is self.row_operands else len(self.row_operands)
        for index, op in enumerate(operands):
            buffers, sems = self.buffers[offset + index]
            copy = op.copy(b, block, buffers, sems, slot)
            copy.start() if action == "start" else copy.wait()


def num_heads_ok(dtype, heads: int) -> bool:
    """Whether the rows kernels read `heads` heads of `dtype` per token: 32-bit data, one head,
    or an even count of 16-bit heads (read as words)."""
    return jnp.dtype(dtype).itemsize == 4 or heads == 1 or heads % 2 == 0

