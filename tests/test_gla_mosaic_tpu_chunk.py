"""Interpret-mode parity of the chunked "mosaic_tpu" GLA kernels ("chunk", "fused_chunk").

Every case runs through the public `gla_tpu.ops.gla` in TPU interpret mode with uninitialized
memory filled with NaN, and is checked against the float64 reference under DESIGN.md's pass rule
(outputs, final state, dq, dk, dv, dg, d initial state). Every mode x gate kind x
initial state x segments combination runs in float32 and in bfloat16, across the awkward sizes.
"""

import functools
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_tpu import ops
from gla_tpu.ops.common import backends
from gla_tpu.ops.gla.mosaic_tpu import BlockSizes
from gla_tpu.ops.gla.reference import gla_reference
from gla_tpu.testing.grads import outputs_and_grads
from gla_tpu.testing.parity import check_gla_parity
from gla_tpu.testing.problems import GLACase, make_gla_inputs
from gla_tpu.testing.tolerance import assert_pass_rule

MODES = ("fused_chunk", "chunk")
GATES = ("key", "head", "none")
# (T, K, V) cycled over the matrix: odd lengths, K != V both ways.
SIZES = ((63, 64, 64), (130, 64, 128), (65, 128, 64), (100, 64, 64))


def _matrix():
    for i, (mode, gate, s0, seg) in enumerate(
            itertools.product(MODES, GATES, (False, True), (False, True))):
        t, kd, vd = SIZES[i % len(SIZES)]
        case = GLACase(batch=1 + i % 2, seq_len=t, num_heads=2 - i % 2, key_dim=kd, value_dim=vd,
                       gate=gate, initial_state=s0, segments=seg)
        name = f"{mode}-{gate}-s0={int(s0)}-seg={int(seg)}-T{t}-K{kd}-V{vd}"
        for dtype in (jnp.float32, jnp.bfloat16):
            yield pytest.param(mode, case, dtype, i, id=f"{name}-{jnp.dtype(dtype).name}")


@pytest.mark.parametrize("mode,case,dtype,seed", list(_matrix()))
def test_parity_matrix(mode, case, dtype, seed):
    check_gla_parity(case, jax.random.key(seed), dtype=dtype, mode=mode, backend="mosaic_tpu",
                     interpret=True)


@pytest.mark.parametrize("mode", MODES)
def test_single_token_with_initial_state(mode):
    case = GLACase(batch=2, seq_len=1, num_heads=1, key_dim=64, value_dim=128, gate="key",
                   initial_state=True)
    check_gla_parity(case, jax.random.key(1), mode=mode, backend="mosaic_tpu", interpret=True)


@pytest.mark.parametrize("mode,gate", [("fused_chunk", "key"), ("chunk", "head")])
def test_chunk_size_128(mode, gate):
    case = GLACase(batch=1, seq_len=130, num_heads=1, key_dim=128, value_dim=64, gate=gate,
                   initial_state=True, segments=True)
    check_gla_parity(case, jax.random.key(2), mode=mode, chunk_size=128, backend="mosaic_tpu",
                     interpret=True)


@pytest.mark.parametrize("mode,gate", [("fused_chunk", "key"), ("chunk", "head")])
def test_strong_gates_bfloat16(mode, gate):
    """g = logsigmoid(x) / 0.1 (about -7 per step), bfloat16 q, k, v with float32 gates."""
    case = GLACase(batch=1, seq_len=100, num_heads=1, key_dim=64, value_dim=64, gate=gate,
                   gate_strength=0.1, initial_state=True, segments=True)
    check_gla_parity(case, jax.random.key(3), dtype=jnp.bfloat16, mode=mode,
                     backend="mosaic_tpu", interpret=True)


