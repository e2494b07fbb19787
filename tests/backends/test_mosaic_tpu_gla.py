"""Interpret-mode parity of the "mosaic_tpu" fused_recurrent kernels against the float64 reference.

Every check runs the kernel (TPU interpret mode, uninitialized memory NaN), the "xla" backend in
the same dtype and the float64 reference, and applies DESIGN.md's pass rule to outputs, final state
and every gradient. Sizes stay small: interpret mode costs about a second per kernel launch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_tpu import ops
from gla_tpu.ops.gla.mosaic_tpu import BlockSizes
from gla_tpu.ops.gla.reference import gla_reference
from gla_tpu.testing.grads import outputs_and_grads
from gla_tpu.testing.parity import check_gla_parity
from gla_tpu.testing.problems import GLACase, make_gla_inputs
from gla_tpu.testing.tolerance import assert_pass_rule

MODE = "fused_recurrent"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _parity(case: GLACase, seed: int, dtype):
    """The public API path: ops.gla(..., backend="mosaic_tpu", mode="fused_recurrent")."""
    return check_gla_parity(case, jax.random.PRNGKey(seed), dtype=dtype, mode=MODE,
                            backend="mosaic_tpu", interpret=True)


def _direct(q, k, v, g=None, *, initial_state=None, output_final_state=False, segment_ids=None,
            block_sizes=None):
    """The public op with the backend's block sizes."""
    return ops.gla(q, k, v, g, initial_state=initial_state, output_final_state=output_final_state,
                   segment_ids=segment_ids, mode=MODE, backend="mosaic_tpu", interpret=True,
                   block_sizes=block_sizes)


def _direct_parity(case: GLACase, seed: int, dtype, block_sizes, inputs=None):
    """The pass rule on the module called directly (block sizes chosen by the test)."""
    key = jax.random.PRNGKey(seed)
    if inputs is None:
        inputs = make_gla_inputs(case, key, dtype)
    inputs = dict(inputs)
    common = dict(segment_ids=inputs.pop("segment_ids"),
                  output_final_state=case.output_final_state)
    ct_key = jax.random.fold_in(key, 1)
    kernel = functools.partial(_direct, **common, block_sizes=block_sizes)
    baseline = functools.partial(ops.gla, **common, mode=MODE, backend="xla")
    reference = functools.partial(gla_reference, **common)
    k_out = outputs_and_grads(kernel, inputs, ct_key)
    b_out = outputs_and_grads(baseline, inputs, ct_key)
    r_out = outputs_and_grads(reference, inputs, ct_key, float64=True)
    return assert_pass_rule(k_out, b_out, r_out, dtype=dtype)


# The discrete matrix: sizes rotate through K != V, D = 64 (head-major copy) and D = 128 (view),
# and lengths that are not multiples of the time block.
_SIZES = ((2, 1, 20, 64, 128), (1, 2, 13, 128, 64), (2, 2, 7, 64, 64))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("segments", [False, True], ids=["noseg", "seg"])
@pytest.mark.parametrize("initial_state", [False, True], ids=["nos0", "s0"])
@pytest.mark.parametrize("gate", ["key", "head", "none"])
def test_parity_matrix(gate, initial_state, segments, dtype):
    index = ["key", "head", "none"].index(gate) + 2 * initial_state + segments
    b, h, t, kd, vd = _SIZES[index % len(_SIZES)]
    case = GLACase(b, t, h, kd, vd, gate=gate, initial_state=initial_state, segments=segments)
    _parity(case, index, DTYPES[dtype])


@pytest.mark.parametrize("gate, dtype", [("key", "bfloat16"), ("head", "float32")])
def test_decode_step_with_initial_state(gate, dtype):
    """T = 1 with a carried state: the decode kernel forward, the time-blocked backward."""
    case = GLACase(2, 1, 2, 64, 128, gate=gate, initial_state=True)
    _parity(case, 11, DTYPES[dtype])


