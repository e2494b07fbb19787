"""The math of one chunk of the delta rule, on values already loaded from VMEM.

Notation of docs/delta_rule_math.md: a chunk holds C tokens; q, k [C, K], v [C, V], beta [C, 1];
the state is held transposed, ST = S^T [V, K] float32, as GLA's chunked kernels hold it. The
decayed scores, the decayed queries and keys, and GLA's output, state update and their pullbacks
come from GLA's chunk math (`gla_tpu.ops.gla.mosaic_tpu.kernels_chunk_tile`, imported as `gla`):
the delta rule is GLA with the values replaced by the new values u = u0 - w S, plus the WY
representation (u0, w) = (I + A)^-1 beta [v, k_in] of the chunk.

Matmul operands are rounded to the input dtype `dt` (float32 accumulation), as in the "xla"
backend; the inverse of I + A is formed in float32 at HIGHEST precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax.experimental.pallas import tpu as pltpu

from gla_tpu.ops.common.products import HIGHEST, product
from gla_tpu.ops.gla.mosaic_tpu import kernels_chunk_tile as gla

_dot = gla._dot  # operands rounded to dt, float32 result


def _iota(shape, axis):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def split_product(x, y):
    """x @ y for float32 x, y from three bfloat16 products: each operand split into a bfloat16
    head and tail, the tail x tail term dropped (about 2^-16 relative; XLA's BF16_BF16_F32_X3,
    which Mosaic does not take as a precision)."""
    bf16 = jnp.bfloat16
    x_hi, y_hi = x.astype(bf16), y.astype(bf16)
    x_lo = (x - x_hi.astype(jnp.float32)).astype(bf16)
    y_lo = (y - y_hi.astype(jnp.float32)).astype(bf16)
    return product(x_hi, y_hi) + (product(x_hi, y_lo) + product(x_lo, y_hi))


def unit_lower_inverse(a, dt=jnp.float32, max_level=None):
    """(I + a)^-1 for a [C, C] float32 strictly lower triangular, C a power of two.

    Blocked inversion by doubling the block: with T the inverse of the block-diagonal part of
    I + a in blocks of h rows, the blocks of 2h rows are [[T11, 0], [-T22 a21 T11, T22]], that is
    T - T a_h T with a_h the pairs (i, j) whose highest differing bit is h (a21 of every 2h-block,
    the pair levels of docs/gla_mosaic_tpu.md). Level 1 is I - a_1 (T = I); every later level
    takes two products. Each level is an exact step of block forward substitution, not a power
    series, so nothing cancels beyond the substitution's own rounding
    (docs/delta_rule_mosaic_tpu.md, "The inverse"). `max_level`: levels below it only (a holding
    several chunks' blocks on its diagonal, the chunk size). The products are float32 at HIGHEST
    precision for float32 inputs (`dt`), three bfloat16 products (`split_product`) for 16-bit
    inputs: one bfloat16 product would cost 25x the rounding of the exact inverse to bfloat16
    at correlated keys and beta near 2."""
    c = a.shape[0]
    i, j = _iota((c, c), 0), _iota((c, c), 1)
    level = i ^ j
    def mm(x, y):
        if jnp.dtype(dt) == jnp.float32:
            return product(x, y, "nn", HIGHEST)
        return split_product(x, y)

    t = (i == j).astype(jnp.float32) - jnp.where((i > j) & (level == 1), a, 0.0)
    h = 2
    while h < (max_level or c):
        a_h = jnp.where((i > j) & (level >= h) & (level < 2 * h), a, 0.0)
        t = t - mm(t, mm(a_h, t))
        h *= 2
    return t


def decayed_key_scores(k, beta, gate, seg, dt, profiler_safe=False, chunk=None):
    """(a, T = (I + beta a)^-1) float32 of the chunks stacked in k's rows: the decayed key scores
    a_ij (j < i within a chunk and a segment) and the inverse of the WY representation, both
    block-diagonal in blocks of `chunk` rows (None: one chunk). They do not depend on the state:
    a kernel forms them for several chunks at once before the sequential pass, where one product
    of the stacked rows costs about what one of a single chunk does (`blocks_of`)."""
    rows = k.shape[0]
    c = chunk or rows
    i, j = _iota((rows, rows), 0), _iota((rows, rows), 1)
    strict = gla.pair_mask(rows, seg) & (i != j) & ((i ^ j) < c)  # same chunk (c a power of 2)
    kk = gla.intra(k, k, gate, strict, dt, want_scores=True, profiler_safe=profiler_safe,
                   max_level=c)[0]
    return kk, unit_lower_inverse(beta * kk, dt, max_level=c)


def blocks_of(x, chunk: int):
    """The diagonal [chunk, chunk] blocks of a block-diagonal x [P * chunk, P * chunk], in
    order (each block's columns rotated to the first lanes)."""
    rows = x.shape[0]
    out = []
    for p in range(rows // chunk):
        band = x[p * chunk:(p + 1) * chunk]
        if p:
            band = pltpu.roll(band, rows - p * chunk, 1)
        out.append(band[:, :chunk])
    return out


class Chunk:
    """The state-independent quantities of one chunk (pass 1 of docs/delta_rule_math.md), shared
    by the forward and the backward step.

    Attributes (float32): strict [C, C] bool (pairs j < i within a segment); kk [C, C] the
    decayed key scores a_ij and t = (I + beta a)^-1 (`decayed_key_scores`, or given); k_in
    [C, K] (keys decayed to the chunk's start, zero where the entering state does not reach);
    u0 [C, V] and w [C, K], the WY representation.
    """

    def __init__(self, k, v, beta, gate, seg, dt, profiler_safe, kk=None, t=None):
        c = k.shape[0]
        self.strict = gla.pair_mask(c, seg) & (_iota((c, c), 0) != _iota((c, c), 1))
        if t is None:
            kk, t = decayed_key_scores(k, beta, gate, seg, dt, profiler_safe)
        self.kk, self.t = kk, t
        self.k_in = gla.carried_queries(k, gate, seg)
        self.u0 = _dot(self.t, beta * v.astype(jnp.float32), "nn", dt)
        self.w = _dot(self.t, beta * self.k_in, "nn", dt)

    def new_values(self, st, dt):
        """u = u0 - w S [C, V] for the entering state ST [V, K]."""
        return self.u0 - _dot(self.w, st, "nt", dt)


def forward(q, k, v, beta, gate, seg, st, scale, dt, profiler_safe=False, inverse=None):
    """(o [C, V] float32, the leaving state ST' [V, K]) of one chunk from the entering ST;
    `inverse`: T of `decayed_key_scores`, when formed before."""
    chunk = Chunk(k, v, beta, gate, seg, dt, profiler_safe, t=inverse)
    u = chunk.new_values(st, dt)
    o = gla.output(q, k, u, gate, seg, st, scale, dt, profiler_safe)
    return o, gla.next_state(k, u, gate, seg, st, dt)


def _head_gate_db(q, kf, dq_inter, dk_late, dk_state, carry_edge, pairs, dt):
    """d loss / d b of a per-head gate in two parts, ([C, 1] reversed, [C, 1] forward): dg_t is
    the sum of the first over tokens t.. the chunk's end and of the second over tokens before t
    (docs/delta_rule_mosaic_tpu.md, "Per-head dg"). Every factor exp(b) is counted once, each
    from the very value that enters it: a pair (i, j) of the scores or of the key scores
    (`pairs` [C, C], dA * A) adds to db_i and takes from db_j, the entering state's queries and
    keys (dq_inter, dk_late [C, K]) add q dq and k dk at their token, the leaving state's keys
    (dk_state) take k dk at theirs and add their sum at the last token; those two cancel for the
    tokens before them, so they are summed forward (over tokens before t) instead, and dg at a
    chunk's first token holds no O(1) terms that cancel. The carried state adds carry_edge [1, K]
    at the last token."""
    c = pairs.shape[0]
    qf = q.astype(jnp.float32)
    lanes = 128
    ones = jnp.ones((c, lanes), jnp.float32)
    if jnp.dtype(dt) == jnp.float32:
        column_sums = product(pairs, ones, "tn", HIGHEST)[:, :1]  # [C, 1]: sum over i of pairs_ij
    else:  # a bfloat16 head and tail: about 2^-16 relative
        head = pairs.astype(jnp.bfloat16)
        tail = (pairs - head.astype(jnp.float32)).astype(jnp.bfloat16)
        ones = ones.astype(jnp.bfloat16)
        column_sums = (product(head, ones, "tn") + product(tail, ones, "tn"))[:, :1]
    reversed_part = (jnp.sum(pairs, axis=1, keepdims=True) - column_sums
                     + jnp.sum(qf * dq_inter + kf * dk_late, axis=1, keepdims=True))
    reversed_part = reversed_part + jnp.where(_iota((c, 1), 0) == c - 1,
                                              jnp.sum(carry_edge, axis=1, keepdims=True), 0.0)
    return reversed_part, jnp.sum(kf * dk_state, axis=1, keepdims=True)


def backward(q, k, v, beta, gate, seg, do_scaled, st, dst, dt, profiler_safe=False,
             scores=None, inverse=None):
    """One chunk's gradients ("Backward" of docs/delta_rule_math.md) from the entering state ST
    [V, K], the cotangent dST [V, K] of the leaving one and do_scaled = scale * dO [C, V].

    Returns float32 (dq [C, K], dk [C, K], dv [C, V], dbeta [C, 1], db, dST of the entering state
    [V, K]); db is d loss / d b (the chunk-local gate sums) per key [C, K] for per-key gates, the
    pair (reversed part, forward part) [C, 1] each of `_head_gate_db` for per-head gates, None
    without a gate. GLA's pullback with v = u gives dq, the early-role dk of the scores M and of the
    leaving state's keys, du and its db; the WY representation adds dr = T^T du and the pairs of A.
    `scores`, `inverse`: (a, T) of `decayed_key_scores`, when formed before.
    """
    chunk = Chunk(k, v, beta, gate, seg, dt, profiler_safe, kk=scores, t=inverse)
    u = chunk.new_values(st, dt)
    dq, dk_early, du, edge, db, (pair_db, dq_inter, dk_state, carry_edge) = gla.backward(
        q, k, u, gate, seg, do_scaled, st, dst, dt, profiler_safe, key_parts=True)
    dst_prev = gla.prev_state_grad(q, gate, seg, dst, do_scaled, dt) - _dot(du, chunk.w, "tn", dt)
    dr = _dot(chunk.t, du, "tn", dt)  # (I + A)^-T du  [C, V]
    d_a = jnp.where(chunk.strict, -_dot(dr, u, "nt", dt), 0.0)  # [C, C]
    dv = beta * dr
    vf = v.astype(jnp.float32)
    dbeta = (jnp.sum((vf - _dot(chunk.k_in, st, "nt", dt)) * dr, axis=1, keepdims=True)
             + jnp.sum(d_a * chunk.kk, axis=1, keepdims=True))
    # k_in = k * exp(b) where the entering state reaches: the later role of k
    dk_in = -beta * _dot(dr, st, "nn", dt)  # [C, K]
    dk_late = gla._mul(dk_in, gate.to_start())
    dk_late = gla._mask_rows(dk_late, None if seg is None else seg.reaches)
    # The pairs of A = beta * kk: row i the later token, column j the earlier one.
    _, dk_late_pairs, dk_early_pairs, db_pairs = gla.intra(
        k, k, gate, chunk.strict, dt, d_scores=beta * d_a, want_dq=True, want_dk=True,
        profiler_safe=profiler_safe)
    kf = k.astype(jnp.float32)
    dk = dk_early + dk_early_pairs + dk_late_pairs + dk_late
    if gate.kind == "key":
        db = db + db_pairs + kf * dk_late
    elif gate.kind == "head":
        db = _head_gate_db(q, kf, dq_inter, dk_late, dk_state, carry_edge,
                           pair_db + jnp.where(chunk.strict, beta * d_a * chunk.kk, 0.0), dt)
    else:
        db = None
    return dq, dk, dv, dbeta, db, dst_prev
