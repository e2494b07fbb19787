"""The "mosaic_tpu" attention backend (not yet implemented)."""

from __future__ import annotations


def check_supported(problem, block_sizes) -> None:
    raise NotImplementedError("the 'mosaic_tpu' flash_attention backend is not implemented yet; use backend='xla'.")


def flash_attention(q, k, v, *, problem, q_segment_ids, kv_segment_ids, block_sizes, interpret):
    check_supported(problem, block_sizes)
