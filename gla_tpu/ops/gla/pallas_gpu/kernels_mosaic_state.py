"""Per-key GLA on Mosaic GPU: the chunk-serial state pass, forward and reversed, one kernel.

One block per (value tile, head, batch) walks the chunks in order (reversed for the backward) and
keeps the state tile S [K, block_v] in float32 registers; a producer warpgroup has the TMA unit
load each chunk's operands into a ring of shared-memory slots. Per chunk n, with the operands
that `prep` (kernels_mosaic_levels.py) wrote, x [C, K], y [C, block_v] and the chunk's decay
exp(b_last) [K]:

    store S                                       (the state entering the chunk, if asked)
    out = w S + A y      (forward)   out = w S + A^T y      (reversed)        [C, block_v]
    S  <- exp(b_last) S + x^T y

Forward: x = kd, y = v, w = qd, out = o, and S the state h_n (stored as two 16-bit parts,
h = hi + lo). Reversed: x = qd, y = do, w = kd, out = dv, and S the gradient dh_{n+1} of the
state after chunk n (stored as one 16-bit part); it also sums the state term of dg,
sum_V h_n dh_{n+1} [K], from the forward's two parts. The loop ends on the final state (forward)
or d initial_state (reversed), float32. w S takes S in its two 16-bit parts, so the inter-chunk
product keeps float32 accuracy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gla_tpu.ops.common.mosaic_gpu import SWIZZLED, ring_producer
from gla_tpu.ops.gla.pallas_gpu.kernels_mosaic_levels import (
    COMPILER_PARAMS,
    F32,
    ROW,
    T,
    full,
    matmul,
    rows,
)

BLOCK_V = 64  # value columns per block (the state tile [K, 64] lives in registers)


@dataclasses.dataclass(frozen=True)
class Pass:
    """What one run of the state pass does (static)."""

    reverse: bool  # walk the chunks last to first (the backward's dh pass)
    outputs: bool  # out = w S + A y (forward: o) or w S + A^T y (reversed: dv)
    store_parts: int  # 16-bit parts of S stored per chunk: 0, 1 (hi) or 2 (hi and lo)
    state_term: bool  # sum_V h_n S per chunk from the forward's stored parts (reverse only)
    chunk: int = 64
    stages: int = 2
    # key groups: x, w, decay, the states and out run over H * groups virtual heads of K / groups
    # keys each, y over the H heads (head // groups); out is then float32, one partial sum per
    # group, summed by the caller (vjp.py)
    groups: int = 1


def state_pass(x, y, decay, s0, *, w=None, a=None, h_parts=None, p: Pass, interpret):
    """x [B, Tp, H, K], y [B, Tp, H, V] (16-bit), decay [B, N, H, K] float32 (b_last per chunk),
    s0 [B, H, K, V] float32 or None, w [B, Tp, H, K] and a [B, Tp, H, C] (p.outputs), h_parts
    (two [B, N, H, K, V] 16-bit arrays, p.state_term). Every per-chunk array is chunk-major, so
    that segments of T fold into the batch by reshapes (vjp.py).

    Returns, in this order, what `p` asks for: out [B, Tp, H, V] (outputs), the stored parts of S
    per chunk ([B, N, H, K, V] each), the state term [B, N, H, V / BLOCK_V, K] float32 (per value
    tile; the caller sums the tiles), and the last state [B, H, K, V] float32."""
    bsz, tp, h, kd = x.shape
    vd = y.shape[-1]
    c, stages, dtype = p.chunk, p.stages, x.dtype
    n = tp // c
    if tp % c or vd % BLOCK_V:
        raise ValueError(f"padded T={tp} and V={vd} must be multiples of {c}, {BLOCK_V}")
    has_s0 = s0 is not None
    out_dtype = F32 if p.groups > 1 else dtype

    def body(*refs):
        refs = list(refs)
        x_ref, y_ref, decay_ref = refs[:3]
        refs = refs[3:]
        s0_ref = refs.pop(0) if has_s0 else None
        w_ref, a_ref = (refs.pop(0), refs.pop(0)) if p.outputs else (None, None)
        hp_refs = (refs.pop(0), refs.pop(0)) if p.state_term else None
        o_ref = refs.pop(0) if p.outputs else None
        part_refs = [refs.pop(0) for _ in range(p.store_parts)]
        term_ref = refs.pop(0) if p.state_term else None
        last_ref = refs.pop(0)
        scratch = dict(zip(scratch_names, refs))
        tile, head, batch, wg = (lax.axis_index(name) for name in ("value", "head", "batch", "wg"))
        vcols = pl.ds(tile * BLOCK_V, BLOCK_V)

        def chunk_index(i):
            return n - 1 - i if p.reverse else i

        @pl.when(wg == 0)
        def _():
            plgpu.set_max_registers(232, action="increase")
            if has_s0:
                state = plgpu.load(s0_ref.at[batch, head, :, vcols], layout=plgpu.Layout.WGMMA,
                                   optimized=False)
            else:
                state = full((kd, BLOCK_V), 0.0)

            def step(i, state):
                slot = lax.rem(i, jnp.int32(stages))
                chunk = chunk_index(i)
                plgpu.barrier_wait(scratch["ready"].at[slot])
                if p.store_parts or p.outputs or p.state_term:
                    # the previous chunk's stores have read the staging buffers
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                parts = []
                if p.store_parts or p.outputs:
                    hi = state.astype(dtype)
                    scratch["st_hi"][...] = hi
                    parts.append(scratch["st_hi"])
                    if p.store_parts == 2 or p.outputs:
                        scratch["st_lo"][...] = (state - hi.astype(F32)).astype(dtype)
                        parts.append(scratch["st_lo"])
                    plgpu.commit_smem()
                for part, part_ref in zip(parts[:p.store_parts], part_refs):
                    plgpu.copy_smem_to_gmem(part, part_ref.at[batch, chunk, head, :, vcols],
                                            commit_group=False)
                if p.state_term:
                    h_full = sum(plgpu.load(hp.at[slot], layout=plgpu.Layout.WGMMA).astype(F32)
                                 for hp in (scratch["h_hi"], scratch["h_lo"]))
                    scratch["term"][...] = jnp.sum(h_full * state, axis=1)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(scratch["term"],
                                            term_ref.at[batch, chunk, head, tile],
                                            commit_group=False)
                decay = plgpu.load(scratch["decay"].at[slot], layout=ROW)
                decayed = state * rows(jnp.exp(decay), state.shape)
                x_s, y_s = scratch["x"].at[slot], scratch["y"].at[slot]
                if p.outputs:
                    a_s = scratch["a"].at[slot]
                    o = matmul([(scratch["w"].at[slot], parts[0]),
                                (scratch["w"].at[slot], parts[1]),
                                (T(a_s) if p.reverse else a_s, y_s)], (c, BLOCK_V),
                               interpret=interpret)
                state = matmul([(T(x_s), y_s)], state.shape, interpret=interpret, init=decayed)
                if interpret:  # jnp.dot read the slot through the generic proxy: order it
                    plgpu.commit_smem()  # before the TMA unit refills the slot
                plgpu.barrier_arrive(scratch["free"].at[slot])
                if p.outputs:
                    scratch["o"][...] = o.astype(out_dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        scratch["o"],
                        o_ref.at[batch, pl.ds(chunk * c, c), head, vcols], commit_group=False)
                if p.store_parts or p.outputs or p.state_term:
                    plgpu.commit_smem_to_gmem_group()
                return state

            state = lax.fori_loop(0, n, step, state)
            plgpu.wait_smem_to_gmem(0)
            last_ref.at[batch, head, :, vcols][...] = state

        @pl.when(wg == 1)
        def _():
            plgpu.set_max_registers(40, action="decrease")

            def load(i, slot):
                chunk = chunk_index(i)
                tokens = pl.ds(chunk * c, c)
                ready = scratch["ready"].at[slot]
                copies = [(x_ref.at[batch, tokens, head], scratch["x"]),
                          (y_ref.at[batch, tokens, head // p.groups, vcols], scratch["y"]),
                          (decay_ref.at[batch, chunk, head], scratch["decay"])]
                if p.outputs:
                    copies += [(w_ref.at[batch, tokens, head], scratch["w"]),
                               (a_ref.at[batch, tokens, head], scratch["a"])]
                if p.state_term:
                    copies += [(hp.at[batch, chunk, head, :, vcols], scratch[name])
                               for hp, name in zip(hp_refs, ("h_hi", "h_lo"))]
                for src, dst in copies:
                    plgpu.copy_gmem_to_smem(src, dst.at[slot], ready)

            ring_producer(load, steps=n, stages=stages, free=(scratch["free"],))

    tiled = dict(transforms=SWIZZLED)
    scratch_types = {
        "x": plgpu.SMEM((stages, c, kd), dtype, **tiled),
        "y": plgpu.SMEM((stages, c, BLOCK_V), dtype, **tiled),
        "decay": plgpu.SMEM((stages, kd), F32),
    }
    if p.outputs:
        scratch_types["w"] = plgpu.SMEM((stages, c, kd), dtype, **tiled)
        scratch_types["a"] = plgpu.SMEM((stages, c, c), dtype, **tiled)
        scratch_types["o"] = (plgpu.SMEM((c, BLOCK_V), F32) if p.groups > 1 else
                              plgpu.SMEM((c, BLOCK_V), dtype, **tiled))
    if p.state_term:
        for name in ("h_hi", "h_lo"):
            scratch_types[name] = plgpu.SMEM((stages, kd, BLOCK_V), dtype, **tiled)
        scratch_types["term"] = plgpu.SMEM((kd,), F32)
    if p.store_parts or p.outputs:
        scratch_types["st_hi"] = plgpu.SMEM((kd, BLOCK_V), dtype, **tiled)
        if p.store_parts == 2 or p.outputs:
            scratch_types["st_lo"] = plgpu.SMEM((kd, BLOCK_V), dtype, **tiled)
    loads = 3 + 2 * p.outputs + 2 * p.state_term
    scratch_types["ready"] = plgpu.Barrier(num_arrivals=loads, num_barriers=stages)
    scratch_types["free"] = plgpu.Barrier(num_barriers=stages)
    scratch_names = list(scratch_types)

    parts_type = jax.ShapeDtypeStruct((bsz, n, h, kd, vd), dtype)
    out_type = ([jax.ShapeDtypeStruct((bsz, tp, h, vd), out_dtype)] if p.outputs else [])
    out_type += [parts_type] * p.store_parts
    if p.state_term:
        out_type.append(jax.ShapeDtypeStruct((bsz, n, h, vd // BLOCK_V, kd), F32))
    out_type.append(jax.ShapeDtypeStruct((bsz, h, kd, vd), F32))
    name = "gla_dstate_mosaic" if p.reverse else "gla_state_mosaic"
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=list(scratch_types.values()),
        grid=(vd // BLOCK_V, h, bsz),
        grid_names=("value", "head", "batch"),
        num_threads=2,
        thread_name="wg",
        kernel_name=name,
        compiler_params=COMPILER_PARAMS,
        interpret=plgpu.InterpretGPUParams() if interpret is True else (interpret or None),
    )
    operands = [x, y, decay] + ([s0] if has_s0 else [])
    if p.outputs:
        operands += [w, a]
    if p.state_term:
        operands += list(h_parts)
    with jax.named_scope(f"{name}_key_dim={kd}"):
        return kernel(*operands)
