"""The delta rule's per-chunk WY operands in one Mosaic GPU kernel (no state: every chunk in
parallel), for any gate kind.

What the state pass (GLA's, with Pass.delta) reads, per chunk of C = 64 tokens of one value head:

    M      = scale * (pairs x <= r of q_r . k_x e^(b_r - b_x))                         [C, C]
    A      = beta_r * (pairs x < r of k_r . k_x e^(b_r - b_x))                         [C, C]
    T      = (I + A)^-1
    w_neg  = -T (beta k e^b),   u0 = T (beta v)                                  [C, K], [C, V]
    q_in   = scale * q e^b,     k_out = k e^(b_last - b),   last = b_last       [C, K], [C, K], [K]

(docs/delta_rule_math.md; the "xla" backend's `chunk_operands` computes the same). Every
exponent is a sum of gates over a range of the chunk (<= 0), never a difference of running sums.

Scores. Per-key gates take GLA's pair levels (gla/pallas_gpu/kernels_mosaic_levels.py,
`level_scores`): per level one factor per token, and the key-key scores ride on the same factors
as a second product per level, so the work does not depend on the gates. Per-head gates (and
none, as zeros) decay a pair by one number: the exponents E_rx = sum of g over (x, r] come from
one product, L (g masked to t > x) with L_rt = [t <= r] (g rounded once to float16, L exact: E
off by at most 2^-11 |E|, as the pair levels' factors), and the scores are q k^T and k k^T times
exp(E), two products; b, b_last - b and b_last are float32 row sums of the masked gates. The
inverse doubles blocks as the TPU kernel's
(delta_rule/mosaic_tpu/kernels_chunk_tile.py, `unit_lower_inverse`): T = I - A on level 0, then
per level L, T <- T - T (A_L T) with A_L the level's pairs, each product as three bfloat16 products
of the float32 operands split into a head and a tail (about 2^-16 relative), on the tensor cores.
w and u0 take T and their right operands rounded to the input dtype, as "xla" does.

One block per (chunk, value head, batch), one warpgroup; value head j reads q and k head
j // G. K a multiple of 64 (at most 128), V a multiple of 64 (at most 256). A block's latency is
a chain of small products, so blocks per SM matter: with per-head gates, bfloat16 and K = V = 128
the shared memory (about 105 KiB: T's and A_L T's buffers also hold beta k e^b and w) lets two
share an SM; the per-key kernel (about 160 KiB) runs one.
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
    CHUNK,
    COL,
    F32,
    GATE_DTYPE,
    GATE_FLOOR,
    LN2,
    LOG2E,
    PREP_RANGES,
    ROW,
    SLAB,
    WGMMA,
    T,
    chunk_decays,
    chunk_kernel,
    cols,
    diagonal,
    head_major_gates,
    iota,
    level_pairs,
    level_scores,
    load_f32,
    load_gates,
    matmul,
    range_constants,
    range_sums,
    rows,
)

BF16 = jnp.bfloat16
MAX_KEY_DIM = 128
MAX_VALUE_DIM = 256


def _split(x):
    """float32 x -> (head, tail) bfloat16 with head + tail = x within about 2^-16 relative."""
    head = x.astype(BF16)
    return head, (x - head.astype(F32)).astype(BF16)


def _parts_product(left_parts, right_parts, shape, *, interpret: bool, init=None):
    """left @ right for two float32 values given as their bfloat16 (head, tail): three bfloat16
    products, tail x tail dropped (left: registers or T(ref); right: refs)."""
    (l_hi, l_lo), (r_hi, r_lo) = left_parts, right_parts
    return matmul([(l_hi, r_hi), (l_hi, r_lo), (l_lo, r_hi)], shape, interpret=interpret,
                  init=init)


def _split_product(left, right_smem, *, interpret: bool):
    """left @ right for float32 `left` [C, C] (registers) and `right` [C, C] given as its bfloat16
    head and tail in right_smem [2, C, C]."""
    return _parts_product(_split(left), (right_smem.at[0], right_smem.at[1]), (CHUNK, CHUNK),
                          interpret=interpret)


def store_split(x, smem):
    head, tail = _split(x)
    smem.at[0][...] = head
    smem.at[1][...] = tail


def _unit_lower_inverse(a, t_smem, y_smem, *, interpret: bool):
    """(I + A)^-1 [C, C] float32 for A [C, C] float32 strictly lower triangular: level 0 by
    I - A_0, then a loop over levels 1.. of T <- T - T (A_L T) (t_smem, y_smem [2, C, C] bfloat16:
    T's and A_L T's head and tail as right operands). Each commit below also tells every warp
    that the other warps are past the products reading the buffer it overwrites next."""
    c = CHUNK
    r, x = iota((c, c), 0), iota((c, c), 1)
    t = jnp.where(r == x, 1.0, 0.0) - jnp.where(level_pairs(0, c), a, 0.0)

    def level_step(level, t):
        store_split(t, t_smem)
        plgpu.commit_smem()
        y = _split_product(jnp.where(level_pairs(level, c), a, 0.0), t_smem, interpret=interpret)
        store_split(y, y_smem)
        plgpu.commit_smem()
        return t - _split_product(t, y_smem, interpret=interpret)

    return lax.fori_loop(1, pair_levels.num_levels(c), level_step, t)


def _tail(kd, vd, dtype, t, beta_rows, decays, smem, outs, tokens, last_at, *, scale,
          interpret, inverse=None):
    """What follows T: q_in, beta k e^b and b_last (decays.prefix(s) -> (e^b [C, SLAB], b_last
    [SLAB]) of key slab s, after decays.prefix_ready()), w_neg = -T (beta k e^b), u0 = T beta v,
    then k_out (decays.suffix(s) -> e^(b_last - b) [C, SLAB], after decays.suffix_ready()); each
    through shared memory (smem: q, k, v, kb, w, last) to its output (outs, in that order: q_in,
    k_out, w_neg, u0, last; `tokens` index the first four, last_at(s) the last). `inverse`:
    (M's shared-memory buffer, T's output) to also write T rounded to the input dtype, through M's
    buffer once M's copy has read it."""
    c = CHUNK
    slabs, v_slabs = kd // SLAB, vd // SLAB
    q_smem, k_smem, v_smem, kb_smem, w_smem, last_s = smem
    q_in_ref, k_out_ref, w_ref, u0_ref, last_ref = outs
    t_in = t.astype(dtype)
    beta_c = rows(beta_rows, (c, SLAB))
    decays.prefix_ready()
    for s in range(slabs):
        span = pl.ds(s * SLAB, SLAB)
        e_b, last = decays.prefix(s)
        last_s.at[s][...] = last
        kb_smem.at[s][...] = (load_f32(k_smem.at[:, span]) * e_b * beta_c).astype(dtype)
        q_smem.at[:, span][...] = (load_f32(q_smem.at[:, span]) * (e_b * scale)).astype(dtype)
    for s in range(v_slabs):
        span = pl.ds(s * SLAB, SLAB)
        v_smem.at[:, span][...] = (load_f32(v_smem.at[:, span]) * beta_c).astype(dtype)
    plgpu.commit_smem()  # also: every warp is past the products that read the prefix's operands
    decays.after_prefix()
    plgpu.copy_smem_to_gmem(q_smem, q_in_ref.at[tokens])
    for s in range(slabs):
        plgpu.copy_smem_to_gmem(last_s.at[s], last_at(last_ref, s))
    for s in range(slabs):  # w_neg = -T (beta k e^b)
        w = matmul([(t_in, kb_smem.at[s])], (c, SLAB), interpret=interpret)
        w_smem.at[s][...] = (-w).astype(dtype)
    for s in range(v_slabs):  # u0 = T (beta v), over beta v
        span = pl.ds(s * SLAB, SLAB)
        u0 = matmul([(t_in, v_smem.at[:, span])], (c, SLAB), interpret=interpret)
        plgpu.commit_smem()  # every warp is past the product reading this slab
        v_smem.at[:, span][...] = u0.astype(dtype)
    if inverse is not None:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # M's copy is past M's buffer
        inverse[0][...] = t_in
    decays.suffix_ready()
    for s in range(slabs):
        span = pl.ds(s * SLAB, SLAB)
        k_smem.at[:, span][...] = (load_f32(k_smem.at[:, span]) * decays.suffix(s)).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(v_smem, u0_ref.at[tokens])
    plgpu.copy_smem_to_gmem(k_smem, k_out_ref.at[tokens])
    if inverse is not None:
        plgpu.copy_smem_to_gmem(inverse[0], inverse[1].at[tokens])
    for s in range(slabs):
        plgpu.copy_smem_to_gmem(w_smem.at[s], w_ref.at[tokens + (pl.ds(s * SLAB, SLAB),)])
    plgpu.wait_smem_to_gmem(0)


