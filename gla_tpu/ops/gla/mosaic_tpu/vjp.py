"""custom_vjp wiring of the Mosaic TPU GLA kernels: the chunked modes and fused_recurrent.

Chunked modes (docs/gla_mosaic_tpu.md): the custom_vjp's inputs are (q, k, v, gates, initial
state). Per-key gates enter as g: the kernels take its chunk-local sums b and return dg. Per-head
gates enter as b, summed outside the kernels, and JAX's autodiff of that sum turns db into dg;
db = sum_K (q*dq - k*dk) + (at each chunk's last token) an "edge" row the backward kernels return
beside dq, dk, dv, and d initial state. The backward is one reverse-order kernel over the states
entering each chunk: "fused_chunk" saves them from its forward (fused_fwd_res), "chunk" saves only
the inputs and recomputes them (kernels_chunk.py; docs/gla_mosaic_tpu.md, "Kernels" and
"Memory a training step holds").

fused_recurrent (docs/gla_mosaic_tpu_recurrent.md): the forward kernel, or the decode kernel at
T = 1; the backward reruns the forward to checkpoint the state at every time block, then the
reversed recurrence. The delta rule's fused_recurrent runs the same wiring with beta
(`RecurrentConfig.delta`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gla_tpu.ops.gla.mosaic_tpu import kernels_chunk, kernels_decode, kernels_recurrent
from gla_tpu.ops.gla.mosaic_tpu.plan import (
    RecurrentPlan,
    chunk_kernel_arrays,
    pad_state,
    head_column,
    recurrent_inputs,
    seq_pack,
    seq_unpack,
    transpose_state,
    unpad_state,
)

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def chunked(cfg, mode, interpret, q, k, v, gates, s0, rel):
    """(o [B, Tp, H, V], final state [B, H, K, V] float32) of the chunked modes from padded q, k, v,
    the gates (per-key log gates [B, Tp, H, K] float32, per-head chunk-local sums [B, Tp, H]
    float32, or None), the initial state or None, and the relative segment index rel [B, Tp] or
    None."""
    arrays = chunk_kernel_arrays(cfg, q, k, v, gates, s0, rel)
    out, _ = _chunked_forward(cfg, mode, interpret, arrays, save_states=False)
    return out


def _chunked_forward(cfg, mode, interpret, arrays, *, save_states):
    """((o, final) in the API's layouts, the kernels' [B, H, N, V, K] states or None)."""
    if mode == "fused_chunk":
        out = kernels_chunk.run(cfg, "fused_fwd_res" if save_states else "fused_fwd", arrays,
                                interpret=interpret)
    else:
        out = kernels_chunk.run(cfg, "states", arrays, interpret=interpret)
        out.update(kernels_chunk.run(cfg, "outputs", {**arrays, "states": out["states"]},
                                     interpret=interpret))
    o = seq_unpack(out["o"], cfg.num_heads, cfg.value_dim)
    return (o, transpose_state(out["final"])), out.get("states")


def _core_fwd(cfg, mode, interpret, q, k, v, gates, s0, rel):
    arrays = chunk_kernel_arrays(cfg, q, k, v, gates, s0, rel)
    # fused_chunk keeps the states its forward passes through ([B, H, N, V, K] float32); chunk
    # keeps only the inputs and recomputes them in the backward.
    save = mode == "fused_chunk"
    out, states = _chunked_forward(cfg, mode, interpret, arrays, save_states=save)
    return out, (q, k, v, gates, s0, rel, states if save else None)


def _core_bwd(cfg, mode, interpret, residuals, cotangents):
    q, k, v, gates, s0, rel, states = residuals
    do, dfinal = cotangents
    arrays = chunk_kernel_arrays(cfg, q, k, v, gates, s0, rel)
    if states is None:
        states = kernels_chunk.run(cfg, "states", arrays, interpret=interpret)["states"]
    arrays["states"] = states
    arrays["do"] = seq_pack(do.astype(cfg.dtype))
    arrays["dfinal"] = transpose_state(dfinal.astype(jnp.float32))
    grads = kernels_chunk.run(cfg, "bwd_reverse", arrays, interpret=interpret)
    dq, dk = (_whole_key_grad(cfg, grads[x]) for x in ("dq", "dk"))
    dv = seq_unpack(grads["dv"], cfg.num_heads, cfg.value_dim)
    if cfg.gate_kind == "key":
        dgates = _whole_key_grad(cfg, grads["dg"])
    elif cfg.gate_kind == "head":
        dgates = _head_gate_sum_grad(cfg, q, k, dq, dk, _rows(grads["edge"]))
    else:
        dgates = None
    ds0 = None if s0 is None else transpose_state(grads["ds0"])
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dgates, ds0, None)


def _whole_key_grad(cfg, shares):
    """[nV, *seq_shape] per-V-block shares of a [B, T, H, K] gradient -> their sum, [B, T, H, K]
    (a free view when there is one V block and K is a multiple of 128)."""
    whole = shares[0] if cfg.num_v_blocks == 1 else jnp.sum(shares, axis=0)
    return seq_unpack(whole, cfg.num_heads, cfg.key_dim)


def _rows(x):
    """[nV, B, H, N, 1, K] per-V-block rows -> [B, N, H, K] summed over V blocks."""
    return jnp.transpose(jnp.sum(x, axis=(0, 4)), (0, 2, 1, 3))


def _head_gate_sum_grad(cfg, q, k, dq, dk, edge):
    """d loss / d b [B, T, H] for per-head chunk-local gate sums b (docs/gla_mosaic_tpu.md, "dg").

    Every term of o and of the states carries b as a factor exp(b_i) of q_i, exp(-b_j) of k_j, or
    exp(b_last) of the whole state leaving a chunk; so db_t = sum_K (q_t dq_t - k_t dk_t), plus
    at each chunk's last token `edge` ([B, N, H, K], summed over K), which equals <S_out, dS_out>.
    Per-key gates do the same per key inside the kernels (`kernels_chunk_tile.gate_grad_per_key`).
    """
    b, t, h = cfg.batch, cfg.seq_len, cfg.num_heads
    n, c = cfg.num_chunks, cfg.chunk
    u = q.astype(jnp.float32) * dq - k.astype(jnp.float32) * dk  # [B, T, H, K]
    u = jnp.sum(u, axis=-1).reshape(b, n, c, h)
    last_row = u[:, :, -1] + jnp.sum(edge, axis=-1)
    return jnp.concatenate([u[:, :, :-1], last_row[:, :, None]], axis=2).reshape(b, t, h)


chunked.defvjp(_core_fwd, _core_bwd)


def recurrent(plan: RecurrentPlan, interpret):
    """The custom_vjp function of (q, k, v, g float32 | None, keep | None, s0 | None,
    beta float32 | None): beta [B, T, HV] for the delta rule (plan.cfg.delta), else None."""

    @jax.custom_vjp
    def core(q, k, v, g, keep, s0, beta):
        return _forward(plan, interpret, q, k, v, g, keep, s0, beta)

    def core_fwd(q, k, v, g, keep, s0, beta):
        out = _forward(plan, interpret, q, k, v, g, keep, s0, beta)
        return out, (q, k, v, g, keep, s0, beta)

    def core_bwd(res, cts):
        q, k, v, g, keep, s0, beta = res
        do, dfinal = cts
        dq, dk, dv, dg, dbeta, ds0 = _backward(plan, interpret, q, k, v, g, keep, s0, beta, do,
                                               dfinal)
        dkeep = None if keep is None else jnp.zeros_like(keep)
        return dq, dk, dv, dg, dkeep, ds0, dbeta

    core.defvjp(core_fwd, core_bwd)
    return core


def _beta_input(plan: RecurrentPlan, beta):
    return None if beta is None else head_column(beta, plan.padded_len)


def _forward(plan: RecurrentPlan, interpret, q, k, v, g, keep, s0, beta):
    _, t, _, _ = q.shape
    h = v.shape[2]  # grid heads: the value heads
    if plan.decode_block_h:
        return _decode(plan, interpret, q, k, v, g, s0)
    qk, kk, vk, gk, kp = recurrent_inputs(plan, q, k, v, g, keep)
    o, *rest = kernels_recurrent.recurrent_forward(
        qk, kk, vk, gk, kp, pad_state(plan, s0), cfg=plan.cfg, layouts=plan.layouts(),
        nt=plan.num_time_blocks, nv=plan.num_v_blocks, emit_o=True,
        emit_final=plan.output_final_state, emit_checkpoints=False, o_shape=vk.shape,
        o_dtype=v.dtype, interpret=interpret, beta=_beta_input(plan, beta),
    )
    o = plan.values.from_kernel(o, heads=h, seq_len=t, partial=False)
    final = unpad_state(plan, rest[0]) if plan.output_final_state else None
    return o, final


def _decode(plan: RecurrentPlan, interpret, q, k, v, g, s0):
    b, _, h, kd = q.shape
    vd = v.shape[-1]
    gk = None
    if g is not None:
        gk = g.reshape(b, h, kd) if g.ndim == 4 else g.reshape(b, h, 1)
    cfg = dataclasses.replace(plan.cfg, key_dim=kd, block_v=plan.decode_block_v)
    o, final = kernels_decode.recurrent_decode(
        q.reshape(b, h, kd), k.reshape(b, h, kd), v.reshape(b, h, vd), gk, s0, cfg=cfg,
        block_h=plan.decode_block_h, emit_final=plan.output_final_state, interpret=interpret,
    )
    return o.reshape(b, 1, h, vd), final


def _backward(plan: RecurrentPlan, interpret, q, k, v, g, keep, s0, beta, do, dfinal):
    b, t, hk, kd = q.shape
    h = v.shape[2]  # grid heads: the value heads
    group = plan.cfg.group
    layouts = plan.layouts()
    nv = plan.num_v_blocks
    qk, kk, vk, gk, kp = recurrent_inputs(plan, q, k, v, g, keep)
    bk = _beta_input(plan, beta)
    dok = plan.values.to_kernel(do.astype(v.dtype), plan.padded_len)
    (checkpoints,) = kernels_recurrent.recurrent_forward(
        None, kk, vk, gk, kp, pad_state(plan, s0), cfg=plan.cfg, layouts=layouts,
        nt=plan.num_time_blocks, nv=nv, emit_o=False, emit_final=False, emit_checkpoints=True,
        o_shape=None, o_dtype=None, interpret=interpret, beta=bk,
    )
    direct = nv == 1 and group == 1  # no partial sums to add: the kernel writes the dtype
    grad_dtypes = {
        "dq": q.dtype if direct else jnp.float32,
        "dk": k.dtype if direct else jnp.float32,
        "dv": v.dtype,
        "dg": jnp.float32,
        "dbeta": jnp.float32,
    }
    dfinal = pad_state(plan, dfinal) if plan.output_final_state else None
    dq, dk, dv, dg, dbeta, ds0 = kernels_recurrent.recurrent_backward(
        qk, kk, vk, gk, kp, dok, checkpoints, dfinal, cfg=plan.cfg, layouts=layouts,
        nt=plan.num_time_blocks, nv=nv, has_initial_state=s0 is not None,
        grad_dtypes=grad_dtypes, interpret=interpret, beta=bk,
    )
    unk = lambda x: plan.keys.from_kernel(x, heads=h, seq_len=t, partial=True)  # noqa: E731

    def per_key_head(x):  # [B, T, HV, K] -> [B, T, H, K]: a group's value heads summed
        return x if group == 1 else jnp.sum(x.reshape(b, t, hk, group, kd), axis=3)

    dq = per_key_head(unk(dq)).astype(q.dtype)
    dk = per_key_head(unk(dk)).astype(k.dtype)
    dv = plan.values.from_kernel(dv, heads=h, seq_len=t, partial=False)
    if dg is not None:
        dg = unk(dg) if g.ndim == 4 else _from_head_column(dg, t)
    if dbeta is not None:
        dbeta = _from_head_column(dbeta, t)
    return dq, dk, dv, dg, dbeta, unpad_state(plan, ds0)


def _from_head_column(x, seq_len: int):
    """[NV, B, H, Tp, 1] partial sums over V blocks -> [B, T, H]."""
    x = jnp.sum(x[..., 0], axis=0)
    return jnp.transpose(x, (0, 2, 1))[:, :seq_len]
