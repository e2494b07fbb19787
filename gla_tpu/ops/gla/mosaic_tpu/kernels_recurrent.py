"""Pallas TPU (Mosaic) kernels of token-by-token gated linear attention and the delta rule; no
autodiff in here.

Notation (docs/gla_mosaic_tpu_recurrent.md): per batch row and head the state S_t [K, V] follows
  S_t = a_t * S_{t-1} + k_t^T v_t,   o_t = scale * q_t S_t,
with the decay a_t = keep_t * exp(g_t), a [K, 1] column (per-key gate) or a scalar (per-head gate,
or only keep_t where there is no gate); keep_t is 0 where a new segment starts. g <= 0, so every
exponential is of a non-positive number. The delta rule (`RecurrentConfig.delta`,
docs/delta_rule_mosaic_tpu.md) writes u_t = beta_t * (v_t - k_t S'_t) in place of v_t, with
S'_t = a_t * S_{t-1}; its grid heads are the value heads, q and k read at head h // group.

Two kernels, each over arrays already in "kernel layout" (plan.py builds them); the T = 1 decode
kernel is in kernels_decode.py:
- `recurrent_forward`: grid (B, H, V blocks, time blocks), the [K, block_v] float32 state in VMEM
  scratch across the sequential time axis; emits o, the final state and/or the state entering
  every time block (the backward's checkpoints).
- `recurrent_backward`: the same grid with time reversed; per time block it recomputes the block's
  states from its checkpoint into VMEM, then runs the reversed recurrence of dS (dq, dk, dv, dg,
  d initial_state).

Inside a time block tokens are taken in sub-blocks of SUBBLOCK (8) rows: one [SUBBLOCK, K] tile
load and one transpose turn SUBBLOCK token rows into [K, SUBBLOCK] columns, then a loop over the
SUBBLOCK tokens does the rank-1 state updates on the VPU, a lane (sublane) rotate picking each
token's column (row).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_tpu.ops.gla.mosaic_tpu.plan import SUBBLOCK, RecurrentConfig


def _state_spec(block_k: int, block_v: int) -> pl.BlockSpec:
    """A [K, block_v] block of a [B, H, K, V] state."""
    return pl.BlockSpec((None, None, block_k, block_v), lambda b, h, j, t: (b, h, 0, j))


def _checkpoint_spec(block_k: int, block_v: int, time_index) -> pl.BlockSpec:
    """A [K, block_v] block of the [B, H, NT, K, V] states entering each time block."""
    return pl.BlockSpec(
        (None, None, None, block_k, block_v), lambda b, h, j, t: (b, h, time_index(t), 0, j)
    )


def compiler_params(semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


class _Tokens:
    """One sub-block of SUBBLOCK tokens loaded from the time-blocked refs, as columns and rows.

    Columns ([K, SUBBLOCK]; k_col(i) is [K, 1]) feed the lane-broadcast side of the rank-1 updates,
    rows ([SUBBLOCK, block_v]; v_row(i) is [1, block_v]) the sublane-broadcast side. The token
    index i
    may be traced: a rotate brings column (row) i to position 0.
    """

    def __init__(self, refs, rows, cfg: RecurrentConfig, *, need_q: bool, need_do: bool):
        f32 = jnp.float32
        self.k = refs["k"][rows, :].astype(f32).T  # [K, SUBBLOCK]
        self.v = refs["v"][rows, :].astype(f32)  # [SUBBLOCK, bv]
        self.q = refs["q"][rows, :].astype(f32).T * cfg.scale if need_q else None  # [K, SUBBLOCK]
        self.do = refs["do"][rows, :].astype(f32) if need_do else None  # [SUBBLOCK, bv]
        self.decay = _decay_block(refs, rows, cfg)
        self.beta = refs["beta"][rows, :] if cfg.delta else None  # [SUBBLOCK, 1] float32

    def k_col(self, i):
        return _col(self.k, i)

    def q_col(self, i):
        return _col(self.q, i)

    def v_row(self, i):
        return _row(self.v, i)

    def do_row(self, i):
        return _row(self.do, i)

    def beta_of(self, i):
        """The delta rule's beta_i as [1, 1], or None (GLA)."""
        return None if self.beta is None else _row(self.beta, i)

    def a(self, i):
        """The decay a_i: [K, 1] (per-key gate), [1, 1] (per-head / keep only) or None."""
        if self.decay is None:
            return None
        if self.decay.shape[0] == SUBBLOCK:  # rows [SUBBLOCK, 1]
            return _row(self.decay, i)
        return _col(self.decay, i)  # columns [K, SUBBLOCK]


