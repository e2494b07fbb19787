"""Per-key GLA on Mosaic GPU: dq, dk and dg of a chunk, by pair levels (any gate, one speed).

One block of one warpgroup per (chunk, key slab of 64 columns, head, batch): the columns of dq, dk
and dg depend on their own columns of q, k, g, h_n and dh_{n+1} only (and on dA, recomputed per
slab). docs/gla_math.md ("Pair levels") has the derivation:

    dA  = scale (do v^T), lower triangle with the diagonal                        [C, C]
    dq  = sum_L F_L (dA_L (k F_L)_lower) + diag(dA) k + scale e^b (do h_n^T)
    dk  = sum_L F_L (dA_L^T (q F_L)_upper) + diag(dA) q + e^(b_last - b) (v dh_{n+1}^T)

with dA_L = dA on the level's pairs; one loop over the levels computes both sides from one factor
F_L (a range sum of the gates, kernels_mosaic_levels.py) and one masked dA_L in shared memory,
read as is for dq and transposed for dk. The gate gradient comes from db_t = q_t dq_t - k_t dk_t
summed within the chunk,

    dg_t = sum_{s >= t} (Dq_s - Dk_s) + sum_{s < t} Y_s + e^(b_last) sum_V h_n dh_{n+1},
    Dq   = sum_L (q F_L) * (dA_L (k F_L)) + q * dq_inter,   Dk = sum_L (k F_L) * (dA_L^T (q F_L)),
    Y    = k * dk_inter,

where each level's pair terms enter Dq and Dk through the *same* rounded operands, so a pair
whose two tokens both lie at or after t cancels to float32 accuracy (a token's pair with itself is
left out: it cancels exactly). The two triangular sums run on the tensor cores, the float32
operands in three bfloat16 parts. The state term sum_V h_n dh_{n+1} comes from the reversed state
pass (kernels_mosaic_state.py), which also computes dv.

Shared memory: q, k, the gates (float16), their range matrix and dA stay for the whole block; a
pool of eight [64, 64] 16-bit tiles holds v, do, h_n, dh_{n+1} (a ring of two stages over the
value tiles of 64) for the first products, then dA_L and the level operands (two pairs of tiles,
by level parity, so a level waits for no other warp before it writes them), and (bfloat16 inputs)
the parts of the dg sums and their range matrix in its second half. 104 KiB with bfloat16
inputs: two blocks per SM (float16: four more bfloat16 tiles). The range matrices come from
global memory, each copied while the products of the one before run
(kernels_mosaic_levels.range_constants).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gla_tpu.ops.common import pair_levels
from gla_tpu.ops.common.mosaic_gpu import SWIZZLED, SWIZZLED_F32, interpret_params
from gla_tpu.ops.gla.pallas_gpu.kernels_mosaic_levels import (
    BF16,
    CHUNK,
    COL,
    COMPILER_PARAMS,
    F32,
    GATE_DTYPE,
    SLAB,
    T,
    cols,
    head_major_gates,
    iota,
    level_operand,
    level_pairs,
    load_f32,
    load_gates,
    matmul,
    operands_released,
    range_constants,
    range_sums,
    rows,
    upper_rows,
)

VALUE_TILES = 8  # V up to 512, in tiles of 64 columns (through a ring of two stages)
POOL = 8  # [64, 64] tiles shared by the three phases
# The range matrices of the gate sums, in the order the kernel reads them: b and b_last - b, one
# per level (GATE_DTYPE, against the gates), then the dg sums' s < t and s >= t (bfloat16,
# against the bfloat16 parts of their operands)
GATE_RANGES = ("prefix", "suffix") + tuple(
    f"level{level}" for level in range(pair_levels.num_levels(CHUNK)))
DG_RANGES = ("before", "at_or_after")


def bf16_parts(x):
    """x float32 -> three bfloat16 parts whose float32 sum is x (24 significand bits)."""
    hi = x.astype(BF16)
    rest = x - hi.astype(F32)
    mid = rest.astype(BF16)
    return hi, mid, (rest - mid.astype(F32)).astype(BF16)


def store_parts(x, tiles):
    """x [C, W] float32 into three bfloat16 tiles (its parts)."""
    for tile, part in zip(tiles, bf16_parts(x)):
        tile[...] = part


def _diagonal(x):
    """The diagonal of a [C, C] float32 tile, one value per row."""
    r, c = iota(x.shape, 0), iota(x.shape, 1)
    return jnp.sum(jnp.where(r == c, x, 0.0), axis=1)


def chunk_grads(q, k, v, do, g, last, h_hi, dh, term, *, scale: float, interpret,
                groups: int = 1):
    """q, k [B, Tp, H, K], v, do [B, Tp, H, V] (16-bit), g float32 log gates [B, Tp, H, K] (per
    key) or [B, Tp, H] (per head), last [B, N, H, K] float32 (b at each chunk's last token), h_hi
    and dh [B, N, H, K, V] 16-bit (the state entering each chunk and the gradient of the state
    after it), term [B, N, H, V / block_v, K] float32 (sum_V h_n dh_{n+1} per value tile of the
    reversed state pass, which writes it; summed here) -> dq, dk [B, Tp, H, K] in q's dtype
    and dg float32 in g's shape (per head: each slab's dg summed over its keys in the kernel, the
    slabs by XLA). With key groups (kernels_mosaic_state.Pass.groups), H counts virtual heads and
    v, do have H / groups heads."""
    bsz, tp, h, kd = q.shape
    vd = v.shape[-1]
    c = CHUNK
    n, vtiles = tp // c, vd // SLAB
    if tp % c or kd % SLAB or vd % SLAB or vtiles > VALUE_TILES:
        raise ValueError(f"padded T={tp}, K={kd}, V={vd}: T and K multiples of {c} and {SLAB}, "
                         f"V a multiple of {SLAB} up to {VALUE_TILES * SLAB}")
    term_tiles = term.shape[3]  # the state pass's value tiles
    if term.shape != (bsz, n, h, term_tiles, kd) or vd % term_tiles:
        raise ValueError(f"term {term.shape}: expected {(bsz, n, h, 'a divisor of V', kd)}")
    return _pair_level_grads(q, k, g, (v, do, last, h_hi, dh, term), scale=scale,
                             interpret=interpret, groups=groups)


def score_grads(q, k, g, da, q_inter, k_inter, *, interpret):
    """The pullback of a chunk's decayed scores and of its decayed q and k, per key, from given
    cotangents: the kernel of `chunk_grads` with dA, do h^T and v dh^T taken as inputs (the delta
    rule's KDA backward, delta_rule/pallas_gpu/operands.py, runs it on its own scores). For

        S_rx   = sum_K q_r k_x e^(b_r - b_x) on and below the diagonal (x <= r),
        q_in   = q e^b,   k_out = k e^(b_last - b)          (b_last not a result here)

    and da [B, Tp, HV, C] (each chunk's rows of dS, rounded to q's dtype; above the diagonal
    not read), q_inter = d q_in, k_inter = d k_out [B, Tp, HV, K] float32, q and k
    [B, Tp, H_q|H_k, K] (16-bit, one dtype; value head j reads head j // (HV / H_q) of q and
    j // (HV / H_k) of k) and per-key gates g [B, Tp, HV, K] float32 -> dq, dk and dg
    [B, Tp, HV, K] float32, per value head."""
    bsz, tp, hv, kd = g.shape

    def head_share(x):  # [B, Tp, heads, K] with heads dividing HV
        return x.ndim == 4 and (x.shape[0], x.shape[1], x.shape[3]) == (bsz, tp, kd) and (
            hv % x.shape[2] == 0)

    if (tp % CHUNK or kd % SLAB or not head_share(q) or not head_share(k)
            or da.shape != (bsz, tp, hv, CHUNK) or q_inter.shape != g.shape
            or k_inter.shape != g.shape):
        raise ValueError(f"q {q.shape}, k {k.shape}, g {g.shape}, da {da.shape}, q_inter "
                         f"{q_inter.shape}, k_inter {k_inter.shape}: T and K multiples of "
                         f"{CHUNK} and {SLAB}, g, q_inter, k_inter [B, Tp, HV, K], q, k "
                         f"[B, Tp, a divisor of HV, K], da [B, Tp, HV, {CHUNK}]")
    return _pair_level_grads(q, k, g, (da.astype(q.dtype), q_inter.astype(F32),
                                       k_inter.astype(F32)),
                             scale=1.0, interpret=interpret, groups=1)


def _pair_level_grads(q, k, g, front, *, scale, interpret, groups):
    """The kernel of `chunk_grads` (front: v, do, last, h_hi, dh, term; dA and the inter-chunk
    parts from products over the value tiles, the state term of dg; v and do at head // groups)
    and of `score_grads` (front: da, q_inter, k_inter, given; dq and dk float32 per value head;
    q and k read at their heads' share of the value heads)."""
    bsz, tp, h, kd = q.shape
    given = len(front) == 3
    heads = g.shape[2]  # the blocks' heads (value heads where given)
    c, dtype = CHUNK, q.dtype
    n, slabs = tp // c, kd // SLAB
    if given:
        vtiles = term_tiles = 0
    else:
        vtiles, term_tiles = front[0].shape[-1] // SLAB, front[5].shape[3]
    levels = pair_levels.num_levels(c)
    shape = (c, SLAB)
    per_head = g.ndim == 3
    if given and per_head:
        raise ValueError("score_grads takes per-key gates")

    def body(*refs):
        if given:
            (q_ref, k_ref, da_ref, qi_ref, ki_ref, g_ref, gr_ref, dgr_ref, dq_ref, dk_ref,
             dg_ref, q_s, k_s, gates, ranges, da_s, pool, qi_s, ki_s, loaded, ranges_in,
             *extra) = refs
        else:
            (q_ref, k_ref, v_ref, do_ref, g_ref, last_ref, h_ref, dh_ref, term_ref, gr_ref,
             dgr_ref, dq_ref, dk_ref, dg_ref, q_s, k_s, gates, ranges, da_s, pool, b_last,
             terms, loaded, tile_loaded, ranges_in, *extra) = refs
        # per-head gates: the chunk's gates in, then its dg summed over the slab's keys out
        head_vec = extra[0] if per_head else None
        # bfloat16 tiles: the parts of the dg sums and their range matrix; within the pool (its
        # value-tile half, free after the first products) for bfloat16 inputs
        bpool = extra[-1] if dtype != BF16 else pool.at[4:8]
        dg_ranges = bpool.at[3]  # the dg sums' range matrices (bfloat16)
        flat, head, batch = (lax.axis_index(x) for x in ("chunk_slab", "head", "batch"))
        chunk, slab = lax.div(flat, jnp.int32(slabs)), lax.rem(flat, jnp.int32(slabs))
        kcols = pl.ds(slab * SLAB, SLAB)
        tokens = (batch, pl.ds(chunk * c, c), head)
        q_tokens, k_tokens = tokens, tokens
        if given:  # q and k at their heads' share of the value heads
            q_tokens, k_tokens = ((batch, pl.ds(chunk * c, c), head // (heads // x.shape[2]))
                                  for x in (q, k))

        def fetch_ranges(i):
            """Range matrix i of GATE_RANGES + DG_RANGES into its buffer (arriving on
            `ranges_in`, one in flight at a time), once every warp is past the products that
            read the buffer's last one."""
            def gate_ranges():
                plgpu.copy_gmem_to_smem(gr_ref.at[i], ranges, ranges_in)

            def dg_sum_ranges():
                plgpu.copy_gmem_to_smem(dgr_ref.at[i - len(GATE_RANGES)], dg_ranges, ranges_in)

            if isinstance(i, int):
                (gate_ranges if i < len(GATE_RANGES) else dg_sum_ranges)()
            else:  # a level's: the next level's, or after the last the dg sums' first
                pl.when(i < len(GATE_RANGES))(gate_ranges)
                pl.when(i >= len(GATE_RANGES))(dg_sum_ranges)

        fetch_ranges(0)
        loads = [(q_ref.at[q_tokens + (kcols,)], q_s), (k_ref.at[k_tokens + (kcols,)], k_s)]
        if given:
            loads += [(da_ref.at[tokens], da_s), (qi_ref.at[tokens + (kcols,)], qi_s),
                      (ki_ref.at[tokens + (kcols,)], ki_s)]
        else:
            loads += [(last_ref.at[batch, chunk, head, kcols], b_last),
                      (term_ref.at[batch, chunk, head, :, kcols], terms)]
        for src, dst in loads:
            plgpu.copy_gmem_to_smem(src, dst, loaded)

        if given:
            load_gates(g_ref, tokens, kcols, gates, loaded, head_vec)
            da = plgpu.load(da_s, layout=plgpu.Layout.WGMMA).astype(F32)
            q_inter = plgpu.load(qi_s, layout=plgpu.Layout.WGMMA)
            k_inter = plgpu.load(ki_s, layout=plgpu.Layout.WGMMA)
            diag = rows(_diagonal(da), shape)
        else:
            da, q_inter, k_inter = _value_products(
                v_ref, do_ref, h_ref, dh_ref, pool, tile_loaded, g_ref, gates, loaded, head_vec,
                (batch, chunk, head), kcols, vtiles, groups, interpret=interpret)
            r, x = iota((c, c), 0), iota((c, c), 1)
            da = jnp.where(r >= x, da * scale, 0.0)
            diag = rows(_diagonal(da), shape)
            da_s[...] = da.astype(dtype)

        # the inter-chunk parts, weighted by exp(b) and exp(b_last - b); each range matrix is
        # fetched once every warp is past the sums of the one before
        plgpu.barrier_wait(ranges_in)  # prefix
        prefix = range_sums(ranges, gates, interpret=interpret)
        operands_released(interpret=interpret)
        fetch_ranges(1)
        q_f, k_f = load_f32(q_s), load_f32(k_s)
        q_inter = q_inter * (jnp.exp2(prefix) * scale)
        grad_q = q_inter + diag * k_f
        cancel = q_f * q_inter  # Dq's inter part
        plgpu.barrier_wait(ranges_in)  # suffix
        suffix = range_sums(ranges, gates, interpret=interpret)
        operands_released(interpret=interpret)
        fetch_ranges(2)
        k_inter = k_inter * jnp.exp2(suffix)
        grad_k = k_inter + diag * q_f
        y_parts = [bpool.at[i] for i in range(3)]  # Y = k dk_inter, summed over s < t at the end
        store_parts(k_f * k_inter, y_parts)

        # the levels: one factor, one masked dA_L, a product for each side; dA_L and X in two
        # pairs of pool tiles (free after the first products), by level parity: the pair the
        # level before last read is free, as every warp has passed the last level's commit
        def level_step(level, carry):
            grad_q, grad_k, cancel = carry
            plgpu.barrier_wait(ranges_in)  # the level's range matrix
            factor = jnp.exp2(range_sums(ranges, gates, interpret=interpret))
            # X: q F_L on upper rows, k F_L on lower rows (level_operand)
            op = level_operand(q_s, k_s, factor, upper_rows(level, shape))
            parity = 2 * lax.rem(level, 2)
            da_level, ops = pool.at[parity], pool.at[parity + 1]
            ops[...] = op
            da16 = plgpu.load(da_s, layout=plgpu.Layout.WGMMA)
            da_level[...] = jnp.where(level_pairs(level, c), da16, jnp.zeros_like(da16))
            plgpu.commit_smem()  # also: every warp is past this level's range sums
            fetch_ranges(level + 3)
            # dA_L has the level's pairs only (upper rows r, lower columns x): dA_L X reads X's
            # lower rows (k F_L) and is 0 off the upper rows, dA_L^T X the reverse; so X
            # weights each side's Dq / Dk terms with that side's own rounded operand
            to_q = matmul([(da_level, ops)], shape, interpret=interpret)
            to_k = matmul([(T(da_level), ops)], shape, interpret=interpret)
            grad_q = grad_q + factor * to_q
            grad_k = grad_k + factor * to_k
            cancel = cancel + op.astype(F32) * (to_q - to_k)
            return grad_q, grad_k, cancel

        grad_q, grad_k, cancel = lax.fori_loop(0, levels, level_step, (grad_q, grad_k, cancel))

        # dg = sum_{s < t} Y_s + e^(b_last) term + sum_{s >= t} cancel_s
        state = None
        if not given:
            term = sum(plgpu.load(terms.at[j], layout=COL) for j in range(term_tiles))
            state = cols(jnp.exp(plgpu.load(b_last, layout=COL)) * term, shape)
        plgpu.barrier_wait(ranges_in)  # before (fetched by the last level)
        dg = matmul([(dg_ranges, part) for part in y_parts], shape, interpret=interpret,
                    init=state)
        operands_released(interpret=interpret)  # the range matrix and the parts are read
        fetch_ranges(len(GATE_RANGES) + 1)
        store_parts(cancel, y_parts)
        plgpu.commit_smem()
        plgpu.barrier_wait(ranges_in)  # at or after
        dg = matmul([(dg_ranges, part) for part in y_parts], shape, interpret=interpret,
                    init=dg)
        if per_head:
            head_vec[...] = jnp.sum(dg, axis=1)
        else:
            dg_ref.at[tokens + (kcols,)][...] = dg
        # dq and dk: float32 through the inter parts' tiles where given, else q's and k's
        dq_s, dk_s = (qi_s, ki_s) if given else (q_s, k_s)
        dq_s[...] = grad_q.astype(dq_s.dtype)
        dk_s[...] = grad_k.astype(dk_s.dtype)
        plgpu.commit_smem()
        if per_head:
            plgpu.copy_smem_to_gmem(head_vec, dg_ref.at[batch, slab, head, pl.ds(chunk * c, c)])
        plgpu.copy_smem_to_gmem(dq_s, dq_ref.at[tokens + (kcols,)])
        plgpu.copy_smem_to_gmem(dk_s, dk_ref.at[tokens + (kcols,)])
        plgpu.wait_smem_to_gmem(0)

    tile = plgpu.SMEM((c, SLAB), dtype, transforms=SWIZZLED)
    scratch = [
        tile,  # q's slab, then dq
        tile,  # k's slab, then dk
        plgpu.SMEM((c, SLAB), GATE_DTYPE, transforms=SWIZZLED),  # g log2(e)
        plgpu.SMEM((c, c), GATE_DTYPE, transforms=SWIZZLED),  # the gates' range matrices
        plgpu.SMEM((c, c), dtype, transforms=SWIZZLED),  # dA
        plgpu.SMEM((POOL, c, SLAB), dtype, transforms=SWIZZLED),
    ]
    if given:
        f32_tile = plgpu.SMEM((c, SLAB), F32, transforms=SWIZZLED_F32)
        scratch += [
            f32_tile,  # d q_in's slab, then dq
            f32_tile,  # d k_out's slab, then dk
            plgpu.Barrier(num_arrivals=5),  # q, k, dA, d q_in, d k_out
            plgpu.Barrier(),  # a range matrix is in
        ]
    else:
        scratch += [
            plgpu.SMEM((SLAB,), F32),  # b_last
            plgpu.SMEM((term_tiles, SLAB), F32),  # the state term of each value tile
            # q, k, b_last, the state term (, per-head gates)
            plgpu.Barrier(num_arrivals=5 if per_head else 4),
            plgpu.Barrier(num_arrivals=4, num_barriers=2),  # a value tile's four, per stage
            plgpu.Barrier(),  # a range matrix is in
        ]
    if per_head:
        scratch.append(plgpu.SMEM((c,), F32))
    if dtype != BF16:
        scratch.append(plgpu.SMEM((4, c, SLAB), BF16, transforms=SWIZZLED))
    out_heads = (bsz, tp, heads, kd)
    token_type = jax.ShapeDtypeStruct(out_heads, F32 if given else dtype)
    # per-head dg: one [Tp] row per (batch, key slab, head), summed over the slabs below
    dg_type = jax.ShapeDtypeStruct((bsz, slabs, h, tp) if per_head else out_heads, F32)
    name = "gla_score_grads_mosaic" if given else "gla_grads_mosaic"
    kernel = plgpu.kernel(
        body,
        out_type=[token_type, token_type, dg_type],
        scratch_types=scratch,
        grid=(n * slabs, heads, bsz),
        grid_names=("chunk_slab", "head", "batch"),
        kernel_name=name,
        compiler_params=COMPILER_PARAMS,
        interpret=interpret_params(interpret),
    )
    ranges = (range_constants(GATE_RANGES), range_constants(DG_RANGES, BF16))
    with jax.named_scope(f"{name}_key_dim={kd}"):
        if given:
            da, q_inter, k_inter = front
            dq, dk, dg = kernel(q, k, da, q_inter, k_inter, g, *ranges)
        else:
            v, do, last, h_hi, dh, term = front
            dq, dk, dg = kernel(q, k, v, do, head_major_gates(g), last, h_hi, dh, term, *ranges)
    if per_head:
        dg = jnp.swapaxes(jnp.sum(dg, axis=1), 1, 2)  # [B, Tp, H]
    return dq, dk, dg


def _value_products(v_ref, do_ref, h_ref, dh_ref, pool, tile_loaded, g_ref, gates, loaded,
                    head_vec, block, kcols, vtiles: int, groups: int, *, interpret):
    """`chunk_grads`' first products, summed over the value tiles: (do v^T [C, C], do h_n^T and
    v dh_{n+1}^T [C, SLAB]), float32; the value tiles [64, 64] of v, do, h_n and dh_{n+1} through
    a ring of two stages in the pool, the slab's gates loaded while the first tiles fly."""
    c = CHUNK
    batch, chunk, head = block
    tokens = (batch, pl.ds(chunk * c, c), head)
    shape = (c, SLAB)

    def load_tile(j):  # value tile j into stage j % 2 of the pool's ring
        stage, vcols = j % 2, pl.ds(j * SLAB, SLAB)
        vtokens = (batch, pl.ds(chunk * c, c), head // groups, vcols)
        for i, src in enumerate((v_ref.at[vtokens], do_ref.at[vtokens],
                                 h_ref.at[batch, chunk, head, kcols, vcols],
                                 dh_ref.at[batch, chunk, head, kcols, vcols])):
            plgpu.copy_gmem_to_smem(src, pool.at[4 * stage + i], tile_loaded.at[stage])

    for j in range(min(vtiles, 2)):
        load_tile(j)
    load_gates(g_ref, tokens, kcols, gates, loaded, head_vec)
    da = q_inter = k_inter = None
    for j in range(vtiles):
        v_j, do_j, h_j, dh_j = (pool.at[4 * (j % 2) + i] for i in range(4))
        plgpu.barrier_wait(tile_loaded.at[j % 2])
        da = matmul([(do_j, T(v_j))], (c, c), interpret=interpret, init=da)
        q_inter = matmul([(do_j, T(h_j))], shape, interpret=interpret, init=q_inter)
        k_inter = matmul([(v_j, T(dh_j))], shape, interpret=interpret, init=k_inter)
        if j + 2 < vtiles:
            operands_released(interpret=interpret)  # stage j % 2 is read
            load_tile(j + 2)
    return da, q_inter, k_inter
