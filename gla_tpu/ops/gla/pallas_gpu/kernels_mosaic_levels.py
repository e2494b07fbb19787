"""Per-key GLA on Mosaic GPU: the intra-chunk pieces, by pair levels (any gate, one speed).

A chunk's intra products factor the decay exp(b_r - b_x) per pair level (common/pair_levels.py):
for level L one [C, K] factor F_L (every exponent <= 0) and one masked matrix product. Six levels
at C = 64, whatever the gates: the work never depends on their strength, and no exponent is
ever positive. This module holds what the forward's `prep` kernel and the backward's chunk kernel
(kernels_mosaic_grads.py) share, and `prep`.

Exponents as range sums. Every exponent the kernels take is a sum of gates over a range of the
chunk's tokens: F_L's is g summed over (m, t] on a level's upper rows and over (t, m] on its
lower rows (m the separator), b_t = g summed over [0, t], b_last - b_t over (t, C). So each is one
product on the tensor cores, E = R g, with R a [C, C] 0/1 range matrix and g rounded once to
float16 (11 significand bits, R exact: an exponent E is off by at most 2^-11 |E|,
docs/gla_math.md, "Exponents as range sums"). The range matrices do not depend on the data
(pair_levels.range_matrices): the kernels copy each from global memory (L2, after the first
block) into one shared-memory tile while the products of the one before run, so no instruction
builds them, and the level is a loop index (one loop body serves the six levels, which keeps the
code within the instruction cache). The gates are stored
times log2(e), so every weight is one exp2 of a range sum (exp would add a multiply per element),
and floored at GATE_FLOOR, within float16's range. The kernels take the gates g themselves: no
cumulative sum precedes them.

`prep` writes, from q, k [C, K] and the gates g of a chunk,

    A     = scale * sum_L mask_L * ((q F_L)_upper (k F_L)_lower^T) + diag(q . k)      [C, C]
    qd    = scale * q * exp(b),   kd = k * exp(b_last - b)                            [C, K]
    last  = b_last                                                                    [K]

A [B, Tp, H, C], qd and kd [B, Tp, H, K] in the input dtype and last [B, N, H, K] float32 feed
the chunk-serial state pass (kernels_mosaic_state.py). One block per (chunk, head, batch), one
warpgroup; key columns in slabs of 64 (the registers a slab's factors need). (One warpgroup per
slab, two or four to a block, was slower: docs/results/history.md, "range matrices from
memory".)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gla_tpu.ops.common import pair_levels
from gla_tpu.ops.common.mosaic_gpu import SWIZZLED, interpret_params

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


def load_f32(ref):
    """A [C, SLAB] 16-bit shared-memory tile as float32 registers (WGMMA layout)."""
    return plgpu.load(ref, layout=WGMMA).astype(F32)


def level_pairs(level, chunk: int):
    """[C, C] bool: the pairs (r, x) of level L (r upper, x lower, one block), one compare per
    element: r >> L is 2 B + 1 on the upper half of block B and x >> L is 2 B on its lower half,
    so with u_r = (r >> L) - 1 on upper rows (-1, matching no column, elsewhere) the pairs are
    u_r == x >> L."""
    r, x = row_index(chunk), col_index(chunk)
    shape = (chunk, chunk)
    u = jnp.where(pair_levels.is_upper(r, level), (r >> level) - 1, r - r - 1)
    return rows(u, shape) == cols(x >> level, shape)


def _rounded(g, with_rest: bool):
    """g [C, SLAB] float32 (times LOG2E), floored at GATE_FLOOR -> (GATE_DTYPE value, what that
    rounding left in GATE_DTYPE, or None)."""
    g = jnp.maximum(g, GATE_FLOOR)
    hi = g.astype(GATE_DTYPE)
    return hi, ((g - hi.astype(F32)).astype(GATE_DTYPE) if with_rest else None)


def store_gates(g_view, gates, rest=None):
    """A slab's gates, times LOG2E, into gates [C, SLAB] (GATE_DTYPE) and, where `rest` is given,
    the rounding's remainder into rest (the two sum to g log2(e) within 2^-22), through
    registers. g_view: per-key gates [C, SLAB] (a float32 view of global memory), or per-head
    gates [C] (a float32 vector in shared memory), the same gate for every key."""
    if len(g_view.shape) == 1:  # rounded once per row, then broadcast
        g = rows(plgpu.load(g_view, layout=ROW) * LOG2E, (CHUNK, SLAB))
    else:
        g = plgpu.load(g_view, layout=WGMMA, optimized=False) * LOG2E
    for buf, part in zip((gates, rest), _rounded(g, rest is not None)):
        if buf is not None:
            buf[...] = part


def load_gates(g_ref, tokens, key_cols, gates, loaded, head_vec, rest=None, wait=True):
    """A slab's gates into `gates` (and `rest`; `store_gates`), and the wait on the block's other
    loads (barrier `loaded`; only where `wait`: a block's first slab). tokens = (batch, the
    chunk's rows, head). Per-key gates (head_vec None): g_ref [B, Tp, H, K], the slab's columns
    `key_cols` (a pl.ds) read while those loads fly. Per-head gates: g_ref [B, H, Tp]
    (`head_major_gates`), the chunk's gates copied into head_vec ([C] float32 shared memory) by
    the first slab, as one more arrival on `loaded`."""
    batch, chunk_rows, head = tokens
    if head_vec is None:
        store_gates(g_ref.at[tokens + (key_cols,)], gates, rest)
        if wait:
            plgpu.barrier_wait(loaded)
        return
    if wait:
        plgpu.copy_gmem_to_smem(g_ref.at[batch, head, chunk_rows], head_vec, loaded)
        plgpu.barrier_wait(loaded)
    store_gates(head_vec, gates, rest)


def head_major_gates(g):
    """Per-head gates g [B, Tp, H] -> [B, H, Tp] (a chunk's gates contiguous, for one copy into
    shared memory); per-key gates [B, Tp, H, K] unchanged."""
    return jnp.swapaxes(g, 1, 2) if g.ndim == 3 else g


def range_sums(ranges_smem, gates, *, interpret: bool, rest=None):
    """[C, SLAB] float32: R @ g log2(e) (a base-2 exponent) for R in ranges_smem ([C, C]
    GATE_DTYPE, committed) and a slab's gates [C, SLAB] (`store_gates`), plus R @ rest where
    given."""
    pairs = [(ranges_smem, x) for x in (gates, rest) if x is not None]
    return matmul(pairs, (CHUNK, SLAB), interpret=interpret)


def upper_rows(level, shape):
    """[C, W] bool: the rows of the level's upper halves."""
    return rows(pair_levels.is_upper(row_index(shape[0]), level), shape)


def level_operand(q_tile, k_tile, factor, upper):
    """X = q F_L on the level's upper rows and k F_L on its lower rows, in q's dtype: one operand
    for both sides of the level's products. A level pair joins an upper row r (its q) and a lower
    row x (its k), so X X^T holds every pair's (q_r F_r) . (k_x F_x), and the products are
    masked to the level's pairs (`level_pairs`) afterwards; X's other pairs are finite (F_L <= 1
    on every row: its exponent is a sum of gates), which the mask needs. q_tile, k_tile: [C, SLAB]
    16-bit shared-memory tiles; the rows are chosen on the 16-bit values (two to a register),
    then converted once."""
    chosen = jnp.where(upper, plgpu.load(q_tile, layout=WGMMA), plgpu.load(k_tile, layout=WGMMA))
    return (chosen.astype(F32) * factor).astype(q_tile.dtype)


def level_scores(q_smem, k_smem, gates, ranges, ranges_in, buffers, fetch_ranges, *,
                 slabs: int, interpret: bool, key_scores: bool = False):
    """The pair levels' scores of a chunk: ([C, C] float32 sum_L mask_L (q F_L)(k F_L)^T, the
    pairs x < r; with `key_scores`, also the same of k against k), by a loop over the levels
    (one body for all, the level a loop index). Per level: the factors F_L by one range-sum
    product per slab (`ranges` [C, C] holds level L's range matrix, arriving on `ranges_in`;
    `fetch_ranges(i)` brings range matrix i once every warp is past the products that read the
    one before), X = k F_L stored to shared memory (`buffers` [2, slabs, C, SLAB], one per
    level parity) as the products' right operand, and the left operands (q F_L, or k F_L) from
    registers. q_smem, k_smem: [C, slabs * SLAB] 16-bit tiles; gates: `store_gates`'s."""
    c = CHUNK

    def level_step(level, scores):
        plgpu.barrier_wait(ranges_in)  # the level's range matrix
        factors = [jnp.exp2(range_sums(ranges, gates.at[s], interpret=interpret))
                   for s in range(slabs)]
        upper = upper_rows(level, (c, SLAB))
        q_tiles = [q_smem.at[:, pl.ds(s * SLAB, SLAB)] for s in range(slabs)]
        k_tiles = [k_smem.at[:, pl.ds(s * SLAB, SLAB)] for s in range(slabs)]
        x = [level_operand(q_tiles[s], k_tiles[s], factors[s], upper) for s in range(slabs)]
        # the right operand's lower rows are k F_L either way (only they meet the mask)
        xk = ([level_operand(k_tiles[s], k_tiles[s], factors[s], upper) for s in range(slabs)]
              if key_scores else x)
        # two buffers of X: the one the level before last read is free, as every warp has
        # passed the last level's commit below since
        x_smem = buffers.at[lax.rem(level, 2)]
        for s in range(slabs):
            x_smem.at[s][...] = xk[s]
        plgpu.commit_smem()  # also: every warp is past this level's range sums
        fetch_ranges(level + 1)
        pairs = level_pairs(level, c)  # each pair has one level
        out = []
        for left, acc in zip((x, xk), scores):
            part = matmul([(left[s], T(x_smem.at[s])) for s in range(slabs)], (c, c),
                          interpret=interpret)
            out.append(jnp.where(pairs, part, acc))
        return tuple(out)

    init = tuple(full((c, c), 0.0) for _ in range(2 if key_scores else 1))
    return lax.fori_loop(0, pair_levels.num_levels(c), level_step, init)


def diagonal(q_smem, k_smem, slabs: int):
    """[C] float32 (ROW layout): q_t . k_t of each token, q_smem, k_smem [C, slabs * SLAB]."""
    diag = None
    for s in range(slabs):
        span = pl.ds(s * SLAB, SLAB)
        prod = jnp.sum(load_f32(q_smem.at[:, span]) * load_f32(k_smem.at[:, span]), axis=1)
        diag = prod if diag is None else diag + prod
    return diag


def chunk_decays(ranges, gates, rest, *, interpret: bool):
    """[SLAB] float32 (ROW layout) b_last of a slab's keys (natural log), from the "prefix"
    range matrix in `ranges`: b transposed ([SLAB, C], a key per row), its last column, one
    row sum."""
    b_keys = matmul([(T(gates), T(ranges)), (T(rest), T(ranges))], (SLAB, CHUNK),
                    interpret=interpret)
    last_col = iota((SLAB, CHUNK), 1) == CHUNK - 1
    return jnp.sum(jnp.where(last_col, b_keys, 0.0), axis=1) * LN2


def chunk_kernel(body, out_type, scratch, grid, name: str, interpret):
    """A Mosaic GPU kernel of one block (one warpgroup) per (chunk, head, batch) of `grid`."""
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=grid,
                        grid_names=("chunk", "head", "batch"), kernel_name=name,
                        compiler_params=COMPILER_PARAMS, interpret=interpret_params(interpret))


