"""The backward of the delta rule's WY operands (kernels_mosaic_operands.py) in one Mosaic GPU
kernel, for per-head gates and none: from the cotangents of M, q_in, k_out, w_neg and u0 to
q, k, v, beta and g, every chunk in parallel.

Per chunk of C = 64 tokens of one value head (docs/delta_rule_math.md, "Backward of the
operands"; D = exp(E) the pair decays, E_rx = g summed over (x, r]):

    dT    = dw kb^T + du0 vb^T,  dw = -dw_neg,  kb = beta k e^b,  vb = beta v          [C, C]
    dkb   = T^T dw,  dvb = T^T du0,  dA = -strict_lower(T^T dT T^T)
    dv    = beta dvb
    dbeta = rowsum(dvb v) + rowsum(dkb k e^b) + rowsum(dA (k k^T) D)
    dq    = (scale dM D) k + scale e^b dq_in
    dk    = beta e^b dkb + e^(b_last - b) dk_out + G_A k + G_A^T k + (scale dM D)^T q,
            G_A = beta dA D (strictly lower), dM D lower
    dg_t  = sum over pairs x < t <= r of W_rx  +  sum_{r >= t} X_r  +  sum_{r < t} R_r,
            W = dA A + dM M,  X = rowsum(dkb kb) + rowsum(dq_in q_in),  R = rowsum(dk_out k_out)

(plus the cotangent of b_last on every token, which the caller adds). The three sums of dg are
each a product with a 0/1 mask (pairs straddling t, then tokens from t on, then before t), so no
two O(1) terms cancel. Products of float32 operands take them as a bfloat16 head and tail
(about 2^-16 relative); the inverse T is recomputed as the forward computes it.

One block per (chunk, value head, batch), one warpgroup; value head j reads q and k head
j // G. K and V multiples of 64 up to 128.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gla_tpu.ops.common.mosaic_gpu import SWIZZLED, SWIZZLED_F32
from gla_tpu.ops.delta_rule.pallas_gpu.kernels_mosaic_operands import (
    head_gate_scores,
    head_gate_sums,
    parts_product,
    split,
    store_split,
    unit_lower_inverse,
)
from gla_tpu.ops.gla.pallas_gpu.kernels_mosaic_levels import (
    CHUNK,
    F32,
    GATE_DTYPE,
    ROW,
    SLAB,
    WGMMA,
    T,
    chunk_kernel,
    head_major_gates,
    iota,
    load_f32,
    matmul,
    rows,
)

MAX_KEY_DIM = 128
MAX_VALUE_DIM = 128


def takes(key_dim: int, value_dim: int, dtype) -> bool:
    """Whether the kernel takes padded K and V, and the dtype (bfloat16: the float32 operands'
    parts are bfloat16, and a product's operands share one dtype)."""
    return (key_dim % SLAB == 0 and value_dim % SLAB == 0 and key_dim <= MAX_KEY_DIM
            and value_dim <= MAX_VALUE_DIM and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16))


