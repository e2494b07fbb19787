"""The "mosaic_tpu" GLA backend: Pallas TPU (Mosaic) kernels, dispatched by mode.

"chunk" and "fused_chunk" live in `mosaic_tpu_chunk` (kernels in `mosaic_tpu_chunk_kernels`,
per-chunk math in `mosaic_tpu_chunk_tile`); "fused_recurrent" in `mosaic_tpu_recurrent`.
docs/gla_mosaic_tpu.md describes the kernels.
"""

from __future__ import annotations

from gla_tpu.ops.gla import mosaic_tpu_chunk as chunk


def _recurrent_module():
    try:
        from gla_tpu.ops.gla import mosaic_tpu_recurrent
    except ImportError as e:
        raise NotImplementedError(
            "mode='fused_recurrent' of the 'mosaic_tpu' gla backend is not available "
            f"({e}); use backend='xla' or a chunked mode."
        ) from e
    return mosaic_tpu_recurrent


def check_supported(problem) -> None:
    """Raises NotImplementedError (naming the constraint) for a problem this backend cannot take."""
    if problem.mode == "fused_recurrent":
        _recurrent_module().check_supported_recurrent(problem)
    else:
        chunk.check_supported_chunk(problem)


def gla(q, k, v, g, *, problem, initial_state, segment_ids, interpret):
    check_supported(problem)
    if problem.mode == "fused_recurrent":
        return _recurrent_module().fused_recurrent(
            q, k, v, g, problem=problem, initial_state=initial_state, segment_ids=segment_ids,
            interpret=interpret,
        )
    return chunk.chunked_gla(q, k, v, g, problem=problem, initial_state=initial_state,
                             segment_ids=segment_ids, interpret=interpret)