def _shift(i):
    """The rotation that moves position i of a SUBBLOCK-long axis to position 0."""
    return jax.lax.rem(SUBBLOCK - i, SUBBLOCK)


def _col(x, i):
    """Column i of an [n, SUBBLOCK] array as [n, 1]."""
    return pltpu.roll(x, _shift(i), 1)[:, 0:1]


def _row(x, i):
    """Row i of a [SUBBLOCK, n] array as [1, n]."""
    return pltpu.roll(x, _shift(i), 0)[0:1, :]


def _decay_block(refs, rows, cfg: RecurrentConfig):
    """a = keep * exp(g) for SUBBLOCK tokens: [K, SUBBLOCK] columns (per key), [SUBBLOCK, 1] rows,
    or None."""
    if not cfg.has_decay:
        return None
    decay = None
    if cfg.gate_kind != "none":
        decay = jnp.exp(refs["g"][rows, :].astype(jnp.float32))  # [SUBBLOCK, K] or [SUBBLOCK, 1]
    if cfg.has_keep:
        keep = refs["keep"][rows, :]  # [SUBBLOCK, 1]
        decay = keep if decay is None else decay * keep
    if cfg.gate_kind == "key":
        return decay.T  # [K, SUBBLOCK]
    return decay


def advance_state(state, a, k_col, v_row, beta=None):
    """S_t = a_t * S_{t-1} + k_t^T v_t on a [K, bv] float32 state; with the delta rule's beta,
    v_t is replaced by beta_t * (v_t - k_t S'_t), S'_t = a_t * S_{t-1}."""
    if a is not None:
        state = a * state
    if beta is not None:
        v_row = beta * (v_row - jnp.sum(k_col * state, axis=0, keepdims=True))
    return state + k_col * v_row


def place_row(acc, i, row):
    """acc[i, :] = row for a [SUBBLOCK, n] accumulator and a [1, n] row (a select, no dynamic
    store)."""
    sel = jax.lax.broadcasted_iota(jnp.int32, acc.shape, 0) == i
    return jnp.where(sel, row, acc)


def place_col(acc, i, col):
    """acc[:, i] = col for an [n, SUBBLOCK] accumulator and an [n, 1] column."""
    sel = jax.lax.broadcasted_iota(jnp.int32, acc.shape, 1) == i
    return jnp.where(sel, col, acc)


def _sub_rows(s):
    return pl.ds(pl.multiple_of(s * SUBBLOCK, SUBBLOCK), SUBBLOCK)


def unpack_refs(refs, names):
    if len(refs) != len(names):
        raise ValueError(f"kernel got {len(refs)} refs for {names}")
    return dict(zip(names, refs))


def _forward_kernel(*refs, cfg: RecurrentConfig, names, emit_o, emit_final, emit_checkpoints):
    r = unpack_refs(refs, names)
    t = pl.program_id(3)
    n_sub = cfg.block_t // SUBBLOCK

    @pl.when(t == 0)
    def _init():
        if "s0" in r:
            r["state"][...] = r["s0"][...]
        else:
            r["state"][...] = jnp.zeros(r["state"].shape, jnp.float32)

    if emit_checkpoints:
        r["ckpt"][...] = r["state"][...]

    def sub_block(s, state):
        rows = _sub_rows(s)
        tok = _Tokens(r, rows, cfg, need_q=emit_o, need_do=False)

        def token(i, carry):
            state, out = carry
            state = advance_state(state, tok.a(i), tok.k_col(i), tok.v_row(i), tok.beta_of(i))
            if emit_o:
                out = place_row(out, i, jnp.sum(tok.q_col(i) * state, axis=0, keepdims=True))
            return state, out

        out = jnp.zeros((SUBBLOCK, state.shape[1]), jnp.float32)  # o rows of the sub-block
        state, out = jax.lax.fori_loop(0, SUBBLOCK, token, (state, out))
        if emit_o:
            r["o"][rows, :] = out.astype(r["o"].dtype)
        return state

    state = jax.lax.fori_loop(0, n_sub, sub_block, r["state"][...])
    r["state"][...] = state
    if emit_final:

        @pl.when(t == pl.num_programs(3) - 1)
        def _final():
            r["final"][...] = state


