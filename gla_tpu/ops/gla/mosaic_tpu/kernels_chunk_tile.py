"""The math of one chunk, on values already loaded from VMEM: shared by every chunked GLA kernel.

Notation of docs/gla_math.md and docs/gla_mosaic_tpu.md: a chunk holds C tokens; q, k [C, K],
v and dO [C, bv] (one block of V); b is the chunk-local inclusive running sum of the log gates
(per-key gates: `running_sum` of g inside the kernels; per-head gates: computed outside); the
state is held transposed, ST = S^T [bv, K] float32, so that every product below is a plain,
A @ B^T or A^T @ B matmul and no in-kernel transpose is needed.

Every exponential is of a non-positive difference of gate sums; a difference that would be
positive is masked *before* `exp`, so no inf ever meets a zero mask.
Matmul operands are in `dt` (the input dtype), accumulation in float32, as in the "xla" backend.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from gla_tpu.ops.common.masks import intra_chunk_visibility
from gla_tpu.ops.common.products import HIGHEST, product


def _dot(a, b, layout, dt):
    """a, b rounded to the input dtype `dt`, multiplied on the MXU in `layout`, float32 result."""
    return product(a.astype(dt), b.astype(dt), layout)


def _zero_outside(x, mask, profiler_safe: bool):
    """x [C, C] float32 (finite) with the entries outside `mask` zeroed. For a matrix about to be
    rounded for the MXU, libtpu folds the select into a masked MXU push, which costs nothing but
    which its static profiler rejects for bfloat16 on v5e and v5p (an LLO type check);
    `profiler_safe` zeroes by a 0/1 product instead (the same values; BlockSizes.profiler_safe)."""
    return x * mask.astype(jnp.float32) if profiler_safe else jnp.where(mask, x, 0.0)


def _zero_on(x, mask, profiler_safe: bool):
    """x with the entries on `mask` zeroed, as `_zero_outside` (a select whose operands take the
    mask as it is: `_zero_outside(x, ~mask)` would cost the negation)."""
    return x * (~mask).astype(jnp.float32) if profiler_safe else jnp.where(mask, 0.0, x)


def rounded_to_bfloat16(x):
    """x float32 rounded to the nearest bfloat16 (ties to even), kept in float32: the value of
    x.astype(bfloat16).astype(float32) (finite x), by integer ops on the bits, a round trip
    libtpu's static profiler rejects on v5e and v5p (the unpack of a packed bfloat16 vreg)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    half_ulp = jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))
    return jax.lax.bitcast_convert_type((bits + half_ulp) & jnp.uint32(0xFFFF0000), jnp.float32)


def _iota(shape, axis):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


# Rows of one float32 vreg: the running sum scans within these groups, then carries across them.
_SUBLANES = 8


