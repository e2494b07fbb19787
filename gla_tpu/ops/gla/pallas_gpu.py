"""The "pallas_gpu" GLA backend (not yet implemented)."""

from __future__ import annotations


def check_supported(problem) -> None:
    raise NotImplementedError("the 'pallas_gpu' gla backend is not implemented yet; use backend='xla'.")


def gla(q, k, v, g, *, problem, initial_state, segment_ids, interpret):
    check_supported(problem)