def recurrent_forward(q, k, v, g, keep, s0, *, cfg: RecurrentConfig, layouts, nt: int, nv: int,
                      emit_o: bool, emit_final: bool, emit_checkpoints: bool, o_shape, o_dtype,
                      interpret, beta=None):
    """Runs the forward recurrence over kernel-layout arrays.

    Args:
      q, k: kernel-layout [.., T, .., K] arrays (see TimeOperand); v likewise with V.
      g: per-key like v's heads, per-head "head_column" [B, H, T, 1] float32, or None.
      beta: the delta rule's "head_column" [B, H, T, 1] float32 (cfg.delta), else None.
      keep: [B, T, 1] float32 (1 = continue, 0 = segment start) or None.
      s0: [B, H, K, V] float32 or None.
      layouts: dict name -> TimeOperand for q, k, v, g, keep, o.
      nt, nv: number of time blocks and of V blocks.
    Returns:
      a tuple with the requested outputs, in order: o (o_shape, o_dtype), final [B, H, K, V]
      float32, checkpoints [B, H, NT, K, V] float32 (the state entering each time block).
    """
    b, h, kd, vd = _state_dims(k, v, layouts, cfg.group)
    fwd_t = lambda t: t  # noqa: E731
    names, args, in_specs = [], [], []
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta), ("g", g), ("keep", keep)):
        if x is None or (name == "q" and not emit_o):
            continue
        names.append(name)
        args.append(x)
        in_specs.append(layouts[name].block_spec(cfg.block_t, nv, fwd_t))
    if s0 is not None:
        names.append("s0")
        args.append(s0)
        in_specs.append(_state_spec(kd, cfg.block_v))
    out_shapes, out_specs = [], []
    if emit_o:
        names.append("o")
        out_shapes.append(jax.ShapeDtypeStruct(o_shape, o_dtype))
        out_specs.append(layouts["o"].block_spec(cfg.block_t, nv, fwd_t))
    if emit_final:
        names.append("final")
        out_shapes.append(jax.ShapeDtypeStruct((b, h, kd, vd), jnp.float32))
        out_specs.append(_state_spec(kd, cfg.block_v))
    if emit_checkpoints:
        names.append("ckpt")
        out_shapes.append(jax.ShapeDtypeStruct((b, h, nt, kd, vd), jnp.float32))
        out_specs.append(_checkpoint_spec(kd, cfg.block_v, fwd_t))
    names.append("state")
    kernel = functools.partial(
        _forward_kernel, cfg=cfg, names=tuple(names), emit_o=emit_o, emit_final=emit_final,
        emit_checkpoints=emit_checkpoints,
    )
    what = "fwd" if emit_o else "ckpt"
    with jax.named_scope(f"gla_recurrent_{what}_block_t={cfg.block_t}_block_v={cfg.block_v}"):
        return pl.pallas_call(
            kernel,
            grid=(b, h, nv, nt),
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shapes,
            scratch_shapes=[pltpu.VMEM((kd, cfg.block_v), jnp.float32)],
            compiler_params=compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
            interpret=interpret,
        )(*args)