def wy_operands_backward(q, k, v, beta, g, d_scores, d_q_in, d_k_out, d_w_neg, d_u0, *,
                         group: int, scale: float, interpret):
    """q, k [B, Tp, H, K], v [B, Tp, HV, V] (16-bit, one dtype; K, V multiples of 64 up to 128),
    beta [B, Tp, HV] float32, g [B, Tp, HV] float32 per-head log gates (zeros for none); the
    float32 cotangents of `kernels_mosaic_operands.wy_operands`' outputs: d_scores [B, Tp, HV,
    C], d_q_in, d_k_out, d_w_neg [B, Tp, HV, K], d_u0 [B, Tp, HV, V] -> float32 (dq, dk
    [B, Tp, HV, K] per value head, dv [B, Tp, HV, V], dbeta [B, Tp, HV], dg [B, Tp, HV] without
    the cotangent of b_last)."""
    bsz, tp, _, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    c, dtype = CHUNK, q.dtype
    n, slabs, v_slabs = tp // c, kd // SLAB, vd // SLAB
    if tp % c or not takes(kd, vd, dtype):
        raise ValueError(f"padded T={tp}, K={kd}, V={vd}, {jnp.dtype(dtype).name}: T must be a "
                         f"multiple of {c}, K and V multiples of {SLAB} up to {MAX_KEY_DIM} and "
                         f"{MAX_VALUE_DIM}, the dtype bfloat16")
    if g.ndim != 3:
        raise ValueError(f"g must be per head [B, Tp, HV]; got {g.shape}")

    def body(q_ref, k_ref, v_ref, beta_ref, g_ref, dm_ref, dqin_ref, dkout_ref, dw_ref, du0_ref,
             dq_ref, dk_ref, dv_ref, dbeta_ref, dg_ref,
             q_s, k_s, v_s, kb_s, gu_s, t_s, y_s, parts_s, f32_s, dk_s, beta_vec, g_vec, out_vec,
             loaded, one_in, k_in, v_in):
        chunk, head, batch = (lax.axis_index(x) for x in ("chunk", "head", "batch"))
        span_c = pl.ds(chunk * c, c)
        tokens = (batch, span_c, head)
        qk_tokens = (batch, span_c, head // group)
        for src, dst in ((q_ref.at[qk_tokens], q_s), (k_ref.at[qk_tokens], k_s),
                         (v_ref.at[tokens], v_s), (beta_ref.at[batch, head, span_c], beta_vec),
                         (g_ref.at[batch, head, span_c], g_vec)):
            plgpu.copy_gmem_to_smem(src, dst, loaded)
        k_spans = [pl.ds(s * SLAB, SLAB) for s in range(slabs)]
        v_spans = [pl.ds(s * SLAB, SLAB) for s in range(v_slabs)]

        def fetch(ref, spans, arrived):
            """A float32 cotangent [C, len(spans) * SLAB] at the chunk's tokens into f32_s, one
            slab per buffer (arriving on `arrived`, one arrival per slab), once every earlier
            store from f32_s has read it and every warp is past its reads of f32_s."""
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.commit_smem()
            for i, span in enumerate(spans):
                plgpu.copy_gmem_to_smem(ref.at[tokens + (span,)], f32_s.at[i], arrived)
            plgpu.barrier_wait(arrived)

        def store(ref, values):
            """float32 [C, SLAB] slabs through f32_s to ref at the chunk's tokens."""
            for i, x in enumerate(values):
                f32_s.at[i][...] = x
            plgpu.commit_smem()
            for i in range(len(values)):
                plgpu.copy_smem_to_gmem(f32_s.at[i], ref.at[tokens + (pl.ds(i * SLAB, SLAB),)])

        plgpu.barrier_wait(loaded)
        r, x = iota((c, c), 0), iota((c, c), 1)
        lower, strict = x <= r, x < r
        qk_d, kk_d, decay = head_gate_scores(q_s, k_s, g_vec, gu_s, slabs=slabs,
                                              interpret=interpret)
        b, after, _ = head_gate_sums(g_vec)
        beta_rows = plgpu.load(beta_vec, layout=ROW)
        e_b, e_after = jnp.exp2(b), jnp.exp2(after)  # [C] ROW
        kk_d = jnp.where(strict, kk_d, 0.0)
        a = rows(beta_rows, (c, c)) * kk_d  # A

        # M's share: dq, its share of dk (into dk_s), of the gates (w_pairs) and x_sum
        fetch(dm_ref, [pl.ds(0, c)], one_in)
        d_m = plgpu.load(f32_s.at[0], layout=WGMMA)
        g_m = jnp.where(lower, d_m * decay, 0.0) * scale  # d(q k^T)
        w_pairs = jnp.where(lower, d_m * qk_d, 0.0) * scale  # dM * M
        fetch(dqin_ref, k_spans, k_in)
        g_m_parts = split(g_m)
        x_sum = jnp.zeros((c,), F32)
        dq = []
        for s, span in enumerate(k_spans):
            d_q_in = plgpu.load(f32_s.at[s], layout=WGMMA)
            q_tile = load_f32(q_s.at[:, span])
            e_b_tile = rows(e_b, (c, SLAB))
            x_sum = x_sum + jnp.sum(d_q_in * q_tile * e_b_tile, axis=1) * scale
            dq.append(matmul([(g_m_parts[0], k_s.at[:, span]), (g_m_parts[1], k_s.at[:, span])],
                             (c, SLAB), interpret=interpret,
                             init=d_q_in * e_b_tile * scale))
        store(dq_ref, dq)
        store_split(g_m, y_s)
        plgpu.commit_smem()
        for s, span in enumerate(k_spans):  # dk = (dM D)^T q, to begin with
            dk_s.at[s][...] = matmul(
                [(T(y_s.at[0]), q_s.at[:, span]), (T(y_s.at[1]), q_s.at[:, span])], (c, SLAB),
                interpret=interpret)

        # T = (I + A)^-1 as the forward forms it; its parts into t_s
        plgpu.commit_smem()  # every warp is past the products reading y_s
        t = unit_lower_inverse(a, t_s, y_s, interpret=interpret)
        plgpu.commit_smem()
        store_split(t, t_s)
        t_parts_t = (T(t_s.at[0]), T(t_s.at[1]))  # T^T as a left operand
        plgpu.commit_smem()

        # u0's share: dv, dbeta's first term, and du0 vb^T of dT
        fetch(du0_ref, v_spans, v_in)
        for s, span in enumerate(v_spans):  # du0's parts into parts_s
            hi, lo = split(plgpu.load(f32_s.at[s], layout=WGMMA))
            parts_s.at[0].at[:, span][...] = hi
            parts_s.at[1].at[:, span][...] = lo
        plgpu.commit_smem()
        dbeta = jnp.zeros((c,), F32)
        dv = []
        beta_tile = rows(beta_rows, (c, SLAB))
        for span in v_spans:
            dvb = parts_product(t_parts_t, (parts_s.at[0].at[:, span], parts_s.at[1].at[:, span]),
                                 (c, SLAB), interpret=interpret)
            dbeta = dbeta + jnp.sum(dvb * load_f32(v_s.at[:, span]), axis=1)
            dv.append(beta_tile * dvb)
        store(dv_ref, dv)
        plgpu.commit_smem()  # every warp is past its reads of v_s
        for span in v_spans:  # vb = beta v, rounded as the forward's u0 takes it
            v_s.at[:, span][...] = (load_f32(v_s.at[:, span]) * beta_tile).astype(dtype)
        for span in k_spans:  # kb = beta k e^b, the same
            kb_s.at[:, span][...] = (load_f32(k_s.at[:, span]) * rows(e_b, (c, SLAB))
                                     * beta_tile).astype(dtype)
        plgpu.commit_smem()
        d_t = matmul([(plgpu.load(parts_s.at[i].at[:, span], layout=WGMMA), T(v_s.at[:, span]))
                      for i in range(2) for span in v_spans], (c, c), interpret=interpret)

        # w's share: dw kb^T of dT, dkb (into dk_s), dbeta's second term, x_sum
        fetch(dw_ref, k_spans, k_in)
        plgpu.commit_smem()  # every warp is past the products reading du0's parts
        for s, span in enumerate(k_spans):  # dw = -dw_neg, its parts into parts_s
            hi, lo = split(-plgpu.load(f32_s.at[s], layout=WGMMA))
            parts_s.at[0].at[:, span][...] = hi
            parts_s.at[1].at[:, span][...] = lo
        plgpu.commit_smem()
        d_t = matmul([(plgpu.load(parts_s.at[i].at[:, span], layout=WGMMA), T(kb_s.at[:, span]))
                      for i in range(2) for span in k_spans], (c, c), interpret=interpret,
                     init=d_t)
        for s, span in enumerate(k_spans):
            dkb = parts_product(t_parts_t, (parts_s.at[0].at[:, span], parts_s.at[1].at[:, span]),
                                 (c, SLAB), interpret=interpret)
            e_b_tile = rows(e_b, (c, SLAB))
            k_e_b = load_f32(k_s.at[:, span]) * e_b_tile
            dbeta = dbeta + jnp.sum(dkb * k_e_b, axis=1)
            x_sum = x_sum + jnp.sum(dkb * k_e_b * beta_tile, axis=1)
            dk_s.at[s][...] = (plgpu.load(dk_s.at[s], layout=WGMMA)
                               + beta_tile * e_b_tile * dkb)

        # dA = -strict_lower(T^T dT T^T): dT T^T, then T^T (dT T^T), over parts
        plgpu.commit_smem()  # every warp is past the products reading y_s and t_s's readers
        y = parts_product(split(d_t), (T(t_s.at[0]), T(t_s.at[1])), (c, c),
                           interpret=interpret)
        store_split(y, y_s)
        plgpu.commit_smem()
        d_a = -jnp.where(strict, parts_product(t_parts_t, (y_s.at[0], y_s.at[1]), (c, c),
                                                interpret=interpret), 0.0)
        dbeta = dbeta + jnp.sum(d_a * kk_d, axis=1)
        w_pairs = w_pairs + d_a * a
        g_a = rows(beta_rows, (c, c)) * d_a * decay  # d(k k^T), strictly lower
        plgpu.commit_smem()  # every warp is past the products reading y_s
        store_split(g_a, y_s)
        plgpu.commit_smem()
        g_a_parts = split(g_a)
        for s, span in enumerate(k_spans):  # dk += G_A k + G_A^T k
            dk_s.at[s][...] = matmul(
                [(g_a_parts[0], k_s.at[:, span]), (g_a_parts[1], k_s.at[:, span]),
                 (T(y_s.at[0]), k_s.at[:, span]), (T(y_s.at[1]), k_s.at[:, span])], (c, SLAB),
                interpret=interpret, init=plgpu.load(dk_s.at[s], layout=WGMMA))

        # k_out's share: dk, and R
        fetch(dkout_ref, k_spans, k_in)
        r_sum = jnp.zeros((c,), F32)
        dk = []
        for s, span in enumerate(k_spans):
            d_k_out = plgpu.load(f32_s.at[s], layout=WGMMA)
            k_after = load_f32(k_s.at[:, span]) * rows(e_after, (c, SLAB))
            r_sum = r_sum + jnp.sum(d_k_out * k_after, axis=1)
            dk.append(plgpu.load(dk_s.at[s], layout=WGMMA) + d_k_out * rows(e_after, (c, SLAB)))
        store(dk_ref, dk)

        # dg: pairs straddling t (L^T W, then x < t), X from t on (L^T diag X), R before t
        # (strict L diag R); the 0/1 masks as bfloat16 left operands in registers, exact
        at_or_after = jnp.where(x >= r, 1.0, 0.0).astype(jnp.bfloat16)  # [t, r]: r >= t
        before = jnp.where(strict, 1.0, 0.0).astype(jnp.bfloat16)  # [t, r]: r < t
        diag = r == x
        dg = jnp.zeros((c,), F32)
        for mask, values, keep in (
                (at_or_after, w_pairs, strict),
                (at_or_after, jnp.where(diag, rows(x_sum, (c, c)), 0.0), None),
                (before, jnp.where(diag, rows(r_sum, (c, c)), 0.0), None)):
            plgpu.commit_smem()  # every warp is past the products reading y_s
            store_split(values, y_s)
            plgpu.commit_smem()
            sums = matmul([(mask, y_s.at[0]), (mask, y_s.at[1])], (c, c), interpret=interpret)
            dg = dg + jnp.sum(sums if keep is None else jnp.where(keep, sums, 0.0), axis=1)
        for ref, vec in ((dbeta_ref, dbeta), (dg_ref, dg)):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            out_vec[...] = vec
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_vec, ref.at[batch, head, span_c])
        plgpu.wait_smem_to_gmem(0)

    tiles = lambda shape, dt=dtype, t=SWIZZLED: plgpu.SMEM(shape, dt, transforms=t)
    scratch = [
        tiles((c, kd)), tiles((c, kd)), tiles((c, vd)),  # q, k, v (then beta v)
        tiles((c, kd)),  # beta k e^b
        tiles((2, c, c), GATE_DTYPE),  # the masked gates and L (the pair decays' operands)
        tiles((2, c, c)),  # T's parts
        tiles((2, c, c)),  # parts of the inverse's products, then of dM D, dT T^T, G_A, dg's
        tiles((2, c, max(kd, vd))),  # du0's parts, then dw's
        tiles((max(slabs, v_slabs), c, SLAB), F32, SWIZZLED_F32),  # float32 cotangents in/out
        tiles((slabs, c, SLAB), F32, SWIZZLED_F32),  # dk's running sum
        plgpu.SMEM((c,), F32), plgpu.SMEM((c,), F32), plgpu.SMEM((c,), F32),  # beta, g, out
        plgpu.Barrier(num_arrivals=5),  # q, k, v, beta, g
        plgpu.Barrier(),  # dM
        plgpu.Barrier(num_arrivals=slabs),  # a [C, K] cotangent
        plgpu.Barrier(num_arrivals=v_slabs),  # du0
    ]
    key_type = jax.ShapeDtypeStruct((bsz, tp, hv, kd), F32)
    vec_type = jax.ShapeDtypeStruct((bsz, hv, tp), F32)
    kernel = chunk_kernel(
        body, [key_type, key_type, jax.ShapeDtypeStruct((bsz, tp, hv, vd), F32), vec_type,
               vec_type], scratch, (n, hv, bsz), "delta_rule_wy_operands_bwd_mosaic", interpret)
    with jax.named_scope(f"delta_rule_wy_operands_bwd_mosaic_key_dim={kd}"):
        dq, dk, dv, dbeta, dg = kernel(q, k, v, jnp.swapaxes(beta, 1, 2), head_major_gates(g),
                                       d_scores, d_q_in, d_k_out, d_w_neg, d_u0)
    return dq, dk, dv, jnp.swapaxes(dbeta, 1, 2), jnp.swapaxes(dg, 1, 2)