def running_sum(x, *, reverse: bool = False):
    """Inclusive running sum of x [C, K] float32 along the chunk: row i sums rows 0..i (reverse:
    rows i..C-1). Mosaic has no cumsum. Within each group of 8 rows (one vreg) a Hillis-Steele
    scan (3 rounds of a sublane rotation, `pltpu.roll` with np.roll's semantics, a mask and an
    add); then the groups' totals are carried from group to group in order. Every row of a group
    is its group's carry plus a sum of at most 8 gates, so the difference of two nearby rows
    rounds about as little as a sequential cumsum's (docs/gla_mosaic_tpu.md, "Gate sums inside
    the kernels")."""
    c, kd = x.shape
    groups = x.reshape(c // _SUBLANES, _SUBLANES, kd)
    rows = _iota(groups.shape, 1)
    shift = 1
    while shift < _SUBLANES:
        if reverse:  # row i adds row i + shift of its group
            rolled = pltpu.roll(groups, _SUBLANES - shift, 1)
            groups = groups + jnp.where(rows < _SUBLANES - shift, rolled, 0.0)
        else:  # row i adds row i - shift
            groups = groups + jnp.where(rows >= shift, pltpu.roll(groups, shift, 1), 0.0)
        shift *= 2
    order = range(c // _SUBLANES)
    out = [None] * len(order)
    carry = None
    for gi in (reversed(order) if reverse else order):
        part = groups[gi] if carry is None else groups[gi] + carry
        out[gi] = part
        carry = part[0:1, :] if reverse else part[_SUBLANES - 1:, :]
    return jnp.concatenate(out, axis=0)


def gate_grad_per_key(db):
    """dg [C, K] float32 of per-key log gates from one chunk's db (or one V block's share of it,
    `backward`): dg_t = sum of db over t..C-1 (b_t sums g over the chunk's tokens up to t)."""
    return running_sum(db, reverse=True)


class Gate:
    """The chunk's gate sums, built lazily so that each kernel scans only what it uses.

    kind "key": from the log gates `g` [C, K] float32, `b` [C, K] (running sum) and `tail`
    [C, K] = b_last - b (the sum of the gates after each token); "head": `col` [C, 1] and
    `row` [1, C], the sums computed outside the kernels, or (`head_ranges`) every exponent
    summed over its own range; "none".
    """

    def __init__(self, kind: str, *, g=None, col=None, row=None):
        self.kind, self.g, self.col, self.row = kind, g, col, row
        self.pairs = self.after = None  # per-head range sums (`head_ranges`)

    @classmethod
    def head_ranges(cls, g_col, g_row):
        """Per-head gates from the log gates as a column [C, 1] and a row [1, C], every exponent
        a sum over its own range (docs/delta_rule_math.md, "Why nothing overflows"): b_i over
        [0, i] and the gates after i as row sums, and pairs [C, C], the sums over (j, i] for
        j < i, as one float32 product of a triangle of ones with the masked gates. A difference
        b_i - b_j of running sums would carry their rounding (|b| 2^-24) into decays near 1."""
        c = g_col.shape[0]
        i, j = _iota((c, c), 0), _iota((c, c), 1)
        gate = cls("head", col=jnp.sum(jnp.where(j <= i, g_row, 0.0), axis=1, keepdims=True))
        gate.after = jnp.sum(jnp.where(j > i, g_row, 0.0), axis=1, keepdims=True)
        gate.pairs = product((j <= i).astype(jnp.float32), jnp.where(i > j, g_col, 0.0), "nn",
                             HIGHEST)
        return gate

    @functools.cached_property
    def b(self):
        return running_sum(self.g)

    @functools.cached_property
    def tail(self):
        """b_last - b_j from a reverse running sum, not from the difference of two forward sums:
        near the chunk's end, where the decay exp(b_last - b_j) is not negligible, it is then a
        sum of a few gates, free of the rounding of the large b."""
        return running_sum(self.g, reverse=True) - self.g

    @functools.cached_property
    def last(self):
        """b at the chunk's last token: [1, K] ("key"), [1, 1] ("head"), None ("none")."""
        if self.kind == "key":
            return jnp.sum(self.g, axis=0, keepdims=True)
        if self.kind == "head":
            return self.col[-1:, :]
        return None

    def to_start(self):
        """exp(b_i): decay from the chunk start to token i, [C, K] or [C, 1], None if ungated."""
        if self.kind == "key":
            return jnp.exp(self.b)
        if self.kind == "head":
            return jnp.exp(self.col)
        return None

    def to_end(self):
        """exp(b_last - b_j): decay from token j to the chunk end, [C, K] or [C, 1]."""
        if self.kind == "key":
            return jnp.exp(self.tail)
        if self.kind == "head":
            return jnp.exp(self.last - self.col if self.after is None else self.after)
        return None

    def whole(self):
        """exp(b_last): decay across the whole chunk, [1, K] or [1, 1]."""
        return None if self.kind == "none" else jnp.exp(self.last)


@dataclasses.dataclass(frozen=True)
class Segments:
    """Segment index relative to the token before the chunk (0 = the carried state's segment)."""

    col: jax.Array  # [C, 1] int32
    row: jax.Array  # [1, C] int32

    @property
    def reaches(self):  # [C, 1]: the carried state reaches token i (no reset before it)
        return self.col == 0

    @property
    def in_last(self):  # [C, 1]: token j belongs to the chunk's last segment
        return self.col == self.col[-1:, :]

    @property
    def keep(self):  # [1, 1]: no reset inside the chunk, the carried state survives it
        return self.col[-1:, :] == 0


def _mul(x, factor):
    return x if factor is None else x * factor


def _mask_rows(x, rows):
    return x if rows is None else jnp.where(rows, x, 0.0)


def pair_mask(c: int, seg: Segments | None):
    """[C, C] bool: token i sees token j (j <= i, same segment)."""
    if seg is None:
        return intra_chunk_visibility(_iota((c, c), 0), _iota((c, c), 1))
    return intra_chunk_visibility(_iota((c, c), 0), _iota((c, c), 1), seg.col, seg.row)


def head_decay(gate: Gate, mask):
    """[C, C] exp(b_i - b_j) on `mask` (pairs j <= i; masked before exp), for per-head gates."""
    exponent = gate.col - gate.row if gate.pairs is None else gate.pairs
    return jnp.where(mask, jnp.exp(jnp.where(mask, exponent, 0.0)), 0.0)


def intra(q, k, gate: Gate, mask, dt, *, d_scores=None, want_scores=False, want_dq=False,
          want_dk=False, profiler_safe=False, max_level=None):
    """Intra-chunk scores A[i, j] = sum_k q_ik k_jk exp(b_ik - b_jk) (masked) and their pullback.

    Args:
      q, k: [C, K]; gate: the chunk's gate sums; mask: [C, C] bool from `pair_mask`.
      d_scores: [C, C] float32 cotangent of A (already masked), needed for dq / dk.
      profiler_safe: masks (and the pair levels' rounded X) as `_zero_outside` and
        `rounded_to_bfloat16` say (BlockSizes.profiler_safe); the same values.
      max_level: per-key gates, pair levels below this (None: all); for rows that stack
        several chunks whose mask keeps pairs within a chunk, the chunk size.
    Returns:
      (A [C, C] | None, dq [C, K] | None, dk [C, K] | None, db [C, K] | None), float32; db (per-key
      gates, with dq and dk) is these pairs' share of q*dq - k*dk, summed so that it cancels
      (`_intra_per_key`).
    """
    c = q.shape[0]
    if gate.kind != "key":
        decay = None if gate.kind == "none" else head_decay(gate, mask)
        scores = dq = dk = None
        if want_scores:
            scores = _zero_outside(_mul(_dot(q, k, "nt", dt), decay), mask, profiler_safe)
        if want_dq or want_dk:
            # The diagonal (i = j, decay 1) stays in float32: its shares of q*dq and k*dk cancel
            # exactly in db (docs/gla_mosaic_tpu.md), which a rounded matmul operand would spoil.
            eye = _iota((c, c), 0) == _iota((c, c), 1)
            ds = _zero_on(_mul(d_scores, decay), eye, profiler_safe)
            d_diag = jnp.sum(jnp.where(eye, d_scores, 0.0), axis=1, keepdims=True)  # [C, 1]
            if want_dq:
                dq = _dot(ds, k, "nn", dt) + d_diag * k.astype(jnp.float32)
            if want_dk:
                dk = _dot(ds, q, "tn", dt) + d_diag * q.astype(jnp.float32)
        return scores, dq, dk, None
    return _intra_per_key(q, k, gate.b, mask, dt, d_scores, want_scores, want_dq or want_dk,
                          profiler_safe, max_level or q.shape[0])


def _intra_per_key(q, k, b, mask, dt, d_scores, want_scores, want_grads, profiler_safe,
                   max_level):
    """Pair levels (docs/gla_mosaic_tpu.md, "Per-key gates: pair levels"). A pair i > j of the
    chunk belongs to level h, the highest bit in which i and j differ: both lie in one aligned
    block of 2h rows, i in its upper half and j in its lower half, so the pair factors through
    r = b at the upper half's first row, exp(b_i - r) * exp(r - b_j), both exponents <= 0. One
    operand per level, X = q exp(b - r) on the upper rows and k exp(r - b) on the lower rows:
    the level's scores are X X^T on its band of pairs, dq's part (dA X) exp(b - r) and dk's
    (dA^T X) exp(r - b). The pairs i = j (decay 1) stay out of the rounded products.

    db: a pair's shares of q*dq and k*dk cancel in dg for the tokens before both. Taken from dq
    and dk they would not (each side rounds its own operand), so the pairs' db is built from the
    rounded X on both sides, X (dA X - dA^T X), in which every pair appears twice with one value;
    the pairs i = j add nothing to db. (dq, dk, db) are None unless `want_grads`. profiler_safe:
    masks and the rounded X as `_zero_outside` and `rounded_to_bfloat16` say."""
    c = q.shape[0]
    f32 = jnp.float32
    qf, kf = q.astype(f32), k.astype(f32)
    rows = _iota((c, 1), 0)
    i, j = _iota((c, c), 0), _iota((c, c), 1)
    level_of = i ^ j  # [C, C]: pair (i, j) is on level h iff h <= i ^ j < 2h
    scores = dq = dk = db = None
    if want_scores:
        scores = jnp.where(i == j, _dot(q, k, "nt", dt), 0.0)
    if want_grads:
        d_diag = jnp.sum(jnp.where(i == j, d_scores, 0.0), axis=1, keepdims=True)  # [C, 1]
        dq, dk = d_diag * kf, d_diag * qf
        db = jnp.zeros(q.shape, f32)
    group_start = b  # [C, K]: b at the first row of each row's aligned group of h rows
    h = 1
    while h < max_level:
        upper = (rows & h) != 0  # [C, 1]: the queries of level h; the other rows are its keys
        ref = jnp.where(upper, group_start, pltpu.roll(group_start, c - h, 0))
        scale = jnp.exp(jnp.where(upper, b - ref, ref - b))  # [C, K], exponents <= 0
        xf = jnp.where(upper, qf, kf) * scale
        x = xf.astype(dt)
        band = (level_of >= h) & (level_of < 2 * h)
        if want_scores:
            scores = scores + jnp.where(band, product(x, x, "nt"), 0.0)
        if want_grads:
            # (upper i, lower j) only
            ds_lvl = _zero_outside(d_scores, band, profiler_safe).astype(dt)
            dq_lvl = product(ds_lvl, x, "nn")  # [C, K], zero off the upper rows
            dk_lvl = product(ds_lvl, x, "tn")  # [C, K], zero off the lower rows
            dq = dq + dq_lvl * scale
            dk = dk + dk_lvl * scale
            by_bits = profiler_safe and jnp.dtype(dt) == jnp.dtype(jnp.bfloat16)
            db = db + (rounded_to_bfloat16(xf) if by_bits else x.astype(f32)) * (dq_lvl - dk_lvl)
        # Row t takes row t - h where bit h of t is set: b at the start of its 2h-group.
        group_start = jnp.where(upper, pltpu.roll(group_start, h, 0), group_start)
        h *= 2
    if want_scores:
        scores = _zero_outside(scores, mask, profiler_safe)
    return scores, dq, dk, db


def carried_queries(q, gate: Gate, seg: Segments | None):
    """q_i * exp(b_i) for tokens the carried state reaches, zero elsewhere: [C, K] float32."""
    qh = _mul(q.astype(jnp.float32), gate.to_start())
    return _mask_rows(qh, None if seg is None else seg.reaches)


def tail_keys(k, gate: Gate, seg: Segments | None):
    """k_j * exp(b_last - b_j) for tokens of the chunk's last segment: [C, K] float32."""
    kt = _mul(k.astype(jnp.float32), gate.to_end())
    return _mask_rows(kt, None if seg is None else seg.in_last)


def carry_state(st, gate: Gate, seg: Segments | None):
    """keep * ST * exp(b_last): the part of a [bv, K] state (or its cotangent) crossing the chunk."""
    st = _mul(st, gate.whole())
    return st if seg is None else jnp.where(seg.keep, st, 0.0)


def output(q, k, v, gate, seg, st, scale, dt, profiler_safe=False):
    """One chunk's output from its tokens and entering state ST [bv, K]: [C, bv] float32."""
    c = q.shape[0]
    scores = intra(q, k, gate, pair_mask(c, seg), dt, want_scores=True,
                   profiler_safe=profiler_safe)[0]
    o = _dot(scores, v, "nn", dt) + _dot(carried_queries(q, gate, seg), st, "nt", dt)
    return o * scale


def next_state(k, v, gate, seg, st, dt):
    """ST_out = keep * ST_in * exp(b_last) + v^T (k * exp(b_last - b))  [bv, K]."""
    return carry_state(st, gate, seg) + _dot(v, tail_keys(k, gate, seg), "tn", dt)


def prev_state_grad(q, gate, seg, dst, do_scaled, dt):
    """Cotangent of the entering state from that of the leaving one: [bv, K]."""
    return carry_state(dst, gate, seg) + _dot(do_scaled, carried_queries(q, gate, seg), "tn", dt)


def backward(q, k, v, gate, seg, do_scaled, st, dst, dt, profiler_safe=False, key_parts=False):
    """One chunk's gradients from its tokens, the entering state ST [bv, K] and the cotangent
    dST [bv, K] of the leaving state; do_scaled = scale * dO, [C, bv] float32.

    Returns float32 (dq [C, K], dk [C, K], dv [C, bv], edge [1, K], db [C, K] or None). edge is
    the share of db at the chunk's last token (docs/gla_mosaic_tpu.md): sum_j k_j * dk_state_j
    (the leaving state's keys) + <keep * ST * exp(b_last), dST> over V (the carried state). Both
    use the very values that enter dk, so the last token's k * dk_state cancels exactly in db.
    db (per-key gates) = q*dq - k*dk with edge at the last token, its intra-chunk pairs summed
    as `_intra_per_key` says. key_parts: also return (pair_db, dq_inter, dk_state, carry_edge)
    for a caller that builds a per-head db by parts (the delta rule's): pair_db [C, C] = dA * A
    off the diagonal (pair (i, j) adds it to db_i and takes it from db_j), the entering state's
    share of dq and the leaving state's of dk [C, K], the carried state's share of edge [1, K].
    """
    c = q.shape[0]
    mask = pair_mask(c, seg)
    d_scores = jnp.where(mask, _dot(do_scaled, v, "nt", dt), 0.0)  # [C, C]
    scores, dq, dk, db = intra(q, k, gate, mask, dt, d_scores=d_scores, want_scores=True,
                               want_dq=True, want_dk=True, profiler_safe=profiler_safe)
    dq_inter = _mul(_dot(do_scaled, st, "nn", dt), gate.to_start())
    dq_inter = _mask_rows(dq_inter, None if seg is None else seg.reaches)
    dq = dq + dq_inter
    k_tail = tail_keys(k, gate, seg)
    dk_state = _mul(_dot(v, dst, "nn", dt), gate.to_end())
    dk_state = _mask_rows(dk_state, None if seg is None else seg.in_last)
    dk = dk + dk_state
    dv = _dot(scores, do_scaled, "tn", dt) + _dot(k_tail, dst, "nt", dt)
    qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
    carry_edge = jnp.sum(carry_state(st, gate, seg) * dst, axis=0, keepdims=True)
    edge = jnp.sum(kf * dk_state, axis=0, keepdims=True) + carry_edge
    if db is not None:
        db = db + qf * dq_inter - kf * dk_state
        db = db + jnp.where(_iota((c, 1), 0) == c - 1, edge, 0.0)
    if key_parts:
        off_diagonal = _iota((c, c), 0) != _iota((c, c), 1)
        pair_db = jnp.where(off_diagonal, d_scores * scores, 0.0)
        return dq, dk, dv, edge, db, (pair_db, dq_inter, dk_state, carry_edge)
    return dq, dk, dv, edge, db
