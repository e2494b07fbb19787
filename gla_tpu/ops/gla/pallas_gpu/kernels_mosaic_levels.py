"""Per-key GLA on Mosaic GPU: the intra-chunk pieces, by pair levels (any gate, one speed).

A chunk's intra products factor the decay exp(b_r - b_x) per pair level (common/pair_levels.py):
for level L one [C, K] factor F_L (every exponent <= 0) and one masked matrix product. Six levels
at C = 64, whatever the gates: the work never depends on their strength, and no exponent is
ever positive. This module holds what the forward's `prep` kernel and the backward's chunk kernel
(kernels_mosaic_grads.py) share, and `prep`.

Exponents as range sums. Every exponent the kernels take is a sum of gates over a range of the
chunk's tokens: F_L's is g summed over (m, t] on a level's upper rows and over (t, m] on its
lower rows (m the separator), b_t = g summed over [0, t], b_last - b_t over (t, C). So each is one
product on the tensor cores, E = R g, with R a [C, C] 0/1 range matrix built from the row index
(and the level, a loop index: one loop body serves the six levels, which keeps the code within
the instruction cache) and g rounded once to float16 (11 significand bits, R exact: an exponent
E is off by at most 2^-11 |E|, docs/gla_math.md, "Exponents as range sums"). The gates are stored
times log2(e), so every weight is one exp2 of a range sum (exp would add a multiply per element),
and floored at GATE_FLOOR, within float16's range. The kernels take the gates g themselves: no
cumulative sum precedes them.

`prep` writes, from q, k [C, K] and the gates g of a chunk,

    A     = scale * sum_L mask_L * ((q F_L)_upper (k F_L)_lower^T) + diag(q . k)      [C, C]
    qd    = scale * q * exp(b),   kd = k * exp(b_last - b)                            [C, K]
    last  = b_last                                                                    [K]

A [B, Tp, H, C], qd and kd [B, Tp, H, K] in the input dtype and last [B, N, H, K] float32 feed
the chunk-serial state pass (kernels_mosaic_state.py). One block per (chunk, head, batch), one
warpgroup; key columns in slabs of 64 (the registers a slab's factors need).
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
GATE_DTYPE = jnp.float16  # the gates (times log2(e)) as operands of the range-sum products
# Base-2 log gates below this are raised to it: float16 ends at 65504, and any weight whose range
# holds such a gate is 2^-16384 = 0 either way (so are the chunk decays that use it).
GATE_FLOOR = -16384.0
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row
COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column
F32 = jnp.float32
BF16 = jnp.bfloat16
LOG2E = 1.4426950408889634  # the stored gates hold g * LOG2E: range sums are base-2 exponents
LN2 = 0.6931471805599453
# Lane semantics: shared-memory buffers keep exactly the transforms given here
COMPILER_PARAMS = plgpu.CompilerParams(approx_math=True,
                                       lowering_semantics=plgpu.LoweringSemantics.Lane)


def iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WGMMA)


def row_index(chunk: int):
    """[C] int32 in the ROW layout: each row's token index."""
    return plgpu.broadcasted_iota(jnp.int32, (chunk,), 0, layout=ROW)


def col_index(chunk: int):
    """[C] int32 in the COL layout: each column's token index."""
    return plgpu.broadcasted_iota(jnp.int32, (chunk,), 0, layout=COL)


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
    register array (WGMMA layout), a shared-memory ref or T(ref), `b` a shared-memory ref or
    T(ref). The GPU interpreter runs no wgmma: there it is a jnp.dot."""
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
    """Slab `slab` ([C, SLAB]) of a swizzled [C, K] tile, as registers in `dtype`."""
    return plgpu.load(ref.at[:, pl.ds(slab * SLAB, SLAB)], layout=WGMMA).astype(dtype)


def range_matrix(lo, hi, chunk: int, dtype=GATE_DTYPE):
    """[C, C] 0/1 in `dtype`: row t keeps the columns s with lo_t < s <= hi_t (lo, hi [C] int32,
    ROW layout). R @ g sums g over each row's range."""
    shape = (chunk, chunk)
    s = iota(shape, 1)
    keep = jnp.logical_and(s > rows(lo, shape), s <= rows(hi, shape))
    return jnp.where(keep, full(shape, 1.0), full(shape, 0.0)).astype(dtype)


