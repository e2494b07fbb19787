"""The pieces every backend shares, tested once: segment geometry, masks, the chunk cumsum, FLOP
counts; and properties of the ops that no parity check shows (determinism, memory at long T)."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from gla_tpu import ops
from gla_tpu.ops.common import flops, segments
from gla_tpu.ops.common.chunk_cumsum import chunk_local_cumsum
from gla_tpu.ops.common.masks import intra_chunk_visibility, lower_triangular
from gla_tpu.testing import GLACase, make_gla_inputs, random_segment_ids

IDS = jnp.array([[7, 7, 3, 3, 3, 7, 1, 1],    # an id that comes back starts a new segment
                 [0, 0, 0, 0, 0, 0, 0, 0]], jnp.int32)


def test_segment_index_and_token_masks():
    seg = segments.segment_index(IDS)
    np.testing.assert_array_equal(seg, [[0, 0, 1, 1, 1, 2, 3, 3], [0] * 8])
    keeps, starts = segments.token_keeps(seg), segments.token_starts(seg)
    np.testing.assert_array_equal(keeps[0], [1, 1, 0, 1, 1, 0, 0, 1])
    np.testing.assert_array_equal(starts, ~keeps)


@pytest.mark.parametrize("chunk", [2, 4])
def test_chunk_segment_geometry_matches_a_loop(chunk):
    seg = segments.segment_index(random_segment_ids(jax.random.key(0), 3, 32, mean_len=3.0))
    b, t = seg.shape
    n = t // chunk
    entry = segments.chunk_entry_segments(seg, chunk)  # [B, N]
    reaches, in_last, keep = segments.chunk_segment_masks(seg.reshape(b, n, chunk),
                                                          entry[:, :, None])
    seg = np.asarray(seg)
    for r in range(b):
        for c in range(n):
            first = c * chunk
            want_entry = seg[r, max(first - 1, 0)]
            assert entry[r, c] == want_entry
            tokens = seg[r, first:first + chunk]
            np.testing.assert_array_equal(reaches[r, c], tokens == want_entry)
            np.testing.assert_array_equal(in_last[r, c], tokens == tokens[-1])
            assert keep[r, c, 0] == (tokens[-1] == want_entry)


def test_intra_chunk_visibility():
    i, j = jnp.arange(5)[:, None], jnp.arange(5)[None, :]
    np.testing.assert_array_equal(intra_chunk_visibility(i, j), np.tril(np.ones((5, 5), bool)))
    np.testing.assert_array_equal(lower_triangular(5, jnp.float32), np.tril(np.ones((5, 5))))
    seg = jnp.array([0, 0, 1, 1, 1])
    visible = intra_chunk_visibility(i, j, seg[:, None], seg[None, :])
    np.testing.assert_array_equal(visible[3], [False, False, True, True, False])


@pytest.mark.parametrize("shape", [(2, 128, 3), (2, 128, 3, 16)])
def test_chunk_local_cumsum(shape):
    g = jax.nn.log_sigmoid(jax.random.normal(jax.random.key(1), shape))
    b = chunk_local_cumsum(g, 64)
    want = np.cumsum(np.asarray(g, np.float64).reshape((2, 2, 64) + shape[2:]), axis=2)
    np.testing.assert_allclose(b, want.reshape(shape), rtol=1e-5, atol=1e-5)
    if len(shape) == 4:
        np.testing.assert_allclose(chunk_local_cumsum(g, 64, method="triangular"), b,
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of chunk_size=48"):
        chunk_local_cumsum(g, 48)


def test_flop_counts():
    assert flops.causal_visible_fraction(4, 4) == 10 / 16
    assert flops.causal_visible_fraction(2, 4) == 7 / 8  # bottom-right: rows see 3 and 4 keys
    assert flops.attention_flops(1, 8, 8, 2, 16) == 4 * 8 * 8 * 2 * 16
    assert flops.attention_flops(1, 8, 8, 2, 16, causal=True, backward=True) == (
        4 * 8 * 8 * 2 * 16 * (36 / 64) * 3.5)
    assert flops.gla_flops(1, 10, 2, 4, 8, chunk_size=64) == 20 * (64 * 4 + 64 * 8 + 4 * 4 * 8)


def _largest_intermediate(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args)
    sizes = [0]

    def visit(jxpr):
        for eqn in jxpr.eqns:
            for var in eqn.outvars:
                if hasattr(var.aval, "shape"):
                    sizes.append(int(np.prod(var.aval.shape)))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jaxpr.jaxpr)
    return max(sizes)


def test_gla_xla_long_sequence_builds_no_t_by_t_array():
    b, t, h, d = 1, 32768, 2, 128
    shape = jax.ShapeDtypeStruct((b, t, h, d), jnp.float32)
    fn = lambda q, k, v, g: ops.gla(q, k, v, g, mode="chunk", backend="xla")[0]  # noqa: E731
    assert _largest_intermediate(fn, shape, shape, shape, shape) < t * t
    # And it runs: the forward on CPU at 8192 tokens (128 chunks) agrees with the token-by-token
    # reference (the same program at a quarter of the length; 32768 ran here until 2026-11-26).
    case = GLACase(b, t // 4, h, d, d, gate="key", output_final_state=True)
    inputs = make_gla_inputs(case, jax.random.key(0))
    o, s = jax.jit(lambda i: ops.gla(**i, output_final_state=True, backend="xla"))(inputs)
    ro = np.asarray(ops.gla_recurrent_reference(**inputs)[0])
    rel = np.linalg.norm(np.asarray(o, np.float64) - ro) / np.linalg.norm(ro)
    assert rel < 1e-5 and np.all(np.isfinite(s))


@pytest.mark.parametrize("op", ["attention", "gla"])
def test_runs_are_bitwise_deterministic(op):
    case = GLACase(2, 100, 2, 32, 32, gate="key", initial_state=True, segments=True)
    inputs = make_gla_inputs(case, jax.random.key(1))
    if op == "attention":
        fn = lambda i: ops.flash_attention(i["q"], i["k"], i["v"], causal=True)  # noqa: E731
    else:
        fn = lambda i: ops.gla(**i, output_final_state=True)  # noqa: E731
    grad_fn = jax.jit(jax.grad(lambda i: jnp.sum(jax.tree_util.tree_leaves(fn(i))[0] ** 2),
                               allow_int=True))
    first, second = grad_fn(inputs), grad_fn(inputs)
    for a, b in zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(second)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_kernel_times_sums_a_trace_by_event_name():
    """bench/kernel_times.py's trace reader, on this host's CPU plane (a GPU's kernels are on its
    device planes): named events with their time per call, the largest first."""
    from bench.kernel_times import kernel_times

    fn = jax.jit(lambda x: jnp.sin(x) @ x)
    times = kernel_times(fn, jnp.ones((64, 64)), iters=2, plane_prefix="/host:CPU",
                         line_filter=lambda name: True)
    assert times and all(isinstance(name, str) and ms >= 0 for name, ms, _ in times)
    assert [ms for _, ms, _ in times] == sorted((ms for _, ms, _ in times), reverse=True)