class _Decays:
    """The tail's view of a chunk's gates (`_tail`)."""

    def __init__(self, prefix, suffix, prefix_ready=lambda: None, after_prefix=lambda: None,
                 suffix_ready=lambda: None):
        self.prefix, self.suffix = prefix, suffix
        self.prefix_ready, self.after_prefix, self.suffix_ready = (
            prefix_ready, after_prefix, suffix_ready)


def head_gate_decays(g_vec, gu_smem, *, interpret):
    """Per-head gates: exp(E) [C, C] float32, E_rx = g summed over (x, r] (base 2, of g_vec: [C]
    float32 natural-log gates in shared memory); 1 on and above the diagonal, where the callers
    mask. gu_smem [2, C, C] float16: the masked gates and L [r, t] = [t <= r], the product's
    operands, as GLA's range sums take them."""
    c = CHUNK
    r, x = iota((c, c), 0), iota((c, c), 1)
    g_rows = jnp.maximum(plgpu.load(g_vec, layout=ROW) * LOG2E, GATE_FLOOR)
    gu_smem.at[0][...] = jnp.where(r > x, rows(g_rows, (c, c)), 0.0).astype(GATE_DTYPE)
    gu_smem.at[1][...] = jnp.where(x <= r, 1.0, 0.0).astype(GATE_DTYPE)
    plgpu.commit_smem()
    return jnp.exp2(matmul([(gu_smem.at[1], gu_smem.at[0])], (c, c), interpret=interpret))


