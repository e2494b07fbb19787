"""The "mosaic_tpu" GLA backend (not yet implemented)."""

from __future__ import annotations


def check_supported(problem) -> None:
    raise NotImplementedError("the 'mosaic_tpu' gla backend is not implemented yet; use backend='xla'.")


def gla(q, k, v, g, *, problem, initial_state, segment_ids, interpret):
    check_supported(problem)