def _backward_kernel(*refs, cfg: RecurrentConfig, names):
    r = unpack_refs(refs, names)
    t = pl.program_id(3)
    n_sub = cfg.block_t // SUBBLOCK
    states = r["states"]  # [block_t + 1, K, bv]: states[i] = state after the block's token i - 1

    @pl.when(t == 0)
    def _init():
        if "dfinal" in r:
            r["carry"][...] = r["dfinal"][...]
        else:
            r["carry"][...] = jnp.zeros(r["carry"].shape, jnp.float32)

    start = r["ckpt"][...]
    states[0] = start

    def recompute(s, state):
        tok = _Tokens(r, _sub_rows(s), cfg, need_q=False, need_do=False)

        def token(i, state):
            state = advance_state(state, tok.a(i), tok.k_col(i), tok.v_row(i), tok.beta_of(i))
            states[s * SUBBLOCK + i + 1] = state
            return state

        return jax.lax.fori_loop(0, SUBBLOCK, token, state)

    jax.lax.fori_loop(0, n_sub, recompute, start)

    kd, bv = start.shape
    per_key = cfg.gate_kind == "key"
    has_dg = cfg.gate_kind != "none"

    def reverse(s_rev, carry):
        s = n_sub - 1 - s_rev
        rows = _sub_rows(s)
        tok = _Tokens(r, rows, cfg, need_q=True, need_do=True)

        def token(i_rev, carry):
            # dsum: dL/dS_t through the tokens after t; state: S_t.
            dsum, state, dq, dk, dv, dg, db = carry
            i = SUBBLOCK - 1 - i_rev
            prev = states[s * SUBBLOCK + i]  # S_{t-1}
            a = tok.a(i)
            k_i, v_i, do_i = tok.k_col(i), tok.v_row(i), tok.do_row(i)
            grad = dsum + tok.q_col(i) * do_i  # dL/dS_t, token t's own output included
            dq = place_col(dq, i, jnp.sum(state * do_i, axis=1, keepdims=True))
            du = jnp.sum(k_i * grad, axis=0, keepdims=True)  # [1, bv]: dL/d(written value)
            if cfg.delta:
                # S_t = S' + k^T u, u = beta (v - k S'): the pullbacks through u and k S'.
                beta = tok.beta_of(i)
                decayed = prev if a is None else a * prev  # S'
                residual = v_i - jnp.sum(k_i * decayed, axis=0, keepdims=True)  # v - k S'
                dp = -beta * du  # dL/d(k S')
                key_grad = grad * (beta * residual) + decayed * dp  # [K, bv]
                db = place_row(db, i, jnp.sum(du * residual, axis=1, keepdims=True))
                du = beta * du
                grad = grad + k_i * dp  # dL/dS'
            else:
                key_grad = grad * v_i
            dk = place_col(dk, i, jnp.sum(key_grad, axis=1, keepdims=True))
            dv = place_row(dv, i, du)
            if a is None:
                return grad, prev, dq, dk, dv, dg, db
            if has_dg:
                gs = jnp.sum(grad * prev, axis=1, keepdims=True)  # [K, 1]
                if per_key:
                    dg = place_col(dg, i, a * gs)
                else:
                    dg = place_row(dg, i, a * jnp.sum(gs, axis=0, keepdims=True))
            return a * grad, prev, dq, dk, dv, dg, db

        dsum, state = carry
        dq = jnp.zeros((kd, SUBBLOCK), jnp.float32)  # columns of the sub-block's tokens
        dk = jnp.zeros((kd, SUBBLOCK), jnp.float32)
        dv = jnp.zeros((SUBBLOCK, bv), jnp.float32)  # rows
        dg = jnp.zeros((kd, SUBBLOCK) if per_key else (SUBBLOCK, 1), jnp.float32)
        db = jnp.zeros((SUBBLOCK, 1), jnp.float32)
        dsum, state, dq, dk, dv, dg, db = jax.lax.fori_loop(
            0, SUBBLOCK, token, (dsum, state, dq, dk, dv, dg, db))
        r["dq"][rows, :] = (dq * cfg.scale).T.astype(r["dq"].dtype)
        r["dk"][rows, :] = dk.T.astype(r["dk"].dtype)
        r["dv"][rows, :] = dv.astype(r["dv"].dtype)
        if has_dg:
            r["dg"][rows, :] = (dg.T if per_key else dg).astype(r["dg"].dtype)
        if cfg.delta:
            r["dbeta"][rows, :] = db
        return dsum, state

    dsum, _ = jax.lax.fori_loop(0, n_sub, reverse, (r["carry"][...], states[cfg.block_t]))
    r["carry"][...] = dsum
    if "ds0" in r:

        @pl.when(t == pl.num_programs(3) - 1)
        def _initial():
            r["ds0"][...] = dsum


