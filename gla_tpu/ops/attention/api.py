"""The public softmax attention op: validation, backend resolution, dispatch."""

from __future__ import annotations

import dataclasses

from gla_tpu.ops.attention import ring as ring_lib
from gla_tpu.ops.attention.validation import validate_attention
from gla_tpu.ops.common import backends
from gla_tpu.ops.common.sharding import kv_for_local_heads, resolve_sharding, sharded_call

# Each backend is the module gla_tpu.ops.attention.<backend>, implementing
# `check_supported(problem, block_sizes)` and
# `flash_attention(q, k, v, *, problem, q_segment_ids, kv_segment_ids, block_sizes, interpret)`.


def flash_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    sm_scale: float | None = None,
    segment_ids=None,
    local_window_size=None,
    logits_soft_cap: float | None = None,
    block_sizes=None,
    backend: str = "auto",
    interpret=False,
    sharding=None,
):
    """Softmax attention `softmax(q k^T * sm_scale + mask) v`, without a [T, S] array in memory.

    Args:
      q: [B, T, H, D] queries.
      k: [B, S, Hkv, D] keys, H % Hkv == 0 (GQA/MQA when Hkv < H).
      v: [B, S, Hkv, D] values; q, k, v share one floating dtype.
      causal: bottom-right aligned: query i sees key j iff j <= i + (S - T).
      sm_scale: logit scale, default D ** -0.5.
      segment_ids: None, a [B, T] int array (T == S), or a pair ([B, T], [B, S]); a query sees
        only keys with its id.
      local_window_size: None, an int w (the pair (w, w)) or a pair (left, right) of ints >= 0,
        as in `jax.nn.dot_product_attention`: query i, at position i + (S - T), sees key j iff
        i + (S - T) - left <= j <= i + (S - T) + right (causal: right = 0). Combines with
        segment ids and GQA.
      logits_soft_cap: None or c > 0: the scores s = sm_scale q k^T become c * tanh(s / c)
        before the softmax (Gemma 2; splash attention's `attn_logits_soft_cap`).
      block_sizes: the backend's BlockSizes (performance only), or None for its defaults.
      backend: "auto", "mosaic_tpu", "pallas_gpu" or "xla".
      interpret: run a Pallas backend in interpret mode on CPU (True, or the backend's interpret
        parameters object).
      sharding: None, or a `jax.sharding.NamedSharding` for q's [B, T, H, D] layout whose spec
        splits the batch, time and/or head dims, e.g. `NamedSharding(mesh, P("data", None,
        "model"))`: each device runs the op on its block (`jax.shard_map`; k, v and the segment
        ids follow q; kv heads split when Hkv divides by the head axes' size and are replicated
        otherwise). The batch and head axes need no communication; a split T runs ring
        attention (self-attention, S == T; causal: T a multiple of twice the time axes' device
        count, zigzag-balanced inside). With None, q's own sharding is used where its type
        carries explicit mesh axes. docs/scale_out.md.

    Returns:
      o: [B, T, H, D] in q's dtype. A query that sees no key gets zeros (and zero gradients).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from gla_tpu import ops
      >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 128, 4, 64), jnp.float32)
      >>> ops.flash_attention(q, k, v, causal=True, backend="xla").shape
      (1, 128, 4, 64)
    """
    options = dict(local_window_size=local_window_size, logits_soft_cap=logits_soft_cap)
    problem, q_seg, kv_seg = validate_attention(
        q, k, v, causal=causal, sm_scale=sm_scale, segment_ids=segment_ids, **options
    )
    module, block_sizes = backends.dispatch("attention", "flash_attention", backend, problem,
                                            block_sizes)

    def run(q, k, v, q_seg, kv_seg, problem=problem):
        return module.flash_attention(
            q, k, v, problem=problem, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
            block_sizes=block_sizes, interpret=interpret,
        )

    layout = resolve_sharding("flash_attention", sharding, q, batch=problem.batch,
                              heads=problem.num_heads, time=problem.q_len)
    if layout is None:
        return run(q, k, v, q_seg, kv_seg)

    kv_split = problem.num_kv_heads % layout.head_shards == 0
    local_heads = problem.num_heads // layout.head_shards
    group = problem.num_heads // problem.num_kv_heads
    ring = _ring(layout, problem, module, block_sizes, interpret)

    def run_local(q, k, v, q_seg, kv_seg):
        if not kv_split:
            k, v = (kv_for_local_heads(x, layout, local_heads, group) for x in (k, v))
        if ring is not None:
            return _ring_local(ring, layout, q, k, v, q_seg, kv_seg)
        segments = None if q_seg is None else (q_seg, kv_seg)
        local, _, _ = validate_attention(q, k, v, causal=causal, sm_scale=problem.sm_scale,
                                         segment_ids=segments, **options)
        return run(q, k, v, q_seg, kv_seg, problem=local)

    q_spec = layout.spec("batch", "time", "heads", None)
    kv_spec = q_spec if kv_split else layout.spec("batch", "time", None, None)
    seg_spec = None if q_seg is None else layout.spec("batch", "time")
    kv_psum = () if kv_split else layout.head_axes
    return sharded_call(run_local, layout, (q, k, v, q_seg, kv_seg),
                        (q_spec, kv_spec, kv_spec, seg_spec, seg_spec), q_spec,
                        grad_psum_axes=((), kv_psum, kv_psum, (), ()))


