"""GLA forward with per-head gates for Hopper, in Pallas Mosaic GPU: one kernel, chunks in order.

One block per (value tile, head, batch) walks the chunks of its sequence in order and keeps the
state tile S [K, block_v] in float32 registers (the wgmma accumulator) from chunk to chunk; a
producer warpgroup has the TMA unit load the next chunk's q, k, v and gate sums into a ring of
two shared-memory slots while the consumer warpgroup computes this one (GPU interpret mode does
not take `plgpu.emit_pipeline`'s predicated copies, so the ring is written out here). Per chunk
of C rows, with b the chunk-local gate sums (non-increasing, b_{-1} = 0):

    A   = (q k^T) * E * scale,      E_rx = exp(b_r - b_x) for x <= r, else 0     [C, C]
    o   = scale * exp(b_r) * (q S) + A v                                          [C, block_v]
    S' = exp(b_last) S + k^T (w * v),  w_x = exp(b_last - b_x)                    [K, block_v]

Every exponent is <= 0 (b is non-increasing within a chunk), so nothing overflows for any gate
strength and there is one speed for every gate. q S takes S in two 16-bit parts (S = hi + lo) so
that the inter-chunk product keeps float32 accuracy at the cost of one more small wgmma.

The forward only: training takes the chunked kernels (vjp.py), whose backward needs the saved
per-chunk states. Segment ids, float32 and K above 128 take them too (plan.mosaic_forward_reason).
docs/gpu_gla.md has the design and the measurements.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gla_tpu.ops.common.mosaic_gpu import interpret_params, ring_producer


def _swizzled(dtype):
    """Tiling + 128-byte swizzle of a 2-D SMEM tile, as wgmma and TMA want it."""
    return (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(128))


def _rows(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def _cols(x, shape):
    return lax.broadcast_in_dim(x, shape, [1])


def _wgmma_layout(x):
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def _zeros(shape):
    return _wgmma_layout(jnp.zeros(shape, jnp.float32))


def _outputs(refs, state, *, chunk, scale):
    """o's tile of one chunk before its intra-chunk product: (A [C, C] 16-bit, scale * exp(b_r)
    * (q S) [C, block_v] float32); o = that + A v."""
    q_s, k_s, b_s, hi_smem, lo_smem = refs
    c, bv = chunk, hi_smem.shape[-1]
    dtype = q_s.dtype
    hi = _wgmma_layout(state.astype(dtype))
    hi_smem[...] = hi
    lo_smem[...] = _wgmma_layout((state - hi.astype(jnp.float32)).astype(dtype))
    plgpu.commit_smem()

    def products(scores_ref, inter_ref):  # q k^T and q S, issued together, awaited once
        plgpu.wgmma(scores_ref, q_s, k_s.transpose((1, 0)))
        plgpu.wgmma(inter_ref, q_s, hi_smem)
        plgpu.wgmma(inter_ref, q_s, lo_smem)
        return scores_ref[...], inter_ref[...]

    scores, inter = pl.run_scoped(products, plgpu.ACC((c, c), jnp.float32),
                                  plgpu.ACC((c, bv), jnp.float32))
    rows_layout = plgpu.Layout.WGMMA.reduce(1)
    # two copies of b: Mosaic GPU's layout inference takes one layout per SMEM buffer
    b_row = plgpu.load(b_s.at[0], layout=rows_layout)  # [C], one per query row
    b_col = plgpu.load(b_s.at[1], layout=plgpu.Layout.WGMMA.reduce(0))  # one per key column
    r = plgpu.broadcasted_iota(jnp.int32, (c, c), 0, layout=plgpu.Layout.WGMMA)
    x = plgpu.broadcasted_iota(jnp.int32, (c, c), 1, layout=plgpu.Layout.WGMMA)
    gap = _wgmma_layout(_rows(b_row, (c, c))) - _wgmma_layout(_cols(b_col, (c, c)))
    gap = jnp.where(r >= x, gap, _wgmma_layout(jnp.full((c, c), -jnp.inf, jnp.float32)))
    a = (scores * (jnp.exp(gap) * scale)).astype(dtype)
    row_scale = plgpu.layout_cast(jnp.exp(b_row) * scale, rows_layout)
    return a, _wgmma_layout(inter * _rows(row_scale, (c, bv)))


def _chunk_step(refs, state, *, chunk, scale, in_place, outputs):
    """One chunk: writes o's tile (if outputs), returns the next state [K, block_v] float32."""
    q_s, k_s, v_s, b_s, o_s, hi_smem, lo_smem, vw_smem = refs
    c, bv = chunk, vw_smem.shape[-1]
    dtype = k_s.dtype
    if outputs:
        a, o = _outputs((q_s, k_s, b_s, hi_smem, lo_smem), state, chunk=chunk, scale=scale)

    rows_layout = plgpu.Layout.WGMMA.reduce(1)
    b_row = plgpu.load(b_s.at[0], layout=rows_layout)
    b_last = b_s[0, c - 1]
    v_tile = plgpu.load(v_s, layout=plgpu.Layout.WGMMA).astype(jnp.float32)  # [C, block_v]
    w = plgpu.layout_cast(jnp.exp(b_last - b_row), rows_layout)
    vw_smem[...] = _wgmma_layout((v_tile * _rows(w, (c, bv))).astype(dtype))
    plgpu.commit_smem()
    state = _wgmma_layout(state * jnp.exp(b_last))
    if not in_place:  # GPU interpret mode runs neither ACC.init nor wgmma from registers
        state = state + jnp.dot(k_s[...].T, vw_smem[...], preferred_element_type=jnp.float32)
        if outputs:
            o_s[...] = (o + jnp.dot(a, v_s[...], preferred_element_type=jnp.float32)
                        ).astype(o_s.dtype)
        return state
    if not outputs:
        def update(state_ref):
            plgpu.wgmma(state_ref, k_s.transpose((1, 0)), vw_smem)

        return pl.run_state(update)(plgpu.ACC.init(state))

    def intra_and_update(acc_refs):  # o += A v and S' += k^T (w v), issued together
        out_ref, state_ref = acc_refs
        plgpu.wgmma(out_ref, a, v_s)
        plgpu.wgmma(state_ref, k_s.transpose((1, 0)), vw_smem)

    o, state = pl.run_state(intra_and_update)((plgpu.ACC.init(o), plgpu.ACC.init(state)))
    o_s[...] = o.astype(o_s.dtype)
    return state