def is_upper(t, level):
    """t (int32 >= 0) in the upper half of its level-`level` block, as int32 0/1; `level` may be
    a loop index."""
    return (t >> level) & 1


def level_range(level, chunk: int):
    """(lo, hi) of the level's exponent ranges: (m, t] on upper rows, (t, m] on lower rows."""
    t = row_index(chunk)
    m = ((t >> (level + 1)) << (level + 1)) + (jnp.int32(1) << level) - 1
    up = is_upper(t, level) == 1
    return jnp.where(up, m, t), jnp.where(up, t, m)


def prefix_range(chunk: int):
    """(lo, hi) of b_t: [0, t]."""
    t = row_index(chunk)
    return t - t - 1, t


def suffix_range(chunk: int):
    """(lo, hi) of b_last - b_t: (t, C)."""
    t = row_index(chunk)
    return t, t - t + (chunk - 1)


def before_range(chunk: int):
    """(lo, hi) of the tokens s < t."""
    t = row_index(chunk)
    return t - t - 1, t - 1


def at_or_after_range(chunk: int):
    """(lo, hi) of the tokens s >= t."""
    t = row_index(chunk)
    return t - 1, t - t + (chunk - 1)


def set_ranges(ranges_smem, bounds, chunk: int, *, interpret: bool):
    """The range matrix of `bounds` (lo, hi) into ranges_smem (in its dtype), once every warp is
    past the last one's products, committed for the tensor cores."""
    operands_released(interpret=interpret)
    ranges_smem[...] = range_matrix(*bounds, chunk, ranges_smem.dtype)
    plgpu.commit_smem()


def level_pairs(level, chunk: int):
    """[C, C] bool: the pairs (r, x) of level L (r upper, x lower, one block), one compare per
    element: r >> L is 2 B + 1 on the upper half of block B and x >> L is 2 B on its lower half,
    so with u_r = (r >> L) - 1 on upper rows (-1, matching no column, elsewhere) the pairs are
    u_r == x >> L."""
    r, x = row_index(chunk), col_index(chunk)
    shape = (chunk, chunk)
    u = jnp.where(is_upper(r, level) == 1, (r >> level) - 1, r - r - 1)
    return rows(u, shape) == cols(x >> level, shape)


def _rounded(g, with_rest: bool):
    """g [C, SLAB] float32 (times LOG2E), floored at GATE_FLOOR -> (GATE_DTYPE value, what that
    rounding left in GATE_DTYPE, or None)."""
    g = jnp.maximum(g, GATE_FLOOR)
    hi = g.astype(GATE_DTYPE)
    return hi, ((g - hi.astype(F32)).astype(GATE_DTYPE) if with_rest else None)


def store_gates(g_view, gates, slabs: int, rest=None):
    """A chunk's gates, times LOG2E, into gates [slabs, C, SLAB] (GATE_DTYPE) and, where `rest` is
    given, the rounding's remainder into rest (the two sum to g log2(e) within 2^-22), through
    registers. g_view: per-key gates [C, slabs * SLAB] (a float32 view of global memory), or
    per-head gates [C] (a float32 vector in shared memory), the same gate for every key."""
    per_head = len(g_view.shape) == 1
    if per_head:  # rounded once, stored in every slab
        parts = _rounded(rows(plgpu.load(g_view, layout=ROW) * LOG2E, (CHUNK, SLAB)),
                         rest is not None)
    for slab in range(slabs):
        if not per_head:
            parts = _rounded(plgpu.load(g_view.at[:, pl.ds(slab * SLAB, SLAB)], layout=WGMMA,
                                        optimized=False) * LOG2E, rest is not None)
        for buf, part in zip((gates, rest), parts):
            if buf is not None:
                buf.at[slab][...] = part