@pytest.mark.parametrize("pattern", ["every_step", "every_other_step"])
@pytest.mark.parametrize("mode,gate", [("chunk", "key"), ("fused_chunk", "head")])
def test_gate_minus_1000_per_step(mode, gate, pattern):
    """g = -1e3 per step: the state forgets all but the current token; no inf, no NaN.

    With -1e3 at every step every decay underflows, so the exact dg is 0 and the relative pass
    rule has no scale: dg is checked for |dg| <= 1e-5 * max|g-free terms| there (float32 rounding
    of the exactly cancelling q*dq - k*dk), and under the full rule with -1e3 on every other step.
    """
    case = GLACase(batch=1, seq_len=70, num_heads=1, key_dim=64, value_dim=64, gate=gate,
                   initial_state=True)
    key = jax.random.key(4)
    inputs = make_gla_inputs(case, key)
    strong = jnp.full(inputs["g"].shape, -1e3, jnp.float32)
    if pattern == "every_other_step":
        odd = (jnp.arange(case.seq_len) % 2 == 1).reshape((1, -1) + (1,) * (strong.ndim - 2))
        strong = jnp.where(odd, strong, inputs["g"])
    inputs["g"] = strong
    inputs.pop("segment_ids")
    common = dict(output_final_state=True)
    run = functools.partial(ops.gla, **common, mode=mode)
    ct_key = jax.random.fold_in(key, 1)
    kernel = outputs_and_grads(functools.partial(run, backend="mosaic_tpu", interpret=True),
                               inputs, ct_key)
    baseline = outputs_and_grads(functools.partial(run, backend="xla"), inputs, ct_key)
    reference = outputs_and_grads(functools.partial(gla_reference, **common), inputs, ct_key,
                                  float64=True)
    for leaf in jax.tree_util.tree_leaves(kernel):
        assert np.all(np.isfinite(leaf))
    if pattern == "every_step":
        assert np.all(reference[1]["g"] == 0.0)
        scale = max(np.max(np.abs(kernel[1][x])) for x in ("q", "k"))
        assert np.max(np.abs(kernel[1]["g"])) <= 1e-5 * scale
        for tree in (kernel, baseline, reference):
            tree[1].pop("g")
    assert_pass_rule(kernel, baseline, reference, dtype=jnp.float32)


def test_modes_agree():
    case = GLACase(batch=1, seq_len=100, num_heads=2, key_dim=64, value_dim=128, gate="key",
                   initial_state=True, segments=True)
    key = jax.random.key(5)
    inputs = make_gla_inputs(case, key)
    seg = inputs.pop("segment_ids")
    results = [
        outputs_and_grads(functools.partial(ops.gla, segment_ids=seg, output_final_state=True,
                                            mode=mode, backend="mosaic_tpu", interpret=True),
                          inputs, jax.random.fold_in(key, 1))
        for mode in MODES
    ]
    jax.tree_util.tree_map(
        functools.partial(np.testing.assert_allclose, rtol=2e-5, atol=2e-5), *results)


def _small(kd=64, vd=64, t=8):
    x = jnp.ones((1, t, 1, kd), jnp.float32)
    return x, x, jnp.ones((1, t, 1, vd), jnp.float32)


@pytest.mark.parametrize("kd,vd", [(96, 64), (64, 100), (576, 64), (64, 32)])
def test_unsupported_head_dims_raise(kd, vd):
    q, k, v = _small(kd, vd)
    with pytest.raises(NotImplementedError, match="multiple of 64.*backend='xla'"):
        ops.gla(q, k, v, mode="chunk", backend="mosaic_tpu", interpret=True)


def test_bad_chunk_size_raises():
    q, k, v = _small()
    with pytest.raises(ValueError, match="chunk_size"):
        ops.gla(q, k, v, mode="fused_chunk", chunk_size=32, backend="mosaic_tpu", interpret=True)


def test_bad_block_v_raises():
    with pytest.raises(ValueError, match="block_v"):
        BlockSizes(block_v=96)


def test_auto_falls_back_to_xla_for_unsupported_dims(monkeypatch):
    monkeypatch.setattr(backends, "default_platform", lambda: "tpu")
    q, k, v = _small(kd=96)
    with pytest.warns(backends.BackendFallbackWarning, match="multiple of 64"):
        o, _ = ops.gla(q, k, v, mode="chunk", backend="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", backends.BackendFallbackWarning)
        expected, _ = ops.gla(q, k, v, mode="chunk", backend="xla")
    np.testing.assert_allclose(o, expected)


def test_block_v_split_matches_whole():
    """Two V blocks (partial dq, dk summed outside) give the one-block result."""
    case = GLACase(batch=1, seq_len=70, num_heads=1, key_dim=64, value_dim=256, gate="key",
                   initial_state=True, segments=True)
    inputs = make_gla_inputs(case, jax.random.key(6))
    seg = inputs.pop("segment_ids")

    def run(block_v, q, k, v, g, initial_state):
        return ops.gla(q, k, v, g, initial_state=initial_state, output_final_state=True,
                       segment_ids=seg, mode="fused_chunk", backend="mosaic_tpu", interpret=True,
                       block_sizes=BlockSizes(block_v=block_v))

    key = jax.random.key(7)
    whole = outputs_and_grads(functools.partial(run, None), inputs, key)
    split = outputs_and_grads(functools.partial(run, 128), inputs, key)
    jax.tree_util.tree_map(functools.partial(np.testing.assert_allclose, rtol=2e-5, atol=2e-5),
                           whole, split)