# The range matrices prep reads, in the order it reads them: one per level, then b and b_last - b
PREP_RANGES = tuple(f"level{level}" for level in range(pair_levels.num_levels(CHUNK))) + (
    "prefix", "suffix")


def range_constants(names, dtype=GATE_DTYPE):
    """[len(names), C, C] 0/1 in `dtype` (pair_levels.range_matrices): the kernels copy them from
    global memory (where every block finds them in L2) instead of building them."""
    return jnp.asarray(pair_levels.range_matrices(names, CHUNK), dtype)


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

    def body(q_ref, k_ref, g_ref, r_ref, a_ref, qd_ref, kd_ref, last_ref, q_smem, k_smem, gates,
             rest, ranges, ops, last_s, loaded, ranges_in, *head_gates):
        chunk, head, batch = (lax.axis_index(x) for x in ("chunk", "head", "batch"))
        tokens = (batch, pl.ds(chunk * c, c), head)

        def fetch_ranges(i):
            """Range matrix i of PREP_RANGES into `ranges` (arriving on `ranges_in`), once every
            warp is past the products that read the last one."""
            plgpu.copy_gmem_to_smem(r_ref.at[i], ranges, ranges_in)

        fetch_ranges(0)
        for src, dst in ((q_ref, q_smem), (k_ref, k_smem)):
            plgpu.copy_gmem_to_smem(src.at[tokens], dst, loaded)
        head_vec = head_gates[0] if per_head else None
        for slab in range(slabs):
            span = pl.ds(slab * SLAB, SLAB)
            # the loads' wait comes with the first slab's gates
            load_gates(g_ref, tokens, span, gates.at[slab], loaded, head_vec, rest.at[slab],
                       wait=slab == 0)

        (scores,) = level_scores(q_smem, k_smem, gates, ranges, ranges_in, ops, fetch_ranges,
                                 slabs=slabs, interpret=interpret)
        r, x = iota((c, c), 0), iota((c, c), 1)
        diag = rows(diagonal(q_smem, k_smem, slabs), (c, c))
        scores = (scores + jnp.where(r == x, diag, 0.0)) * scale

        # qd over q. b with the rest of the gates: d initial_state and the chunk decays have no
        # term of weight 1 beside them. b_last from b transposed ([SLAB, C], a key per row): its
        # last column, one row sum
        plgpu.barrier_wait(ranges_in)  # prefix
        for s in range(slabs):
            span = pl.ds(s * SLAB, SLAB)
            b = range_sums(ranges, gates.at[s], interpret=interpret, rest=rest.at[s])
            last_s.at[s][...] = chunk_decays(ranges, gates.at[s], rest.at[s],
                                             interpret=interpret)
            q_smem.at[:, span][...] = (load_f32(q_smem.at[:, span])
                                       * (jnp.exp2(b) * scale)).astype(dtype)
        plgpu.commit_smem()
        fetch_ranges(levels + 1)
        plgpu.copy_smem_to_gmem(q_smem, qd_ref.at[tokens])
        for s in range(slabs):
            plgpu.copy_smem_to_gmem(last_s.at[s],
                                    last_ref.at[batch, chunk, head, pl.ds(s * SLAB, SLAB)])
        plgpu.barrier_wait(ranges_in)  # suffix
        for s in range(slabs):
            span = pl.ds(s * SLAB, SLAB)
            after = range_sums(ranges, gates.at[s], interpret=interpret)  # b_last - b
            k_smem.at[:, span][...] = (load_f32(k_smem.at[:, span])
                                       * jnp.exp2(after)).astype(dtype)
        a_smem = ops.at[0, 0]  # A (C = SLAB); the last level read the other buffer
        a_smem[...] = scores.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(a_smem, a_ref.at[tokens])
        plgpu.copy_smem_to_gmem(k_smem, kd_ref.at[tokens])
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        plgpu.SMEM((c, kd), dtype, transforms=SWIZZLED),  # q, then qd
        plgpu.SMEM((c, kd), dtype, transforms=SWIZZLED),  # k, then kd
        plgpu.SMEM((slabs, c, SLAB), GATE_DTYPE, transforms=SWIZZLED),  # g log2(e), rounded
        plgpu.SMEM((slabs, c, SLAB), GATE_DTYPE, transforms=SWIZZLED),  # and the rest
        plgpu.SMEM((c, c), GATE_DTYPE, transforms=SWIZZLED),  # a range matrix
        plgpu.SMEM((2, slabs, c, SLAB), dtype, transforms=SWIZZLED),  # two levels' X; A
        plgpu.SMEM((slabs, SLAB), F32),  # b_last
        plgpu.Barrier(num_arrivals=3 if per_head else 2),  # q, k (, per-head gates)
        plgpu.Barrier(),  # a range matrix is in
    ]
    if per_head:
        scratch.append(plgpu.SMEM((c,), F32))  # the chunk's per-head gates
    token_type = jax.ShapeDtypeStruct(q.shape, dtype)
    kernel = chunk_kernel(body, [jax.ShapeDtypeStruct((bsz, tp, h, c), dtype), token_type,
                                 token_type, jax.ShapeDtypeStruct((bsz, n, h, kd), F32)],
                          scratch, (n, h, bsz), "gla_prep_mosaic", interpret)
    with jax.named_scope(f"gla_prep_mosaic_key_dim={kd}"):
        return kernel(q, k, head_major_gates(g), range_constants(PREP_RANGES))