def load_gates(g_ref, tokens, key_cols, gates, slabs: int, loaded, head_vec, rest=None):
    """A block's gates into `gates` (and `rest`; `store_gates`), then the wait on the block's
    other loads (barrier `loaded`). tokens = (batch, the chunk's rows, head). Per-key gates
    (head_vec None): g_ref [B, Tp, H, K], the slabs `key_cols` (a tuple of one pl.ds, or empty for
    all K) read while those loads fly. Per-head gates: g_ref [B, H, Tp] (`head_major_gates`), the
    chunk's gates copied into head_vec ([C] float32 shared memory) as one more arrival on
    `loaded`."""
    batch, chunk_rows, head = tokens
    if head_vec is None:
        store_gates(g_ref.at[tokens + key_cols], gates, slabs, rest)
        plgpu.barrier_wait(loaded)
        return
    plgpu.copy_gmem_to_smem(g_ref.at[batch, head, chunk_rows], head_vec, loaded)
    plgpu.barrier_wait(loaded)
    store_gates(head_vec, gates, slabs, rest)


def head_major_gates(g):
    """Per-head gates g [B, Tp, H] -> [B, H, Tp] (a chunk's gates contiguous, for one copy into
    shared memory); per-key gates [B, Tp, H, K] unchanged."""
    return jnp.swapaxes(g, 1, 2) if g.ndim == 3 else g


def range_sums(ranges_smem, gates, slab: int, *, interpret: bool, rest=None):
    """[C, SLAB] float32: R @ g log2(e) (a base-2 exponent) for R in ranges_smem ([C, C]
    GATE_DTYPE, committed) and the slab's gates (`store_gates`), plus R @ rest where given."""
    pairs = [(ranges_smem, x.at[slab]) for x in (gates, rest) if x is not None]
    return matmul(pairs, (CHUNK, SLAB), interpret=interpret)


def upper_rows(level, shape):
    """[C, W] bool: the rows of the level's upper halves."""
    return rows(is_upper(row_index(shape[0]), level) == 1, shape)


def level_operand(q, k, factor, upper, dtype):
    """X = q F_L on the level's upper rows and k F_L on its lower rows, in dtype: one operand for
    both sides of the level's products. A level pair joins an upper row r (its q) and a lower
    row x (its k), so X X^T holds every pair's (q_r F_r) . (k_x F_x), and the products are
    masked to the level's pairs (`level_pairs`) afterwards; X's other pairs are finite (F_L <= 1
    on every row: its exponent is a sum of gates), which the mask needs."""
    return (jnp.where(upper, q, k) * factor).astype(dtype)


