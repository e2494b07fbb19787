"""The chunked delta-rule kernels: GLA's chunk grid and layouts
(`gla_tpu.ops.gla.mosaic_tpu.kernels_chunk.call`) with the delta rule's chunk math
(kernels_chunk_tile.py).

  forward    sequential over chunks, state in VMEM scratch: outputs, final state and (under
             differentiation) the state entering every chunk and each chunk's key scores and
             WY inverse. A prologue per grid step forms the inverses of its chunks
             (`_inverse_prologue`).
  backward   sequential, reverse order, on the saved residuals: dq, dk (per value head), dv,
             dbeta, the gate's db, and the cotangent of the initial state.

Grid rows are value heads; q and k are read at head hv // G in place. The whole V is one block
(u = u0 - w S and the WY representation are formed once per chunk).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_tpu.ops.delta_rule.mosaic_tpu import kernels_chunk_tile as tile
from gla_tpu.ops.gla.mosaic_tpu import kernels_chunk as chunk_grid
from gla_tpu.ops.gla.mosaic_tpu import kernels_chunk_tile as gla_tile
from gla_tpu.ops.gla.mosaic_tpu.plan import ChunkConfig, seq_shape


def _gate_names(cfg: ChunkConfig):
    return {"key": ["g"], "head": ["gcol", "grow"], "none": []}[cfg.gate_kind]


def _common_inputs(cfg: ChunkConfig):
    seg = ["segcol", "segrow"] if cfg.has_segments else []
    return ["q", "k", "v", "beta", *_gate_names(cfg), *seg]


def _rows_views(cfg: ChunkConfig, r: dict, first: int, count: int) -> dict:
    """The refs of chunks first .. first + count - 1 (static) of a grid step's block, stacked."""
    rows = pl.ds(first * cfg.chunk, count * cfg.chunk)
    entries = first if count == 1 else pl.ds(first, count)  # [count, ...] per-chunk arrays
    return {name: (ref.at[rows] if name in chunk_grid._TOKEN_ROWS else ref.at[entries])
            for name, ref in r.items() if name not in chunk_grid._WHOLE_STATES}


def _inverse_prologue(cfg: ChunkConfig, pack: int, *, keep_scores: bool):
    """Fills the scratch "inverse" (and "scores") with (a, T) of every chunk of the grid step.
    They do not depend on the state; `pack` chunks at a time form one block-diagonal
    [pack * C, pack * C] (`tile.decayed_key_scores`): up to the MXU's width, the inverse's chain
    of small products costs per pack about what it costs per chunk."""
    g = cfg.chunks_per_step

    def prologue(r):
        for first in range(0, g, pack):
            views = _rows_views(cfg, r, first, pack)
            k, beta = views["k"][...], views["beta"][...]
            gate, seg = _gate_and_segments(cfg, views, rows=pack)
            kk, t = tile.decayed_key_scores(k, beta, gate, seg, cfg.dtype, cfg.profiler_safe,
                                            chunk=cfg.chunk)
            for p, (t_p, kk_p) in enumerate(zip(tile.blocks_of(t, cfg.chunk),
                                                tile.blocks_of(kk, cfg.chunk))):
                r["inverse"][first + p] = t_p
                if keep_scores:
                    r["scores"][first + p] = kk_p
    return prologue


def _gate_and_segments(cfg: ChunkConfig, r: dict, rows: int = 1):
    """The Gate and Segments of `rows` stacked chunks (per-head gate rows and segment rows are
    [rows, 1, C] blocks, laid out as one [1, rows * C] row)."""
    if cfg.gate_kind == "key":
        gate = gla_tile.Gate("key", g=r["g"][...])
    elif cfg.gate_kind == "head":
        gate = gla_tile.Gate.head_ranges(r["gcol"][...], _row(r, "grow", rows))
    else:
        gate = gla_tile.Gate("none")
    seg = None
    if cfg.has_segments:
        seg = gla_tile.Segments(r["segcol"][...], _row(r, "segrow", rows))
    return gate, seg


def _row(r: dict, name: str, rows: int):
    """[1, rows * C] from the [1, C] rows of `rows` consecutive chunks."""
    ref = r[name]
    if rows == 1:
        return ref[...]
    return jnp.concatenate([ref[p] for p in range(rows)], axis=1)


def _load(cfg: ChunkConfig, r: dict):
    """(q, k, v, beta, gate, seg) of one chunk from its refs."""
    gate, seg = _gate_and_segments(cfg, r)
    return r["q"][...], r["k"][...], r["v"][...], r["beta"][...], gate, seg


