"""Pallas TPU kernels of chunked GLA and their `pallas_call` builders.

Every kernel walks a grid (batch, head, V block, block of G chunks) and, within a grid step,
applies pieces of `kernels_chunk_tile` to each of its G chunks in turn
(`plan.chunks_per_grid_step`). The kernels ("roles") are:

  fused_fwd      sequential over chunks, state in VMEM scratch: outputs and final state.
  fused_fwd_res  as fused_fwd, also writing the state entering every chunk (the backward's
                 residual).
  states         sequential: the state entering every chunk, materialized, and the final state.
  outputs        parallel over chunks: outputs from materialized states.
  bwd_reverse    sequential, reverse order: dq, dk, dv and the gate's chunk-edge term from
                 materialized states, the cotangent of the state leaving each chunk carried in
                 VMEM scratch, and the cotangent of the initial state.

"fused_chunk" = fused_fwd (fused_fwd_res under differentiation) / bwd_reverse on the saved
states; "chunk" = states + outputs / states (recomputed) + bwd_reverse. States are held
transposed ([V, K]); docs/gla_mosaic_tpu.md gives the layouts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_tpu.ops.common.tpu import LANES, tpu_interpret_params
from gla_tpu.ops.gla.mosaic_tpu import kernels_chunk_tile as tile
from gla_tpu.ops.gla.mosaic_tpu.plan import ChunkConfig, seq_shape

# Roles whose grid walks the chunks in reverse order, and roles free of a carried state.
_REVERSED = frozenset({"bwd_reverse"})
_PARALLEL = frozenset({"outputs"})


# Arrays with one row per token (blocks of G*C rows); the others hold one entry per chunk (blocks
# of G entries on a leading axis). beta, dbeta, dbcol, gcol and grow are the delta rule's
# (gla_tpu/ops/delta_rule/mosaic_tpu/kernels_chunk.py).
_TOKEN_ROWS = frozenset({"q", "k", "g", "v", "do", "o", "dv", "dq", "dk", "dg", "bcol", "segcol",
                         "beta", "dbeta", "dbcol", "dbcol_forward", "gcol"})
# Whole [bv, K] states (initial, final and their cotangents): one block per grid row, not per chunk.
_WHOLE_STATES = ("s0", "final", "dfinal", "ds0")


def _seq_spec(d: int, block: int, rows: int, step_of, group: int = 1):
    """BlockSpec of a `seq_pack`ed array: `rows` tokens of one head, one `block` of its D
    columns. `group`: grid heads per head of this array (q and k of grouped value heads: grid
    head hi reads head hi // group)."""
    def head(hi):
        # lax.div truncates (hi >= 0): `//` would lower through sign, which asks for the chip
        return hi if group == 1 else jax.lax.div(hi, group)

    if d % LANES == 0:
        per_head = d // block
        return pl.BlockSpec(
            (None, rows, block),
            lambda bi, hi, vi, ni: (bi, step_of(ni), head(hi) * per_head + vi % per_head))
    return pl.BlockSpec((None, None, rows, d),
                        lambda bi, hi, vi, ni: (bi, head(hi), step_of(ni), 0))


def _partial_spec(d: int, rows: int, step_of):
    """BlockSpec of a per-V-block share of a [B, T, H, D] gradient, [nV, *seq_shape]: `rows`
    tokens of one head (the layout of `_seq_spec` behind a leading V-block axis)."""
    if d % LANES == 0:
        return pl.BlockSpec((None, None, rows, d), lambda bi, hi, vi, ni: (vi, bi, step_of(ni), hi))
    return pl.BlockSpec((None, None, None, rows, d),
                        lambda bi, hi, vi, ni: (vi, bi, hi, step_of(ni), 0))


def _specs(cfg: ChunkConfig, step_of):
    """BlockSpecs of every kernel array for one grid step: G = cfg.chunks_per_step chunks."""
    c, kd, bv, g = cfg.chunk, cfg.key_dim, cfg.block_v, cfg.chunks_per_step
    rows = g * c
    column = pl.BlockSpec((None, None, rows, 1), lambda bi, hi, vi, ni: (bi, hi, step_of(ni), 0))
    return {
        "q": _seq_spec(kd, kd, rows, step_of, cfg.group),
        "k": _seq_spec(kd, kd, rows, step_of, cfg.group),
        "g": _seq_spec(kd, kd, rows, step_of),  # per-key log gates, float32
        "v": _seq_spec(cfg.value_dim, bv, rows, step_of),
        "do": _seq_spec(cfg.value_dim, bv, rows, step_of),
        "o": _seq_spec(cfg.value_dim, bv, rows, step_of),
        "dv": _seq_spec(cfg.value_dim, bv, rows, step_of),
        # Per-head gate sums as a column [B, H, T, 1] and as rows [B, H, N, 1, C]; the delta
        # rule's beta, its cotangent and the per-head gate sums' cotangent (in two parts) as
        # columns.
        "bcol": column, "beta": column, "dbeta": column, "dbcol": column,
        "dbcol_forward": column, "gcol": column,
        "brow": pl.BlockSpec((None, None, g, 1, c),
                             lambda bi, hi, vi, ni: (bi, hi, step_of(ni), 0, 0)),
        "grow": pl.BlockSpec((None, None, g, 1, c),
                             lambda bi, hi, vi, ni: (bi, hi, step_of(ni), 0, 0)),
        # Relative segment index as a column [B, T, 1] and as rows [B, N, 1, C].
        "segcol": pl.BlockSpec((None, rows, 1), lambda bi, hi, vi, ni: (bi, step_of(ni), 0)),
        "segrow": pl.BlockSpec((None, g, 1, c), lambda bi, hi, vi, ni: (bi, step_of(ni), 0, 0)),
        # One [bv, K] block of a transposed state [B, H, V, K] (s0, final, their cotangents).
        **{name: pl.BlockSpec((None, None, bv, kd), lambda bi, hi, vi, ni: (bi, hi, vi, 0))
           for name in _WHOLE_STATES},
        # Materialized per-chunk states [B, H, N, V, K].
        "states": pl.BlockSpec((None, None, g, bv, kd),
                               lambda bi, hi, vi, ni: (bi, hi, step_of(ni), vi, 0)),
        # The delta rule's per-chunk [C, C] matrices kept for its backward, [B, H, N, C, C].
        **{name: pl.BlockSpec((None, None, g, c, c),
                              lambda bi, hi, vi, ni: (bi, hi, step_of(ni), 0, 0))
           for name in ("wy_inverse", "key_scores")},
        # Per-V-block shares of dq, dk and per-key dg.
        **{name: _partial_spec(kd, rows, step_of) for name in ("dq", "dk", "dg")},
        # Per-chunk, per-V-block [1, K] rows for the gate gradient: [nV, B, H, N, 1, K] float32.
        "edge": pl.BlockSpec((None, None, None, g, 1, kd),
                             lambda bi, hi, vi, ni: (vi, bi, hi, step_of(ni), 0, 0)),
    }


def _gate_names(cfg: ChunkConfig, with_rows: bool = True):
    if cfg.gate_kind == "key":
        return ["g"]
    if cfg.gate_kind == "head":
        return ["bcol", "brow"] if with_rows else ["bcol"]
    return []


def _seg_names(cfg: ChunkConfig):
    return ["segcol", "segrow"] if cfg.has_segments else []


def _s0_names(cfg: ChunkConfig):
    return ["s0"] if cfg.has_initial_state else []


def _inputs(cfg: ChunkConfig, role: str):
    gate, seg = _gate_names(cfg), _seg_names(cfg)
    return {
        "fused_fwd": ["q", "k", "v", *gate, *seg, *_s0_names(cfg)],
        "fused_fwd_res": ["q", "k", "v", *gate, *seg, *_s0_names(cfg)],
        "states": ["k", "v", *_gate_names(cfg, with_rows=False), *seg, *_s0_names(cfg)],
        "outputs": ["q", "k", "v", *gate, *seg, "states"],
        "bwd_reverse": ["q", "k", "v", *gate, *seg, "do", "states", "dfinal"],
    }[role]


def _outputs(cfg: ChunkConfig, role: str):
    b, t, h, kd, vd = cfg.batch, cfg.seq_len, cfg.num_heads, cfg.key_dim, cfg.value_dim
    f32 = jnp.float32
    o = jax.ShapeDtypeStruct(seq_shape(b, t, h, vd), cfg.dtype)
    state = jax.ShapeDtypeStruct((b, h, vd, kd), f32)
    states = jax.ShapeDtypeStruct((b, h, cfg.num_chunks, vd, kd), f32)
    partial = (cfg.num_v_blocks, *seq_shape(b, t, h, kd))
    grads = {name: jax.ShapeDtypeStruct(partial, cfg.key_grad_dtype) for name in ("dq", "dk")}
    grads["dv"] = o
    if cfg.gate_kind == "key":
        grads["dg"] = jax.ShapeDtypeStruct(partial, f32)
    elif cfg.gate_kind == "head":
        # Per-chunk [1, K] rows for the gate gradient: [nV, B, H, N, 1, K] float32.
        grads["edge"] = jax.ShapeDtypeStruct((cfg.num_v_blocks, b, h, cfg.num_chunks, 1, kd), f32)
    return {
        "fused_fwd": {"o": o, "final": state},
        "fused_fwd_res": {"o": o, "states": states, "final": state},
        "states": {"states": states, "final": state},
        "outputs": {"o": o},
        "bwd_reverse": {**grads, "ds0": state},
    }[role]


def run(cfg: ChunkConfig, role: str, arrays: dict, *, interpret=False):
    """Runs one kernel role on kernel-layout `arrays` (name -> array); returns name -> output."""
    return call(cfg, f"gla_{role}_C{cfg.chunk}_bv{cfg.block_v}_{cfg.gate_kind}",
                _inputs(cfg, role), _outputs(cfg, role),
                functools.partial(_chunk_step, cfg, role), arrays,
                reverse=role in _REVERSED, parallel=role in _PARALLEL, interpret=interpret)


def call(cfg, name: str, in_names, out_shapes: dict, step, arrays: dict, *, reverse: bool,
         parallel: bool, interpret=False, prologue=None, per_chunk_scratch=None):
    """The chunked kernels' `pallas_call`, shared by every chunked op family.

    Grid (batch, head, V block, block of G chunks); `step(views, carry)` computes one chunk from
    `views` (name -> ref of this chunk's slice of each named array, `_specs` gives the layouts)
    and, unless `parallel`, reads the carried [bv, K] float32 state (or its cotangent) from the
    VMEM scratch `carry` and returns the next one. `reverse`: chunks in reverse order, the carry
    starting from "dfinal" and ending in "ds0"; else from "s0" (or zeros) and ending in "final".

    `per_chunk_scratch` ({name: (shape, dtype)}) adds VMEM scratch of G entries of `shape` on a
    leading axis; `prologue(refs)`, called once per grid step before the chunks, may fill them
    from the whole block's refs (state-independent work of all G chunks at once, whose
    independent chains the scheduler can interleave), and each chunk's `views` hold its entry.
    """
    n = cfg.num_steps
    step_of = (lambda ni: n - 1 - ni) if reverse else (lambda ni: ni)
    specs = _specs(cfg, step_of)
    last = "parallel" if parallel else "arbitrary"
    scratch = [] if parallel else [pltpu.VMEM((cfg.block_v, cfg.key_dim), jnp.float32)]
    extra = dict(per_chunk_scratch or {})
    scratch += [pltpu.VMEM((cfg.chunks_per_step, *shape), dtype) for shape, dtype in extra.values()]
    kernel = functools.partial(_kernel, cfg, step, reverse, tuple(in_names), tuple(out_shapes),
                               tuple(extra), prologue)
    pallas = pl.pallas_call(
        kernel,
        grid=(cfg.batch, cfg.num_heads, cfg.num_v_blocks, n),
        in_specs=[specs[x] for x in in_names],
        out_specs=[specs[x] for x in out_shapes],
        out_shape=list(out_shapes.values()),
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", last)),
        interpret=tpu_interpret_params(interpret),
        name=name,
    )
    with jax.named_scope(name):
        outs = pallas(*[arrays[x] for x in in_names])
    return dict(zip(out_shapes, outs))


def _kernel(cfg, step, reverse: bool, in_names, out_names, extra_names, prologue, *refs):
    """One grid step: G = cfg.chunks_per_step chunks in order (reverse order when `reverse`),
    the carried state passed from chunk to chunk through the VMEM scratch."""
    n_in, n_out = len(in_names), len(out_names)
    r = dict(zip(in_names, refs[:n_in]))
    r.update(zip(out_names, refs[n_in:n_in + n_out]))
    scratch = refs[n_in + n_out:]
    carry = scratch[0] if scratch else None
    r.update(zip(extra_names, scratch[1:]))
    grid_step, last = pl.program_id(3), pl.num_programs(3) - 1
    g = cfg.chunks_per_step

    if carry is not None:
        first_source = "dfinal" if reverse else ("s0" if cfg.has_initial_state else None)

        @pl.when(grid_step == 0)
        def _init():
            if first_source is None:
                carry[...] = jnp.zeros(carry.shape, jnp.float32)
            else:
                carry[...] = r[first_source][...]

    if prologue is not None:
        prologue(r)

    def one_chunk(j, _):
        chunk = g - 1 - j if reverse else j
        rows = pl.ds(pl.multiple_of(chunk * cfg.chunk, cfg.chunk), cfg.chunk)
        views = {name: (ref.at[rows] if name in _TOKEN_ROWS else ref.at[chunk])
                 for name, ref in r.items() if name not in _WHOLE_STATES}
        nxt = step(views, carry)
        if nxt is not None:
            carry[...] = nxt
        return 0

    jax.lax.fori_loop(0, g, one_chunk, 0)
    # The carried value after the last chunk: final state, or d initial state when reversed.
    end = "ds0" if reverse else "final"
    if carry is not None and end in r:
        @pl.when(grid_step == last)
        def _finish():
            r[end][...] = carry[...]


def _chunk_step(cfg: ChunkConfig, role: str, r: dict, carry):
    """One chunk of one role; `r` maps names to refs of this chunk's slice, `carry` is the VMEM
    scratch of the carried state (or its cotangent). Returns the next carried value (None for
    the parallel roles)."""
    dt = cfg.dtype

    def load(name):
        return r[name][...] if name in r else None

    if cfg.gate_kind == "key":
        gate = tile.Gate("key", g=load("g"))
    elif cfg.gate_kind == "head":
        gate = tile.Gate("head", col=load("bcol"), row=load("brow"))
    else:
        gate = tile.Gate("none")
    seg = tile.Segments(load("segcol"), load("segrow")) if cfg.has_segments else None
    do = None if "do" not in r else r["do"][...].astype(jnp.float32) * cfg.scale

    q, k, v = load("q"), load("k"), load("v")
    if role in ("fused_fwd", "fused_fwd_res"):
        st = carry[...]
        if "states" in r:
            r["states"][...] = st
        o = tile.output(q, k, v, gate, seg, st, cfg.scale, dt, cfg.profiler_safe)
        r["o"][...] = o.astype(r["o"].dtype)
        nxt = tile.next_state(k, v, gate, seg, st, dt)
    elif role == "states":
        st = carry[...]
        r["states"][...] = st
        nxt = tile.next_state(k, v, gate, seg, st, dt)
    elif role == "outputs":
        o = tile.output(q, k, v, gate, seg, r["states"][...], cfg.scale, dt, cfg.profiler_safe)
        r["o"][...] = o.astype(r["o"].dtype)
        return None
    elif role == "bwd_reverse":
        dst = carry[...]  # cotangent of the state leaving this chunk
        dq, dk, dv, edge, db = tile.backward(q, k, v, gate, seg, do, r["states"][...], dst, dt,
                                             cfg.profiler_safe)
        if cfg.gate_kind == "key":
            r["dg"][...] = tile.gate_grad_per_key(db)
        elif cfg.gate_kind == "head":
            r["edge"][...] = edge
        r["dq"][...] = dq.astype(r["dq"].dtype)
        r["dk"][...] = dk.astype(r["dk"].dtype)
        r["dv"][...] = dv.astype(r["dv"].dtype)
        nxt = tile.prev_state_grad(q, gate, seg, dst, do, dt)
    else:
        raise ValueError(f"unknown kernel role {role!r}")
    return nxt
