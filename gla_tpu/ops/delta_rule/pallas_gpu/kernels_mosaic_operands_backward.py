"""The backward of the delta rule's WY operands in one Mosaic GPU kernel (per-head gates and
none; no state: every chunk in parallel), by docs/delta_rule_math.md "Backward of the operands".

Per chunk of C = 64 tokens of one value head, from the forward kernel's T = (I + A)^-1, w_neg,
u0 and scores M (kernels_mosaic_operands.py), the inputs and the cotangents of M, q_in, k_out,
w_neg and u0, with D_rx = e^(b_r - b_x) the pair decays (x <= r) and X = T^T d w_neg:

    dvb = T^T d u0                                                          [C, V]
    dA  = -strict_lower(X w_neg^T + dvb u0^T)                               [C, C]
    G_M = dM D (x <= r),   G_A = beta_r dA D                                [C, C]
    dq  = scale (G_M k + e^b d q_in)                                        [C, K]
    dk  = (G_A + G_A^T) k + scale G_M^T q - beta e^b X + e^(b_last - b) d k_out
    dv  = beta dvb
    dbeta = rowsum(dvb v) - rowsum(X k e^b) + rowsum(dA (k k^T D))          [C]

and the three per-token parts of dg that need the chunk's matrices:

    pairs_t = sum over r >= t, x < t of P_rx,  P = beta dA (k k^T D) + dM M
    entry_r = -beta_r rowsum(X k e^b) + scale rowsum(d q_in q e^b)   (dg_t sums it over r >= t)
    tail_r  = rowsum(d k_out k e^(b_last - b))                       (dg_t sums it over r < t)

(operands.py adds the cumulative sums, b_last's cotangent, and sums dq and dk over a head's
value heads). pairs is one product: L P with L_tr = [r >= t] (P as two bfloat16 parts, about
2^-16 relative), then row sums over x < t. Products take 16-bit operands (T, w_neg, u0, q, k as
the forward rounded them, the cotangents of w_neg and u0 rounded to the input dtype, X, dvb, G_M
and G_A rounded) with float32 sums, as `operands.operands_backward` in XLA.

One block per (chunk, value head, batch), one warpgroup; K and V multiples of 64 up to 128.
Shared memory at K = V = 128: 204 KiB at its peak (one block per SM), in two scopes: the
first holds what dq needs (q, d q_in, dM, M then G_M, the gates' operands), the second what the
products over T need besides what stays (T and v, loaded as it opens; dv's staging tile, P's
parts, G_A). All of it in one scope would be 1 KiB over a Hopper block's 227 KiB.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gla_tpu.ops.common.mosaic_gpu import SWIZZLED, SWIZZLED_F32
from gla_tpu.ops.delta_rule.pallas_gpu.kernels_mosaic_operands import (
    head_gate_decays,
    head_gate_sums,
    store_split,
)
from gla_tpu.ops.gla.pallas_gpu.kernels_mosaic_levels import (
    BF16,
    CHUNK,
    F32,
    GATE_DTYPE,
    ROW,
    SLAB,
    WGMMA,
    T,
    chunk_kernel,
    iota,
    load_f32,
    matmul,
    operands_released,
    rows,
)

MAX_KEY_DIM = 128
MAX_VALUE_DIM = 128
# [6, C] float32 vectors in shared memory: inputs, then outputs
BETA, GATES, DBETA, PAIRS, ENTRY, TAIL = range(6)


def takes(key_dim: int, value_dim: int) -> bool:
    """Whether the kernel takes padded K and V."""
    return (key_dim % SLAB == 0 and value_dim % SLAB == 0 and key_dim <= MAX_KEY_DIM
            and value_dim <= MAX_VALUE_DIM)


def operands_backward(q, k, v, beta, g, scores, w_neg, u0, inverse, d_scores, d_q_in, d_k_out,
                      d_w_neg, du0, *, group: int, scale: float, with_gates: bool, interpret):
    """The module docstring's cotangents.

    Args: q, k [B, Tp, H, K], v, u0, du0 [B, Tp, HV, V], w_neg, d_w_neg [B, Tp, HV, K], scores
      (M) and T [B, Tp, HV, C], one 16-bit dtype (HV = H * group, Tp a multiple of C); beta, g
      [B, Tp, HV] float32 (natural-log gates per head; ignored without gates); d_scores
      [B, Tp, HV, C], d_q_in, d_k_out [B, Tp, HV, K] float32.
    Returns: float32 dq, dk [B, Tp, HV, K] (per value head), dv [B, Tp, HV, V] in the 16-bit
      dtype (nothing adds to it after: the rounding the op's result makes), float32 dbeta
      [B, HV, Tp] and, with gates, pairs, entry, tail [B, HV, Tp].
    """
    bsz, tp, _, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    c, dtype = CHUNK, q.dtype
    n, slabs, v_slabs = tp // c, kd // SLAB, vd // SLAB
    if tp % c or not takes(kd, vd):
        raise ValueError(f"padded T={tp}, K={kd}, V={vd}: T must be a multiple of {c}, K and V "
                         f"multiples of {SLAB} up to {MAX_KEY_DIM} and {MAX_VALUE_DIM}")
    key_spans = [pl.ds(s * SLAB, SLAB) for s in range(slabs)]
    value_spans = [pl.ds(s * SLAB, SLAB) for s in range(v_slabs)]
    tile = lambda shape, dt=dtype, t=SWIZZLED: plgpu.SMEM(shape, dt, transforms=t)
    f32_tile = lambda shape: plgpu.SMEM(shape, F32, transforms=SWIZZLED_F32)

    def body(q_ref, k_ref, v_ref, beta_ref, g_ref, m_ref, wn_ref, u0_ref, t_ref, dm_ref, dqi_ref,
             dko_ref, dwn_ref, du_ref, *refs):
        outs, (k_s, wn_s, u0_s, dw_s, du_s, dk_o, vec_s, loaded, first_loaded, late_loaded) = (
            refs[:-10], refs[-10:])
        dq_ref, dk_ref, dv_ref = outs[:3]
        vec_refs = dict(zip((DBETA, PAIRS, ENTRY, TAIL) if with_gates else (DBETA,), outs[3:]))
        chunk, head, batch = (lax.axis_index(x) for x in ("chunk", "head", "batch"))
        span_c = pl.ds(chunk * c, c)
        tokens = (batch, span_c, head)  # the value head's
        qk_tokens = (batch, span_c, head // group)
        loads = [(k_ref.at[qk_tokens], k_s), (wn_ref.at[tokens], wn_s), (u0_ref.at[tokens], u0_s),
                 (dwn_ref.at[tokens], dw_s), (du_ref.at[tokens], du_s),
                 (beta_ref.at[batch, head, span_c], vec_s.at[BETA])]
        loads += [(dko_ref.at[tokens + (span,)], dk_o.at[s]) for s, span in enumerate(key_spans)]
        if with_gates:
            loads.append((g_ref.at[batch, head, span_c], vec_s.at[GATES]))
        for src, dst in loads:
            plgpu.copy_gmem_to_smem(src, dst, loaded)
        r, x = iota((c, c), 0), iota((c, c), 1)

        def first(q_s, dq_o, dm_s, mg_s, gu_s):
            """dq (stored), dk's d k_out, G_M and scores terms (into dk_o), dM M's rows, entry's q
            term and tail."""
            first_loads = [(q_ref.at[qk_tokens], q_s), (dm_ref.at[tokens], dm_s)]
            first_loads += [(dqi_ref.at[tokens + (span,)], dq_o.at[s])
                            for s, span in enumerate(key_spans)]
            if with_gates:
                first_loads.append((m_ref.at[tokens], mg_s))
            for src, dst in first_loads:
                plgpu.copy_gmem_to_smem(src, dst, first_loaded)
            plgpu.barrier_wait(loaded)
            plgpu.barrier_wait(first_loaded)
            if with_gates:
                decays = head_gate_decays(vec_s.at[GATES], gu_s, interpret=interpret)
                b, after, _ = head_gate_sums(vec_s.at[GATES])
                e_b, e_after = (rows(jnp.exp2(y), (c, SLAB)) for y in (b, after))
            else:
                decays, e_b, e_after = 1.0, 1.0, 1.0
            dm = plgpu.load(dm_s, layout=WGMMA)
            g_m = jnp.where(x <= r, dm * decays, 0.0)
            pairs = (jnp.where(x <= r, dm * load_f32(mg_s), 0.0) if with_gates else None)
            operands_released(interpret=interpret)  # every warp has read M
            mg_s[...] = g_m.astype(dtype)
            plgpu.commit_smem()
            g_m16 = g_m.astype(dtype)
            entry = tail = None
            for s, span in enumerate(key_spans):
                d_q_in = plgpu.load(dq_o.at[s], layout=WGMMA)
                dq = matmul([(g_m16, k_s.at[:, span])], (c, SLAB), interpret=interpret,
                            init=d_q_in * e_b)
                dq_o.at[s][...] = dq * scale
                d_k_out = plgpu.load(dk_o.at[s], layout=WGMMA)
                dk = matmul([(T(mg_s), q_s.at[:, span])], (c, SLAB), interpret=interpret)
                dk_o.at[s][...] = dk * scale + d_k_out * e_after
                if with_gates:
                    q_term = jnp.sum(d_q_in * load_f32(q_s.at[:, span]) * e_b, axis=1) * scale
                    k_term = jnp.sum(d_k_out * load_f32(k_s.at[:, span]) * e_after, axis=1)
                    entry = q_term if entry is None else entry + q_term
                    tail = k_term if tail is None else tail + k_term
            plgpu.commit_smem()
            for s, span in enumerate(key_spans):
                plgpu.copy_smem_to_gmem(dq_o.at[s], dq_ref.at[tokens + (span,)])
            # the stores are past this scope's buffers, and (the wait ends in a warpgroup
            # barrier) every warp past the products reading them, before the next scope takes
            # their space
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            return dict(decays=decays, e_b=e_b, pairs=pairs, entry=entry, tail=tail) if (
                with_gates) else {}

        kept = pl.run_scoped(
            first, tile((c, kd)), f32_tile((slabs, c, SLAB)), f32_tile((c, c)), tile((c, c)),
            tile((2, c, c), GATE_DTYPE))

        def second(t_s, v_s, dv_o, p_s, ga_s):
            """dv (stored), dA, dk's remaining terms, dbeta, entry's k term, pairs."""
            for src, dst in ((t_ref.at[tokens], t_s), (v_ref.at[tokens], v_s)):
                plgpu.copy_gmem_to_smem(src, dst, late_loaded)
            decays, e_b = (kept["decays"], kept["e_b"]) if with_gates else (1.0, 1.0)
            beta_rows = plgpu.load(vec_s.at[BETA], layout=ROW)
            beta_c = rows(beta_rows, (c, SLAB))
            da = dbeta = None
            plgpu.barrier_wait(late_loaded)
            for s, span in enumerate(value_spans):
                dvb = matmul([(T(t_s), du_s.at[:, span])], (c, SLAB), interpret=interpret)
                term = jnp.sum(dvb * load_f32(v_s.at[:, span]), axis=1)
                dbeta = term if dbeta is None else dbeta + term
                if s:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                dv_o[...] = (dvb * beta_c).astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(dv_o, dv_ref.at[tokens + (span,)])
                da = matmul([((-dvb).astype(dtype), T(u0_s.at[:, span]))], (c, c),
                            interpret=interpret, init=da)
            k_term = None
            for s, span in enumerate(key_spans):
                xs = matmul([(T(t_s), dw_s.at[:, span])], (c, SLAB), interpret=interpret)
                term = jnp.sum(xs * load_f32(k_s.at[:, span]) * e_b, axis=1)
                k_term = term if k_term is None else k_term + term
                dk_o.at[s][...] = plgpu.load(dk_o.at[s], layout=WGMMA) - xs * (beta_c * e_b)
                da = matmul([((-xs).astype(dtype), T(wn_s.at[:, span]))], (c, c),
                            interpret=interpret, init=da)
            da = jnp.where(r > x, da, 0.0)
            kk = matmul([(plgpu.load(k_s.at[:, span], layout=WGMMA), T(k_s.at[:, span]))
                         for span in key_spans], (c, c), interpret=interpret)
            kk = jnp.where(r > x, kk * decays, 0.0)
            da_kk = da * kk
            dbeta = dbeta - k_term + jnp.sum(da_kk, axis=1)
            g_a = rows(beta_rows, (c, c)) * da * decays
            ga_s[...] = g_a.astype(dtype)
            plgpu.commit_smem()
            g_a16 = g_a.astype(dtype)
            for s, span in enumerate(key_spans):
                dk_o.at[s][...] = matmul(
                    [(g_a16, k_s.at[:, span]), (T(ga_s), k_s.at[:, span])], (c, SLAB),
                    interpret=interpret, init=plgpu.load(dk_o.at[s], layout=WGMMA))
            vectors = {DBETA: dbeta}
            if with_gates:
                store_split(kept["pairs"] + rows(beta_rows, (c, c)) * da_kk, p_s)
                plgpu.commit_smem()
                at_or_after = jnp.where(x >= r, 1.0, 0.0).astype(BF16)  # L [t, r]: r >= t
                summed = matmul([(at_or_after, p_s.at[0]), (at_or_after, p_s.at[1])], (c, c),
                                interpret=interpret)
                vectors[PAIRS] = jnp.sum(jnp.where(x < r, summed, 0.0), axis=1)
                vectors[ENTRY] = kept["entry"] - beta_rows * k_term
                vectors[TAIL] = kept["tail"]
            for i, vec in vectors.items():
                vec_s.at[i][...] = vec
            plgpu.commit_smem()
            for i, ref in vec_refs.items():
                plgpu.copy_smem_to_gmem(vec_s.at[i], ref.at[batch, head, span_c])
            for s, span in enumerate(key_spans):
                plgpu.copy_smem_to_gmem(dk_o.at[s], dk_ref.at[tokens + (span,)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(second, tile((c, c)), tile((c, vd)), tile((c, SLAB)),
                      tile((2, c, c), BF16), tile((c, c)))

    scratch = [
        tile((c, kd)),  # k
        tile((c, kd)), tile((c, vd)),  # w_neg, u0
        tile((c, kd)), tile((c, vd)),  # their cotangents
        f32_tile((slabs, c, SLAB)),  # d k_out, then dk
        plgpu.SMEM((6, c), F32),  # beta, gates; dbeta, pairs, entry, tail
        plgpu.Barrier(num_arrivals=6 + slabs + with_gates),
        plgpu.Barrier(num_arrivals=2 + slabs + with_gates),
        plgpu.Barrier(num_arrivals=2),  # T, v
    ]
    key_type = jax.ShapeDtypeStruct((bsz, tp, hv, kd), F32)
    vec_type = jax.ShapeDtypeStruct((bsz, hv, tp), F32)
    out_type = [key_type, key_type, jax.ShapeDtypeStruct((bsz, tp, hv, vd), dtype)]
    out_type += [vec_type] * (4 if with_gates else 1)
    kernel = chunk_kernel(body, out_type, scratch, (n, hv, bsz),
                          "delta_rule_operands_backward_mosaic", interpret)
    g_heads = jnp.swapaxes(g, 1, 2) if with_gates else jnp.zeros((1, 1, 1), F32)
    with jax.named_scope(f"delta_rule_operands_backward_mosaic_key_dim={kd}"):
        return tuple(kernel(q, k, v, jnp.swapaxes(beta, 1, 2), g_heads, scores, w_neg, u0,
                            inverse, d_scores, d_q_in, d_k_out, d_w_neg, du0))