def forward(cfg: ChunkConfig, arrays: dict, *, save_residuals: bool, pack: int,
            interpret=False):
    """{"o": [seq_shape of (B, T, HV, V)] in the input dtype, "final": [B, HV, V, K] float32,
    and with `save_residuals` what the backward reads: "states" [B, HV, N, V, K] (the state
    entering every chunk), "wy_inverse" and "key_scores" [B, HV, N, C, C] (T and a), float32}."""
    b, t, hv, vd, kd = cfg.batch, cfg.seq_len, cfg.num_heads, cfg.value_dim, cfg.key_dim
    c, f32 = cfg.chunk, jnp.float32
    outputs = {"o": jax.ShapeDtypeStruct(seq_shape(b, t, hv, vd), cfg.dtype)}
    if save_residuals:
        outputs["states"] = jax.ShapeDtypeStruct((b, hv, cfg.num_chunks, vd, kd), f32)
        for name in ("wy_inverse", "key_scores"):
            outputs[name] = jax.ShapeDtypeStruct((b, hv, cfg.num_chunks, c, c), f32)
    outputs["final"] = jax.ShapeDtypeStruct((b, hv, vd, kd), f32)
    inputs = _common_inputs(cfg) + (["s0"] if cfg.has_initial_state else [])

    def step(r, carry):
        q, k, v, beta, gate, seg = _load(cfg, r)
        st = carry[...]
        if save_residuals:
            r["states"][...] = st
            r["wy_inverse"][...] = r["inverse"][...]
            r["key_scores"][...] = r["scores"][...]
        o, nxt = tile.forward(q, k, v, beta, gate, seg, st, cfg.scale, cfg.dtype,
                              cfg.profiler_safe, inverse=r["inverse"][...])
        r["o"][...] = o.astype(r["o"].dtype)
        return nxt

    scratch = {"inverse": ((c, c), f32)}
    if save_residuals:
        scratch["scores"] = ((c, c), f32)
    name = f"delta_rule_fwd_C{c}_{cfg.gate_kind}"
    return chunk_grid.call(cfg, name, inputs, outputs, step, arrays, reverse=False,
                           parallel=False, interpret=interpret,
                           prologue=_inverse_prologue(cfg, pack, keep_scores=save_residuals),
                           per_chunk_scratch=scratch)


def backward(cfg: ChunkConfig, arrays: dict, *, interpret=False):
    """Gradients from the forward's residuals ("states", "wy_inverse", "key_scores") and the
    cotangents "do" and "dfinal": "dq", "dk" [1, seq_shape of (B, T, HV, K)] float32 (per value
    head), "dv" in the input dtype, "dbeta" [B, HV, T, 1] float32, "dg" (per-key gates: d loss /
    d g, [1, seq_shape]) or "dbcol" (per-head gates: d loss / d b, b the chunk-local sums of g,
    [B, HV, T, 1]), "ds0" [B, HV, V, K]."""
    b, t, hv, vd, kd = cfg.batch, cfg.seq_len, cfg.num_heads, cfg.value_dim, cfg.key_dim
    f32 = jnp.float32
    per_head_k = jax.ShapeDtypeStruct((1, *seq_shape(b, t, hv, kd)), f32)
    column = jax.ShapeDtypeStruct((b, hv, t, 1), f32)
    outputs = {"dq": per_head_k, "dk": per_head_k,
               "dv": jax.ShapeDtypeStruct(seq_shape(b, t, hv, vd), cfg.dtype), "dbeta": column}
    if cfg.gate_kind == "key":
        outputs["dg"] = per_head_k
    elif cfg.gate_kind == "head":
        outputs["dbcol"] = column
        outputs["dbcol_forward"] = column
    outputs["ds0"] = jax.ShapeDtypeStruct((b, hv, vd, kd), f32)
    inputs = _common_inputs(cfg) + ["do", "states", "wy_inverse", "key_scores", "dfinal"]

    def step(r, carry):
        q, k, v, beta, gate, seg = _load(cfg, r)
        do = r["do"][...].astype(f32) * cfg.scale
        dq, dk, dv, dbeta, db, dst = tile.backward(
            q, k, v, beta, gate, seg, do, r["states"][...], carry[...], cfg.dtype,
            cfg.profiler_safe, scores=r["key_scores"][...], inverse=r["wy_inverse"][...])
        r["dq"][...] = dq
        r["dk"][...] = dk
        r["dv"][...] = dv.astype(r["dv"].dtype)
        r["dbeta"][...] = dbeta
        if cfg.gate_kind == "key":
            r["dg"][...] = gla_tile.gate_grad_per_key(db)
        elif cfg.gate_kind == "head":
            r["dbcol"][...], r["dbcol_forward"][...] = db
        return dst

    name = f"delta_rule_bwd_C{cfg.chunk}_{cfg.gate_kind}"
    return chunk_grid.call(cfg, name, inputs, outputs, step, arrays, reverse=True,
                           parallel=False, interpret=interpret)