def recurrent_backward(q, k, v, g, keep, do, checkpoints, dfinal, *, cfg: RecurrentConfig, layouts,
                       nt: int, nv: int, has_initial_state: bool, grad_dtypes, interpret,
                       beta=None):
    """The reversed recurrence, time blocks from last to first.

    Args:
      q, k, v, g, keep, beta: as for `recurrent_forward`; do: like o.
      checkpoints: [B, H, NT, K, V] float32, the state entering each time block.
      dfinal: [B, H, K, V] float32 cotangent of the final state, or None.
      grad_dtypes: dict name -> dtype for dq, dk, dv, dg.
    Returns:
      (dq, dk, dv, dg or None, dbeta or None, d_initial_state or None); dq, dk, dg, dbeta carry a
      leading [NV] axis of partial sums over V blocks (the layouts' `partial` flag); dq and dk are
      per grid head (with cfg.group > 1 the caller sums each group).
    """
    b, h, kd, vd = _state_dims(k, v, layouts, cfg.group)
    rev_t = lambda t: nt - 1 - t  # noqa: E731
    names, args, in_specs = [], [], []
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta), ("g", g), ("keep", keep),
                    ("do", do)):
        if x is None:
            continue
        names.append(name)
        args.append(x)
        in_specs.append(layouts[name].block_spec(cfg.block_t, nv, rev_t))
    names.append("ckpt")
    args.append(checkpoints)
    in_specs.append(_checkpoint_spec(kd, cfg.block_v, rev_t))
    if dfinal is not None:
        names.append("dfinal")
        args.append(dfinal)
        in_specs.append(_state_spec(kd, cfg.block_v))
    out_shapes, out_specs = [], []
    grads = (["dq", "dk", "dv"] + (["dg"] if g is not None else [])
             + (["dbeta"] if cfg.delta else []))
    sources = {"dq": q, "dk": k, "dv": v, "dg": g, "dbeta": beta}
    for name in grads:
        layout = layouts[name]
        shape = sources[name].shape
        if name in ("dq", "dk") and cfg.group > 1:  # per grid head
            shape = _with_heads(shape, layouts[name], cfg.group)
        if layout.partial:
            shape = (nv,) + shape
        names.append(name)
        out_shapes.append(jax.ShapeDtypeStruct(shape, grad_dtypes[name]))
        out_specs.append(layout.block_spec(cfg.block_t, nv, rev_t))
    if has_initial_state:
        names.append("ds0")
        out_shapes.append(jax.ShapeDtypeStruct((b, h, kd, vd), jnp.float32))
        out_specs.append(_state_spec(kd, cfg.block_v))
    names += ["states", "carry"]
    kernel = functools.partial(_backward_kernel, cfg=cfg, names=tuple(names))
    with jax.named_scope(f"gla_recurrent_bwd_block_t={cfg.block_t}_block_v={cfg.block_v}"):
        outs = pl.pallas_call(
            kernel,
            grid=(b, h, nv, nt),
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shapes,
            scratch_shapes=[
                pltpu.VMEM((cfg.block_t + 1, kd, cfg.block_v), jnp.float32),
                pltpu.VMEM((kd, cfg.block_v), jnp.float32),
            ],
            compiler_params=compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
            interpret=interpret,
        )(*args)
    outs = list(outs)
    dq, dk, dv = outs[:3]
    dg = outs[3] if g is not None else None
    dbeta = outs[len(grads) - 1] if cfg.delta else None
    ds0 = outs[-1] if has_initial_state else None
    return dq, dk, dv, dg, dbeta, ds0


def _with_heads(shape, layout, group: int):
    """A q/k kernel-layout shape with `group` times the heads."""
    if layout.kind == "head_major":  # [B, H, T, D]
        return (shape[0], shape[1] * group) + tuple(shape[2:])
    return tuple(shape[:2]) + (shape[2] * group,)  # [B, T, H*D]


def _state_dims(k, v, layouts, group: int = 1):
    """(B, grid heads, K, V) of kernel-layout k and v; grid heads are k's heads times group."""
    b = k.shape[0]
    if layouts["k"].kind == "head_major":
        h, kd = k.shape[1], k.shape[3]
    else:
        kd = layouts["k"].block_d
        h = k.shape[2] // kd
    h *= group
    vd = v.shape[3] if layouts["v"].kind == "head_major" else v.shape[2] // h
    return b, h, kd, vd
