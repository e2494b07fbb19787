"""Entry of the "mosaic_tpu" attention backend: what it takes, and the call.

The layout: [B, T, H, D] inputs are padded to the block grid here. At D = 128 the forward reads
them as they are, every head of a q block in one block (plan's forward_reads_rows); otherwise,
and for the backward, the custom_vjp (vjp.py) copies them head-major [B, H, Tp, D], so that every
block's last two dims are (block, D) with D the full dim (D = 64 included). The kernels write o,
dq, dk, dv back in [B, Tp, H, D] where D is a multiple of 128 (vjp.token_major_output). Ring
attention's blocks (below) stay head-major.
Kernels: kernels.py; custom_vjp: vjp.py; tiles and VMEM: plan.py.
Design, VMEM footprints and roofline: docs/attention_mosaic_tpu.md.
"""

from __future__ import annotations

import jax.numpy as jnp

from gla_tpu.ops.attention.mosaic_tpu import kernels, vjp
from gla_tpu.ops.attention.mosaic_tpu.plan import BlockSizes, kernel_config
from gla_tpu.ops.common.capabilities import ATTENTION_FEATURES, Capabilities, Dims
from gla_tpu.ops.common.padding import pad_time

CAPABILITIES = Capabilities(
    op="flash_attention", backend="mosaic_tpu", platform="TPU; CPU with interpret=True",
    # float16 has no native TPU matmul path; the kernels are tested and compiled in these two
    dtypes=("bfloat16", "float32"), dims=(("head_dim", Dims(values=(64, 128, 256))),),
    features=ATTENTION_FEATURES,
    notes="forward, dq and dk/dv kernels (Mosaic); blocks outside the causal mask or the "
          "window skipped; any T, S",
    block_sizes=BlockSizes,
)

def check_supported(problem, block_sizes) -> None:
    CAPABILITIES.check(problem, block_sizes)


def _head_major(x, length_padded: int):
    """[B, T, H, D] -> [B, H, Tp, D], zero-padded along time."""
    return pad_time(jnp.swapaxes(x, 1, 2), length_padded, axis=2)


def _segment_rows(seg, length_padded: int):
    """[B, T] int32 -> [B, 1, Tp] (padding is masked by position, its id does not matter)."""
    return pad_time(seg, length_padded, axis=1)[:, None, :]


def _segments(problem, q_segment_ids, kv_segment_ids, cfg):
    """Segment rows [B, 1, Tp], [B, 1, Sp], or (None, None)."""
    if not problem.has_segments:
        return None, None
    return (_segment_rows(q_segment_ids, cfg.q_len_padded),
            _segment_rows(kv_segment_ids, cfg.kv_len_padded))


def flash_attention(q, k, v, *, problem, q_segment_ids, kv_segment_ids, block_sizes, interpret):
    """Backend entry called by `gla_tpu.ops.flash_attention` after validation.

    Args:
      q: [B, T, H, D]; k, v: [B, S, Hkv, D] (what CAPABILITIES takes).
      problem: the validated AttentionProblem.
      q_segment_ids, kv_segment_ids: [B, T], [B, S] int32, or both None.
      block_sizes: BlockSizes or None for `BlockSizes.default(D)`.
      interpret: False, True (TPU interpret mode, NaN-filled uninitialized memory) or
        a pltpu.InterpretParams.
    Returns:
      o: [B, T, H, D] in q's dtype.
    """
    cfg = kernel_config(problem, block_sizes, interpret)
    tp, sp = cfg.q_len_padded, cfg.kv_len_padded
    q_seg, kv_seg = _segments(problem, q_segment_ids, kv_segment_ids, cfg)
    o = vjp.attention(cfg, pad_time(q, tp), pad_time(k, sp), pad_time(v, sp), q_seg, kv_seg)
    return o[:, : problem.q_len]  # [B, T, H, D]


# The blocks of ring attention (ops/attention/ring.py): one (query block, key block) pair, with
# float32 outputs (the ring sums P of them).


def attention_block(q, k, v, *, problem, q_segment_ids, kv_segment_ids, block_sizes, interpret):
    """o [B, T, H, D] float32 over this block's keys and lse [B, H, T] float32 (-inf for a row
    that sees no key of the block); as `xla.attention_block`."""
    cfg = kernel_config(problem, block_sizes, interpret, rows_kernels=False)
    q_seg, kv_seg = _segments(problem, q_segment_ids, kv_segment_ids, cfg)
    o, lse = kernels.flash_forward(cfg, _head_major(q, cfg.q_len_padded),
                                   _head_major(k, cfg.kv_len_padded),
                                   _head_major(v, cfg.kv_len_padded), q_seg, kv_seg,
                                   out_dtype=jnp.float32)
    lse = lse[:, :, 0, : problem.q_len]
    # the kernel marks a row with no visible key by lse = +inf (p = 0 in its backward)
    return jnp.swapaxes(o[:, :, : problem.q_len], 1, 2), jnp.where(lse == jnp.inf, -jnp.inf, lse)


def attention_block_grads(q, k, v, do, lse, delta, *, problem, q_segment_ids, kv_segment_ids,
                          block_sizes, interpret):
    """This block's float32 dq [B, T, H, D], dk, dv [B, S, Hkv, D] given the whole attention's
    lse and delta [B, H, T]; as `xla.attention_block_grads`."""
    cfg = kernel_config(problem, block_sizes, interpret, rows_kernels=False)
    q_seg, kv_seg = _segments(problem, q_segment_ids, kv_segment_ids, cfg)
    tp, sp = cfg.q_len_padded, cfg.kv_len_padded
    qh, doh = _head_major(q, tp), _head_major(do, tp)
    kh, vh = _head_major(k, sp), _head_major(v, sp)
    # Padded rows: q = do = delta = 0, so whatever p they get adds nothing.
    lse_rows = pad_time(jnp.where(jnp.isfinite(lse), lse, jnp.inf), tp, axis=2)[:, :, None]
    delta_rows = pad_time(delta, tp, axis=2)[:, :, None]
    if cfg.fused_backward:
        dq, dk, dv = kernels.flash_dqkv(cfg, qh, kh, vh, doh, lse_rows, delta_rows, q_seg,
                                        kv_seg, out_dtype=jnp.float32)
    else:
        dq = kernels.flash_dq(cfg, qh, kh, vh, doh, lse_rows, delta_rows, q_seg, kv_seg,
                              out_dtype=jnp.float32)
        dk, dv = kernels.flash_dkv(cfg, qh, kh, vh, doh, lse_rows, delta_rows, q_seg, kv_seg,
                                   out_dtype=jnp.float32)
    back = lambda x, n: jnp.swapaxes(x[:, :, :n], 1, 2)  # noqa: E731
    return back(dq, problem.q_len), back(dk, problem.kv_len), back(dv, problem.kv_len)