def _head_gate_scores(q_smem, k_smem, g_vec, gu_smem, *, slabs, interpret):
    """Per-head gates: (M before scale and mask, A before beta and mask: q k^T and k k^T times
    `head_gate_decays`). q k^T and k k^T take their left operands from registers, as the pair
    levels do: with q from shared memory and L from registers the scores came out wrong on an
    H200 while the interpreter agreed, which of the two not isolated."""
    c = CHUNK
    decay = head_gate_decays(g_vec, gu_smem, interpret=interpret)
    k_tiles = [k_smem.at[:, pl.ds(s * SLAB, SLAB)] for s in range(slabs)]
    q_regs = [plgpu.load(q_smem.at[:, pl.ds(s * SLAB, SLAB)], layout=WGMMA)
              for s in range(slabs)]
    k_regs = [plgpu.load(tile, layout=WGMMA) for tile in k_tiles]
    qk = matmul([(q_regs[s], T(k_tiles[s])) for s in range(slabs)], (c, c), interpret=interpret)
    kk = matmul([(k_regs[s], T(k_tiles[s])) for s in range(slabs)], (c, c), interpret=interpret)
    return qk * decay, kk * decay


def head_gate_sums(g_vec):
    """(b [C], b_last - b [C], b_last [SLAB]) base-2 sums of the per-head gates g_vec, ROW
    layout: row sums of the gates masked per row."""
    c = CHUNK
    r, x = iota((c, c), 0), iota((c, c), 1)
    g_by_col = cols(jnp.maximum(plgpu.load(g_vec, layout=COL) * LOG2E, GATE_FLOOR), (c, c))
    b = jnp.sum(jnp.where(x <= r, g_by_col, 0.0), axis=1)
    after = jnp.sum(jnp.where(x > r, g_by_col, 0.0), axis=1)
    return b, after, jnp.sum(g_by_col, axis=1)