def _consumer(refs, *, geo, state):
    """Walks the chunks: waits for each slot's loads, computes, frees the slot, stores o."""
    (q_smem, k_smem, v_smem, b_smem, o_smem, hi_smem, lo_smem, vw_smem, ready, free, o_ref,
     tile) = refs
    chunk, stages, block_v, outputs = geo["chunk"], geo["stages"], geo["block_v"], geo["outputs"]

    def step(i, state):
        slot = lax.rem(i, jnp.int32(stages))
        out = lax.rem(i, jnp.int32(2))
        plgpu.barrier_wait(ready.at[slot])
        if outputs:
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # o_smem[out] was stored 2 steps ago
        refs = (q_smem.at[slot] if outputs else None, k_smem.at[slot], v_smem.at[slot],
                b_smem.at[slot], o_smem.at[out] if outputs else None, hi_smem, lo_smem, vw_smem)
        state = _chunk_step(refs, state, chunk=chunk, scale=geo["scale"],
                            in_place=not geo["interpret"], outputs=outputs)
        plgpu.barrier_arrive(free.at[slot])
        if outputs:
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[out], o_ref.at[pl.ds(i * chunk, chunk),
                                                             pl.ds(tile * block_v, block_v)])
        return state

    state = lax.fori_loop(0, geo["chunks"], step, state)
    plgpu.wait_smem_to_gmem(0)
    return state


def _producer(refs, *, geo):
    """Copies chunk i's tiles and gate sums into slot i % stages, once it is free."""
    q_ref, k_ref, v_ref, b_ref, q_smem, k_smem, v_smem, b_smem, ready, free, tile = refs
    chunk, stages, block_v, n = geo["chunk"], geo["stages"], geo["block_v"], geo["chunks"]
    outputs = geo["outputs"]

    def load(i, slot):
        rows = pl.ds(i * chunk, chunk)
        if outputs:
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], ready.at[slot])
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], ready.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[rows, pl.ds(tile * block_v, block_v)],
                                v_smem.at[slot], ready.at[slot])
        for copy in range(b_smem.shape[1]):
            plgpu.copy_gmem_to_smem(b_ref.at[rows], b_smem.at[slot, copy], ready.at[slot])

    ring_producer(load, steps=n, stages=stages, free=(free,))


