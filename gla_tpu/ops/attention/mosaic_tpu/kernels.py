"""Pallas TPU (Mosaic) kernels of softmax flash attention: forward; the backward in one kernel
(dq, dk and dv), or in two (dq; dk and dv).

The kernels know nothing of autodiff; `vjp.py` wires them with `jax.custom_vjp`.
Every array here is padded and, but for the rows forward (`flash_forward_rows`: [B, Tp, H, 128]
in, every head per block), head-major (docs/attention_mosaic_tpu.md says why):
q, o, do [B, H, Tp, D]; k, v [B, Hkv, Sp, D]; lse, di [B, H, 1, Tp] float32 rows;
segment ids [B, 1, Tp] and [B, 1, Sp] int32 rows. Tp and Sp are multiples of every block size
used along them. Padded keys are masked by position; padded query rows are sliced off by the caller
(their cotangent is zero, so they add nothing to dk or dv).

Notation (as in the docs): s = sm_scale * q k^T, m the running row max, l the running row sum of
exp(s - m), lse = m + log(l), p = exp(s - lse), di = rowsum(o * do), ds = p * (do v^T - di).
The kernels exponentiate in base 2: they scale q k^T by sm_scale * log2(e) and take exp2, which
is exp without its own multiply by log2(e) (one VPU pass over the score tile fewer); m lives in
these base-2 units, lse in natural ones.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gla_tpu.ops.attention.mosaic_tpu import blocks, rows
from gla_tpu.ops.attention.mosaic_tpu.plan import (
    KernelConfig,
    backward_sub_block,
    cost_estimate,
)
from gla_tpu.ops.attention.scores import base2_scores
from gla_tpu.ops.common.base2 import LN_2, LOG2_E
from gla_tpu.ops.common.masks import attention_visibility
from gla_tpu.ops.common.products import product
from gla_tpu.ops.common.tpu import LANES


def _run_where_visible(cfg: KernelConfig, q_block, kv_block, bq: int, bkv: int, compute):
    """Runs `compute(masked)` for this (q block, kv block) step, where causal or windowed only if
    the q block sees a key of the kv block (blocks.py). `masked` is static: whether any block of
    the kernel needs the visibility mask (causal, a window, segment ids, padded keys). One copy
    of the body serves every block: a second, mask-free copy for the blocks inside the mask
    would save its arithmetic there (libtpu's estimate: 0.5% of the causal D = 128 forward on
    v5e, 2.5% on v6e) and cost half as much compile time again (docs/attention_mosaic_tpu.md,
    "Causal block skipping")."""
    if cfg.bounded:
        pl.when(blocks.has_visible_key(cfg, q_block, kv_block, bq, bkv))(
            lambda: compute(cfg.masked))
    else:
        compute(cfg.masked)


def _scores(cfg: KernelConfig, qk):
    """(base-2 scores, the soft cap's derivative or None) from q k^T (attention/scores.py)."""
    return base2_scores(qk, cfg.sm_scale, cfg.logits_soft_cap)


def _lanes_to(x, width: int):
    """A [rows, 128] array with equal lanes, as [rows, width]: tiled (free) and/or sliced."""
    reps, rest = divmod(width, LANES)
    if not rest:
        return jnp.tile(x, (1, reps))
    if not reps:
        return x[:, :width]
    return jnp.concatenate([jnp.tile(x, (1, reps)), x[:, :rest]], axis=1)


def _visibility(cfg: KernelConfig, q_pos, k_pos, q_seg, kv_seg):
    """Bool mask of the block (shape of q_pos/k_pos broadcast)."""
    mask = attention_visibility(
        q_pos, k_pos, causal=cfg.causal, offset=cfg.offset, q_seg=q_seg, kv_seg=kv_seg,
        window=cfg.window,
    )
    if cfg.kv_padded:
        mask = jnp.logical_and(mask, k_pos < cfg.kv_len)
    return mask


def _column(row_ref):
    """A [1, n] row block as an [n, 1] column (lane-major to sublane-major)."""
    return row_ref[0][:, None]


def _compiler_params(cfg: KernelConfig, semantics, vmem_limit_bytes=None):
    return pltpu.CompilerParams(dimension_semantics=semantics,
                                vmem_limit_bytes=vmem_limit_bytes or cfg.vmem_limit_bytes)


def _call_name(kind: str, cfg: KernelConfig, bq: int, bkv: int) -> str:
    causal = "_causal" if cfg.causal else ""
    window = "" if cfg.window is None else f"_window={cfg.window[0]}_{cfg.window[1]}"
    cap = "" if cfg.logits_soft_cap is None else "_softcap"
    return f"flash_{kind}{causal}{window}{cap}_d{cfg.head_dim}_block_q={bq}_block_kv={bkv}"


def _sub_start(c, size: int):
    """The first row of sub-block c (an int, or a traced int32 in a loop) of `size` rows."""
    return c * size if isinstance(c, int) else pl.multiple_of(c * size, size)


def _plus(x, start):
    """x + start, where start is a traced sub-block start (as is x where start is the int 0)."""
    return x if isinstance(start, int) and start == 0 else x + start


def _sub_loop(steps: int, body) -> None:
    """body(c) for c < steps: inline for one step, else a loop (not unrolled)."""
    if steps == 1:
        body(0)
    else:
        pl.loop(0, steps)(body)


# Forward.


def _forward_head(cfg: KernelConfig, i, step, read_q, read_kv, write_o, lse_ref, m_sc, acc_sc,
                  sums_sc, q_seg_ref, kv_seg_ref):
    """One head's online softmax at grid step (q block i, inner step `step`, the kv block
    `blocks.kv_block_at`): the state starts at the first step (`_forward_init`), takes the kv
    block where the q block sees it (`_forward_update`), and o and lse are written after the
    last step (`_forward_finalize`).

    read_q() -> q [bq, D]; read_kv(cols) -> (k, v) [bkc, D] for a slice of the kv block's rows;
    write_o(o) stores o [bq, D] float32; lse_ref a [1, bq] row. m_sc [bq, 128]; with row sums on
    the VPU acc_sc [bq, D] and sums_sc = l [bq, 128]; on the MXU acc_sc = [l | acc]
    [bq, 128 + D] and sums_sc = vx = [ones | v] [bkc, 128 + D] (the ones go first so that every
    slice starts on a lane tile)."""
    bq, bkv = cfg.block_q, cfg.block_kv
    pl.when(step == 0)(lambda: _forward_init(cfg, m_sc, acc_sc, sums_sc))
    _forward_update(cfg, i, blocks.kv_block_at(cfg, i, step, bq, bkv), read_q, read_kv, m_sc,
                    acc_sc, sums_sc, q_seg_ref, kv_seg_ref)
    pl.when(step == blocks.kv_steps(cfg, bq, bkv) - 1)(
        lambda: _forward_finalize(cfg, write_o, lse_ref, m_sc, acc_sc, sums_sc))


def _forward_init(cfg: KernelConfig, m_sc, acc_sc, sums_sc):
    """The online softmax's state before the first kv block (of one head, or with a leading head
    axis, of every head)."""
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
    if cfg.row_sum_on_mxu:
        sums_sc[:, :LANES] = jnp.ones((cfg.block_kv_compute, LANES), sums_sc.dtype)
    else:
        sums_sc[...] = jnp.zeros(sums_sc.shape, jnp.float32)


def _forward_update(cfg: KernelConfig, i, j, read_q, read_kv, m_sc, acc_sc, sums_sc, q_seg_ref,
                    kv_seg_ref):
    """One head's state takes kv block j where q block i sees it (`_forward_head`'s arguments)."""
    l_sc, vx_sc = (None, sums_sc) if cfg.row_sum_on_mxu else (sums_sc, None)
    bq, bkv, bkc = cfg.block_q, cfg.block_kv, cfg.block_kv_compute

    def compute(masked: bool):
        q = read_q()  # [bq, D]
        q_seg = _column(q_seg_ref) if cfg.has_segments else None  # [bq, 1]
        for c in range(bkv // bkc):
            cols = slice(c * bkc, (c + 1) * bkc)
            k, v = read_kv(cols)  # [bkc, D] each
            s, _ = _scores(cfg, product(q, k, "nt"))  # [bq, bkc], base-2 units
            if masked:
                q_pos = i * bq + lax.broadcasted_iota(jnp.int32, s.shape, 0)
                k_pos = j * bkv + c * bkc + lax.broadcasted_iota(jnp.int32, s.shape, 1)
                kv_seg = kv_seg_ref[:, cols] if cfg.has_segments else None  # [1, bkc]
                s = jnp.where(_visibility(cfg, q_pos, k_pos, q_seg, kv_seg), s, -jnp.inf)
            m_prev = m_sc[...]  # [bq, 128], lanes equal
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            shift = m_next
            if masked:
                # A row with no visible key so far keeps m = -inf; shift it by 0 so that
                # exp2(-inf - shift) = 0 and no inf - inf appears. (Without a mask every row
                # sees a key, so m is finite.)
                shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # [bq, 128]
            alpha = jnp.exp2(m_prev - shift)  # [bq, 128]
            p = jnp.exp2(s - _lanes_to(shift, bkc))  # [bq, bkc]
            if cfg.row_sum_on_mxu:
                vx_sc[:, LANES:] = v
                # [bq, 128 + D]: l's increment (the sum of p as the product rounds it), p v
                pv = product(p.astype(v.dtype), vx_sc[...])
            else:
                l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
                pv = product(p.astype(v.dtype), v)  # [bq, D]
            acc_sc[...] = _lanes_to(alpha, acc_sc.shape[1]) * acc_sc[...] + pv
            m_sc[...] = m_next

    _run_where_visible(cfg, i, j, bq, bkv, compute)


def _forward_finalize(cfg: KernelConfig, write_o, lse_ref, m_sc, acc_sc, sums_sc):
    """One head's o and lse after the last kv block (`_forward_head`'s arguments)."""
    l = acc_sc[:, :LANES] if cfg.row_sum_on_mxu else sums_sc[...]  # [bq, 128], lanes equal
    acc = acc_sc[:, LANES:] if cfg.row_sum_on_mxu else acc_sc[...]  # [bq, D]
    seen = l > 0.0
    inv_l = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
    write_o(acc * _lanes_to(inv_l, cfg.head_dim))
    # A row that sees no key gets lse = +inf, so exp(s - lse) = 0 in the backward.
    lse = jnp.where(seen, m_sc[...] * LN_2 + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
    # [bq, 128] with equal lanes -> the [1, bq] row the backward reads (one transpose per q
    # block; an lse stored replicated over 128 lanes would cost 128x its bytes in HBM).
    lse_ref[...] = jnp.transpose(lse)[:1, :]


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, cfg: KernelConfig):
    """Head-major blocks: q [bq, D], k, v [bkv, D] of one head; grid (b, head, i, j)."""
    q_seg_ref, kv_seg_ref, refs = _segment_refs(cfg, refs)
    o_ref, lse_ref, m_sc, acc_sc, sums_sc = refs

    def write_o(o):
        o_ref[...] = o.astype(o_ref.dtype)

    _forward_head(cfg, pl.program_id(2), pl.program_id(3), lambda: q_ref[...],
                  lambda cols: (k_ref[cols, :], v_ref[cols, :]), write_o, lse_ref, m_sc, acc_sc,
                  sums_sc, q_seg_ref, kv_seg_ref)


def _fwd_rows_kernel(q_hbm, k_hbm, v_hbm, *refs, cfg: KernelConfig):
    """Every head per block (plan.forward_reads_rows): q [B, Tp * H, 128] with head h of token t
    at row t * H + h (the [B, Tp, H, 128] input by a free reshape), k and v likewise with Hkv
    heads, in HBM; grid (b, i, j). The kernel fetches their blocks itself (`rows.RowStream`: q's
    per q block, k's and v's per kv block) and runs the heads in a loop, each on strided row
    reads; o is gathered in float32 by strided row writes and stored token-major in 512-row
    chunks by a loop (`_O_STORE_ROWS`). The state scratch has a leading head axis."""
    q_seg_ref, kv_seg_ref, refs = _segment_refs(cfg, refs)
    o_ref, lse_ref, m_sc, acc_sc, sums_sc, o_sc, *stream_refs = refs
    bq, bkv = cfg.block_q, cfg.block_kv
    h_q = cfg.num_heads
    i, step = pl.program_id(1), pl.program_id(2)
    j = blocks.kv_block_at(cfg, i, step, bq, bkv)
    stream = _row_stream(cfg, [(q_hbm, h_q, bq)], [
        (k_hbm, cfg.num_kv_heads, bkv), (v_hbm, cfg.num_kv_heads, bkv)], stream_refs,
        functools.partial(_kv_blocks_seen, cfg, bq, bkv))
    pl.when(step == 0)(lambda: _forward_init(cfg, m_sc, acc_sc, sums_sc))

    def step_compute(read):
        def head_step(h):
            hk = h // cfg.group
            _forward_update(
                cfg, i, j, lambda: read(0, h, 0, bq),
                lambda cols: (read(1, hk, cols.start, cols.stop - cols.start),
                              read(2, hk, cols.start, cols.stop - cols.start)),
                m_sc.at[h], acc_sc.at[h], sums_sc if cfg.row_sum_on_mxu else sums_sc.at[h],
                q_seg_ref, kv_seg_ref)

        rows.each_head(h_q, head_step)

    stream.run(step_compute)

    @pl.when(step == blocks.kv_steps(cfg, bq, bkv) - 1)
    def _finalize():
        def head_step(h):
            def write_o(o):
                o_sc[pl.ds(h, bq, stride=h_q), :] = o

            _forward_finalize(cfg, write_o, lse_ref.at[h], m_sc.at[h], acc_sc.at[h],
                              sums_sc if cfg.row_sum_on_mxu else sums_sc.at[h])

        rows.each_head(h_q, head_step)
        # a divisor of bq * H (a multiple of 128: bq is), e.g. 256 at bq = 128, H = 6
        size = math.gcd(_O_STORE_ROWS, bq * h_q)

        def store(c):  # o in the output's dtype, a loop over chunks of rows (code of one)
            chunk = pl.ds(_sub_start(c, size), size)
            o_ref[0, chunk, :] = o_sc[chunk, :].astype(o_ref.dtype)

        _sub_loop(bq * h_q // size, store)


# Rows of o that the rows forward casts and stores per step of its last loop, at most (the
# greatest common divisor with bq * H): the kernel's code stays that of one chunk (storing o's
# bq * H rows at once cost 6-16% of the forward's compile time at bq = 1024; the loop, 0.1-0.2%
# of its estimated cycles).
_O_STORE_ROWS = 512


def _segment_refs(cfg: KernelConfig, refs):
    """(q segment ids ref, kv segment ids ref, the other refs): the ids come first where there
    are segments, else (None, None)."""
    refs = list(refs)
    if cfg.has_segments:
        return refs[0], refs[1], refs[2:]
    return None, None, refs


def _row_stream(cfg: KernelConfig, row_operands, step_operands, stream_refs, visible):
    """The rows.RowStream of a rows kernel: operands (hbm ref [B, N * Hx, 128], Hx, block
    tokens), their scratch `stream_refs` (`_stream_scratch`), visible(r) -> (lo, hi)."""
    ops = [rows.operand(x, hx, block, cfg.interpret) for x, hx, block in
           (*row_operands, *step_operands)]
    buffers = tuple(zip(stream_refs[:-1:2], stream_refs[1:-1:2]))
    return rows.RowStream(tuple(ops[:len(row_operands)]), tuple(ops[len(row_operands):]),
                          buffers, stream_refs[-1], visible, cfg.stream_across_rows,
                          steps_from_lo=blocks.windowed(cfg))


def _stream_scratch(cfg: KernelConfig, dtype, operands) -> list:
    """The scratch of `_row_stream` over operands [(Hx, block tokens)] of `dtype`."""
    return rows.stream_scratch([(dtype, hx, block) for hx, block in operands], cfg.interpret)


def _rows_semantics(cfg: KernelConfig) -> tuple:
    """The rows forward's grid (b, i, j) semantics: "arbitrary" throughout where the stream
    fetches across q blocks, which needs the grid run in order (rows.RowStream); else the q
    blocks split between cores."""
    if cfg.stream_across_rows:
        return ("arbitrary",) * 3
    return ("parallel", "parallel", "arbitrary")


def _kv_blocks_seen(cfg: KernelConfig, bq: int, bkv: int, i):
    """(lo, hi): the kv blocks q block i may see (blocks.kv_range), as a traced int32 range;
    lo > hi where it sees none."""
    return blocks.kv_range(cfg, i, bq, bkv)


def _rows_out(shape, dtype, rows: int, index_map, token_major: bool):
    """(ShapeDtypeStruct, BlockSpec) of an output written in (rows, D) blocks: head-major
    `shape` [B, Hx, N, D] at index_map's (b, head, block, 0), or (token_major, D a multiple of
    128) the same blocks of [B, N, Hx * D] at (b, block, head), which is [B, N, Hx, D] by a free
    reshape: the API's layout, no transpose after the kernel."""
    b, hx, n, d = shape
    if not token_major:
        return jax.ShapeDtypeStruct(shape, dtype), pl.BlockSpec((None, None, rows, d), index_map)

    def token_map(*grid_index):
        bi, hi, block, _ = index_map(*grid_index)
        return bi, block, hi

    return (jax.ShapeDtypeStruct((b, n, hx * d), dtype),
            pl.BlockSpec((None, rows, d), token_map))


def _q_major_maps(cfg: KernelConfig, bq: int, bkv: int):
    """Index maps of the (batch, head, q block, kv block) grids of the forward and dq kernels.

    Returns (q_map, kv_map, segment BlockSpecs [q ids, kv ids]). With causal masking or a
    window, the kv blocks outside the q block's range are skipped; kv_map re-points them to the
    nearest needed block so the pipeline sees an unchanged index and fetches nothing. The kv head
    is the query head divided by the group size (GQA without repeating k/v).
    """

    def q_map(bi, hi, i, step):
        return bi, hi, i, 0

    def kv_map(bi, hi, i, step):
        j = blocks.kv_block_at(cfg, i, step, bq, bkv)
        if cfg.bounded:
            j = blocks.clamp_into(j, blocks.kv_range(cfg, i, bq, bkv))
        return bi, lax.div(hi, cfg.group), j, 0

    def kv_seg_map(bi, hi, i, j):
        _, _, j, _ = kv_map(bi, hi, i, j)
        return bi, 0, j

    seg_specs = [
        pl.BlockSpec((None, 1, bq), lambda bi, hi, i, j: (bi, 0, i)),
        pl.BlockSpec((None, 1, bkv), kv_seg_map),
    ]
    return q_map, kv_map, seg_specs


def _forward_scratch(cfg: KernelConfig, heads: tuple, dtype) -> list:
    """The forward's state: m, then [l | acc] and vx (row sums on the MXU) or acc and l, each with
    the leading `heads` dims ((), or (H,) for the token-major kernel; vx is shared)."""
    bq, d = cfg.block_q, cfg.head_dim
    scratch = [pltpu.VMEM((*heads, bq, LANES), jnp.float32)]  # m
    if cfg.row_sum_on_mxu:
        return scratch + [
            pltpu.VMEM((*heads, bq, LANES + d), jnp.float32),  # [l | acc]
            pltpu.VMEM((cfg.block_kv_compute, LANES + d), dtype),  # vx = [ones | v]
        ]
    return scratch + [
        pltpu.VMEM((*heads, bq, d), jnp.float32),  # acc
        pltpu.VMEM((*heads, bq, LANES), jnp.float32),  # l
    ]


def flash_forward(cfg: KernelConfig, q, k, v, q_seg, kv_seg, *, out_dtype=None,
                  token_major_out: bool = False):
    """Returns o [B, H, Tp, D] (token_major_out: [B, Tp, H * D], D a multiple of 128) in
    `out_dtype` (default q's dtype) and lse [B, H, 1, Tp] float32 rows."""
    b, h, tp, d = q.shape
    bq, bkv = cfg.block_q, cfg.block_kv
    grid = (b, h, tp // bq, blocks.kv_steps(cfg, bq, bkv))
    q_map, kv_map, seg_specs = _q_major_maps(cfg, bq, bkv)
    in_specs = [
        pl.BlockSpec((None, None, bq, d), q_map),
        pl.BlockSpec((None, None, bkv, d), kv_map),
        pl.BlockSpec((None, None, bkv, d), kv_map),
    ]
    o_shape, o_spec = _rows_out(q.shape, out_dtype or q.dtype, bq, q_map, token_major_out)
    lse_spec = pl.BlockSpec((None, None, 1, bq), lambda bi, hi, i, j: (bi, hi, 0, i))
    return _forward_call(cfg, _fwd_kernel, grid, [q, k, v], in_specs, seg_specs,
                         [o_shape, o_spec], lse_spec, _forward_scratch(cfg, (), v.dtype),
                         ("parallel", "parallel", "parallel", "arbitrary"), q_seg, kv_seg)


def flash_forward_rows(cfg: KernelConfig, q, k, v, q_seg, kv_seg):
    """The forward on the API's layout (plan.forward_reads_rows): q [B, Tp, H, 128], k, v
    [B, Sp, Hkv, 128]; returns o [B, Tp, H, 128] in q's dtype and lse [B, H, 1, Tp] float32 rows.
    Every block holds all heads, so no head-major copy is made (docs/attention_mosaic_tpu.md,
    "Layout")."""
    b, tp, h, d = q.shape
    hkv = k.shape[2]
    bq, bkv = cfg.block_q, cfg.block_kv
    grid = (b, tp // bq, blocks.kv_steps(cfg, bq, bkv))
    head_map, kv_head_map, seg_specs = _q_major_maps(cfg, bq, bkv)

    def q_map(bi, i, j):
        return bi, head_map(bi, 0, i, j)[2], 0

    def kv_map(bi, i, j):
        return bi, kv_head_map(bi, 0, i, j)[2], 0

    seg_specs = [pl.BlockSpec(spec.block_shape, functools.partial(
        lambda index_map, bi, i, j: index_map(bi, 0, i, j), spec.index_map))
        for spec in seg_specs]
    # q, k and v stay in HBM: the kernel fetches their blocks itself (rows.RowStream)
    in_specs = [pl.BlockSpec(memory_space=pl.ANY)] * 3
    o_out = [jax.ShapeDtypeStruct(rows.rows_view(q).shape, q.dtype),
             pl.BlockSpec((1, bq * h, d), q_map)]
    lse_spec = pl.BlockSpec((None, h, 1, bq), lambda bi, i, j: (bi, 0, 0, i))
    scratch = _forward_scratch(cfg, (h,), v.dtype)
    scratch.append(pltpu.VMEM((bq * h, d), jnp.float32))  # o of every head, token-major
    scratch += _stream_scratch(cfg, q.dtype, [(h, bq), (hkv, bkv), (hkv, bkv)])
    o, lse = _forward_call(cfg, _fwd_rows_kernel, grid, [rows.rows_view(x) for x in (q, k, v)],
                           in_specs, seg_specs, o_out, lse_spec, scratch,
                           _rows_semantics(cfg), q_seg, kv_seg)
    return o.reshape(b, tp, h, d), lse


def _forward_call(cfg, kernel, grid, args, in_specs, seg_specs, o_out, lse_spec, scratch,
                  semantics, q_seg, kv_seg):
    """The forward's pallas_call; the kv axis (last) carries the online softmax."""
    if cfg.has_segments:
        in_specs = in_specs + seg_specs
        args = args + [q_seg, kv_seg]
    o_shape, o_spec = o_out
    b, h, tp = cfg.batch, cfg.num_heads, cfg.q_len_padded
    out_shape = [o_shape, jax.ShapeDtypeStruct((b, h, 1, tp), jnp.float32)]
    name = _call_name("fwd", cfg, cfg.block_q, cfg.block_kv)
    with jax.named_scope(name):
        return pl.pallas_call(
            functools.partial(kernel, cfg=cfg),
            out_shape=out_shape,
            grid=grid,
            in_specs=in_specs,
            out_specs=[o_spec, lse_spec],
            scratch_shapes=scratch,
            compiler_params=_compiler_params(cfg, semantics, cfg.forward_vmem_limit_bytes),
            cost_estimate=cost_estimate(cfg, passes=1, arrays=args, out_shape=out_shape),
            interpret=cfg.interpret,
            name=name,
        )(*args)


# Backward: dq.


def _dq_head(cfg: KernelConfig, i, step, read, lse_ref, di_ref, dq_sc, write_dq, q_seg_ref,
             kv_seg_ref):
    """One head's dq at grid step (q block i, inner step `step`, the kv block
    `blocks.kv_block_at`): read(start, size) -> (q, k, v, do), q and do [bq, D], k and v
    [size, D] the rows start..start + size of the kv block (its `plan.backward_sub_block`s);
    lse_ref, di_ref [1, bq] rows; dq_sc [bq, D] float32; write_dq(dq) stores the scaled float32
    dq after the last step."""
    bq, bkv = cfg.block_q_dq, cfg.block_kv_dq
    bkc = backward_sub_block(bkv)
    j = blocks.kv_block_at(cfg, i, step, bq, bkv)

    @pl.when(step == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    def sub_step(masked: bool, c):
        start = _sub_start(c, bkc)
        q, k, v, do = read(start, bkc)
        s, cap_grad = _scores(cfg, product(q, k, "nt"))  # [bq, bkc], base-2 units
        p = jnp.exp2(s - _column(lse_ref) * LOG2_E)  # [bq, bkc]
        if masked:
            q_pos = i * bq + lax.broadcasted_iota(jnp.int32, s.shape, 0)
            k_pos = _plus(j * bkv, start) + lax.broadcasted_iota(jnp.int32, s.shape, 1)
            q_seg = _column(q_seg_ref) if cfg.has_segments else None  # [bq, 1]
            kv_seg = kv_seg_ref[:, pl.ds(start, bkc)] if cfg.has_segments else None  # [1, bkc]
            p = jnp.where(_visibility(cfg, q_pos, k_pos, q_seg, kv_seg), p, 0.0)
        dp = product(do, v, "nt")  # [bq, bkc]
        ds = p * (dp - _column(di_ref))
        if cap_grad is not None:
            ds = ds * cap_grad
        dq_sc[...] += product(ds.astype(k.dtype), k)  # [bq, D]

    def compute(masked: bool):
        _sub_loop(bkv // bkc, lambda c: sub_step(masked, c))

    _run_where_visible(cfg, i, j, bq, bkv, compute)

    @pl.when(step == blocks.kv_steps(cfg, bq, bkv) - 1)
    def _finalize():
        write_dq(dq_sc[...] * cfg.sm_scale)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, *refs, cfg: KernelConfig):
    """Head-major blocks of one head; grid (b, head, i, j)."""
    q_seg_ref, kv_seg_ref, refs = _segment_refs(cfg, refs)
    dq_ref, dq_sc = refs

    def write_dq(dq):
        dq_ref[...] = dq.astype(dq_ref.dtype)

    _dq_head(cfg, pl.program_id(2), pl.program_id(3),
             lambda start, size: (q_ref[...], k_ref[pl.ds(start, size), :],
                                  v_ref[pl.ds(start, size), :], do_ref[...]),
             lse_ref, di_ref, dq_sc,
             write_dq, q_seg_ref, kv_seg_ref)


def _backward_in_specs(bq: int, bkv: int, d: int, q_map, kv_map, row_map):
    """BlockSpecs of the backward kernels' inputs q, k, v, do, lse, di; the grids differ (q-major
    for dq, kv-major for dk/dv), the blocks do not."""
    return [
        pl.BlockSpec((None, None, bq, d), q_map),
        pl.BlockSpec((None, None, bkv, d), kv_map),
        pl.BlockSpec((None, None, bkv, d), kv_map),
        pl.BlockSpec((None, None, bq, d), q_map),
        pl.BlockSpec((None, None, 1, bq), row_map),
        pl.BlockSpec((None, None, 1, bq), row_map),
    ]


def flash_dq(cfg: KernelConfig, q, k, v, do, lse, di, q_seg, kv_seg, *, out_dtype=None,
             token_major_out: bool = False):
    """dq [B, H, Tp, D] (token_major_out: [B, Tp, H * D]) in `out_dtype` (default q's dtype);
    lse, di [B, H, 1, Tp] float32."""
    b, h, tp, d = q.shape
    bq, bkv = cfg.block_q_dq, cfg.block_kv_dq
    grid = (b, h, tp // bq, blocks.kv_steps(cfg, bq, bkv))
    q_map, kv_map, seg_specs = _q_major_maps(cfg, bq, bkv)

    def row_map(bi, hi, i, step):
        return bi, hi, 0, i

    in_specs = _backward_in_specs(bq, bkv, d, q_map, kv_map, row_map)
    args = [q, k, v, do, lse, di]
    if cfg.has_segments:
        in_specs += seg_specs
        args += [q_seg, kv_seg]
    out_shape, out_spec = _rows_out(q.shape, out_dtype or q.dtype, bq, q_map, token_major_out)
    name = _call_name("bwd_dq", cfg, bq, bkv)
    with jax.named_scope(name):
        return pl.pallas_call(
            functools.partial(_dq_kernel, cfg=cfg),
            out_shape=out_shape,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_spec,
            scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)],
            compiler_params=_compiler_params(
                cfg, ("parallel", "parallel", "parallel", "arbitrary")
            ),
            cost_estimate=cost_estimate(cfg, passes=2, arrays=args, out_shape=[out_shape]),
            interpret=cfg.interpret,
            name=name,
        )(*args)


# Backward: dk and dv, computed transposed (keys on sublanes, queries on lanes) so that the
# per-query rows lse and di broadcast without a relayout.


def _dkv_head(cfg: KernelConfig, j, i, read, lse_ref, di_ref, dk_sc, dv_sc, q_seg_ref,
              kv_seg_ref, add_dq=None):
    """One query head's share of dk and dv at grid step (kv block j, q block i): read(start,
    size) -> (q, k, v, do), q and do [size, D] the rows start..start + size of the q block (its
    `plan.backward_sub_block`s), k and v [bkv, D]; lse_ref, di_ref [1, bq] rows; accumulates
    into dk_sc, dv_sc [bkv, D]. With `add_dq` (the one-kernel backward), also this kv block's
    share of dq from the tile: add_dq(c, ds^T [bkv, sub-block] in q's dtype) for sub-block c."""
    bq, bkv = cfg.block_q_dkv, cfg.block_kv_dkv
    bqc = backward_sub_block(bq)

    def sub_step(masked: bool, c):
        start = _sub_start(c, bqc)
        cols = pl.ds(start, bqc) if bqc < bq else slice(None)
        q, k, v, do = read(start, bqc)
        s_t, cap_grad = _scores(cfg, product(k, q, "nt"))  # [bkv, bqc], base-2 units
        p_t = jnp.exp2(s_t - lse_ref[:, cols] * LOG2_E)  # [bkv, bqc]; lse row [1, bqc]
        if masked:
            k_pos = j * bkv + lax.broadcasted_iota(jnp.int32, s_t.shape, 0)
            q_pos = _plus(i * bq, start) + lax.broadcasted_iota(jnp.int32, s_t.shape, 1)
            q_seg = q_seg_ref[:, cols] if cfg.has_segments else None  # [1, bqc]
            kv_seg = _column(kv_seg_ref) if cfg.has_segments else None  # [bkv, 1]
            p_t = jnp.where(_visibility(cfg, q_pos, k_pos, q_seg, kv_seg), p_t, 0.0)
        dv_sc[...] += product(p_t.astype(do.dtype), do)  # [bkv, D]
        dp_t = product(v, do, "nt")
        ds_t = p_t * (dp_t - di_ref[:, cols])  # [bkv, bqc]
        if cap_grad is not None:
            ds_t = ds_t * cap_grad
        ds_t = ds_t.astype(q.dtype)
        dk_sc[...] += product(ds_t, q)  # [bkv, D]
        if add_dq is not None:
            add_dq(c, ds_t)

    def compute(masked: bool):
        _sub_loop(bq // bqc, lambda c: sub_step(masked, c))

    _run_where_visible(cfg, i, j, bq, bkv, compute)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, *refs, cfg: KernelConfig):
    """Head-major blocks; grid (b, kv head, j, query head in group, i)."""
    q_seg_ref, kv_seg_ref, (dk_ref, dv_ref, dk_sc, dv_sc) = _segment_refs(cfg, refs)
    _dkv_steps(cfg, (q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, q_seg_ref, kv_seg_ref),
               (dk_ref, dv_ref, dk_sc, dv_sc))


def _dkv_steps(cfg: KernelConfig, ins, outs, add_dq=None):
    """The dk/dv kernels' grid step (b, kv head, j, query head in group, i): zero the
    accumulators at the kv block's first step, add this step's share (`_dkv_head`), write dk and
    dv after its last. ins: (q, k, v, do, lse, di, q segment, kv segment) refs; outs: (dk, dv
    refs, their float32 accumulators)."""
    q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, q_seg_ref, kv_seg_ref = ins
    dk_ref, dv_ref, dk_sc, dv_sc = outs
    j, gi, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    q_block = blocks.q_block_at(cfg, j, i, cfg.block_q_dkv, cfg.block_kv_dkv)

    @pl.when(jnp.logical_and(gi == 0, i == 0))
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    _dkv_head(cfg, j, q_block,
              lambda start, size: (q_ref[pl.ds(start, size), :], k_ref[...], v_ref[...],
                                   do_ref[pl.ds(start, size), :]),
              lse_ref, di_ref, dk_sc, dv_sc, q_seg_ref, kv_seg_ref, add_dq)

    @pl.when(jnp.logical_and(gi == pl.num_programs(3) - 1, i == pl.num_programs(4) - 1))
    def _finalize():
        dk_ref[...] = (dk_sc[...] * cfg.sm_scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dkv_q_block(cfg: KernelConfig, j, i):
    """The q block the dk/dv kernels fetch at (kv block j, inner step i): causal or windowed,
    the steps outside the range of q blocks that see kv block j are pointed at its edge."""
    bq, bkv = cfg.block_q_dkv, cfg.block_kv_dkv
    i = blocks.q_block_at(cfg, j, i, bq, bkv)
    if cfg.bounded:
        return blocks.clamp_into(i, blocks.q_range(cfg, j, bq, bkv))
    return i


def _kv_major_inputs(cfg: KernelConfig, q, k, v, do, lse, di, q_seg, kv_seg):
    """(grid, input BlockSpecs, inputs, kv_map) of the kv-major backward kernels (dk/dv, and the
    one-kernel backward): grid (b, kv head, kv block j, query head in group, q step i)."""
    b, hkv, sp, d = k.shape
    bq, bkv = cfg.block_q_dkv, cfg.block_kv_dkv
    g = cfg.group
    grid = (b, hkv, sp // bkv, g, blocks.q_steps(cfg, bq, bkv))
    q_block = functools.partial(_dkv_q_block, cfg)

    def q_map(bi, ni, j, gi, i):
        return bi, ni * g + gi, q_block(j, i), 0

    def row_map(bi, ni, j, gi, i):
        return bi, ni * g + gi, 0, q_block(j, i)

    def kv_map(bi, ni, j, gi, i):
        return bi, ni, j, 0

    in_specs = _backward_in_specs(bq, bkv, d, q_map, kv_map, row_map)
    args = [q, k, v, do, lse, di]
    if cfg.has_segments:
        in_specs += [
            pl.BlockSpec((None, 1, bq), lambda bi, ni, j, gi, i: (bi, 0, q_block(j, i))),
            pl.BlockSpec((None, 1, bkv), lambda bi, ni, j, gi, i: (bi, 0, j)),
        ]
        args += [q_seg, kv_seg]
    return grid, in_specs, args, kv_map


def flash_dkv(cfg: KernelConfig, q, k, v, do, lse, di, q_seg, kv_seg, *, out_dtype=None,
              token_major_out: bool = False):
    """(dk, dv) [B, Hkv, Sp, D] (token_major_out: [B, Sp, Hkv * D]) in `out_dtype` (default k's
    dtype), summed over the G query heads of each kv head."""
    bq, bkv, d = cfg.block_q_dkv, cfg.block_kv_dkv, cfg.head_dim
    # (batch, kv head, kv block) parallel; (query head in group, q block) accumulate.
    grid, in_specs, args, kv_map = _kv_major_inputs(cfg, q, k, v, do, lse, di, q_seg, kv_seg)
    outs = [_rows_out(x.shape, out_dtype or x.dtype, bkv, kv_map, token_major_out)
            for x in (k, v)]
    out_shape = [shape for shape, _ in outs]
    name = _call_name("bwd_dkv", cfg, bq, bkv)
    with jax.named_scope(name):
        return pl.pallas_call(
            functools.partial(_dkv_kernel, cfg=cfg),
            out_shape=out_shape,
            grid=grid,
            in_specs=in_specs,
            out_specs=[spec for _, spec in outs],
            scratch_shapes=[pltpu.VMEM((bkv, d), jnp.float32), pltpu.VMEM((bkv, d), jnp.float32)],
            compiler_params=_compiler_params(
                cfg, ("parallel", "parallel", "parallel", "arbitrary", "arbitrary")
            ),
            cost_estimate=cost_estimate(cfg, passes=3, arrays=args, out_shape=out_shape),
            interpret=cfg.interpret,
            name=name,
        )(*args)


# Backward in one kernel: dk and dv as `flash_dkv` computes them, and dq from the same ds tile.
# The two-kernel backward computes s, p and dp twice (7 block products); this one once (5). dq is
# accumulated for the kv head's whole (padded) query sequence in VMEM, transposed: one [D, sub]
# float32 tile per q sub-block, updated by k^T ds^T, a plain product of k^T (transposed once per
# kv block) and the dk/dv body's ds^T tile, so that no step transposes a score tile. The tiles
# are transposed back once, as dq is written.


def _dqkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, *refs, cfg: KernelConfig,
                 token_major: bool):
    """Head-major blocks; grid (b, kv head, j, query head in group, i). dq_ref: the group's dq,
    [G, Tp, D] (token-major: [Tp, G * D]), written after the last step; dqt_sc
    [G, Tp / sub, D, sub] float32 (sub = `plan.backward_sub_block(block_q_dkv)`); kt_sc
    [D, block_kv_dkv], this kv block's k^T."""
    q_seg_ref, kv_seg_ref, refs = _segment_refs(cfg, refs)
    dq_ref, dk_ref, dv_ref, dqt_sc, dk_sc, dv_sc, kt_sc = refs
    j, gi, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    bq, d = cfg.block_q_dkv, cfg.head_dim
    sub = backward_sub_block(bq)
    q_block = blocks.q_block_at(cfg, j, i, bq, cfg.block_kv_dkv)
    first = jnp.logical_and(gi == 0, i == 0)  # of kv block j
    last = jnp.logical_and(gi == pl.num_programs(3) - 1, i == pl.num_programs(4) - 1)

    @pl.when(jnp.logical_and(j == 0, first))
    def _zero_dq():
        @pl.loop(0, dqt_sc.shape[1])
        def _(n):
            dqt_sc[:, n] = jnp.zeros((cfg.group, d, sub), jnp.float32)

    @pl.when(first)
    def _transpose_k():
        kt_sc[...] = k_ref[...].astype(jnp.float32).T.astype(kt_sc.dtype)

    def add_dq(c, ds_t):
        dqt_sc[gi, q_block * (bq // sub) + c] += product(kt_sc[...], ds_t)  # [D, sub]

    _dkv_steps(cfg, (q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, q_seg_ref, kv_seg_ref),
               (dk_ref, dv_ref, dk_sc, dv_sc), add_dq)

    @pl.when(jnp.logical_and(j == pl.num_programs(2) - 1, last))
    def _write_dq():
        @pl.loop(0, dqt_sc.shape[1])
        def _(n):
            rows_n = pl.ds(pl.multiple_of(n * sub, sub), sub)
            for g in range(cfg.group):
                dq = (dqt_sc[g, n].T * cfg.sm_scale).astype(dq_ref.dtype)  # [sub, D]
                if token_major:
                    dq_ref[rows_n, g * d:(g + 1) * d] = dq
                else:
                    dq_ref[g, rows_n, :] = dq


def flash_dqkv(cfg: KernelConfig, q, k, v, do, lse, di, q_seg, kv_seg, *, out_dtype=None,
               token_major_out: bool = False):
    """(dq [B, H, Tp, D], dk, dv [B, Hkv, Sp, D]) (token_major_out: [B, Tp, H * D] and
    [B, Sp, Hkv * D]) in one kernel (`plan.KernelConfig.fused_backward`), dq in q's dtype, dk and
    dv in k's (or `out_dtype`); dk and dv summed over the G query heads of each kv head."""
    b, hkv, _, d = k.shape
    tp = q.shape[2]
    bq, bkv = cfg.block_q_dkv, cfg.block_kv_dkv
    sub = backward_sub_block(bq)
    g = cfg.group
    # (batch, kv head) parallel; kv block, query head in group and q block accumulate (dq over
    # the kv blocks)
    grid, in_specs, args, kv_map = _kv_major_inputs(cfg, q, k, v, do, lse, di, q_seg, kv_seg)
    dq_dtype = out_dtype or q.dtype
    if token_major_out:
        dq_shape = jax.ShapeDtypeStruct((b, tp, hkv * g * d), dq_dtype)
        dq_spec = pl.BlockSpec((None, tp, g * d), lambda bi, ni, j, gi, i: (bi, 0, ni))
    else:
        dq_shape = jax.ShapeDtypeStruct((b, hkv, g, tp, d), dq_dtype)
        dq_spec = pl.BlockSpec((None, None, g, tp, d), lambda bi, ni, j, gi, i: (bi, ni, 0, 0, 0))
    outs = [_rows_out(x.shape, out_dtype or x.dtype, bkv, kv_map, token_major_out)
            for x in (k, v)]
    out_shape = [dq_shape] + [shape for shape, _ in outs]
    name = _call_name("bwd_dqkv", cfg, bq, bkv)
    with jax.named_scope(name):
        dq, dk, dv = pl.pallas_call(
            functools.partial(_dqkv_kernel, cfg=cfg, token_major=token_major_out),
            out_shape=out_shape,
            grid=grid,
            in_specs=in_specs,
            out_specs=[dq_spec] + [spec for _, spec in outs],
            scratch_shapes=[pltpu.VMEM((g, tp // sub, d, sub), jnp.float32),
                            pltpu.VMEM((bkv, d), jnp.float32), pltpu.VMEM((bkv, d), jnp.float32),
                            pltpu.VMEM((d, bkv), k.dtype)],
            compiler_params=_compiler_params(
                cfg, ("parallel", "parallel", "arbitrary", "arbitrary", "arbitrary"),
                cfg.fused_backward_vmem_limit_bytes),
            cost_estimate=cost_estimate(cfg, passes=4, arrays=args, out_shape=out_shape),
            interpret=cfg.interpret,
            name=name,
        )(*args)
    if not token_major_out:
        dq = dq.reshape(b, hkv * g, tp, d)
    return dq, dk, dv