def wy_operands(q, k, v, beta, g, *, group: int, scale: float, interpret,
                with_inverse: bool = False):
    """q, k [B, Tp, H, K] and v [B, Tp, HV, V] (16-bit, one dtype; Tp a multiple of 64, K of 64
    up to 128, V of 64 up to 256; HV = H * group), beta [B, Tp, HV] float32, g float32 log gates
    [B, Tp, HV, K] (per key) or [B, Tp, HV] (per head; zeros for none) -> (scores [B, Tp, HV, C],
    q_in, k_out, w_neg [B, Tp, HV, K], u0 [B, Tp, HV, V] in the input dtype, last [B, N, HV, K]
    float32): the module docstring's operands, token-major. `with_inverse` adds
    T = (I + A)^-1 [B, Tp, HV, C] (each chunk's rows) rounded to the input dtype, as w and u0
    take it: the operands' backward reads it."""
    bsz, tp, _, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    c, dtype = CHUNK, q.dtype
    n, slabs = tp // c, kd // SLAB
    if tp % c or kd % SLAB or vd % SLAB or kd > MAX_KEY_DIM or vd > MAX_VALUE_DIM:
        raise ValueError(f"padded T={tp}, K={kd}, V={vd}: T must be a multiple of {c}, K and V "
                         f"of {SLAB}, K <= {MAX_KEY_DIM}, V <= {MAX_VALUE_DIM}")
    levels = pair_levels.num_levels(c)
    per_head = g.ndim == 3
    # beta k e^b and w: in T's and A_L T's buffers where they are bfloat16 ([2, C, C] holds
    # [slabs, C, SLAB] as C = SLAB), else buffers of their own
    shared_kb = per_head and jnp.dtype(dtype) == jnp.dtype(BF16)

    def body(q_ref, k_ref, v_ref, beta_ref, g_ref, *refs):
        t_ref = r_ref = None
        if not per_head:
            r_ref, *refs = refs  # the range matrices (an input)
        if with_inverse:
            t_ref, *refs = refs
        if per_head:
            (m_ref, q_in_ref, k_out_ref, w_ref, u0_ref, last_ref, q_smem, k_smem, v_smem,
             gu_smem, t_smem, y_smem, m_smem, last_s, beta_vec, g_vec, loaded, *kb_w) = refs
        else:
            (m_ref, q_in_ref, k_out_ref, w_ref, u0_ref, last_ref, q_smem, k_smem, v_smem,
             gates, rest, ranges, buffers, t_smem, y_smem, m_smem, last_s, beta_vec, loaded,
             ranges_in) = refs
        chunk, head, batch = (lax.axis_index(x) for x in ("chunk", "head", "batch"))
        span_c = pl.ds(chunk * c, c)
        tokens = (batch, span_c, head)  # the value head's
        qk_tokens = (batch, span_c, head // group)
        inputs = [(q_ref.at[qk_tokens], q_smem), (k_ref.at[qk_tokens], k_smem),
                  (v_ref.at[tokens], v_smem), (beta_ref.at[batch, head, span_c], beta_vec)]
        if per_head:
            inputs.append((g_ref.at[batch, head, span_c], g_vec))
        else:
            def fetch_ranges(i):
                """Range matrix i of PREP_RANGES into `ranges` (arriving on `ranges_in`), once
                every warp is past the products that read the last one."""
                plgpu.copy_gmem_to_smem(r_ref.at[i], ranges, ranges_in)

            fetch_ranges(0)
        for src, dst in inputs:
            plgpu.copy_gmem_to_smem(src, dst, loaded)
        r, x = iota((c, c), 0), iota((c, c), 1)
        if per_head:
            plgpu.barrier_wait(loaded)
            scores, key_scores = _head_gate_scores(q_smem, k_smem, g_vec, gu_smem,
                                                   slabs=slabs, interpret=interpret)
            b, after, last = head_gate_sums(g_vec)
            scores = jnp.where(x <= r, scores, 0.0)
            key_scores = jnp.where(x < r, key_scores, 0.0)
            e_b, e_after = (rows(jnp.exp2(y), (c, SLAB)) for y in (b, after))
            decays = _Decays(prefix=lambda s: (e_b, last * LN2), suffix=lambda s: e_after)
            kb_smem, w_smem = (t_smem, y_smem) if shared_kb else kb_w
        else:
            for s in range(slabs):
                # the loads' wait comes with the first slab's gates
                load_gates(g_ref, tokens, pl.ds(s * SLAB, SLAB), gates.at[s], loaded, None,
                           rest.at[s], wait=s == 0)
            scores, key_scores = level_scores(q_smem, k_smem, gates, ranges, ranges_in, buffers,
                                              fetch_ranges, slabs=slabs, interpret=interpret,
                                              key_scores=True)
            scores = scores + jnp.where(r == x, rows(diagonal(q_smem, k_smem, slabs), (c, c)),
                                        0.0)
            decays = _Decays(
                prefix=lambda s: (
                    jnp.exp2(range_sums(ranges, gates.at[s], interpret=interpret,
                                        rest=rest.at[s])),
                    chunk_decays(ranges, gates.at[s], rest.at[s], interpret=interpret)),
                suffix=lambda s: jnp.exp2(range_sums(ranges, gates.at[s], interpret=interpret)),
                prefix_ready=lambda: plgpu.barrier_wait(ranges_in),
                after_prefix=lambda: fetch_ranges(levels + 1),
                suffix_ready=lambda: plgpu.barrier_wait(ranges_in))
            # beta k e^b and w in the levels' X buffers (the last level read buffer 1: the
            # tail's first commit comes before w is stored)
            kb_smem, w_smem = buffers.at[0], buffers.at[1]
        m_smem[...] = (scores * scale).astype(dtype)
        beta_rows = plgpu.load(beta_vec, layout=ROW)  # [C]
        t = _unit_lower_inverse(rows(beta_rows, (c, c)) * key_scores, t_smem, y_smem,
                                interpret=interpret)
        plgpu.commit_smem()  # M; every warp is past the inverse's last products
        plgpu.copy_smem_to_gmem(m_smem, m_ref.at[tokens])
        _tail(kd, vd, dtype, t, beta_rows, decays,
              (q_smem, k_smem, v_smem, kb_smem, w_smem, last_s),
              (q_in_ref, k_out_ref, w_ref, u0_ref, last_ref), tokens,
              lambda ref, s: ref.at[batch, chunk, head, pl.ds(s * SLAB, SLAB)],
              scale=scale, interpret=interpret,
              inverse=None if t_ref is None else (m_smem, t_ref))

    tiles = lambda shape, dt=dtype: plgpu.SMEM(shape, dt, transforms=SWIZZLED)
    scratch = [tiles((c, kd)), tiles((c, kd)), tiles((c, vd))]  # q (q_in), k (k_out), v (u0)
    if per_head:
        scratch.append(tiles((2, c, c), GATE_DTYPE))  # the masked gates, head and tail
    else:
        scratch += [
            tiles((slabs, c, SLAB), GATE_DTYPE),  # g log2(e), rounded
            tiles((slabs, c, SLAB), GATE_DTYPE),  # and the rest
            tiles((c, c), GATE_DTYPE),  # a range matrix
            tiles((2, slabs, c, SLAB)),  # the levels' X; beta k e^b, w
        ]
    scratch += [
        tiles((2, c, c), BF16),  # T, head and tail (with shared_kb: beta k e^b)
        tiles((2, c, c), BF16),  # A_L T, head and tail (with shared_kb: w)
        tiles((c, c)),  # M
        plgpu.SMEM((slabs, SLAB), F32),  # b_last
        plgpu.SMEM((c,), F32),  # beta
    ]
    if per_head:
        scratch += [plgpu.SMEM((c,), F32),  # the chunk's gates
                    plgpu.Barrier(num_arrivals=5)]  # q, k, v, beta, gates
        if not shared_kb:
            scratch += [tiles((slabs, c, SLAB)), tiles((slabs, c, SLAB))]  # beta k e^b, w
    else:
        scratch += [plgpu.Barrier(num_arrivals=4),  # q, k, v, beta
                    plgpu.Barrier()]  # a range matrix is in
    key_type = jax.ShapeDtypeStruct((bsz, tp, hv, kd), dtype)
    chunk_rows = jax.ShapeDtypeStruct((bsz, tp, hv, c), dtype)
    kernel = chunk_kernel(
        body, [chunk_rows] * with_inverse + [
            chunk_rows, key_type, key_type, key_type,
            jax.ShapeDtypeStruct((bsz, tp, hv, vd), dtype),
            jax.ShapeDtypeStruct((bsz, n, hv, kd), F32)],
        scratch, (n, hv, bsz), "delta_rule_wy_operands_mosaic", interpret)
    args = [q, k, v, jnp.swapaxes(beta, 1, 2), head_major_gates(g)]
    if not per_head:
        args.append(range_constants(PREP_RANGES))
    with jax.named_scope(f"delta_rule_wy_operands_mosaic_key_dim={kd}"):
        outs = tuple(kernel(*args))
    return outs[1:] + outs[:1] if with_inverse else outs  # T last
