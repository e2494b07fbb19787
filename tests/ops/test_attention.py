"""flash_attention on every backend, one suite: each case runs on each backend that declares it
takes it and must raise NotImplementedError on each that does not.

Every run checks o, dq, dk and dv against the float64 reference under the pass rule
(docs/testing.md); Pallas backends run in interpret mode with uninitialized memory filled with NaN
(mosaic_tpu: TPU interpret mode; pallas_gpu: the Triton kernels' CPU interpreter). Small tiles
give multi-block grids (causal skipping, ragged padding) at small sizes. A case's XLA baseline and
reference are computed once for all its backends (its tests share an xdist group).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gla_tpu import ops
from gla_tpu.ops.attention import mosaic_tpu, pallas_gpu
from gla_tpu.ops.attention.validation import validate_attention
from gla_tpu.ops.common import backends
from gla_tpu.testing import AttentionCase, make_attention_inputs
from gla_tpu.testing.grads import outputs_and_grads
from gla_tpu.testing.parity import check_attention_parity
from gla_tpu.testing.strategies import attention_cases, budget

pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

BACKENDS = ("xla", "mosaic_tpu", "pallas_gpu")
CAPABILITIES = {cap.backend: cap for cap in backends.capabilities("attention")}
F32, BF16 = jnp.float32, jnp.bfloat16

# Tiles per backend: "small" gives several blocks at T of a few hundred, "mixed" uneven tiles
# across the three kernels (and, on TPU, a forward inner loop over kv and the row sums on the
# MXU, which a v6e takes by default: "mixed" serves bfloat16 cases only).
TILES = {
    "small": {
        "mosaic_tpu": mosaic_tpu.BlockSizes(block_q=128, block_kv=128, block_q_dq=128,
                                            block_kv_dq=128, block_q_dkv=128, block_kv_dkv=128),
        "pallas_gpu": pallas_gpu.BlockSizes(32, 16, 32, 16, 16, 32),
    },
    "mixed": {
        "mosaic_tpu": mosaic_tpu.BlockSizes(block_q=128, block_kv=256, block_kv_compute=128,
                                            block_q_dq=256, block_kv_dq=128, block_q_dkv=128,
                                            block_kv_dkv=256, row_sum_on_mxu=True),
        "pallas_gpu": pallas_gpu.BlockSizes(64, 32, 32, 64, 64, 32),
    },
    None: {},
}


def _block_sizes(tiles, backend):
    return TILES[tiles].get(backend)


def _refusal(backend, case, dtype):
    inputs = make_attention_inputs(case, jax.random.key(0), dtype)
    problem, _, _ = validate_attention(inputs["q"], inputs["k"], inputs["v"], **case.options(),
                                       sm_scale=None, segment_ids=inputs["segment_ids"])
    return CAPABILITIES[backend].refusal(problem)


C = AttentionCase
CASES = {
    # Causal with T < S and T > S (the first T - S rows then see no key), ragged lengths, GQA.
    "causal-T<S-gqa": (C(1, 100, 260, 4, 2, 64, causal=True), F32, "small"),
    "causal-T>S-d128": (C(1, 260, 100, 2, 1, 128, causal=True), F32, "small"),
    "causal-T>S-bf16-mixed": (C(1, 300, 200, 2, 2, 64, causal=True), BF16, "mixed"),
    "gqa-8to1": (C(1, 130, 130, 16, 2, 64, causal=True), F32, "small"),
    "mqa-bf16": (C(2, 63, 100, 3, 1, 128), BF16, None),
    # Segments: one shared array, and a pair where some queries see no key.
    "segments-shared-causal": (C(2, 200, 200, 2, 1, 64, causal=True, segments="shared"), F32,
                               "small"),
    "segments-pair-bf16": (C(1, 129, 257, 4, 2, 128, segments="pair"), BF16, "mixed"),
    # D = 256, multi-block and default tiles.
    "d256-causal": (C(1, 257, 257, 2, 1, 256, causal=True), F32, "small"),
    "d256-segments-bf16": (C(1, 200, 300, 2, 2, 256, segments="pair"), BF16, None),
    "t1": (C(2, 1, 7, 2, 2, 64), F32, None),
    # Head dims only some backends take: 16 and 32 (pallas_gpu, xla), 48 (xla only).
    "d32-causal-gqa": (C(1, 100, 70, 4, 2, 32, causal=True), F32, "small"),
    "d16-segments-pair": (C(1, 70, 100, 4, 2, 16, segments="pair"), F32, "small"),
    "d48": (C(1, 16, 16, 2, 2, 48), F32, None),
    # float16: mosaic_tpu refuses it.
    "f16-causal": (C(1, 70, 90, 2, 1, 64, causal=True), jnp.float16, "small"),
    # Local windows: smaller and larger than a block, left-only (causal), two-sided, T != S,
    # with GQA and segments; soft-capped scores (a cap of 1 bends most of them), alone, causal
    # with GQA, and with a window.
    "window-causal-gqa": (C(1, 300, 300, 4, 2, 64, causal=True, window=100), F32, "small"),
    "window-two-sided-T<S": (C(1, 100, 260, 2, 1, 64, window=(40, 17)), F32, "small"),
    "window-left-T>S-segments-bf16": (C(2, 200, 150, 2, 1, 64, window=(300, 0),
                                        segments="pair"), BF16, "mixed"),
    "window-narrow-long": (C(1, 600, 600, 2, 1, 64, window=(30, 50)), F32, "small"),
    "window-causal-d128-bf16": (C(2, 640, 640, 4, 2, 128, causal=True, window=(200, 0)), BF16,
                                "small"),
    "softcap": (C(1, 130, 200, 2, 2, 128, soft_cap=1.0), F32, "small"),
    "softcap-causal-gqa-bf16": (C(1, 200, 200, 4, 2, 64, causal=True, soft_cap=2.0), BF16,
                                None),
    "softcap-window-causal": (C(1, 257, 257, 2, 2, 64, causal=True, window=(64, 5),
                                soft_cap=1.5), F32, "small"),
}


# --full only: the longest window cases and the bfloat16 soft cap (the windowed ring, the TPU
# compile checks and the GPU interpret tests keep windows at D = 128 and soft caps in the
# default run); T > S at D = 128 (causal-T>S-bf16-mixed keeps T > S, test_all_rows_blind_causal
# and test_rows_that_see_no_key_give_zeros_and_zero_grads rows that see no key, on every
# backend); GQA 8:1 (groups of 2 in causal-T<S-gqa and segments-pair-bf16, of 3 in mqa-bf16);
# D = 256 causal in float32 at the small tiles (test_head_dim_256_backward_elementwise runs it at
# T = 200 on both kernels, every element against the float64 reference; d256-segments-bf16 keeps
# D = 256 under the pass rule); the causal window with GQA (a causal window narrower than a
# block: softcap-window-causal; windows with GQA: window-two-sided-T<S and
# window-left-T>S-segments-bf16). One backend's run of a case, by its test id: D = 32 on xla and
# pallas_gpu (D = 16 keeps the head dims below 64 there) and D = 48 on xla; mosaic_tpu's
# refusals of both (and pallas_gpu's of D = 48) stay in the default run. The soft cap alone
# (softcap-window-causal keeps soft caps on every backend, at T = S = 257 with two kv heads).
# The Pallas runs of segments-shared-causal: validate_attention turns a shared array into the
# pair the kernels take (segments-pair-bf16, window-left-T>S-segments-bf16 with a causal window);
# its xla run keeps the shared array.
CASES_FULL_ONLY = ("window-causal-d128-bf16", "window-narrow-long", "softcap-causal-gqa-bf16",
                   "causal-T>S-d128", "gqa-8to1", "d256-causal", "window-causal-gqa",
                   "d32-causal-gqa-xla", "d32-causal-gqa-pallas_gpu", "d48-xla", "softcap",
                   "segments-shared-causal-mosaic_tpu", "segments-shared-causal-pallas_gpu")


def _params():
    for name, (case, dtype, tiles) in CASES.items():
        for backend in BACKENDS:
            test_id = f"{name}-{backend}"
            marks = [pytest.mark.xdist_group(name)]
            if name in CASES_FULL_ONLY or test_id in CASES_FULL_ONLY:
                marks.append(pytest.mark.full)
            yield pytest.param(backend, case, dtype, tiles, id=test_id, marks=marks)


@pytest.mark.parametrize("backend,case,dtype,tiles", list(_params()))
def test_cases(backend, case, dtype, tiles):
    run = functools.partial(check_attention_parity, case, dtype=dtype, backend=backend,
                            interpret=backend != "xla", block_sizes=_block_sizes(tiles, backend))
    if _refusal(backend, case, dtype) is None:
        run()
    else:
        with pytest.raises(NotImplementedError, match=backend):
            run()


@pytest.mark.parametrize("backend", ["mosaic_tpu", "pallas_gpu"])
def test_head_dim_256_backward_elementwise(backend):
    """Every gradient element of a D = 256 problem matches the float64 reference, not just the
    RMS (a published kernel once shipped a D = 256 backward with 7% of its elements wrong)."""
    case = C(1, 200, 200, 2, 1, 256, causal=True)
    inputs = make_attention_inputs(case, jax.random.key(3), F32)
    del inputs["segment_ids"]
    kernel = functools.partial(ops.flash_attention, causal=True, backend=backend,
                               interpret=True, block_sizes=_block_sizes("small", backend))
    reference = functools.partial(ops.attention_reference, causal=True)
    out, grads = outputs_and_grads(kernel, inputs, jax.random.key(4))
    ref_out, ref_grads = outputs_and_grads(reference, inputs, jax.random.key(4), float64=True)
    for name, x, r in [("o", out, ref_out)] + [(n, grads[n], ref_grads[n]) for n in grads]:
        # float32 elementwise: within 1e-4 of the array's largest reference magnitude.
        np.testing.assert_allclose(x, r, rtol=0, atol=1e-4 * np.abs(r).max(), err_msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_that_see_no_key_give_zeros_and_zero_grads(backend):
    b, t, s, h, d = 1, 140, 150, 2, 64
    kq, kk, kv = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(kq, (b, t, h, d), F32)
    k = jax.random.normal(kk, (b, s, h, d), F32)
    v = jax.random.normal(kv, (b, s, h, d), F32)
    # Query ids 0..4, key ids 0..2: queries with id 3 or 4 see no key.
    q_seg = (jnp.arange(t, dtype=jnp.int32) % 5)[None, :]
    kv_seg = (jnp.arange(s, dtype=jnp.int32) % 3)[None, :]
    blind = np.asarray(q_seg[0] >= 3)

    def loss(q, k, v):
        o = ops.flash_attention(q, k, v, segment_ids=(q_seg, kv_seg), backend=backend,
                                interpret=backend != "xla",
                                block_sizes=_block_sizes("small", backend))
        return jnp.sum(o * o), o

    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, o), (dq, dk, dv) = grad_fn(q, k, v)
    for x in (o, dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(x)))
    np.testing.assert_array_equal(np.asarray(o)[0, blind], 0.0)
    np.testing.assert_array_equal(np.asarray(dq)[0, blind], 0.0)
    assert np.abs(np.asarray(o)[0, ~blind]).min() > 0
    ref = ops.attention_reference(q, k, v, segment_ids=(q_seg, kv_seg))
    np.testing.assert_allclose(o, ref, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_rows_blind_causal(backend):
    """Causal with T > S puts whole query blocks before the diagonal: all-zero output blocks."""
    case = C(1, 300, 40, 2, 1, 64, causal=True)
    inputs = make_attention_inputs(case, jax.random.key(6))
    del inputs["segment_ids"]
    o = ops.flash_attention(**inputs, causal=True, backend=backend, interpret=backend != "xla",
                            block_sizes=_block_sizes("small", backend))
    np.testing.assert_array_equal(np.asarray(o)[:, : 300 - 40], 0.0)


# pallas_gpu's run at D = 16 with --full only (its D = 64 run keeps the one-key case there, D = 16
# runs in test_cases[d16-segments-pair-pallas_gpu]; the draw hypothesis found, D = 16, stays on
# "xla").
@pytest.mark.parametrize("head_dim,backend", [
    pytest.param(d, backend, marks=pytest.mark.full if (backend, d) == ("pallas_gpu", 16) else ())
    for d in (16, 64) for backend in BACKENDS])
def test_single_key_gives_v_and_no_query_or_key_gradient(backend, head_dim):
    """With one key every query's softmax is exactly 1: o = v, and dq, dk vanish (the relative
    error the pass rule uses has no scale there). Found by hypothesis at T = 63, S = 1, D = 16 in
    bfloat16, where the XLA backend's dq and dk are rounding noise."""
    case = C(1, 63, 1, 1, 1, head_dim)
    if _refusal(backend, case, BF16) is not None:
        pytest.skip(f"{backend} does not take head_dim {head_dim} (test_cases checks it refuses)")
    inputs = make_attention_inputs(case, jax.random.key(7), BF16)
    del inputs["segment_ids"]
    kernel = functools.partial(ops.flash_attention, backend=backend, interpret=backend != "xla")
    out, grads = outputs_and_grads(kernel, inputs, jax.random.key(8), cotangent_dtype=BF16)
    v = np.asarray(inputs["v"], np.float32)
    np.testing.assert_array_equal(out, np.broadcast_to(v, out.shape))
    _, ref_grads = outputs_and_grads(ops.attention_reference, inputs, jax.random.key(8),
                                     float64=True, cotangent_dtype=BF16)
    np.testing.assert_allclose(grads["v"], ref_grads["v"], rtol=1e-2)
    for name in ("q", "k"):
        # Each element of dq, dk is a difference of products of O(1) values that cancel exactly:
        # what is left is rounding of bfloat16 operands.
        assert np.max(np.abs(grads[name])) <= 0.1, (name, np.max(np.abs(grads[name])))


# Shapes hypothesis draws from menus of awkward sizes: the XLA backend (held to fixed bounds, as
# the baseline of every other backend's rule) and the mosaic_tpu kernels. Each example is a
# problem of its own shapes (a few seconds of compiling): 2 and 1 examples in the default run
# (test_cases keeps the kernels' cases), 6 and 3 with --full.
@budget(2, full=6)
@given(case=attention_cases(), dtype=st.sampled_from([F32, BF16]))
def test_xla_hypothesis(case, dtype):
    check_attention_parity(case, dtype=dtype, backend="xla")


@budget(1, full=3)
@given(case=attention_cases(head_dims=(64, 128)), dtype=st.sampled_from([F32, BF16]),
       tiles=st.sampled_from([None, "small"]))
def test_mosaic_tpu_hypothesis(case, dtype, tiles):
    check_attention_parity(case, dtype=dtype, backend="mosaic_tpu", interpret=True,
                           block_sizes=_block_sizes(tiles, "mosaic_tpu"))
