"""Block sizes of the "mosaic_tpu" delta rule."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Performance knobs of the chunked delta-rule kernels (the values never depend on them).

    profiler_safe: the intra-chunk masks as 0/1 products instead of selects, for libtpu's static
      profiler on v5e and v5p (GLA's `BlockSizes.profiler_safe`, docs/tpu_static_estimate.md);
      the same values.
    """

    profiler_safe: bool = False
