"""The undifferentiated per-head-gate forward on Mosaic GPU, split in time where blocks are few.

kernels_mosaic_forward.py runs one block per (value tile, head, batch) through the whole sequence.
When those blocks cannot fill the GPU (long T, few heads: (2, 16384, 8, 128, 128) has 32 blocks
for 132 SMs), T is cut into P segments that run side by side as P times the batch, in two passes:

1. the kernel without outputs (no q) gives each segment's end state from a zero state, S(p);
2. XLA scans them into the state each segment starts from (time_split.segment_starts),
       S_in(0) = initial state,   S_in(p+1) = exp(G(p)) S_in(p) + S(p),
   G(p) the sum of the segment's gates (<= 0), a few [B, H, K, V] products;
3. the kernel with outputs runs every segment from its S_in; the last one's final state is the
   call's.

The first pass reads k, v and the gates and does one wgmma per chunk of the second's four, so the
split costs about a third more work in exchange for P times the blocks; o is computed once, as
without the split. plan.mosaic_time_splits picks P (docs/gpu_gla.md).
"""

from __future__ import annotations

import jax.numpy as jnp

from gla_tpu.ops.common.chunk_cumsum import chunk_local_cumsum
from gla_tpu.ops.common.padding import pad_time
from gla_tpu.ops.gla.pallas_gpu import kernels_mosaic_forward
from gla_tpu.ops.gla.pallas_gpu.plan import MOSAIC_BLOCK_V
from gla_tpu.ops.gla.pallas_gpu.time_split import fold, segment_starts, unfold


def forward(q, k, v, g, s0, *, geo, interpret: bool):
    """q, k [B, Tp, H, K], v [B, Tp, H, V], g [B, Tp, H] float32 log gates, s0 [B, H, K, V]
    float32 or None -> (o [B, Tp, H, V] in v's dtype, final state [B, H, K, V] float32)."""
    run = dict(scale=geo.scale, chunk=geo.chunk, block_v=MOSAIC_BLOCK_V, interpret=interpret)
    splits = geo.mosaic_splits
    if splits == 1:
        b = chunk_local_cumsum(g, geo.chunk, method="triangular")  # [B, Tp, H]
        return kernels_mosaic_forward.forward(q, k, v, jnp.swapaxes(b, 1, 2), s0, **run)

    bsz, tp, h, kd = q.shape
    vd = v.shape[-1]
    q, k, v, g = (pad_time(x, splits * geo.chunk) for x in (q, k, v, g))
    seg = q.shape[1] // splits
    q, k, v = (fold(x, splits) for x in (q, k, v))
    b = jnp.swapaxes(chunk_local_cumsum(fold(g, splits), geo.chunk, method="triangular"), 1, 2)
    s_local = kernels_mosaic_forward.forward(None, k, v, b, None, **run)  # [B * P, H, K, V]
    decay = jnp.exp(jnp.sum(g.reshape(bsz, splits, seg, h), axis=2))[..., None]  # [B, P, H, 1]
    start = jnp.zeros((bsz, h, kd, vd), jnp.float32) if s0 is None else s0
    o, final = kernels_mosaic_forward.forward(q, k, v, b, segment_starts(s_local, decay, start),
                                              **run)
    o = unfold(o, splits)[:, :tp]
    return o, final.reshape(bsz, splits, h, kd, vd)[:, -1]
