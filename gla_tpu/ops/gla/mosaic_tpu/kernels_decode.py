"""Pallas TPU (Mosaic) kernel of one GLA token for every (batch row, head): the T = 1 decode step.

Per head: S = a * S_0 + k^T v ([K, V] float32, a = exp(g) as in kernels_recurrent.py),
o = scale * q S. Several heads per grid step and no time axis; the [B, 1, H, D] inputs are read as
[B, H, D] with no copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_tpu.ops.gla.mosaic_tpu.kernels_recurrent import (
    advance_state,
    compiler_params,
    place_row,
    unpack_refs,
)
from gla_tpu.ops.gla.mosaic_tpu.plan import RecurrentConfig


def _decode_kernel(*refs, cfg: RecurrentConfig, names, block_h: int):
    r = unpack_refs(refs, names)
    f32 = jnp.float32
    q = r["q"][...].astype(f32).T * cfg.scale  # [K, block_h]
    k = r["k"][...].astype(f32).T  # [K, block_h]
    v = r["v"][...].astype(f32)  # [block_h, bv]
    decay = None
    if cfg.gate_kind == "key":
        decay = jnp.exp(r["g"][...].astype(f32)).T  # [K, block_h]
    elif cfg.gate_kind == "head":
        decay = jnp.exp(r["g"][...].astype(f32))  # [block_h, 1]
    out = jnp.zeros(v.shape, f32)
    for j in range(block_h):
        if "s0" in r:
            a = None
            if decay is not None:
                a = decay[:, j : j + 1] if cfg.gate_kind == "key" else decay[j : j + 1, :]
            state = advance_state(r["s0"][j], a, k[:, j : j + 1], v[j : j + 1, :])
        else:
            state = k[:, j : j + 1] * v[j : j + 1, :]
        if "final" in r:
            r["final"][j] = state
        out = place_row(out, j, jnp.sum(q[:, j : j + 1] * state, axis=0, keepdims=True))
    r["o"][...] = out.astype(r["o"].dtype)


def recurrent_decode(q, k, v, g, s0, *, cfg: RecurrentConfig, block_h: int, emit_final: bool,
                     interpret):
    """One token for every (batch row, head): T = 1, block_h heads per grid step.

    Args:
      q, k: [B, H, K]; v: [B, H, V] (the [B, 1, H, D] inputs reshaped, no copy).
      g: [B, H, K] (per key), [B, H, 1] (per head), both float32, or None.
      s0: [B, H, K, V] float32 or None.
    Returns:
      (o [B, H, V] in v's dtype, final [B, H, K, V] float32 or None).
    """
    b, h, kd = q.shape
    vd = v.shape[2]
    bv, bh = cfg.block_v, block_h
    nv = vd // bv
    names, args, in_specs = [], [], []

    def head_spec(d):
        return pl.BlockSpec((None, bh, d), lambda bi, hi, j: (bi, hi, 0))

    for name, x, spec in (
        ("q", q, head_spec(kd)),
        ("k", k, head_spec(kd)),
        ("v", v, pl.BlockSpec((None, bh, bv), lambda bi, hi, j: (bi, hi, j))),
        ("g", g, None if g is None else head_spec(g.shape[2])),
        ("s0", s0, pl.BlockSpec((None, bh, kd, bv), lambda bi, hi, j: (bi, hi, 0, j))),
    ):
        if x is not None:
            names.append(name)
            args.append(x)
            in_specs.append(spec)
    names.append("o")
    out_shapes = [jax.ShapeDtypeStruct((b, h, vd), v.dtype)]
    out_specs = [pl.BlockSpec((None, bh, bv), lambda bi, hi, j: (bi, hi, j))]
    if emit_final:
        names.append("final")
        out_shapes.append(jax.ShapeDtypeStruct((b, h, kd, vd), jnp.float32))
        out_specs.append(pl.BlockSpec((None, bh, kd, bv), lambda bi, hi, j: (bi, hi, 0, j)))
    kernel = functools.partial(_decode_kernel, cfg=cfg, names=tuple(names), block_h=bh)
    with jax.named_scope(f"gla_recurrent_decode_block_h={bh}_block_v={bv}"):
        outs = pl.pallas_call(
            kernel,
            grid=(b, h // bh, nv),
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shapes,
            compiler_params=compiler_params(("parallel", "parallel", "parallel")),
            interpret=interpret,
        )(*args)
    return outs[0], (outs[1] if emit_final else None)
