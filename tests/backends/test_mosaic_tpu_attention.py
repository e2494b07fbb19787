"""The "mosaic_tpu" flash attention backend in TPU interpret mode on CPU.

Every run uses `interpret=True`, i.e. pltpu.InterpretParams(uninitialized_memory="nan"): an output
element or scratch entry the kernels fail to write shows up as NaN and fails the pass rule.
Shapes are small (T <= 300) to keep this file within its CI budget; block sizes of 128 give
multi-block grids (causal skipping, padding of ragged lengths) at those sizes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

from gla_tpu import ops
from gla_tpu.ops.attention.mosaic_tpu import BlockSizes
from gla_tpu.ops.attention.mosaic_tpu.plan import kernel_config, vmem_estimate_bytes
from gla_tpu.ops.attention.validation import AttentionProblem
from gla_tpu.ops.common import backends
from gla_tpu.testing.grads import outputs_and_grads
from gla_tpu.testing.parity import check_attention_parity
from gla_tpu.testing.problems import AttentionCase, make_attention_inputs
from gla_tpu.testing.strategies import attention_cases

SMALL = BlockSizes(block_q=128, block_kv=128, block_q_dq=128, block_kv_dq=128,
                   block_q_dkv=128, block_kv_dkv=128)
# Uneven tiles across the three kernels, and a forward inner loop over kv (block_kv_compute).
MIXED = BlockSizes(block_q=128, block_kv=256, block_kv_compute=128, block_q_dq=256,
                   block_kv_dq=128, block_q_dkv=128, block_kv_dkv=256)

C = AttentionCase


def _parity(case, dtype=jnp.float32, block_sizes=None, seed=0, interpret=True):
    return check_attention_parity(case, jax.random.key(seed), dtype=dtype, backend="mosaic_tpu",
                                  interpret=interpret, block_sizes=block_sizes)


P = pytest.param
PARITY_CASES = [
    # Causal with T < S and T > S (the first T - S rows then see no key), ragged lengths.
    P(C(1, 100, 260, 4, 2, 64, causal=True), jnp.float32, SMALL, id="causal_T<S_gqa"),
    P(C(1, 260, 100, 2, 1, 128, causal=True), jnp.float32, SMALL, id="causal_T>S_d128"),
    P(C(1, 300, 200, 2, 2, 64, causal=True), jnp.bfloat16, MIXED, id="causal_T>S_bf16_mixed"),
    # GQA 8:1 and MQA.
    P(C(1, 130, 130, 16, 2, 64, causal=True), jnp.float32, SMALL, id="gqa_8to1"),
    P(C(2, 63, 100, 3, 1, 128), jnp.bfloat16, None, id="mqa_bf16"),
    # Segments: one shared array, and a pair where some queries see no key.
    P(C(2, 200, 200, 2, 1, 64, causal=True, segments="shared"), jnp.float32, SMALL,
      id="segments_shared_causal"),
    P(C(1, 129, 257, 4, 2, 128, segments="pair"), jnp.bfloat16, MIXED, id="segments_pair_bf16"),
    # D = 256, forward and backward, multi-block and default tiles.
    P(C(1, 257, 257, 2, 1, 256, causal=True), jnp.float32, SMALL, id="d256_causal"),
    P(C(1, 200, 300, 2, 2, 256, segments="pair"), jnp.bfloat16, None, id="d256_segments_bf16"),
    # T = 1.
    P(C(2, 1, 7, 2, 2, 64), jnp.float32, None, id="t1"),
]


@pytest.mark.parametrize("case,dtype,block_sizes", PARITY_CASES)
def test_parity(case, dtype, block_sizes):
    _parity(case, dtype, block_sizes)


@settings(max_examples=6)
@given(
    case=attention_cases(head_dims=(64, 128)),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    block_sizes=st.sampled_from([None, SMALL]),
)
def test_parity_hypothesis(case, dtype, block_sizes):
    _parity(case, dtype, block_sizes)


def test_head_dim_256_backward_elementwise():
    """Every gradient element of a D = 256 problem matches the float64 reference, not just the
    RMS (a known kernel once shipped a D = 256 backward with 7% of elements wrong)."""
    case = C(1, 200, 200, 2, 1, 256, causal=True)
    inputs = make_attention_inputs(case, jax.random.key(3), jnp.float32)
    del inputs["segment_ids"]
    kernel = functools.partial(ops.flash_attention, causal=True, backend="mosaic_tpu",
                               interpret=True, block_sizes=SMALL)
    reference = functools.partial(ops.attention_reference, causal=True)
    out, grads = outputs_and_grads(kernel, inputs, jax.random.key(4))
    ref_out, ref_grads = outputs_and_grads(reference, inputs, jax.random.key(4), float64=True)
    for name, x, r in [("o", out, ref_out)] + [(n, grads[n], ref_grads[n]) for n in grads]:
        # float32 elementwise: within 1e-4 of the array's largest reference magnitude.
        np.testing.assert_allclose(x, r, rtol=0, atol=1e-4 * np.abs(r).max(), err_msg=name)


def test_rows_that_see_no_key_give_zeros_and_zero_grads():
    b, t, s, h, d = 1, 140, 150, 2, 64
    key = jax.random.key(5)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, t, h, d), jnp.float32)
    k = jax.random.normal(kk, (b, s, h, d), jnp.float32)
    v = jax.random.normal(kv, (b, s, h, d), jnp.float32)
    # Query ids 0..4, key ids 0..2: queries with id 3 or 4 see no key.
    q_seg = (jnp.arange(t, dtype=jnp.int32) % 5)[None, :]
    kv_seg = (jnp.arange(s, dtype=jnp.int32) % 3)[None, :]
    blind = np.asarray(q_seg[0] >= 3)

    def loss(q, k, v):
        o = ops.flash_attention(q, k, v, segment_ids=(q_seg, kv_seg), backend="mosaic_tpu",
                                interpret=True, block_sizes=SMALL)
        return jnp.sum(o * o), o

    (_, o), (dq, dk, dv) = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    for x in (o, dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(x)))
    np.testing.assert_array_equal(np.asarray(o)[0, blind], 0.0)
    np.testing.assert_array_equal(np.asarray(dq)[0, blind], 0.0)
    assert np.abs(np.asarray(o)[0, ~blind]).min() > 0
    ref = ops.attention_reference(q, k, v, segment_ids=(q_seg, kv_seg))
    np.testing.assert_allclose(o, ref, atol=1e-5)


def test_all_rows_blind_causal():
    """Causal with T > S puts whole q blocks before the diagonal: all-zero output blocks."""
    case = C(1, 300, 40, 2, 1, 64, causal=True)
    inputs = make_attention_inputs(case, jax.random.key(6))
    del inputs["segment_ids"]
    o = ops.flash_attention(**inputs, causal=True, backend="mosaic_tpu", interpret=True,
                            block_sizes=SMALL)
    np.testing.assert_array_equal(np.asarray(o)[:, : 300 - 40], 0.0)


def test_interpret_params_instance_passes_through():
    params = pltpu.InterpretParams(uninitialized_memory="nan", dma_execution_mode="eager")
    _parity(C(1, 70, 90, 2, 1, 64, causal=True), interpret=params)


# Errors and capability.


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_q=100),
        dict(block_kv=0),
        dict(block_q_dkv=-128),
        dict(block_kv_dq=True),
        dict(block_q_dq=256.0),
        dict(block_kv=256, block_kv_compute=384),
        dict(block_kv_compute=64),
        dict(vmem_limit_bytes=-1),
    ],
)
def test_bad_block_sizes_raise_value_error(kwargs):
    with pytest.raises(ValueError, match="BlockSizes"):
        BlockSizes(**kwargs)


def _tiny(d=64, dtype=jnp.float32):
    x = jnp.ones((1, 8, 2, d), dtype)
    return x, x, x


def test_block_sizes_of_wrong_type_raise_value_error():
    with pytest.raises(ValueError, match="block_sizes"):
        ops.flash_attention(*_tiny(), backend="mosaic_tpu", interpret=True, block_sizes=(128, 128))


def test_bad_interpret_raises_value_error():
    with pytest.raises(ValueError, match="interpret"):
        ops.flash_attention(*_tiny(), backend="mosaic_tpu", interpret="yes")


@pytest.mark.parametrize("d", [32, 96, 192, 512])
def test_unsupported_head_dim_raises_not_implemented(d):
    with pytest.raises(NotImplementedError, match=r"head_dim in \(64, 128, 256\).*xla"):
        ops.flash_attention(*_tiny(d), backend="mosaic_tpu", interpret=True)


def test_unsupported_dtype_raises_not_implemented():
    with pytest.raises(NotImplementedError, match="float16.*xla"):
        ops.flash_attention(*_tiny(64, jnp.float16), backend="mosaic_tpu", interpret=True)


def test_auto_falls_back_to_xla_for_unsupported_head_dim(monkeypatch):
    monkeypatch.setattr(backends, "default_platform", lambda: "tpu")
    monkeypatch.setattr(backends, "_warned", set())
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 16, 2, 48), jnp.float32) for i in range(3))
    with pytest.warns(backends.BackendFallbackWarning, match="mosaic_tpu.*xla.*head_dim"):
        o = ops.flash_attention(q, k, v, causal=True)
    np.testing.assert_allclose(o, ops.flash_attention(q, k, v, causal=True, backend="xla"))


def test_default_block_sizes_clamp_to_short_sequences():
    problem_sizes = dict(batch=1, num_heads=2, num_kv_heads=1, head_dim=256, causal=True,
                         sm_scale=1.0, has_segments=False, dtype=jnp.dtype(jnp.bfloat16))
    cfg = kernel_config(AttentionProblem(q_len=300, kv_len=1000, **problem_sizes),
                                   None, False)
    assert (cfg.block_q, cfg.q_len_padded) == (512, 512)
    assert (cfg.block_kv, cfg.block_kv_compute, cfg.kv_len_padded) == (512, 256, 1024)
    cfg = kernel_config(AttentionProblem(q_len=5, kv_len=130, **problem_sizes),
                                   SMALL, False)
    assert (cfg.block_q, cfg.q_len_padded, cfg.block_kv, cfg.kv_len_padded) == (128, 128, 128, 256)


@pytest.mark.parametrize("d", (64, 128, 256))
def test_default_blocks_fit_the_smallest_default_vmem_limit(d):
    bs = BlockSizes.default(d)
    for kind, bq, bkv in (("fwd", bs.block_q, bs.block_kv), ("dq", bs.block_q_dq, bs.block_kv_dq),
                          ("dkv", bs.block_q_dkv, bs.block_kv_dkv)):
        est = vmem_estimate_bytes(kind, bq, bkv, d, 4, block_kv_compute=bs.block_kv_compute,
                                  segments=True)
        assert est <= 12 * 2**20, (kind, est)