def _ring(layout, problem, module, block_sizes, interpret) -> ring_lib.Ring | None:
    """The ring of a call whose spec splits T, or None; refuses what the ring cannot serve."""
    shards = layout.time_shards
    if shards == 1:
        return None
    where = f"flash_attention with T split over mesh axes {layout.time_axes} ({shards} devices)"
    if problem.kv_len != problem.q_len:
        raise NotImplementedError(
            f"{where}: ring attention takes self-attention, q and k of one length; got T = "
            f"{problem.q_len}, S = {problem.kv_len}.")
    if problem.causal and problem.window is None and problem.q_len % (2 * shards):
        raise ValueError(
            f"{where}: causal ring attention cuts T into 2 x {shards} zigzag halves, so T must "
            f"be a multiple of {2 * shards}; got T = {problem.q_len}.")
    if not hasattr(module, "attention_block"):
        raise NotImplementedError(
            f"{where}: backend {module.CAPABILITIES.backend!r} has no ring attention blocks; "
            "use backend='xla' or 'mosaic_tpu', or shard the batch and head axes only.")

    def block_problem(q, k, v, q_seg, kv_seg, causal, window):
        segments = None if q_seg is None else (q_seg, kv_seg)
        local, q_seg, kv_seg = validate_attention(
            q, k, v, causal=causal, sm_scale=problem.sm_scale, segment_ids=segments,
            logits_soft_cap=problem.logits_soft_cap)
        # a block's window is in its own positions and may have a negative side (ring.py)
        local = dataclasses.replace(local, window=window)
        return dict(problem=local, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                    block_sizes=block_sizes, interpret=interpret)

    def block(q, k, v, q_seg, kv_seg, causal, window=None):
        return module.attention_block(
            q, k, v, **block_problem(q, k, v, q_seg, kv_seg, causal, window))

    def block_grads(q, k, v, do, lse, delta, q_seg, kv_seg, causal, window=None):
        return module.attention_block_grads(
            q, k, v, do, lse, delta, **block_problem(q, k, v, q_seg, kv_seg, causal, window))

    return ring_lib.Ring(axes=layout.time_axes, shards=shards, causal=problem.causal,
                         block=block, block_grads=block_grads, window=problem.window)


def _ring_local(ring: ring_lib.Ring, layout, q, k, v, q_seg, kv_seg):
    """One device's ring attention on its contiguous blocks (zigzag inside where causal without
    a window)."""
    if not ring.causal or ring.window is not None:
        return ring_lib.ring_attention(ring, q, k, v, q_seg, kv_seg)
    zig = lambda x: ring_lib.to_zigzag(x, ring.axes, ring.shards)  # noqa: E731
    o = ring_lib.ring_attention(ring, *map(zig, (q, k, v, q_seg, kv_seg)))
    return ring_lib.from_zigzag(o, ring.axes, ring.shards)
