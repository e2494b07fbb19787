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
sum_V h_n dh_{n+1} [K], from the forward's two parts (or from hi alone and, at each row's first
chunk, the float32 state entering it: Pass.term_parts). The loop ends on the final state (forward)
or d initial_state (reversed), float32. w S takes S in its high 16-bit part (Pass.out_parts = 1,
what ops.gla runs by default: the state rounded to the input dtype, as XLA's chunked baseline
rounds it) or in both parts, which keeps the inter-chunk product float32-accurate.

Delta (Pass.delta, the chunked delta rule of docs/delta_rule_math.md; one more input w_neg =
-w [C, K], the WY representation's w negated). Forward, with y = u0:

    u   = u0 + w_neg S                                 (S in the parts w S takes)    [C, block_v]
    out = w S + A u,   S <- exp(b_last) S + x^T u,     u stored per chunk

Reversed, with y = do, x = q_in, w = k_out and A the scores: out = du = w S + A^T y as above, then
S <- exp(b_last) S + x^T y + w_neg^T du. The value columns stay separable (u's columns read only
S's), so the value tiles split the delta rule as they split GLA; the keys do not (groups = 1).

K above 128 runs as G groups of 128 keys (virtual heads; the state is separable by key, out is
the sum of the groups' outs). One block walks its head's groups one after another, each over all
chunks: group g adds its out to the float32 sum of the groups before it, which group g - 1 wrote
to a scratch output and TMA reads back (in float32, or in the input dtype: Pass.sums_16bit), and
the last group writes the sum in the input dtype.
So no float32 partial outputs per group leave the kernel for XLA to add (docs/gpu_gla.md;
measured: docs/results/history.md, "key groups summed inside the state passes").
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gla_tpu.ops.common.mosaic_gpu import (
    SHARED_MEMORY_BYTES,
    SMEM_ALIGNMENT,
    SWIZZLED,
    SWIZZLED_64,
    SWIZZLED_F32,
    interpret_params,
    ring_producer,
)
from gla_tpu.ops.gla.pallas_gpu.kernels_mosaic_levels import (
    COMPILER_PARAMS,
    F32,
    ROW,
    T,
    full,
    matmul,
    rows,
)

BLOCK_V = 64  # value columns per block by default (the state tile [K, 64] lives in registers)
BLOCK_VS = (32, 64)  # the value tiles it takes (Pass.block_v)
# shared memory the lowering adds to the scratch buffers of a pass with a state term (the same
# 2 KiB at K 64 and 128, tiles 32 and 64; shared_memory_bytes)
STATE_TERM_LOWERING_BYTES = 2048


@dataclasses.dataclass(frozen=True)
class Pass:
    """What one run of the state pass does (static)."""

    reverse: bool  # walk the chunks last to first (the backward's dh pass)
    outputs: bool  # out = w S + A y (forward: o) or w S + A^T y (reversed: dv)
    store_parts: int  # 16-bit parts of S stored per chunk: 0, 1 (hi) or 2 (hi and lo)
    state_term: bool  # sum_V h_n S per chunk from the forward's stored parts (reverse only)
    chunk: int = 64
    stages: int = 2
    # key groups: x, w, decay and the states run over H * groups virtual heads of K / groups
    # keys each, y and out over the H heads; one block walks a head's groups in turn and sums
    # their outputs (state_pass)
    groups: int = 1
    # the groups' partial output sums in x's dtype instead of float32 (half the bytes written
    # and read back; one more rounding)
    sums_16bit: bool = False
    # value columns per block: 64, or 32 for twice the blocks (shapes whose B H V / 64 blocks
    # leave an SM with one); the state tile is [K, block_v]
    block_v: int = BLOCK_V
    # 16-bit parts of the forward's states the state term reads (state_term): 2 (hi and lo), or
    # 1 (hi; the first chunk's state then comes exact from state_pass's h_first)
    term_parts: int = 2
    # 16-bit parts of S that w S takes (outputs): 2 (hi and lo, float32-accurate), or 1 (hi;
    # BlockSizes.mosaic_output_parts, whose default is 1)
    out_parts: int = 2
    # the delta rule (ops.delta_rule's "pallas_gpu" chunk; module docstring, "Delta"): y is
    # replaced per chunk by u = y + w_neg S (forward, y = u0) or, reversed, the update takes
    # w_neg^T out as well; needs outputs, groups == 1
    delta: bool = False

    @property
    def splits_state(self) -> bool:
        """Whether a chunk's S is split into hi and lo: stored in two parts, or taken in two by
        the outputs."""
        return self.store_parts == 2 or (self.outputs and self.out_parts == 2)


def state_pass(x, y, decay, s0, *, w=None, a=None, h_parts=None, h_first=None, w_neg=None,
               p: Pass, interpret):
    """x [B, Tp, H, K], y [B, Tp, H / G, V] (16-bit), decay [B, N, H, K] float32 (b_last per
    chunk), s0 [B, H, K, V] float32 or None, w [B, Tp, H, K] and a [B, Tp, H, C] (p.outputs),
    h_parts (p.term_parts [B, N, H, K, V] 16-bit arrays, p.state_term), h_first [B, H, K, V]
    float32 or None (zero): the state entering each batch row's first chunk, which the state term
    takes there instead of the stored part where p.term_parts == 1; H counts virtual heads, G =
    p.groups per head of y. Every per-chunk array is chunk-major, so that segments of T fold into
    the batch by reshapes (vjp.py).

    p.delta: w_neg [B, Tp, H, K] in x's dtype (the module docstring's "Delta").

    Returns, in this order, what `p` asks for: out [B, Tp, H / G, V] in x's dtype (outputs), u
    [B, Tp, H, V] in x's dtype (delta, forward), the stored parts of S per chunk
    ([B, N, H, K, V] each), the state term [B, N, H, V / block_v, K] float32 (per value tile;
    the caller sums the tiles), and the last state [B, H, K, V] float32."""
    bsz, tp, h, kd = x.shape
    vd = y.shape[-1]
    c, stages, dtype, groups = p.chunk, p.stages, x.dtype, p.groups
    n = tp // c
    bv = p.block_v
    if bv not in BLOCK_VS:
        raise ValueError(f"Pass.block_v={bv} must be one of {BLOCK_VS}")
    if tp % c or vd % bv:
        raise ValueError(f"padded T={tp} and V={vd} must be multiples of {c}, {bv}")
    if y.shape[2] * groups != h:
        raise ValueError(f"x's {h} virtual heads must be y's {y.shape[2]} heads x {groups} groups")
    has_s0 = s0 is not None
    if p.delta and (not p.outputs or groups != 1 or w_neg is None):
        raise ValueError("Pass.delta needs outputs, groups == 1 and w_neg")
    delta_u = p.delta and not p.reverse  # the forward writes u
    if p.state_term and len(h_parts) != p.term_parts:
        raise ValueError(f"{len(h_parts)} parts of h for Pass.term_parts={p.term_parts}")
    # the state term's first chunk from h_first (a 16-bit part alone there rounds an initial
    # state that dg at a few tokens depends on; docs/gpu_gla.md, "What the training pass stores")
    exact_first = p.state_term and p.term_parts == 1 and h_first is not None
    h_names = ("h_hi", "h_lo")[:p.term_parts]
    # a block walks its head's key groups one after another; each group's out is added to the
    # float32 partial sum of the groups before it (`partial`, an output read back by TMA), and the
    # last group writes the sum in x's dtype
    summed = p.outputs and groups > 1
    sum_dtype = dtype if p.sums_16bit else F32

    def body(*refs):
        refs = list(refs)
        x_ref, y_ref, decay_ref = refs[:3]
        refs = refs[3:]
        s0_ref = refs.pop(0) if has_s0 else None
        w_ref, a_ref = (refs.pop(0), refs.pop(0)) if p.outputs else (None, None)
        wn_ref = refs.pop(0) if p.delta else None
        hp_refs = [refs.pop(0) for _ in h_names] if p.state_term else None
        first_ref = refs.pop(0) if exact_first else None
        o_ref = refs.pop(0) if p.outputs else None
        u_ref = refs.pop(0) if delta_u else None
        partial_ref = refs.pop(0) if summed else None
        part_refs = [refs.pop(0) for _ in range(p.store_parts)]
        term_ref = refs.pop(0) if p.state_term else None
        last_ref = refs.pop(0)
        scratch = dict(zip(scratch_names, refs))
        tile, head, batch, wg = (lax.axis_index(name) for name in ("value", "head", "batch", "wg"))
        vcols = pl.ds(tile * bv, bv)

        def chunk_index(i):
            return n - 1 - i if p.reverse else i

        def out_tile(ref, chunk):
            """ref's [C, block_v] tile of one chunk (out or the partial sums, [B, Tp, H / G, V])."""
            return ref.at[batch, pl.ds(chunk * c, c), head, vcols]

        def store(staging, value, ref, chunk):
            staging[...] = value
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(staging, out_tile(ref, chunk), commit_group=False)

        def store_out(o, group, chunk):
            """o [C, block_v] float32 of one group -> out (the last group) or the partial sum."""
            if not summed:
                store(scratch["o"], o.astype(dtype), o_ref, chunk)
                return
            pl.when(group > 0)(lambda: plgpu.barrier_wait(scratch["partial_ready"]))
            # loaded at the step's start (not for group 0)
            before = plgpu.load(scratch["partial"], layout=plgpu.Layout.WGMMA).astype(F32)
            o = o + jnp.where(group > 0, before, 0.0)
            pl.when(group < groups - 1)(
                lambda: store(scratch["partial"], o.astype(sum_dtype), partial_ref, chunk))
            pl.when(group == groups - 1)(
                lambda: store(scratch["o"], o.astype(dtype), o_ref, chunk))

        def run_group(group):
            vhead = head * groups + group
            if has_s0:
                state = plgpu.load(s0_ref.at[batch, vhead, :, vcols], layout=plgpu.Layout.WGMMA,
                                   optimized=False)
            else:
                state = full((kd, bv), 0.0)

            def step(i, state, first=False):
                slot = lax.rem(group * n + i, jnp.int32(stages))
                chunk = chunk_index(i)
                plgpu.barrier_wait(scratch["ready"].at[slot])
                if p.store_parts or p.outputs or p.state_term:
                    # the previous chunk's stores have read the staging buffers
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                if summed:  # the sum of the groups before this one, awaited in store_out
                    pl.when(group > 0)(lambda: plgpu.copy_gmem_to_smem(
                        out_tile(partial_ref, chunk), scratch["partial"],
                        scratch["partial_ready"]))
                parts = []
                if p.store_parts or p.outputs:
                    hi = state.astype(dtype)
                    scratch["st_hi"][...] = hi
                    parts.append(scratch["st_hi"])
                    if p.splits_state:
                        scratch["st_lo"][...] = (state - hi.astype(F32)).astype(dtype)
                        parts.append(scratch["st_lo"])
                    plgpu.commit_smem()
                for part, part_ref in zip(parts[:p.store_parts], part_refs):
                    plgpu.copy_smem_to_gmem(part, part_ref.at[batch, chunk, vhead, :, vcols],
                                            commit_group=False)
                if p.state_term:
                    if first:  # the first chunk's state, float32 (its stored part goes unread)
                        h_full = plgpu.load(first_ref.at[batch, vhead, :, vcols],
                                            layout=plgpu.Layout.WGMMA, optimized=False)
                    else:
                        h_full = sum(plgpu.load(scratch[name].at[slot],
                                                layout=plgpu.Layout.WGMMA).astype(F32)
                                     for name in h_names)
                    scratch["term"][...] = jnp.sum(h_full * state, axis=1)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(scratch["term"],
                                            term_ref.at[batch, chunk, vhead, tile],
                                            commit_group=False)
                decay = plgpu.load(scratch["decay"].at[slot], layout=ROW)
                decayed = state * rows(jnp.exp(decay), state.shape)
                x_s, y_s = scratch["x"].at[slot], scratch["y"].at[slot]
                if delta_u:  # u = u0 + w_neg S replaces y
                    u0 = plgpu.load(y_s, layout=plgpu.Layout.WGMMA).astype(F32)
                    u = matmul([(scratch["w_neg"].at[slot], part) for part in parts[:p.out_parts]],
                               (c, bv), interpret=interpret, init=u0)
                    y_s = scratch["u"]
                    y_s[...] = u.astype(dtype)
                    plgpu.commit_smem()
                if p.outputs:
                    a_s = scratch["a"].at[slot]
                    o = matmul([(scratch["w"].at[slot], part) for part in parts[:p.out_parts]]
                               + [(T(a_s) if p.reverse else a_s, y_s)], (c, bv),
                               interpret=interpret)
                updates = [(T(x_s), y_s)]
                if p.delta and p.reverse:  # the update's w_neg^T du, du = out
                    scratch["u"][...] = o.astype(dtype)
                    plgpu.commit_smem()
                    updates.append((T(scratch["w_neg"].at[slot]), scratch["u"]))
                state = matmul(updates, state.shape, interpret=interpret, init=decayed)
                if interpret:  # jnp.dot read the slot through the generic proxy: order it
                    plgpu.commit_smem()  # before the TMA unit refills the slot
                plgpu.barrier_arrive(scratch["free"].at[slot])
                if p.outputs:
                    store_out(o, group, chunk)
                if delta_u:
                    plgpu.copy_smem_to_gmem(scratch["u"], out_tile(u_ref, chunk),
                                            commit_group=False)
                if p.store_parts or p.outputs or p.state_term:
                    plgpu.commit_smem_to_gmem_group()
                return state

            if exact_first:  # reversed: the walk's last step is the first chunk
                state = lax.fori_loop(0, n - 1, step, state)
                state = step(jnp.int32(n - 1), state, first=True)
            else:
                state = lax.fori_loop(0, n, step, state)
            # every store done: the next group reads the partial sums back
            plgpu.wait_smem_to_gmem(0)
            last_ref.at[batch, vhead, :, vcols][...] = state

        @pl.when(wg == 0)
        def _():
            # 32 columns: fewer, so that two blocks' warpgroups fit an SM's 64 K registers
            plgpu.set_max_registers(232 if bv == 64 else 208, action="increase")
            if groups == 1:
                run_group(jnp.int32(0))
            else:
                lax.fori_loop(0, groups, lambda group, _: run_group(group), None)

        @pl.when(wg == 1)
        def _():
            plgpu.set_max_registers(40, action="decrease")

            def load(i, slot):
                group, i = lax.div(i, jnp.int32(n)), lax.rem(i, jnp.int32(n))
                vhead = head * groups + group
                chunk = chunk_index(i)
                tokens = pl.ds(chunk * c, c)
                ready = scratch["ready"].at[slot]
                copies = [(x_ref.at[batch, tokens, vhead], scratch["x"]),
                          (y_ref.at[batch, tokens, head, vcols], scratch["y"]),
                          (decay_ref.at[batch, chunk, vhead], scratch["decay"])]
                if p.outputs:
                    copies += [(w_ref.at[batch, tokens, vhead], scratch["w"]),
                               (a_ref.at[batch, tokens, vhead], scratch["a"])]
                if p.delta:
                    copies.append((wn_ref.at[batch, tokens, vhead], scratch["w_neg"]))
                if p.state_term:
                    copies += [(hp.at[batch, chunk, vhead, :, vcols], scratch[name])
                               for hp, name in zip(hp_refs, h_names)]
                for src, dst in copies:
                    plgpu.copy_gmem_to_smem(src, dst.at[slot], ready)

            ring_producer(load, steps=groups * n, stages=stages, free=(scratch["free"],))

    scratch_types = _scratch_types(p, kd, dtype)
    scratch_names = list(scratch_types)

    heads = h // groups
    parts_type = jax.ShapeDtypeStruct((bsz, n, h, kd, vd), dtype)
    out_type = []
    if p.outputs:
        out_type.append(jax.ShapeDtypeStruct((bsz, tp, heads, vd), dtype))
    if delta_u:
        out_type.append(jax.ShapeDtypeStruct((bsz, tp, heads, vd), dtype))
    if summed:
        out_type.append(jax.ShapeDtypeStruct((bsz, tp, heads, vd), sum_dtype))
    out_type += [parts_type] * p.store_parts
    if p.state_term:
        out_type.append(jax.ShapeDtypeStruct((bsz, n, h, vd // bv, kd), F32))
    out_type.append(jax.ShapeDtypeStruct((bsz, h, kd, vd), F32))
    name = "gla_dstate_mosaic" if p.reverse else "gla_state_mosaic"
    if p.delta:
        name = "delta_rule_dstate_mosaic" if p.reverse else "delta_rule_state_mosaic"
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=list(scratch_types.values()),
        grid=(vd // bv, heads, bsz),
        grid_names=("value", "head", "batch"),
        num_threads=2,
        thread_name="wg",
        kernel_name=name,
        compiler_params=COMPILER_PARAMS,
        interpret=interpret_params(interpret),
    )
    operands = [x, y, decay] + ([s0] if has_s0 else [])
    if p.outputs:
        operands += [w, a]
    if p.delta:
        operands.append(w_neg)
    if p.state_term:
        operands += list(h_parts)
    if exact_first:
        operands.append(h_first)
    with jax.named_scope(f"{name}_key_dim={kd}"):
        outs = kernel(*operands)
    if summed:  # the partial sums are the kernel's scratch
        outs = [outs[0]] + list(outs[2:])
    return outs


def _scratch_types(p: Pass, kd: int, dtype) -> dict:
    """state_pass's shared-memory buffers and barriers, by name, for key width kd."""
    c, stages, bv = p.chunk, p.stages, p.block_v
    h_names = ("h_hi", "h_lo")[:p.term_parts]
    summed = p.outputs and p.groups > 1
    sum_dtype = dtype if p.sums_16bit else F32
    # 16-bit tiles: [., block_v] ones in rows of 128 bytes take the 128-byte swizzle, of 64 the
    # 64-byte one; wgmma wants both operands' swizzles equal, so x, w and a follow them
    tiled = dict(transforms=SWIZZLED if bv * jnp.dtype(dtype).itemsize >= 128 else SWIZZLED_64)
    scratch_types = {
        "x": plgpu.SMEM((stages, c, kd), dtype, **tiled),
        "y": plgpu.SMEM((stages, c, bv), dtype, **tiled),
        "decay": plgpu.SMEM((stages, kd), F32),
    }
    if p.outputs:
        scratch_types["w"] = plgpu.SMEM((stages, c, kd), dtype, **tiled)
        scratch_types["a"] = plgpu.SMEM((stages, c, c), dtype, **tiled)
        scratch_types["o"] = plgpu.SMEM((c, bv), dtype, **tiled)
    if p.delta:
        scratch_types["w_neg"] = plgpu.SMEM((stages, c, kd), dtype, **tiled)
        scratch_types["u"] = plgpu.SMEM((c, bv), dtype, **tiled)  # u, or du reversed
    if summed:
        scratch_types["partial"] = plgpu.SMEM(
            (c, bv), sum_dtype, **(tiled if p.sums_16bit else dict(transforms=SWIZZLED_F32)))
        scratch_types["partial_ready"] = plgpu.Barrier()
    if p.state_term:
        for name in h_names:
            scratch_types[name] = plgpu.SMEM((stages, kd, bv), dtype, **tiled)
        scratch_types["term"] = plgpu.SMEM((kd,), F32)
    if p.store_parts or p.outputs:
        scratch_types["st_hi"] = plgpu.SMEM((kd, bv), dtype, **tiled)
        if p.splits_state:
            scratch_types["st_lo"] = plgpu.SMEM((kd, bv), dtype, **tiled)
    loads = 3 + 2 * p.outputs + p.delta + p.term_parts * p.state_term
    scratch_types["ready"] = plgpu.Barrier(num_arrivals=loads, num_barriers=stages)
    scratch_types["free"] = plgpu.Barrier(num_barriers=stages)
    return scratch_types


def shared_memory_bytes(p: Pass, key_dim: int, dtype) -> int:
    """One block's shared memory: the scratch buffers as Pallas places them (each aligned to
    SMEM_ALIGNMENT), 8 bytes per barrier, and what the lowering adds for a state term. Equals
    Mosaic GPU's own count (tests/backends/test_pallas_gpu_delta_rule.py)."""
    total = STATE_TERM_LOWERING_BYTES if p.state_term else 0
    for t in _scratch_types(p, key_dim, dtype).values():
        if isinstance(t, plgpu.Barrier):
            total += 8 * math.prod(np.atleast_1d(t.num_barriers))
        else:
            size = math.prod(t.shape) * jnp.dtype(t.dtype).itemsize
            total += -(-size // SMEM_ALIGNMENT) * SMEM_ALIGNMENT
    return total


def fits(p: Pass, key_dim: int, dtype) -> bool:
    """Whether state_pass under `p` fits a Hopper block's shared memory at key width key_dim."""
    return shared_memory_bytes(p, key_dim, dtype) <= SHARED_MEMORY_BYTES
