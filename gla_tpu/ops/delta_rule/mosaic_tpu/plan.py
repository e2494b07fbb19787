"""Block sizes of the "mosaic_tpu" delta rule."""

from __future__ import annotations

import dataclasses

from gla_tpu.ops.gla.mosaic_tpu.plan import BlockSizes as GlaBlockSizes

# Chunks whose inverses one block-diagonal product chain forms, where the chip is not known.
DEFAULT_INVERSE_CHUNKS = 2


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Performance knobs of the chunked delta-rule kernels (the values never depend on them).

    inverse_chunks: chunks whose (I + A)^-1 are formed together, as one block-diagonal matrix of
      inverse_chunks * 64 rows (a power of two, at most 8). None: the MXU's width / 64 on a known
      chip (2 on v4, v5e, v5p; 4 on v6e, 7x), 2 elsewhere. Fewer where the chunks of one grid
      step do not divide by it.
    profiler_safe: the intra-chunk masks as 0/1 products instead of selects, for libtpu's static
      profiler on v5e and v5p (GLA's `BlockSizes.profiler_safe`, docs/tpu_static_estimate.md);
      the same values.
    block_t_recurrent, block_v_recurrent: fused_recurrent (T > 1): tokens per grid step (a
      multiple of 8, also the backward's recompute interval) and V columns of the state per grid
      step (a multiple of 128 dividing V, or V); None picks them (GLA's `BlockSizes` fields of
      the same names, whose kernels these are).
    """

    inverse_chunks: int | None = None
    profiler_safe: bool = False
    block_t_recurrent: int | None = None
    block_v_recurrent: int | None = None

    def __post_init__(self):
        if self.inverse_chunks is not None and self.inverse_chunks not in (1, 2, 4, 8):
            raise ValueError(f"BlockSizes.inverse_chunks must be None, 1, 2, 4 or 8; got "
                             f"{self.inverse_chunks!r}.")
        if not isinstance(self.profiler_safe, bool):
            raise ValueError(f"BlockSizes.profiler_safe must be True or False; got "
                             f"{self.profiler_safe!r}.")
        self.recurrent()  # GLA's checks of the fused_recurrent fields

    def recurrent(self) -> GlaBlockSizes:
        """The fused_recurrent fields as GLA's BlockSizes, which the shared kernels plan with."""
        return GlaBlockSizes(block_t_recurrent=self.block_t_recurrent,
                             block_v_recurrent=self.block_v_recurrent)


def inverse_chunks(block_sizes: BlockSizes, chunk: int, chunks_per_step: int,
                   mxu_width: int | None) -> int:
    """Chunks per block-diagonal inverse: the field, else the MXU's width / chunk (2 where the
    chip is not known), then halved until it divides the chunks of a grid step."""
    pack = block_sizes.inverse_chunks
    if pack is None:
        pack = max(1, mxu_width // chunk) if mxu_width else DEFAULT_INVERSE_CHUNKS
    while chunks_per_step % pack:
        pack //= 2
    return pack


# The decode kernel's blocks: double-buffered state in and out per value head, within this budget
# (GLA's fused_recurrent budget).
DECODE_VMEM_BUDGET_BYTES = 12 * 2**20


def decode_block_h(num_value_heads: int, group: int, key_dim: int, value_dim: int) -> int | None:
    """Value heads per grid step of the decode kernel: all of them, else the largest multiple of
    8 dividing HV whose key heads (block / group) form whole 8-row blocks, within the VMEM
    budget; None when none fits."""
    candidates = [num_value_heads] + [
        d for d in (64, 32, 16, 8)
        if d < num_value_heads and num_value_heads % d == 0 and d % group == 0
        and (d // group) % 8 == 0]
    for bh in candidates:
        if 4 * bh * key_dim * value_dim * 4 <= DECODE_VMEM_BUDGET_BYTES:
            return bh
    return None
