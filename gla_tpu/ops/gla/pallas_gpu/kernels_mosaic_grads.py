"""Per-key GLA on Mosaic GPU: dq, dk and dg of a chunk, by pair levels (any gate, one speed).

One block per (chunk, key slab of 64 columns, head, batch): the columns of dq, dk and dg depend on
their own columns of q, k, b (the chunk-local gate sums), h_n and dh_{n+1} only (and on dA,
recomputed per slab). Two
warpgroups, each its side of every level (docs/gla_math.md, "Pair levels", has the derivation):

    dA  = scale (do v^T), lower triangle with the diagonal                        [C, C]
    wg 0:  dq = sum_L F_L (dA_L (k F_L)_lower) + diag(dA) k + scale e^b (do h_n^T)
    wg 1:  dk = sum_L F_L (dA_L^T (q F_L)_upper) + diag(dA) q + e^(B - b) (v dh_{n+1}^T)

with dA_L = dA on the level's pairs. The gate gradient comes from db_t = q_t dq_t - k_t dk_t
summed within the chunk,

    dg_t = sum_{s >= t} (Dq_s - Dk_s) + sum_{s < t} Y_s + e^B sum_V h_n dh_{n+1},
    Dq   = sum_L (q F_L) * (dA_L (k F_L)) + q * dq_inter,   Dk = sum_L (k F_L) * (dA_L^T (q F_L)),
    Y    = k * dk_inter,

where each level's pair terms enter Dq and Dk through the *same* rounded operands, so a pair
whose two tokens both lie at or after t cancels to float32 accuracy (a token's pair with itself is
left out: it cancels exactly). The two triangular sums run on the tensor cores, the 0/1
triangles in shared memory and the float32 operands in three bfloat16 parts. The state term sum_V h_n dh_{n+1} comes from the reversed state
pass (kernels_mosaic_state.py), which also computes dv.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gla_tpu.ops.common import pair_levels
from gla_tpu.ops.common.mosaic_gpu import SWIZZLED
from gla_tpu.ops.gla.pallas_gpu.kernels_mosaic_levels import (
    BF16,
    CHUNK,
    COL,
    COMPILER_PARAMS,
    F32,
    PAD,
    SLAB,
    T,
    cols,
    full,
    iota,
    last_sums,
    level_factor,
    load_slab,
    load_sums,
    matmul,
    operands_released,
    rows,
    shift_buffer,
)

VALUE_TILE = 128  # value columns of v, do, h_n and dh_{n+1} in shared memory at once


def bf16_parts(x):
    """x float32 -> three bfloat16 parts whose float32 sum is x (24 significand bits)."""
    hi = x.astype(BF16)
    rest = x - hi.astype(F32)
    mid = rest.astype(BF16)
    return hi, mid, (rest - mid.astype(F32)).astype(BF16)


def lower_triangle(chunk: int, *, strict: bool = False, upper: bool = False):
    """[C, C] bfloat16 0/1 (exact): rows r, columns s; s <= r (s < r if strict; s >= r if
    upper, s > r if both)."""
    r, s = iota((chunk, chunk), 0), iota((chunk, chunk), 1)
    if upper:
        keep = s > r if strict else s >= r
    else:
        keep = s < r if strict else s <= r
    return jnp.where(keep, full((chunk, chunk), 1.0), full((chunk, chunk), 0.0)).astype(BF16)


def summed_rows(tri, x, parts_smem, *, interpret: bool, init=None):
    """tri @ x [C, W] float32 to float32 accuracy: x (float32 registers) in three bfloat16 parts
    through parts_smem [3, C, W] (bfloat16, swizzled), tri a 0/1 bfloat16 [C, C] (exact) in
    shared memory, committed."""
    operands_released(interpret=interpret)
    for i, part in enumerate(bf16_parts(x)):
        parts_smem.at[i][...] = part
    plgpu.commit_smem()
    return matmul([(tri, parts_smem.at[i]) for i in range(3)], x.shape, interpret=interpret,
                  init=init)


def _level_mask(chunk: int, level: int, *, transposed: bool):
    """[C, C] the pairs of level L: rows r, columns x (transposed: rows x, columns r)."""
    a, b = iota((chunk, chunk), 0), iota((chunk, chunk), 1)
    r, x = (b, a) if transposed else (a, b)
    return jnp.logical_and(pair_levels.same_block(r, x, level),
                           jnp.logical_and(pair_levels.is_upper(r, level),
                                           jnp.logical_not(pair_levels.is_upper(x, level))))


def _diagonal(x):
    """The diagonal of a [C, C] float32 tile, one value per row."""
    r, c = iota(x.shape, 0), iota(x.shape, 1)
    return jnp.sum(jnp.where(r == c, x, 0.0), axis=1)


def chunk_grads(q, k, v, do, b, h_hi, dh, term, *, scale: float, interpret):
    """q, k [B, Tp, H, K], v, do [B, Tp, H, V] (16-bit), b [B, Tp, H, K] float32 chunk-local
    gate sums,
    h_hi and dh [B, H, N, K, V] 16-bit (the state entering each chunk and the gradient of the
    state after it), term [B, H, N, K] float32 (sum_V h_n dh_{n+1}) -> dq, dk [B, Tp, H, K] in
    q's dtype and dg [B, Tp, H, K] float32."""
    bsz, tp, h, kd = q.shape
    vd = v.shape[-1]
    c, dtype = CHUNK, q.dtype
    n, slabs = tp // c, kd // SLAB
    if tp % c or kd % SLAB or vd > VALUE_TILE or vd % 64:
        raise ValueError(f"padded T={tp}, K={kd}, V={vd}: T and K multiples of {c} and {SLAB}, "
                         f"V a multiple of 64 up to {VALUE_TILE}")
    levels = pair_levels.num_levels(c)

    def body(q_ref, k_ref, v_ref, do_ref, b_ref, h_ref, dh_ref, term_ref, dq_ref, dk_ref, dg_ref,
             q_s, k_s, v_s, do_s, h_s, dh_s, term_s, b_pad, exchange, ops_q, ops_k, parts_q,
             parts_k, at_or_after, before, loaded,
             sums_ready, dg_ready, done):
        flat, head, batch = (lax.axis_index(x) for x in ("chunk_slab", "head", "batch"))
        chunk, slab = lax.div(flat, jnp.int32(slabs)), lax.rem(flat, jnp.int32(slabs))
        wg = lax.axis_index("wg")
        kcols = pl.ds(slab * SLAB, SLAB)
        tokens = (batch, pl.ds(chunk * c, c), head)
        shape = (c, SLAB)

        @pl.when(wg == 0)
        def _():
            copies = [(q_ref.at[tokens + (kcols,)], q_s), (k_ref.at[tokens + (kcols,)], k_s),
                      (v_ref.at[tokens], v_s), (do_ref.at[tokens], do_s),
                      (h_ref.at[batch, head, chunk, kcols], h_s),
                      (dh_ref.at[batch, head, chunk, kcols], dh_s),
                      (term_ref.at[batch, head, chunk, kcols], term_s)]
            for src, dst in copies:
                plgpu.copy_gmem_to_smem(src, dst, loaded)

            # the gate sums into the shift buffer, then every warpgroup reads them
            b = plgpu.load(b_ref.at[tokens + (kcols,)], layout=plgpu.Layout.WGMMA,
                           optimized=False)
            b_pad.at[pl.ds(PAD, c), pl.ds(0, SLAB)][...] = b
            at_or_after[...] = lower_triangle(c, upper=True)
            plgpu.commit_smem()  # the tensor cores of both warpgroups read at_or_after
            plgpu.barrier_arrive(sums_ready)

        plgpu.barrier_wait(loaded)

        def side(queries: bool, own_ops):
            """dq (queries) or dk, and this side's part of the dg sums; own_ops [C, SLAB] holds
            this side's level operands."""
            mine, other = (q_s, k_s) if queries else (k_s, q_s)
            # dA = do v^T (queries) or dA^T = v do^T, and do h_n^T or v dh_{n+1}^T
            left, right, state = (do_s, v_s, h_s) if queries else (v_s, do_s, dh_s)
            da = matmul([(left, T(right))], (c, c), interpret=interpret)
            inter = matmul([(left, T(state))], shape, interpret=interpret)
            r, x = iota((c, c), 0), iota((c, c), 1)
            visible = r >= x if queries else r <= x
            da = jnp.where(visible, da * scale, 0.0)  # dA (queries) or dA^T, [C, C]
            da16 = da.astype(dtype)
            plgpu.barrier_wait(sums_ready)
            b = load_sums(b_pad, 0, c)
            mine_f = load_slab(mine, 0)
            other_f = load_slab(other, 0)
            if queries:
                weight = jnp.exp(b) * scale
            else:
                weight = jnp.exp(cols(last_sums(b_pad, 0, c), shape) - b)
            inter = inter * weight
            grad = inter + rows(_diagonal(da), shape) * other_f
            cancel = mine_f * inter if queries else None  # Dq's inter part; Dk has none
            y = None if queries else mine_f * inter  # Y = k dk_inter
            for level in range(levels):
                factor = level_factor(b_pad, b, 0, level, c)
                upper = pair_levels.is_upper(iota(shape, 0), level)
                q_op = jnp.where(upper, load_slab(q_s, 0) * factor, 0.0).astype(dtype)
                k_op = jnp.where(upper, 0.0, load_slab(k_s, 0) * factor).astype(dtype)
                mine_op, other_op = (q_op, k_op) if queries else (k_op, q_op)
                if level:
                    operands_released(interpret=interpret)  # the last level's wgmma read own_ops
                own_ops[...] = other_op
                plgpu.commit_smem()
                mask = _level_mask(c, level, transposed=not queries)
                prod = matmul([(jnp.where(mask, da16, jnp.zeros_like(da16)), own_ops)], shape,
                              interpret=interpret)
                grad = grad + factor * prod
                term = mine_op.astype(F32) * prod
                cancel = term if cancel is None else cancel + term
            return grad, cancel, y

        @pl.when(wg == 0)
        def _():
            own_ops, own_parts = ops_q, parts_q
            dq, dq_cancel, _ = side(True, own_ops)
            dg = summed_rows(at_or_after, dq_cancel, own_parts, interpret=interpret)
            plgpu.barrier_wait(dg_ready)
            dg = dg + plgpu.load(exchange.at[:, pl.ds(0, SLAB)], layout=plgpu.Layout.WGMMA,
                                 optimized=False)
            dg_ref.at[tokens + (kcols,)][...] = dg
            own_ops[...] = dq.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(own_ops, dq_ref.at[tokens + (kcols,)])
            plgpu.wait_smem_to_gmem(0)
            plgpu.barrier_arrive(done)

        @pl.when(wg == 1)
        def _():
            own_ops, own_parts = ops_k, parts_k
            before[...] = lower_triangle(c, strict=True)  # its tensor cores read it after a commit
            dk, dk_cancel, y = side(False, own_ops)
            b_last = cols(last_sums(b_pad, 0, c), shape)
            state = jnp.exp(b_last) * cols(plgpu.load(term_s, layout=COL), shape)
            part = summed_rows(at_or_after, -dk_cancel, own_parts, interpret=interpret,
                               init=state)
            part = summed_rows(before, y, own_parts, interpret=interpret, init=part)
            exchange.at[:, pl.ds(0, SLAB)][...] = part
            plgpu.barrier_arrive(dg_ready)  # every thread releases its rows
            own_ops[...] = dk.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(own_ops, dk_ref.at[tokens + (kcols,)])
            plgpu.wait_smem_to_gmem(0)
            plgpu.barrier_wait(done)

    scratch = [
        plgpu.SMEM((c, SLAB), dtype, transforms=SWIZZLED),  # q's slab
        plgpu.SMEM((c, SLAB), dtype, transforms=SWIZZLED),  # k's slab
        plgpu.SMEM((c, vd), dtype, transforms=SWIZZLED),  # v
        plgpu.SMEM((c, vd), dtype, transforms=SWIZZLED),  # do
        plgpu.SMEM((SLAB, vd), dtype, transforms=SWIZZLED),  # h_n's rows of the slab
        plgpu.SMEM((SLAB, vd), dtype, transforms=SWIZZLED),  # dh_{n+1}'s rows
        plgpu.SMEM((SLAB,), F32),  # the state term
        shift_buffer(c, SLAB),
        plgpu.SMEM((c, SLAB + 8), F32),  # warpgroup 1's part of dg (padded as the shift buffer)
        # each side's level operands, then its gradient; each side's bfloat16 parts (static
        # buffers per warpgroup: no buffer is picked by the warpgroup index at run time)
        plgpu.SMEM((c, SLAB), dtype, transforms=SWIZZLED),
        plgpu.SMEM((c, SLAB), dtype, transforms=SWIZZLED),
        plgpu.SMEM((3, c, SLAB), BF16, transforms=SWIZZLED),
        plgpu.SMEM((3, c, SLAB), BF16, transforms=SWIZZLED),
        # the triangles of the dg sums, s >= t and s < t: shared-memory operands (a triangle
        # taken from registers summed the wrong rows on an H100, 2026-11-25)
        plgpu.SMEM((c, c), BF16, transforms=SWIZZLED),
        plgpu.SMEM((c, c), BF16, transforms=SWIZZLED),
        plgpu.Barrier(num_arrivals=7),  # loaded
        plgpu.Barrier(num_arrivals=1),  # gate sums in the shift buffer
        plgpu.Barrier(num_arrivals=1),  # warpgroup 1's dg part in g_s
        plgpu.Barrier(num_arrivals=1),  # warpgroup 0 is done with every buffer
    ]
    token_type = jax.ShapeDtypeStruct(q.shape, dtype)
    kernel = plgpu.kernel(
        body,
        out_type=[token_type, token_type, jax.ShapeDtypeStruct(q.shape, F32)],
        scratch_types=scratch,
        grid=(n * slabs, h, bsz),
        grid_names=("chunk_slab", "head", "batch"),
        num_threads=2,
        thread_name="wg",
        compiler_params=COMPILER_PARAMS,
        interpret=plgpu.InterpretGPUParams() if interpret is True else (interpret or None),
    )
    with jax.named_scope(f"gla_grads_mosaic_key_dim={kd}"):
        return kernel(q, k, v, do, b, h_hi, dh, term)