def test_decode_kernel_matches_time_blocked_path():
    """The T = 1 decode kernel and the padded time-blocked kernel give the same step."""
    case = GLACase(1, 1, 8, 128, 64, gate="key", initial_state=True)
    inputs = make_gla_inputs(case, jax.random.PRNGKey(3), jnp.float32)
    inputs.pop("segment_ids")
    decode = _direct(**inputs, output_final_state=True)
    padded = _direct(**inputs, output_final_state=True,
                     block_sizes=BlockSizes(block_h_decode=0))
    for a, b in zip(decode, padded):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("gate", ["key", "head"])
def test_strong_gates(gate):
    """g = logsigmoid(x) / 0.1: decays near exp(-7) per step, segments and a carried state, at an
    odd length (T = 63)."""
    case = GLACase(1, 63, 2, 64, 64, gate=gate, gate_strength=0.1, initial_state=True,
                   segments=True)
    _parity(case, 5, jnp.float32)


@pytest.mark.parametrize("gate", ["key", "head"])
def test_gate_minus_1e3_per_step(gate):
    """g = -1e3 at every step: the state forgets everything but the current token; outputs and
    gradients stay finite and pass the rule (exp(-1e3) underflows to an exact zero)."""
    case = GLACase(1, 11, 1, 64, 64, gate=gate, initial_state=True)
    inputs = make_gla_inputs(case, jax.random.PRNGKey(9), jnp.float32)
    inputs["g"] = jnp.full(inputs["g"].shape, -1e3, jnp.float32)
    results = _direct_parity(case, 9, jnp.float32, None, inputs=inputs)
    assert all(np.isfinite(c.kernel_error) for c in results)


def test_long_odd_length():
    """T = 130 leaves a partial time block over several time blocks (zero padding in the wrapper).
    T = 1, 7 (the matrix, decode tests) and 63 (strong gates) are covered above."""
    case = GLACase(1, 130, 1, 128, 64, gate="key", initial_state=True, segments=True)
    _parity(case, 130, jnp.float32)


@pytest.mark.parametrize(
    "kd, vd, block_sizes",
    [
        # V split over two blocks: dq, dk and dg come out as partial sums over V blocks.
        (64, 256, BlockSizes(block_t_recurrent=8, block_v_recurrent=128)),
        # K = 192 is zero-padded to 256 lanes, V = 64 takes the head-major copy.
        (192, 64, BlockSizes(block_t_recurrent=16)),
    ],
    ids=["v_blocks", "padded_k"],
)
def test_block_sizes_and_padded_dims(kd, vd, block_sizes):
    case = GLACase(1, 19, 2, kd, vd, gate="key", initial_state=True, segments=True)
    _direct_parity(case, 7, jnp.float32, block_sizes)


@pytest.mark.parametrize("dim", [32, 96, 576])
def test_unsupported_head_dims_name_constraint(dim):
    q = k = jnp.ones((1, 4, 1, dim))
    v = jnp.ones((1, 4, 1, 64))
    with pytest.raises(NotImplementedError, match=r"multiple of 64 from 64 to 512.*backend='xla'"):
        ops.gla(q, k, v, backend="mosaic_tpu", mode=MODE, interpret=True)
    with pytest.raises(NotImplementedError, match="backend='xla'"):
        _direct(q, k, v)


@pytest.mark.parametrize(
    "kwargs",
    [dict(block_t_recurrent=12), dict(block_t_recurrent=-8), dict(block_v_recurrent=0),
     dict(block_h_decode=2.0)],
)
def test_invalid_block_sizes(kwargs):
    with pytest.raises(ValueError):
        BlockSizes(**kwargs)


def test_block_v_must_divide_value_dim():
    q = k = jnp.ones((1, 4, 1, 64))
    v = jnp.ones((1, 4, 1, 256))
    with pytest.raises(ValueError, match="block_v_recurrent"):
        _direct(q, k, v, block_sizes=BlockSizes(block_v_recurrent=384))
