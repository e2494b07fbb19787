"""The "mosaic_tpu" GLA backend: Pallas TPU (Mosaic) kernels, dispatched by mode.

"chunk" and "fused_chunk" live in `mosaic_tpu_chunk` (kernels in `mosaic_tpu_chunk_kernels`,
per-chunk math in `mosaic_tpu_chunk_tile`); "fused_recurrent" in `mosaic_tpu_recurrent`.
docs/gla_mosaic_tpu.md and docs/gla_mosaic_tpu_recurrent.md describe the kernels.
"""

from __future__ import annotations

import jax.numpy as jnp

from gla_tpu.ops.gla import mosaic_tpu_chunk as chunk
from gla_tpu.ops.gla import mosaic_tpu_recurrent as recurrent

# The dtypes the kernels are tested and compiled for (float16 has no native TPU matmul path).
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def check_supported(problem) -> None:
    """Raises NotImplementedError (naming the constraint) for a problem this backend cannot take."""
    if jnp.dtype(problem.dtype) not in SUPPORTED_DTYPES:
        raise NotImplementedError(
            "the 'mosaic_tpu' gla backend takes bfloat16 or float32 q, k, v; got "
            f"{jnp.dtype(problem.dtype).name}. backend='xla' takes any floating dtype."
        )
    if problem.mode == "fused_recurrent":
        recurrent.check_supported_recurrent(problem)
    else:
        chunk.check_supported_chunk(problem)


def gla(q, k, v, g, *, problem, initial_state, segment_ids, interpret):
    check_supported(problem)
    if problem.mode == "fused_recurrent":
        return recurrent.fused_recurrent(
            q, k, v, g, problem=problem, initial_state=initial_state, segment_ids=segment_ids,
            interpret=interpret,
        )
    return chunk.chunked_gla(q, k, v, g, problem=problem, initial_state=initial_state,
                             segment_ids=segment_ids, interpret=interpret)
