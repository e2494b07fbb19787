"""The per-chunk cotangents of the delta rule's state pass in one Mosaic GPU kernel (no state:
every chunk in parallel), after the reversed pass.

Per chunk of C = 64 tokens of one value head, with S the state entering the chunk and dS' the
cotangent of the state leaving it, each given as two 16-bit parts (hi + lo, float32-accurate),
[K, V] (docs/delta_rule.md, "GPU kernels"; vjp.py's `chunk_cotangents` computes the same in XLA):

    d q_in  = do S^T       d w_neg = du S^T       d k_out = u dS'^T      [C, K]
    d M     = do u^T                                                      [C, C]

16-bit products with float32 sums on the tensor cores; float32 results but d w_neg, which is
written in the 16-bit dtype (the operands' backward takes it only as a product's 16-bit operand,
so the rounding is the one it would make). One block per (chunk,
value head, batch), one warpgroup: do, u and du [C, V] and S's two parts [K, V] arrive by TMA; the
products over S run; dS' takes S's buffers; then the products over dS'. K a multiple of 64 up to
128, V a multiple of 64 up to 128 (shared memory: about 176 KiB at K = V = 128).
"""

from __future__ import annotations

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gla_tpu.ops.common.mosaic_gpu import SWIZZLED, SWIZZLED_F32
from gla_tpu.ops.gla.pallas_gpu.kernels_mosaic_levels import (
    CHUNK,
    F32,
    SLAB,
    WGMMA,
    T,
    chunk_kernel,
    matmul,
    operands_released,
)

MAX_KEY_DIM = 128
MAX_VALUE_DIM = 128


def takes(key_dim: int, value_dim: int) -> bool:
    """Whether the kernel takes padded K and V."""
    return (key_dim % SLAB == 0 and value_dim % SLAB == 0 and key_dim <= MAX_KEY_DIM
            and value_dim <= MAX_VALUE_DIM)


def chunk_cotangents(do, u, du, h_parts, dh_parts, *, interpret):
    """do, u, du [B, Tp, HV, V] and the state parts h_parts, dh_parts ((hi, lo), each
    [B, N, HV, K, V]), one 16-bit dtype -> (d q_in, d k_out [B, Tp, HV, K] float32, d w_neg
    [B, Tp, HV, K] in the 16-bit dtype, d M [B, Tp, HV, C] float32): the module docstring's
    products, token-major."""
    bsz, tp, hv, vd = do.shape
    n, kd = h_parts[0].shape[1], h_parts[0].shape[3]
    c, dtype = CHUNK, do.dtype
    if tp != n * c or not takes(kd, vd):
        raise ValueError(f"padded T={tp} (chunks {n}), K={kd}, V={vd}: T must be {c} per chunk, "
                         f"K and V multiples of {SLAB} up to {MAX_KEY_DIM} and {MAX_VALUE_DIM}")
    v_slabs = vd // SLAB

    def body(do_ref, u_ref, du_ref, hi_ref, lo_ref, dh_hi_ref, dh_lo_ref,
             dq_ref, dk_ref, dw_ref, dm_ref, do_s, u_s, du_s, parts, out_s, dw_s, m_s, loaded,
             dh_loaded):
        chunk, head, batch = (lax.axis_index(x) for x in ("chunk", "head", "batch"))
        tokens = (batch, pl.ds(chunk * c, c), head)
        at_chunk = (batch, chunk, head)
        for src, dst in ((do_ref, do_s), (du_ref, du_s), (u_ref, u_s)):
            plgpu.copy_gmem_to_smem(src.at[tokens], dst, loaded)
        for i, src in enumerate((hi_ref, lo_ref)):
            plgpu.copy_gmem_to_smem(src.at[at_chunk], parts.at[i], loaded)
        plgpu.barrier_wait(loaded)
        spans = [pl.ds(s * SLAB, SLAB) for s in range(v_slabs)]

        def rows_of(x_s):  # [C, V] 16-bit from shared memory into registers, per value slab
            return [plgpu.load(x_s.at[:, span], layout=WGMMA) for span in spans]

        def times_state_t(x_regs, out_ref, staging, last_store_pending):
            """x [C, V] @ (hi + lo)^T [V, K] into out_ref at the chunk's tokens, through staging
            (in out_ref's dtype)."""
            y = matmul([(x_regs[s], T(parts.at[i].at[:, spans[s]]))
                        for i in range(2) for s in range(v_slabs)], (c, kd), interpret=interpret)
            if last_store_pending:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            staging[...] = y.astype(staging.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(staging, out_ref.at[tokens])

        do_regs = rows_of(do_s)
        times_state_t(do_regs, dq_ref, out_s, False)
        times_state_t(rows_of(du_s), dw_ref, dw_s, False)  # its own staging tile
        operands_released(interpret=interpret)  # every warp is past the products reading S
        for i, src in enumerate((dh_hi_ref, dh_lo_ref)):
            plgpu.copy_gmem_to_smem(src.at[at_chunk], parts.at[i], dh_loaded)
        m = matmul([(do_regs[s], T(u_s.at[:, spans[s]])) for s in range(v_slabs)], (c, c),
                   interpret=interpret)
        m_s[...] = m
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(m_s, dm_ref.at[tokens])
        plgpu.barrier_wait(dh_loaded)
        times_state_t(rows_of(u_s), dk_ref, out_s, True)  # out_s: d q_in's store done reading
        plgpu.wait_smem_to_gmem(0)

    tile = lambda shape, dt=dtype, t=SWIZZLED: plgpu.SMEM(shape, dt, transforms=t)
    scratch = [
        tile((c, vd)), tile((c, vd)), tile((c, vd)),  # do, u, du
        tile((2, kd, vd)),  # S's parts, then dS''s
        tile((c, kd), F32, SWIZZLED_F32),  # d q_in, then d k_out, on its way out
        tile((c, kd)),  # d w_neg on its way out
        tile((c, c), F32, SWIZZLED_F32),  # d M
        plgpu.Barrier(num_arrivals=5),  # do, u, du, S's parts
        plgpu.Barrier(num_arrivals=2),  # dS''s parts
    ]
    key_type = jax.ShapeDtypeStruct((bsz, tp, hv, kd), F32)
    kernel = chunk_kernel(body, [key_type, key_type,
                                 jax.ShapeDtypeStruct((bsz, tp, hv, kd), dtype),
                                 jax.ShapeDtypeStruct((bsz, tp, hv, c), F32)],
                          scratch, (n, hv, bsz), "delta_rule_chunk_cotangents_mosaic", interpret)
    with jax.named_scope(f"delta_rule_chunk_cotangents_mosaic_key_dim={kd}"):
        dq, dk, dw, dm = kernel(do, u, du, *h_parts, *dh_parts)
    return dq, dk, dw, dm
