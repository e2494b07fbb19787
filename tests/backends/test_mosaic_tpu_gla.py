"""What is particular to the "mosaic_tpu" GLA (tests/ops/test_gla.py checks its numerics with every
other backend; tests/backends/test_tpu_compile.py compiles it): its block sizes, the split of V
over grid steps (partial dq, dk, dg summed outside), and the T = 1 decode kernel against the
time-blocked kernels, in TPU interpret mode."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_tpu import ops
from gla_tpu.ops.gla.mosaic_tpu import BlockSizes
from gla_tpu.testing.grads import outputs_and_grads
from gla_tpu.testing.parity import check_gla_parity
from gla_tpu.testing.problems import GLACase, make_gla_inputs


def _run(q, k, v, g=None, *, mode, block_sizes=None, **kwargs):
    return ops.gla(q, k, v, g, mode=mode, backend="mosaic_tpu", interpret=True,
                   block_sizes=block_sizes, **kwargs)


def test_chunked_block_v_split_matches_whole():
    """Two V blocks (partial dq, dk summed outside) give the one-block result."""
    case = GLACase(batch=1, seq_len=70, num_heads=1, key_dim=64, value_dim=256, gate="key",
                   initial_state=True, segments=True)
    inputs = make_gla_inputs(case, jax.random.key(6))
    seg = inputs.pop("segment_ids")

    def run(block_v, q, k, v, g, initial_state):
        return _run(q, k, v, g, initial_state=initial_state, output_final_state=True,
                    segment_ids=seg, mode="fused_chunk", block_sizes=BlockSizes(block_v=block_v))

    key = jax.random.key(7)
    whole = outputs_and_grads(functools.partial(run, None), inputs, key)
    split = outputs_and_grads(functools.partial(run, 128), inputs, key)
    jax.tree_util.tree_map(functools.partial(np.testing.assert_allclose, rtol=2e-5, atol=2e-5),
                           whole, split)


@pytest.mark.parametrize("mode,gate", [("chunk", "key"),
                                       pytest.param("fused_chunk", "key", marks=pytest.mark.full),
                                       pytest.param("chunk", "head", marks=pytest.mark.full)])
def test_profiler_safe_kernels_give_the_same_values(mode, gate):
    """BlockSizes.profiler_safe (0/1 products for the masks, the bfloat16 rounding by integer ops)
    computes what the default kernels compute: outputs and every gradient bit for bit, bfloat16,
    per-key and per-head gates with segments and an initial state."""
    case = GLACase(1, 70, 2, 64, 128, gate=gate, initial_state=True, segments=True)
    inputs = make_gla_inputs(case, jax.random.key(8), jnp.bfloat16)
    seg = inputs.pop("segment_ids")

    def run(safe, q, k, v, g, initial_state):
        return _run(q, k, v, g, initial_state=initial_state, output_final_state=True,
                    segment_ids=seg, mode=mode, block_sizes=BlockSizes(profiler_safe=safe))

    key = jax.random.key(9)
    default = outputs_and_grads(functools.partial(run, False), inputs, key)
    safe = outputs_and_grads(functools.partial(run, True), inputs, key)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(
        np.asarray(a, np.float32), np.asarray(b, np.float32)), default, safe)


def test_rounding_to_bfloat16_by_bits_matches_the_cast():
    """kernels_chunk_tile.rounded_to_bfloat16 is the float32 -> bfloat16 -> float32 round trip,
    ties to even included, over random magnitudes and the halfway points."""
    from gla_tpu.ops.gla.mosaic_tpu.kernels_chunk_tile import rounded_to_bfloat16

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * np.exp2(rng.integers(-60, 60, 4096))).astype(np.float32)
    halfway = (np.arange(1, 513, dtype=np.uint32) << 16 | np.uint32(0x8000)).view(np.float32)
    x = jnp.asarray(np.concatenate([x, halfway, -halfway, [0.0, -0.0]]).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(rounded_to_bfloat16(x)),
                                  np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32)))


def test_recurrent_v_blocks_pass_the_rule():
    """fused_recurrent with V split over two blocks of 128 and 8-token time blocks: dq, dk and dg
    come out as partial sums over V blocks."""
    case = GLACase(1, 19, 2, 64, 256, gate="key", initial_state=True, segments=True)
    check_gla_parity(case, mode="fused_recurrent", backend="mosaic_tpu", interpret=True,
                     block_sizes=BlockSizes(block_t_recurrent=8, block_v_recurrent=128))


def test_decode_kernel_matches_time_blocked_path():
    """The T = 1 decode kernel and the padded time-blocked kernel give the same step."""
    case = GLACase(1, 1, 8, 128, 64, gate="key", initial_state=True)
    inputs = make_gla_inputs(case, jax.random.PRNGKey(3), jnp.float32)
    inputs.pop("segment_ids")
    decode = _run(**inputs, output_final_state=True, mode="fused_recurrent")
    padded = _run(**inputs, output_final_state=True, mode="fused_recurrent",
                  block_sizes=BlockSizes(block_h_decode=0))
    for a, b in zip(decode, padded):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(block_v=96), "block_v"), (dict(block_v=0), "block_v"),
     (dict(block_t_recurrent=12), "block_t_recurrent"),
     (dict(block_t_recurrent=-8), "block_t_recurrent"),
     (dict(block_v_recurrent=0), "block_v_recurrent"),
     (dict(block_h_decode=2.0), "block_h_decode"),
     (dict(profiler_safe=1), "profiler_safe")],
)
def test_invalid_block_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockSizes(**kwargs)


@pytest.mark.parametrize("mode,sizes,match", [
    ("fused_recurrent", BlockSizes(block_v_recurrent=384), "block_v_recurrent=384"),
    ("chunk", BlockSizes(block_v=128), "block_v=128 must divide V=320"),
])
def test_block_sizes_must_fit_the_problem(mode, sizes, match):
    q = k = jnp.ones((1, 4, 1, 64))
    v = jnp.ones((1, 4, 1, 256 if mode == "fused_recurrent" else 320))
    with pytest.raises(ValueError, match=match):
        _run(q, k, v, mode=mode, block_sizes=sizes)
