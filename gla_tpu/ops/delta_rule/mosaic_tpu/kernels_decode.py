"""Pallas TPU kernel of one delta-rule token for every (batch row, value head): the decode step.

Per value head, state S [K, V] float32 (docs/delta_rule_math.md, the new-value form):
S = D S_0; u = beta (v - S^T k); S = S + k u^T; o = scale * S^T q. Several value heads per grid
step, q and k read at their key heads in place (a block of bh value heads reads bh / G key
heads); the [B, 1, H, D] inputs are read as [B, H, D] with no copy. GLA's decode kernel
(gla/mosaic_tpu/kernels_decode.py) is the same loop without the prediction u.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gla_tpu.ops.gla.mosaic_tpu.kernels_recurrent import compiler_params, place_row, unpack_refs


def _decode_kernel(*refs, names, block_h: int, group: int, gate_kind: str, scale: float):
    r = unpack_refs(refs, names)
    f32 = jnp.float32
    q = r["q"][...].astype(f32).T * scale  # [K, block_h / G]
    k = r["k"][...].astype(f32).T  # [K, block_h / G]
    v = r["v"][...].astype(f32)  # [block_h, V]
    beta = r["beta"][...]  # [block_h, 1] float32
    decay = None
    if gate_kind == "key":
        decay = jnp.exp(r["g"][...]).T  # [K, block_h]
    elif gate_kind == "head":
        decay = jnp.exp(r["g"][...])  # [block_h, 1]
    out = jnp.zeros(v.shape, f32)
    for j in range(block_h):
        k_j, q_j = k[:, j // group:j // group + 1], q[:, j // group:j // group + 1]  # [K, 1]
        if "s0" in r:
            state = r["s0"][j]  # [K, V]
            if gate_kind == "key":
                state = decay[:, j:j + 1] * state
            elif gate_kind == "head":
                state = decay[j:j + 1, :] * state
            predicted = jnp.sum(k_j * state, axis=0, keepdims=True)  # [1, V]
            u = beta[j:j + 1, :] * (v[j:j + 1, :] - predicted)
            state = state + k_j * u
        else:
            state = k_j * (beta[j:j + 1, :] * v[j:j + 1, :])
        if "final" in r:
            r["final"][j] = state
        out = place_row(out, j, jnp.sum(q_j * state, axis=0, keepdims=True))
    r["o"][...] = out.astype(r["o"].dtype)


def decode(q, k, v, beta, g, s0, *, group: int, block_h: int, gate_kind: str, scale: float,
           emit_final: bool, interpret):
    """One token for every (batch row, value head), block_h value heads per grid step.

    Args:
      q, k: [B, H, K]; v: [B, HV, V] (the [B, 1, ., D] inputs reshaped, no copy).
      beta: [B, HV, 1] float32; g: [B, HV, K] (per key), [B, HV, 1] (per head), float32, or None.
      s0: [B, HV, K, V] float32 or None.
      group: HV // H; block_h: a multiple of group dividing HV.
    Returns:
      (o [B, HV, V] in v's dtype, final [B, HV, K, V] float32 or None).
    """
    b, hv, vd = v.shape
    kd = q.shape[2]
    bh, bq = block_h, block_h // group
    names, args, in_specs = [], [], []
    for name, x, spec in (
        ("q", q, pl.BlockSpec((None, bq, kd), lambda bi, hi: (bi, hi, 0))),
        ("k", k, pl.BlockSpec((None, bq, kd), lambda bi, hi: (bi, hi, 0))),
        ("v", v, pl.BlockSpec((None, bh, vd), lambda bi, hi: (bi, hi, 0))),
        ("beta", beta, pl.BlockSpec((None, bh, 1), lambda bi, hi: (bi, hi, 0))),
        ("g", g, None if g is None else pl.BlockSpec((None, bh, g.shape[2]),
                                                     lambda bi, hi: (bi, hi, 0))),
        ("s0", s0, pl.BlockSpec((None, bh, kd, vd), lambda bi, hi: (bi, hi, 0, 0))),
    ):
        if x is not None:
            names.append(name)
            args.append(x)
            in_specs.append(spec)
    names.append("o")
    out_shapes = [jax.ShapeDtypeStruct((b, hv, vd), v.dtype)]
    out_specs = [pl.BlockSpec((None, bh, vd), lambda bi, hi: (bi, hi, 0))]
    if emit_final:
        names.append("final")
        out_shapes.append(jax.ShapeDtypeStruct((b, hv, kd, vd), jnp.float32))
        out_specs.append(pl.BlockSpec((None, bh, kd, vd), lambda bi, hi: (bi, hi, 0, 0)))
    kernel = functools.partial(_decode_kernel, names=tuple(names), block_h=bh, group=group,
                               gate_kind=gate_kind, scale=scale)
    with jax.named_scope(f"delta_rule_decode_block_h={bh}"):
        outs = pl.pallas_call(
            kernel,
            grid=(b, hv // bh),
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shapes,
            compiler_params=compiler_params(("parallel", "parallel")),
            interpret=interpret,
        )(*args)
    return outs[0], (outs[1] if emit_final else None)