def forward(q, k, v, b, s0, *, scale: float, chunk: int, block_v: int, interpret: bool,
            stages: int = 2):
    """Per-head-gate GLA forward.

    q, k [B, Tp, H, K] and v [B, Tp, H, V] (16-bit; Tp a multiple of chunk, K in {64, 128}, V a
    multiple of block_v), b [B, H, Tp] float32 chunk-local gate sums, s0 [B, H, K, V] float32 or
    None -> (o [B, Tp, H, V] in v's dtype, final state [B, H, K, V] float32). q None: the final
    state alone (no q S, no q k^T, no o: what forward_mosaic.py's first pass needs).
    """
    outputs = q is not None
    bsz, tp, h, kd = k.shape
    vd = v.shape[-1]
    dtype = k.dtype
    if tp % chunk or vd % block_v:
        raise ValueError(f"padded T={tp} and V={vd} must be multiples of {chunk}, {block_v}")
    has_s0 = s0 is not None
    geo = dict(chunk=chunk, stages=stages, block_v=block_v, chunks=tp // chunk, scale=scale,
               interpret=bool(interpret), outputs=outputs)

    def body(*refs):
        refs = list(refs)
        q_ref = refs.pop(0) if outputs else None
        k_ref, v_ref, b_ref = refs[:3]
        s0_ref = refs[3] if has_s0 else None
        refs = refs[3 + has_s0:]
        o_ref = refs.pop(0) if outputs else None
        final_ref = refs.pop(0)
        scratch_refs = iter(refs)  # the buffers a pass without outputs has no use for are None
        (q_smem, k_smem, v_smem, b_smem, o_smem, hi_smem, lo_smem, vw_smem, state_smem, ready,
         free, loaded) = (None if t is None else next(scratch_refs) for t in scratch)
        tile, head, batch, wg = (lax.axis_index(n) for n in ("value", "head", "batch", "wg"))
        cols = pl.ds(tile * block_v, block_v)

        @pl.when(wg == 0)
        def _():
            plgpu.set_max_registers(232, action="increase")
            if has_s0:
                plgpu.copy_gmem_to_smem(s0_ref.at[batch, head, :, cols], state_smem, loaded)
                plgpu.barrier_wait(loaded)
                state = plgpu.load(state_smem, layout=plgpu.Layout.WGMMA)
            else:
                state = _zeros((kd, block_v))
            refs = (q_smem, k_smem, v_smem, b_smem, o_smem, hi_smem, lo_smem, vw_smem, ready,
                    free, o_ref.at[batch, :, head] if outputs else None, tile)
            state = _consumer(refs, geo=geo, state=state)
            state_smem[...] = state
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(state_smem, final_ref.at[batch, head, :, cols])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _():
            plgpu.set_max_registers(40, action="decrease")
            refs = (q_ref.at[batch, :, head] if outputs else None, k_ref.at[batch, :, head],
                    v_ref.at[batch, :, head], b_ref.at[batch, head], q_smem, k_smem, v_smem,
                    b_smem, ready, free, tile)
            _producer(refs, geo=geo)

    tiled = _swizzled(dtype)
    b_copies = 2 if outputs else 1
    scratch = [
        plgpu.SMEM((stages, chunk, kd), dtype, transforms=tiled) if outputs else None,  # q
        plgpu.SMEM((stages, chunk, kd), dtype, transforms=tiled),  # k
        plgpu.SMEM((stages, chunk, block_v), dtype, transforms=tiled),  # v
        plgpu.SMEM((stages, b_copies, chunk), jnp.float32),  # b
        plgpu.SMEM((2, chunk, block_v), dtype, transforms=tiled) if outputs else None,  # o
        plgpu.SMEM((kd, block_v), dtype, transforms=tiled) if outputs else None,  # S, high
        plgpu.SMEM((kd, block_v), dtype, transforms=tiled) if outputs else None,  # S, low
        plgpu.SMEM((chunk, block_v), dtype, transforms=tiled),  # w * v
        plgpu.SMEM((kd, block_v), jnp.float32, transforms=_swizzled(jnp.float32)),  # S in/out
        # one arrival per TMA copy of a chunk: q (with outputs), k, v, b (twice with outputs)
        plgpu.Barrier(num_arrivals=2 + b_copies + outputs, num_barriers=stages),  # ready
        plgpu.Barrier(num_barriers=stages),  # free
        plgpu.Barrier(num_barriers=1),  # s0 loaded
    ]
    state_type = jax.ShapeDtypeStruct((bsz, h, kd, vd), jnp.float32)
    kernel = plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct(v.shape, v.dtype), state_type] if outputs else [state_type],
        scratch_types=[t for t in scratch if t is not None],
        grid=(vd // block_v, h, bsz),
        grid_names=("value", "head", "batch"),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(interpret),
    )
    operands = ((q,) if outputs else ()) + (k, v, b) + ((s0,) if has_s0 else ())
    name = "gla_fwd_mosaic_per_head" if outputs else "gla_fwd_mosaic_per_head_states"
    with jax.named_scope(f"{name}_block_v={block_v}"):
        out = kernel(*operands)
    return tuple(out) if outputs else out[0]
