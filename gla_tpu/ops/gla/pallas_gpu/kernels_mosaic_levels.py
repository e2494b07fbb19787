"""Per-key GLA on Mosaic GPU: the intra-chunk pieces, by pair levels (any gate, one speed).

A chunk's intra products factor the decay exp(b_r - b_x) per pair level (common/pair_levels.py):
for level L one [C, K] factor F_L (every exponent <= 0) and one masked matrix product. Six levels
at C = 64, whatever the gates: the work never depends on their strength, and no exponent is
ever positive. This module holds what the forward's `prep` kernel and the backward's chunk kernel
(kernels_mosaic_grads.py) share, and `prep`. From the chunk-local gate sums b (computed by XLA,
float32) it writes

    A     = scale * sum_L mask_L * ((q F_L)_upper (k F_L)_lower^T) + diag(q . k)      [C, C]
    qd    = scale * q * exp(b),   kd = k * exp(b_last - b)                            [C, K]

A [B, H, Tp, C], qd and kd [B, Tp, H, K] in the input dtype feed the chunk-serial state pass
(kernels_mosaic_state.py). One block per (chunk, head, batch), one warpgroup. Key columns are
taken in slabs of 64 (the registers a slab's factors need). The gate sums reach shared memory
through registers, not TMA: the row shifts read a padded, unswizzled buffer, and a float32 tile
that TMA wrote with a 128-byte swizzle read back wrong rows on an H100 (2026-11-25).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gla_tpu.ops.common import pair_levels
from gla_tpu.ops.common.mosaic_gpu import SWIZZLED

CHUNK = 64
SLAB = 64  # key columns per slab
PAD = 8  # rows above and below the gate sums in the shift buffer (level shifts reach 4)
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row
COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column
F32 = jnp.float32
BF16 = jnp.bfloat16
# Lane semantics: shared-memory buffers keep exactly the transforms given here (the row-shifted
# views of the unswizzled gate-sum buffer need that; warpgroup semantics would infer its own)
COMPILER_PARAMS = plgpu.CompilerParams(approx_math=True,
                                       lowering_semantics=plgpu.LoweringSemantics.Lane)


def iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WGMMA)


def rows(x, shape):
    """A per-row vector (ROW layout) broadcast along the columns."""
    return lax.broadcast_in_dim(x, shape, [0])


def cols(x, shape):
    """A per-column vector (COL layout) broadcast along the rows."""
    return lax.broadcast_in_dim(x, shape, [1])


def full(shape, value, dtype=F32):
    return plgpu.layout_cast(jnp.full(shape, value, dtype), WGMMA)


class T:
    """A shared-memory operand taken transposed (wgmma reads it so; interpret mode transposes)."""

    def __init__(self, ref):
        self.ref = ref


def matmul(pairs, shape, *, interpret: bool, init=None):
    """init + sum(a @ b for a, b in pairs) [shape] float32 on the tensor cores. `a` is a 16-bit
    register array (WGMMA layout) or a shared-memory ref, `b` a shared-memory ref or T(ref).
    The GPU interpreter runs no wgmma from registers: there it is a jnp.dot."""
    if interpret:
        out = full(shape, 0.0) if init is None else init
        for a, b in pairs:
            a_val, b_val = (x if isinstance(x, jax.Array) else
                            x.ref[...].T if isinstance(x, T) else x[...] for x in (a, b))
            out = out + jnp.dot(a_val, b_val, preferred_element_type=F32)
        return out

    def issue(acc_ref):
        for a, b in pairs:
            a, b = (x.ref.transpose((1, 0)) if isinstance(x, T) else x for x in (a, b))
            plgpu.wgmma(acc_ref, a, b)

    if init is None:
        def scoped(acc_ref):
            issue(acc_ref)
            return acc_ref[...]

        return pl.run_scoped(scoped, plgpu.ACC(shape, F32))
    return pl.run_state(issue)(plgpu.ACC.init(init))


def operands_released(*, interpret: bool):
    """Every warp of the warpgroup is past its wait on the wgmmas issued so far, so a shared-memory
    operand they read may be overwritten: a warp's wgmma wait covers its own rows of the product
    only, and another warp may still be reading the operand (a warpgroup barrier). The GPU
    interpreter runs no wgmma, and its barriers would hold every warpgroup of the block."""
    if not interpret:
        plgpu.commit_smem()


def load_slab(ref, slab: int, dtype=F32):
    """Slab `slab` ([C, SLAB]) of a swizzled [C, K] tile, as float32 registers."""
    return plgpu.load(ref.at[:, pl.ds(slab * SLAB, SLAB)], layout=WGMMA).astype(dtype)


def _shifted(b_pad, slab: int, shift: int, chunk: int):
    """[C, SLAB]: row t holds b[t + shift] (rows past the chunk are never selected)."""
    return plgpu.load(b_pad.at[pl.ds(PAD + shift, chunk), pl.ds(slab * SLAB, SLAB)],
                      layout=WGMMA, optimized=False)


def _separator_rows(b_pad, b, slab: int, level: int, chunk: int):
    """[C, SLAB]: row t holds b at m_L(t), the separator of t's level-L block."""
    shape = (chunk, SLAB)
    t = iota(shape, 0)
    block, half = 1 << (level + 1), 1 << level
    out = None
    if block > 8:  # few blocks: one broadcast row per block, chosen by the block index
        for j in range(chunk // block):
            m = j * block + half - 1
            row = plgpu.load(b_pad.at[PAD + m, pl.ds(slab * SLAB, SLAB)], layout=COL,
                             optimized=False)
            out = cols(row, shape) if out is None else jnp.where(t >= j * block,
                                                                cols(row, shape), out)
        return out
    pos = t & (block - 1)  # small blocks: a shift per position in the block
    for p in range(block):
        shift = half - 1 - p
        val = b if shift == 0 else _shifted(b_pad, slab, shift, chunk)
        out = val if out is None else jnp.where(pos == p, val, out)
    return out


def level_factor(b_pad, b, slab: int, level: int, chunk: int):
    """F_L [C, SLAB] float32: exp(b_t - b_m) on the level's upper rows, exp(b_m - b_t) on the
    others (m the separator; both exponents <= 0)."""
    ref = _separator_rows(b_pad, b, slab, level, chunk)
    upper = pair_levels.is_upper(iota(b.shape, 0), level)
    return jnp.exp(jnp.where(upper, b - ref, ref - b))


def level_operands(q, k, factor, level: int, dtype):
    """(q F_L on the level's upper rows, k F_L on its lower rows), zero elsewhere, in dtype."""
    upper = pair_levels.is_upper(iota(q.shape, 0), level)
    zero = full(q.shape, 0.0)
    return (jnp.where(upper, q * factor, zero).astype(dtype),
            jnp.where(upper, zero, k * factor).astype(dtype))


def same_block_mask(chunk: int, level: int):
    r, x = iota((chunk, chunk), 0), iota((chunk, chunk), 1)
    return pair_levels.same_block(r, x, level)


def load_gate_sums(b_ref, tokens, b_pad, slabs: int, chunk: int):
    """A chunk's gate sums b [C, K] (float32, from global memory; `tokens` indexes b_ref down to
    [C, K]) into the shift buffer's middle rows, slab by slab, through registers: the buffer's
    rows are padded against bank conflicts, which a TMA copy cannot write."""
    for slab in range(slabs):
        cols_ = pl.ds(slab * SLAB, SLAB)
        b = plgpu.load(b_ref.at[tokens + (cols_,)], layout=WGMMA, optimized=False)
        b_pad.at[pl.ds(PAD, chunk), cols_][...] = b


def load_sums(b_pad, slab: int, chunk: int):
    return _shifted(b_pad, slab, 0, chunk)


def last_sums(b_pad, slab: int, chunk: int):
    """b at the chunk's last token, [SLAB] in the COL layout."""
    return plgpu.load(b_pad.at[PAD + chunk - 1, pl.ds(slab * SLAB, SLAB)], layout=COL,
                      optimized=False)


def shift_buffer(chunk: int, key_dim: int):
    """The padded, unswizzled float32 buffer of the gate sums (row shifts read it; 8 more
    columns than keys keep a warp's 8 rows off one bank)."""
    return plgpu.SMEM((PAD + chunk + PAD, key_dim + 8), F32)


def prep(q, k, b, *, scale: float, interpret):
    """q, k [B, Tp, H, K] (16-bit, Tp a multiple of 64, K a multiple of 64), b [B, Tp, H, K]
    float32 chunk-local gate sums -> (A [B, H, Tp, C], qd, kd [B, Tp, H, K] in q's dtype): see
    the module docstring."""
    bsz, tp, h, kd = q.shape
    c, dtype = CHUNK, q.dtype
    n, slabs = tp // c, kd // SLAB
    if tp % c or kd % SLAB:
        raise ValueError(f"padded T={tp} and K={kd} must be multiples of {c} and {SLAB}")
    levels = pair_levels.num_levels(c)

    def body(q_ref, k_ref, b_ref, a_ref, qd_ref, kd_ref, q_smem, k_smem, b_pad, kf_smem, a_smem,
             loaded):
        chunk, head, batch = (lax.axis_index(x) for x in ("chunk", "head", "batch"))
        tokens = (batch, pl.ds(chunk * c, c), head)
        for src, dst in ((q_ref, q_smem), (k_ref, k_smem)):
            plgpu.copy_gmem_to_smem(src.at[tokens], dst, loaded)
        load_gate_sums(b_ref, tokens, b_pad, slabs, c)
        plgpu.commit_smem()  # row shifts read other threads' rows
        plgpu.barrier_wait(loaded)

        scores = full((c, c), 0.0)
        for level in range(levels):
            if level:
                operands_released(interpret=interpret)  # the last level's wgmma read kf_smem
            q_ops = []
            for slab in range(slabs):
                b = load_sums(b_pad, slab, c)
                factor = level_factor(b_pad, b, slab, level, c)
                q_op, k_op = level_operands(load_slab(q_smem, slab), load_slab(k_smem, slab),
                                            factor, level, dtype)
                kf_smem.at[slab][...] = k_op
                q_ops.append(q_op)
            plgpu.commit_smem()
            part = matmul([(q_ops[s], T(kf_smem.at[s])) for s in range(slabs)], (c, c),
                          interpret=interpret)
            scores = scores + jnp.where(same_block_mask(c, level), part, 0.0)
        diag = None
        for slab in range(slabs):
            prod = jnp.sum(load_slab(q_smem, slab) * load_slab(k_smem, slab), axis=1)
            diag = prod if diag is None else diag + prod
        r, x = iota((c, c), 0), iota((c, c), 1)
        scores = scores + jnp.where(r == x, rows(diag, (c, c)), 0.0)
        a_smem[...] = (scores * scale).astype(dtype)

        for slab in range(slabs):
            b = load_sums(b_pad, slab, c)
            shape = b.shape
            last = cols(last_sums(b_pad, slab, c), shape)
            span = pl.ds(slab * SLAB, SLAB)
            qd = load_slab(q_smem, slab) * (jnp.exp(b) * scale)
            kdec = load_slab(k_smem, slab) * jnp.exp(last - b)
            q_smem.at[:, span][...] = qd.astype(dtype)
            k_smem.at[:, span][...] = kdec.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(a_smem, a_ref.at[batch, head, pl.ds(chunk * c, c)])
        plgpu.copy_smem_to_gmem(q_smem, qd_ref.at[tokens])
        plgpu.copy_smem_to_gmem(k_smem, kd_ref.at[tokens])
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        plgpu.SMEM((c, kd), dtype, transforms=SWIZZLED),  # q, then qd
        plgpu.SMEM((c, kd), dtype, transforms=SWIZZLED),  # k, then kd
        shift_buffer(c, kd),  # b
        plgpu.SMEM((slabs, c, SLAB), dtype, transforms=SWIZZLED),  # a level's key operands
        plgpu.SMEM((c, c), dtype, transforms=SWIZZLED),  # A
        plgpu.Barrier(num_arrivals=2),
    ]
    token_type = jax.ShapeDtypeStruct(q.shape, dtype)
    kernel = plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((bsz, h, tp, c), dtype), token_type, token_type],
        scratch_types=scratch,
        grid=(n, h, bsz),
        grid_names=("chunk", "head", "batch"),
        compiler_params=COMPILER_PARAMS,
        interpret=plgpu.InterpretGPUParams() if interpret is True else (interpret or None),
    )
    with jax.named_scope(f"gla_prep_mosaic_key_dim={kd}"):
        return kernel(q, k, b)