def prep(q, k, g, *, scale: float, interpret):
    """q, k [B, Tp, H, K] (16-bit, Tp a multiple of 64, K a multiple of 64), g float32 log gates
    [B, Tp, H, K] (per key) or [B, Tp, H] (per head) -> (A [B, Tp, H, C], qd, kd [B, Tp, H, K] in
    q's dtype, last [B, N, H, K] float32): see the module docstring."""
    bsz, tp, h, kd = q.shape
    c, dtype = CHUNK, q.dtype
    n, slabs = tp // c, kd // SLAB
    if tp % c or kd % SLAB:
        raise ValueError(f"padded T={tp} and K={kd} must be multiples of {c} and {SLAB}")
    levels = pair_levels.num_levels(c)
    per_head = g.ndim == 3

    def body(q_ref, k_ref, g_ref, a_ref, qd_ref, kd_ref, last_ref, q_smem, k_smem, gates, rest,
             ranges, kops, stage, loaded, *head_gates):
        chunk, head, batch = (lax.axis_index(x) for x in ("chunk", "head", "batch"))
        tokens = (batch, pl.ds(chunk * c, c), head)
        for src, dst in ((q_ref, q_smem), (k_ref, k_smem)):
            plgpu.copy_gmem_to_smem(src.at[tokens], dst, loaded)
        load_gates(g_ref, tokens, (), gates, slabs, loaded, head_gates[0] if per_head else None,
                   rest)

        def level_step(level, scores):
            # after the last level's wgmmas, which read `ranges` and `kops`
            set_ranges(ranges, level_range(level, c), c, interpret=interpret)
            ops = []
            for slab in range(slabs):
                factor = jnp.exp2(range_sums(ranges, gates, slab, interpret=interpret))
                op = level_operand(load_slab(q_smem, slab), load_slab(k_smem, slab), factor,
                                   upper_rows(level, factor.shape), dtype)
                kops.at[slab][...] = op
                ops.append(op)
            plgpu.commit_smem()
            part = matmul([(ops[s], T(kops.at[s])) for s in range(slabs)], (c, c),
                          interpret=interpret)
            return jnp.where(level_pairs(level, c), part, scores)  # each pair has one level

        scores = lax.fori_loop(0, levels, level_step, full((c, c), 0.0))
        diag = None
        for slab in range(slabs):
            prod = jnp.sum(load_slab(q_smem, slab) * load_slab(k_smem, slab), axis=1)
            diag = prod if diag is None else diag + prod
        r, x = iota((c, c), 0), iota((c, c), 1)
        scores = (scores + jnp.where(r == x, rows(diag, (c, c)), 0.0)) * scale

        # qd and kd over q and k; b_last of each slab through `stage`. b with the rest of the
        # gates: d initial_state and the chunk decays have no term of weight 1 beside them
        set_ranges(ranges, prefix_range(c), c, interpret=interpret)
        for slab in range(slabs):
            b = range_sums(ranges, gates, slab, interpret=interpret, rest=rest)
            span = pl.ds(slab * SLAB, SLAB)
            qd = load_slab(q_smem, slab) * (jnp.exp2(b) * scale)
            if slab:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last slab's row is out
            stage[...] = b * LN2
            q_smem.at[:, span][...] = qd.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(stage.at[c - 1], last_ref.at[batch, chunk, head, span])
        set_ranges(ranges, suffix_range(c), c, interpret=interpret)
        for slab in range(slabs):
            after = range_sums(ranges, gates, slab, interpret=interpret)  # b_last - b
            span = pl.ds(slab * SLAB, SLAB)
            k_smem.at[:, span][...] = (load_slab(k_smem, slab) * jnp.exp2(after)).astype(dtype)
        kops.at[0][...] = scores.astype(dtype)  # A (C = SLAB)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(kops.at[0], a_ref.at[tokens])
        plgpu.copy_smem_to_gmem(q_smem, qd_ref.at[tokens])
        plgpu.copy_smem_to_gmem(k_smem, kd_ref.at[tokens])
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        plgpu.SMEM((c, kd), dtype, transforms=SWIZZLED),  # q, then qd
        plgpu.SMEM((c, kd), dtype, transforms=SWIZZLED),  # k, then kd
        plgpu.SMEM((slabs, c, SLAB), GATE_DTYPE, transforms=SWIZZLED),  # g log2(e), rounded
        plgpu.SMEM((slabs, c, SLAB), GATE_DTYPE, transforms=SWIZZLED),  # and the rest
        plgpu.SMEM((c, c), GATE_DTYPE, transforms=SWIZZLED),  # a range matrix
        plgpu.SMEM((slabs, c, SLAB), dtype, transforms=SWIZZLED),  # a level's operand X; A
        plgpu.SMEM((c, SLAB), F32),  # b of a slab (its last row goes out)
        plgpu.Barrier(num_arrivals=3 if per_head else 2),  # q, k (, per-head gates)
    ]
    if per_head:
        scratch.append(plgpu.SMEM((c,), F32))  # the chunk's per-head gates
    token_type = jax.ShapeDtypeStruct(q.shape, dtype)
    kernel = plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((bsz, tp, h, c), dtype), token_type, token_type,
                  jax.ShapeDtypeStruct((bsz, n, h, kd), F32)],
        scratch_types=scratch,
        grid=(n, h, bsz),
        grid_names=("chunk", "head", "batch"),
        kernel_name="gla_prep_mosaic",
        compiler_params=COMPILER_PARAMS,
        interpret=plgpu.InterpretGPUParams() if interpret is True else (interpret or None),
    )
    with jax.named_scope(f"gla_prep_mosaic_key_dim={kd}"):
        return kernel(q, k, head_major_gates(g))
