"""delta_rule (DeltaNet, Gated DeltaNet, KDA) on its backends, "xla" and "mosaic_tpu" (TPU
interpret mode on CPU), against the float64 token recurrence (`delta_rule_recurrent_jax`, itself
checked against the NumPy references in test_delta_rule_references.py).

The "xla" backend has no baseline below it: it is held to the fixed bounds of
tolerance.XLA_MAX_RELATIVE_RMS (float32: 1e-5 relative RMS error) for outputs, final state and
every gradient (dq, dk, dv, dbeta, dg, d initial_state) through one scalar loss. "mosaic_tpu" is
held to the pass rule against "xla" on the same inputs. "pallas_gpu" has its own file
(tests/backends/test_pallas_gpu_delta_rule.py).
"""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gla_tpu import ops
from gla_tpu.ops.common import backends
from gla_tpu.ops.delta_rule import api as delta_rule_api
from gla_tpu.testing import DeltaRuleCase, make_delta_rule_inputs
from gla_tpu.testing.grads import outputs_and_grads
from gla_tpu.testing.parity import case_seed, check_delta_rule_parity
from gla_tpu.testing.strategies import budget
from gla_tpu.testing.tolerance import assert_accuracy

F32, BF16 = jnp.float32, jnp.bfloat16
C = DeltaRuleCase

# Every gate kind in both modes, both dtypes meeting every gate kind; grouped value heads
# (H = 2, HV = 4; H = 1, HV = 2) and plain ones; K != V both ways; T = 1, 7, 65, 130 (a chunk and
# one token, two chunks and two tokens); segments with a one-token segment; initial and final
# states; keys l2-normalized inside the op or passed with unit norm; logsigmoid and Kimi gates.
CASES = {
    "chunk-none-T65-gva-f32": (C(2, 65, 2, 4, 16, 24, gate="none", initial_state=True,
                                 segments=True), F32, "chunk", None),
    "chunk-head-kimi-T130-f32-unit-keys": (C(1, 130, 2, 4, 32, 16, gate="head", gate_law="kimi",
                                             initial_state=True, use_qk_l2norm=False), F32,
                                           "chunk", None),
    "chunk-key-kimi-T65-seg-f32": (C(2, 65, 2, 4, 16, 24, gate="key", gate_law="kimi",
                                     initial_state=True, segments=True), F32, "chunk", None),
    "chunk-key-T7-bf16": (C(2, 7, 2, 4, 16, 24, gate="key", initial_state=True, segments=True),
                          BF16, "chunk", None),
    "chunk-head-T1-f32": (C(2, 1, 2, 4, 16, 24, gate="head", initial_state=True), F32, "chunk",
                          None),
    "chunk128-key-T130-f32": (C(1, 130, 1, 2, 16, 24, gate="key", gate_strength=16.0,
                                initial_state=True, segments=True), F32, "chunk", 128),
    "recurrent-none-T7-mqa-f32-unit-keys": (C(1, 7, 1, 2, 24, 16, gate="none", segments=True,
                                              use_qk_l2norm=False), F32, "fused_recurrent", None),
    "recurrent-head-kimi-T65-bf16": (C(1, 65, 2, 4, 16, 24, gate="head", gate_law="kimi",
                                       initial_state=True, segments=True), BF16,
                                     "fused_recurrent", None),
    "recurrent-key-T130-f32": (C(1, 130, 2, 4, 32, 16, gate="key", gate_strength=16.0,
                                 initial_state=True, segments=True, output_final_state=False),
                               F32, "fused_recurrent", None),
}



def _full_cases():
    """--full: the rest of the sweep, every (mode, gate, gate law, dtype) at larger heads and
    three shapes in rotation, plus chunk_size 128 and float16."""
    shapes = ((63, 2, 2, 64, 64, True, True), (257, 1, 3, 64, 32, False, False),
              (129, 2, 4, 32, 64, True, False))  # (T, H, HV, K, V, segments, use_qk_l2norm)
    cases, i = {}, 0
    for mode in ("chunk", "fused_recurrent"):
        for gate in ("none", "head", "key"):
            for law in ("logsigmoid",) if gate == "none" else ("logsigmoid", "kimi"):
                for dtype in (F32, BF16):
                    t, h, hv, kd, vd, seg, l2 = shapes[i % len(shapes)]
                    name = f"{mode}-{gate}-{law}-T{t}-K{kd}-V{vd}-{jnp.dtype(dtype).name}"
                    cases[name] = (C(2, t, h, hv, kd, vd, gate=gate, gate_law=law,
                                     initial_state=True, segments=seg, use_qk_l2norm=l2),
                                   dtype, mode, None)
                    i += 1
    cases["chunk128-head-T257-f32"] = (C(1, 257, 2, 4, 64, 64, gate="head", initial_state=True,
                                         segments=True), F32, "chunk", 128)
    cases["chunk-key-T100-f16"] = (C(1, 100, 2, 4, 32, 32, gate="key", initial_state=True),
                                   jnp.float16, "chunk", None)
    cases["recurrent-none-T100-f16"] = (C(1, 100, 2, 4, 32, 32, gate="none",
                                          initial_state=True), jnp.float16, "fused_recurrent",
                                        None)
    return cases


# --full only: per-key Kimi gates in chunk (Kimi's law is a draw of the gates, which
# chunk-head-kimi-T130-f32-unit-keys and recurrent-head-kimi-T65-bf16 take; per-key gates in
# chunk: chunk-key-T7-bf16 and chunk128-key-T130-f32, with segments at T = 65:
# chunk-none-T65-gva-f32).
CASES_FULL_ONLY = ("chunk-key-kimi-T65-seg-f32",)


def _params(cases, marks=()):
    return [pytest.param(case, dtype, mode, chunk, id=name,
                         marks=pytest.mark.full if name in CASES_FULL_ONLY else marks)
            for name, (case, dtype, mode, chunk) in cases.items()]


@pytest.mark.parametrize("case,dtype,mode,chunk_size",
                         _params(CASES) + _params(_full_cases(), pytest.mark.full))
def test_xla_against_float64_recurrence(case, dtype, mode, chunk_size):
    check_delta_rule_parity(case, dtype=dtype, mode=mode, chunk_size=chunk_size, backend="xla")


# The "mosaic_tpu" kernels (mode "chunk", K and V in {64, 128, 256}) in TPU interpret mode,
# NaN-filled buffers: each variant, grouped value heads (H = 1, HV = 2; H = 2, HV = 4), K != V,
# beta in (0, 2), segments, initial and final states, Kimi and strong (x16) gates, both dtypes,
# T a chunk and one token, two chunks and two tokens.
KERNEL_CASES = {
    "none-T100-gva-seg-f32": (C(1, 100, 1, 2, 64, 64, gate="none", initial_state=True,
                                segments=True), F32),
    "head-kimi-T130-K64-V128-bf16": (C(1, 130, 2, 4, 64, 128, gate="head", gate_law="kimi",
                                       initial_state=True, segments=True), BF16),
    "key-kimi-T65-seg-bf16": (C(1, 65, 1, 2, 64, 64, gate="key", gate_law="kimi",
                                initial_state=True, segments=True), BF16),
    # --full only (below): test_gates_of_minus_1000_and_minus_inf[chunk-key-mosaic_tpu] runs the
    # same gates at T = 130 with segments and a state (H = 2, HV = 4), some of them -1e3 or -inf
    "key-strong-T130-f32": (C(1, 130, 1, 2, 64, 64, gate="key", gate_strength=16.0,
                              initial_state=True, segments=True), F32),
    # Per-head gates of about -11 a token: dg small next to the terms db sums ("Per-head dg",
    # docs/delta_rule_mosaic_tpu.md).
    "head-strong-T100-f32": (C(2, 100, 1, 2, 64, 64, gate="head", gate_strength=1 / 16), F32),
}


def _full_kernel_cases():
    """--full: every gate kind and law in both dtypes, K, V in {64, 128, 256}, unit keys."""
    cases = {}
    dims = ((128, 64), (64, 256), (256, 128))
    i = 0
    for gate in ("none", "head", "key"):
        for law in ("logsigmoid",) if gate == "none" else ("logsigmoid", "kimi"):
            for dtype in (F32, BF16):
                kd, vd = dims[i % len(dims)]
                name = f"{gate}-{law}-K{kd}-V{vd}-{jnp.dtype(dtype).name}"
                cases[name] = (C(2, 129, 2, 4, kd, vd, gate=gate, gate_law=law,
                                 initial_state=True, segments=i % 2 == 0,
                                 use_qk_l2norm=i % 3 != 0), dtype)
                i += 1
    return cases


# --full only, beside key-strong-T130-f32: key-kimi-T65-seg-bf16, the per-key kernels in
# bfloat16 (test_gates_of_minus_1000_and_minus_inf[chunk-key-mosaic_tpu] keeps per-key gates with
# segments and a state in float32; head-kimi-T130-K64-V128-bf16 the chunk kernels in bfloat16 with
# Kimi gates and segments).
KERNEL_CASES_FULL_ONLY = ("key-strong-T130-f32", "key-kimi-T65-seg-bf16")


@pytest.mark.parametrize("case,dtype", [
    pytest.param(case, dtype, id=name,
                 marks=pytest.mark.full if name in KERNEL_CASES_FULL_ONLY else ())
    for name, (case, dtype) in KERNEL_CASES.items()] + [
    pytest.param(case, dtype, id=name, marks=pytest.mark.full)
    for name, (case, dtype) in _full_kernel_cases().items()])
def test_mosaic_tpu_against_float64_recurrence(case, dtype):
    check_delta_rule_parity(case, dtype=dtype, mode="chunk", backend="mosaic_tpu",
                            interpret=True)


# The decode kernel (mode "fused_recurrent" at T = 1): each variant, grouped value heads, both
# dtypes, with and without an initial state; its gradient is XLA's autodiff of the step.
DECODE_CASES = {
    "none-gva-f32": (C(3, 1, 2, 4, 64, 128, gate="none", initial_state=True), F32),
    "head-kimi-bf16": (C(2, 1, 2, 4, 64, 64, gate="head", gate_law="kimi", initial_state=True),
                       BF16),
    "key-f32-no-state": (C(2, 1, 1, 2, 128, 64, gate="key"), F32),
    "key-kimi-bf16": (C(2, 1, 8, 16, 64, 64, gate="key", gate_law="kimi", initial_state=True),
                      BF16),
}


# --full: the two float32 cases (the bfloat16 ones keep every gate kind but none in the default
# run; the "none" gate is the chunk cases').
@pytest.mark.parametrize("case,dtype", [
    pytest.param(c, d, id=n, marks=pytest.mark.full if d == F32 else ())
    for n, (c, d) in DECODE_CASES.items()])
def test_mosaic_tpu_decode_step_against_float64_recurrence(case, dtype):
    check_delta_rule_parity(case, dtype=dtype, mode="fused_recurrent", backend="mosaic_tpu",
                            interpret=True)


# The token-by-token kernels (mode "fused_recurrent", T > 1; GLA's kernels with the delta
# update): each variant, grouped value heads, segments, states, strong and Kimi gates, both
# dtypes, K != V, several time blocks and V blocks (BlockSizes' recurrent fields), T = 2.
RECURRENT_KERNEL_CASES = {
    "head-gva-seg-T20-f32": (C(1, 20, 1, 2, 64, 64, gate="head", initial_state=True,
                               segments=True), F32, None),
    "key-kimi-T37-K64-V128-bf16": (C(2, 37, 2, 2, 64, 128, gate="key", gate_law="kimi",
                                     initial_state=True), BF16, None),
    "key-strong-T19-V256-blocks-bf16": (C(1, 19, 2, 4, 64, 256, gate="key", gate_strength=16.0,
                                          initial_state=True, segments=True,
                                          use_qk_l2norm=False), BF16,
                                        dict(block_v_recurrent=128, block_t_recurrent=8)),
}
FULL_RECURRENT_KERNEL_CASES = {
    "none-seg-T13-K128-V64-f32": (C(1, 13, 1, 1, 128, 64, gate="none", segments=True), F32,
                                  None),
    "head-kimi-T2-K256-f32": (C(2, 2, 1, 2, 256, 128, gate="head", gate_law="kimi",
                                initial_state=True), F32, None),
    "head-kimi-T16-no-state-bf16": (C(1, 16, 1, 2, 128, 128, gate="head", gate_law="kimi",
                                      output_final_state=False), BF16, None),
}


# --full only: key-kimi-T37-K64-V128-bf16 (per-key gates in bfloat16 with K != V:
# key-strong-T19-V256-blocks-bf16; Kimi's law is a draw of the gates, which the decode cases and
# head-kimi-T130-K64-V128-bf16 take).
RECURRENT_KERNEL_CASES_FULL_ONLY = ("key-kimi-T37-K64-V128-bf16",)


@pytest.mark.parametrize("case,dtype,blocks", [
    pytest.param(*v, id=n,
                 marks=pytest.mark.full if n in RECURRENT_KERNEL_CASES_FULL_ONLY else ())
    for n, v in RECURRENT_KERNEL_CASES.items()] + [
    pytest.param(*v, id=n, marks=pytest.mark.full)
    for n, v in FULL_RECURRENT_KERNEL_CASES.items()])
def test_mosaic_tpu_fused_recurrent_against_float64_recurrence(case, dtype, blocks):
    from gla_tpu.ops.delta_rule.mosaic_tpu import BlockSizes

    check_delta_rule_parity(case, dtype=dtype, mode="fused_recurrent", backend="mosaic_tpu",
                            interpret=True, block_sizes=blocks and BlockSizes(**blocks))


# One chunk at a time, a choice no chip defaults to (128-wide MXUs take 2, 256-wide ones 4), with
# --full only.
@pytest.mark.parametrize("pack", [pytest.param(1, marks=pytest.mark.full), 4])
def test_mosaic_tpu_block_diagonal_inverse_of_1_and_4_chunks(pack):
    """The inverses formed one chunk at a time and four at a time (BlockSizes.inverse_chunks; the
    cases above take the default 2 off a TPU): per-head gates with segments, four chunks."""
    from gla_tpu.ops.delta_rule.mosaic_tpu import BlockSizes

    case = C(1, 256, 1, 2, 64, 64, gate="head", gate_law="kimi", initial_state=True,
             segments=True)
    check_delta_rule_parity(case, dtype=F32, mode="chunk", backend="mosaic_tpu", interpret=True,
                            block_sizes=BlockSizes(inverse_chunks=pack))


def _run_all(inputs, key, *, mode, use_qk_l2norm=True, backend="xla"):
    """(outputs and grads of `backend`, float64 reference outputs and grads) for the same
    inputs."""
    seg = inputs.pop("segment_ids")
    ct_key = jax.random.fold_in(key, 1)
    common = dict(output_final_state=True, segment_ids=seg, use_qk_l2norm=use_qk_l2norm)
    ours = outputs_and_grads(functools.partial(ops.delta_rule, **common, mode=mode,
                                               backend=backend,
                                               interpret=backend == "mosaic_tpu"),
                             inputs, ct_key)
    reference = outputs_and_grads(functools.partial(ops.delta_rule_reference, **common), inputs,
                                  ct_key, float64=True)
    return ours, reference


# fused_recurrent with per-head gates runs the per-key scan with one gate per head: --full only
MODES_GATES = [("chunk", "head"), ("chunk", "key"), ("fused_recurrent", "key"),
               pytest.param("fused_recurrent", "head", marks=pytest.mark.full)]
# The "mosaic_tpu" kernels (interpret mode) at K = V = 64, the smallest they take.
MOSAIC_GATES = [("chunk", "key", "mosaic_tpu"),
                pytest.param("chunk", "head", "mosaic_tpu", marks=pytest.mark.full),
                pytest.param("fused_recurrent", "key", "mosaic_tpu", marks=pytest.mark.full),
                ("fused_recurrent", "head", "mosaic_tpu")]


@pytest.mark.parametrize("mode,gate,backend", [
    ("chunk", "head", "xla"), ("chunk", "key", "xla"), ("fused_recurrent", "key", "xla"),
    pytest.param("fused_recurrent", "head", "xla", marks=pytest.mark.full), *MOSAIC_GATES])
def test_gates_of_minus_1000_and_minus_inf(mode, gate, backend):
    """g = -1e3 at some steps (three in one chunk, then weak gates: the chunk's running sums reach
    -300, where float32 differences of them would cost 3e-5 relative in the weak decays after)
    and -inf at others (two in a row, a chunk's first and last token): finite outputs and
    gradients within the float32 bound, dg included (0 where the gate cuts the state)."""
    kd, vd = (16, 24) if backend == "xla" else (64, 64)
    case = C(1, 130, 2, 4, kd, vd, gate=gate, gate_strength=16.0, initial_state=True,
             segments=True)
    key = jax.random.key(case_seed(case, "strong"))
    inputs = make_delta_rule_inputs(case, key)
    steps = jnp.arange(case.seq_len).reshape((1, -1) + (1,) * (inputs["g"].ndim - 2))
    strong, cut = jnp.isin(steps, jnp.array([5, 9, 17, 80])), jnp.isin(steps, jnp.array(
        [40, 41, 64, 127]))
    inputs["g"] = jnp.where(strong, -1e3, jnp.where(cut, -jnp.inf, inputs["g"]))
    ours, reference = _run_all(inputs, key, mode=mode, backend=backend)
    for leaf in jax.tree_util.tree_leaves(ours):
        assert np.all(np.isfinite(leaf))
    assert np.all(np.asarray(ours[1]["g"])[np.broadcast_to(cut, inputs["g"].shape)] == 0.0)
    assert_accuracy(ours, reference, dtype=F32)


@pytest.mark.parametrize("mode,gate", MODES_GATES)
def test_minus_inf_gate_is_a_hard_reset(mode, gate):
    """Outputs from a -inf gate on (on every key) do not depend on anything before it: keys,
    values, the initial state."""
    case = C(1, 70, 2, 4, 16, 24, gate=gate, initial_state=True)
    inputs = make_delta_rule_inputs(case, jax.random.key(case_seed(case, "reset")))
    inputs.pop("segment_ids")
    steps = jnp.arange(case.seq_len).reshape((1, -1) + (1,) * (inputs["g"].ndim - 2))
    inputs["g"] = jnp.where(steps == 40, -jnp.inf, inputs["g"])
    before = (jnp.arange(case.seq_len) < 40).reshape(1, -1, 1, 1)
    changed = dict(inputs, k=jnp.where(before, -inputs["k"], inputs["k"]),
                   v=jnp.where(before, 2 * inputs["v"] + 1, inputs["v"]),
                   initial_state=inputs["initial_state"] + 1)
    run = jax.jit(functools.partial(ops.delta_rule, output_final_state=True, mode=mode,
                                    use_qk_l2norm=True))
    o, state = run(**inputs)
    o2, state2 = run(**changed)
    np.testing.assert_array_equal(np.asarray(o[:, 40:]), np.asarray(o2[:, 40:]))
    np.testing.assert_array_equal(np.asarray(state), np.asarray(state2))
    assert not np.array_equal(np.asarray(o[:, :40]), np.asarray(o2[:, :40]))


def test_grouped_value_heads_read_their_query_and_key_head():
    """H = 2, HV = 6: the same as q and k repeated to six heads."""
    case = C(1, 40, 2, 6, 16, 8, gate="key", initial_state=True)
    inputs = make_delta_rule_inputs(case, jax.random.key(3))
    inputs.pop("segment_ids")
    repeated = {**inputs, **{n: jnp.repeat(inputs[n], 3, axis=2) for n in ("q", "k")}}
    for mode in ("chunk", "fused_recurrent"):
        run = jax.jit(functools.partial(ops.delta_rule, output_final_state=True, mode=mode,
                                        use_qk_l2norm=True))
        for x, y in zip(run(**inputs), run(**repeated)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


def test_float64_inputs_compute_in_float64():
    """float64 inputs (under jax_enable_x64): float64 outputs, states and gradients that agree with
    the float64 recurrence to 1e-10 (mode "chunk"; "fused_recurrent" runs the same scan as the
    reference)."""
    case = C(1, 40, 1, 2, 8, 8, gate="key", gate_law="kimi", initial_state=True, segments=True)
    key = jax.random.key(4)
    inputs = make_delta_rule_inputs(case, key)
    with jax.enable_x64(True):
        for n in ("q", "k", "v", "beta", "g", "initial_state"):
            inputs[n] = jnp.asarray(np.asarray(inputs[n], np.float64))
        ours, reference = _run_all(inputs, key, mode="chunk")
    o, final = ours[0]
    assert o.dtype == final.dtype == np.float64
    for name, x, ref in zip(("o", "final"), ours[0], reference[0]):
        assert np.linalg.norm(x - ref) <= 1e-10 * np.linalg.norm(ref), name
    for name, grad in ours[1].items():
        ref = reference[1][name]
        assert grad.dtype == np.float64
        assert np.linalg.norm(grad - ref) <= 1e-10 * np.linalg.norm(ref), name


# The xla backend over shapes hypothesis draws from menus of awkward sizes (2 examples in the
# default run, 3 with --full).
@st.composite
def _problems(draw):
    hv, h = draw(st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]))
    case = C(batch=draw(st.integers(1, 2)), seq_len=draw(st.sampled_from([1, 7, 63, 65, 100])),
             num_heads=h, num_value_heads=hv, key_dim=draw(st.sampled_from([8, 16, 32])),
             value_dim=draw(st.sampled_from([8, 24])),
             gate=draw(st.sampled_from(["none", "head", "key"])),
             gate_law=draw(st.sampled_from(["logsigmoid", "kimi"])),
             initial_state=draw(st.booleans()), segments=draw(st.booleans()),
             output_final_state=draw(st.booleans()), use_qk_l2norm=draw(st.booleans()))
    return case, draw(st.sampled_from([F32, BF16]))


@budget(1, full=3)  # the fixed cases above keep every gate kind, law and mode
@given(problem=_problems(), mode=st.sampled_from(["chunk", "fused_recurrent"]),
       chunk_size=st.sampled_from([64, 128]))
def test_xla_hypothesis(problem, mode, chunk_size):
    case, dtype = problem
    check_delta_rule_parity(case, dtype=dtype, mode=mode, chunk_size=chunk_size, backend="xla")


# Backends: which takes what.


X = jnp.ones((1, 8, 2, 16), jnp.float32)
BETA = jnp.full((1, 8, 2), 0.5, jnp.float32)


def test_auto_on_cpu_runs_xla_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto = ops.delta_rule(X, X, X, BETA, output_final_state=True)
    xla = ops.delta_rule(X, X, X, BETA, output_final_state=True, backend="xla")
    for a, b in zip(auto, xla):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


X64 = jnp.ones((1, 32, 1, 64), jnp.float32)
BETA64 = jnp.full((1, 32, 1), 0.5, jnp.float32)


@pytest.mark.parametrize("x,kwargs,reason", [
    (X, {}, "takes K 64, 128, 256; got K=16"),
    (X64, {"chunk_size": 128}, "runs chunk_size 64; got chunk_size=128"),
    (X64.astype(jnp.float16), {}, "takes bfloat16, float32 q, k, v; got float16"),
], ids=["K16", "chunk128", "float16"])
def test_mosaic_tpu_refuses_what_it_cannot_take(x, kwargs, reason):
    beta = BETA if x.shape[-1] == 16 else BETA64
    with pytest.raises(NotImplementedError,
                       match=re.escape(f"the 'mosaic_tpu' delta_rule {reason}") + ".* backend='xla' takes it"):
        ops.delta_rule(x, x, x, beta, backend="mosaic_tpu", interpret=True, **kwargs)


@pytest.mark.parametrize("platform,kernel,why", [
    ("tpu", "mosaic_tpu", "takes K 64, 128, 256"),
    ("gpu", "pallas_gpu", "takes bfloat16, float16")])
def test_auto_on_tpu_and_gpu_warns_once_and_runs_xla(monkeypatch, platform, kernel, why):
    monkeypatch.setattr(backends, "default_platform", lambda: platform)
    monkeypatch.setattr(backends, "_warned", set())
    with pytest.warns(ops.BackendFallbackWarning, match=f"from '{kernel}' to 'xla'.*{why}"):
        o, _ = ops.delta_rule(X, X, X, BETA)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o2, _ = ops.delta_rule(X, X, X, BETA)  # warned once
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o2))


def test_capabilities_table_renders():
    from gla_tpu.ops.common.capabilities import backend_table

    table = backend_table(backends.capabilities("delta_rule"))
    assert table.splitlines()[0].startswith("| backend | platform | dtypes | K | V | modes |")
    assert "| `xla` | any (plain JAX) |" in table and "| yes | yes | yes | yes |" in table


# The fla-named aliases.


ALIASES = [  # (alias, mode, gate kind)
    (ops.chunk_delta_rule, "chunk", "none"),
    (ops.chunk_gated_delta_rule, "chunk", "head"),
    (ops.chunk_kda, "chunk", "key"),
    (ops.fused_recurrent_delta_rule, "fused_recurrent", "none"),
    (ops.fused_recurrent_gated_delta_rule, "fused_recurrent", "head"),
    (ops.fused_recurrent_kda, "fused_recurrent", "key"),
]
GATES = {"none": None, "head": -jnp.ones((1, 8, 2)), "key": -jnp.ones((1, 8, 2, 16))}


@pytest.mark.parametrize("alias,mode,gate", ALIASES, ids=lambda x: getattr(x, "__name__", x))
def test_aliases_fix_mode_and_take_fla_argument_order(monkeypatch, alias, mode, gate):
    """Each alias calls delta_rule with its mode and fla's positional order (q, k, v, beta) or
    (q, k, v, g, beta); a mode raises ValueError (a gate of another variant too:
    test_errors.py)."""
    calls = []
    monkeypatch.setattr(delta_rule_api, "delta_rule",
                        lambda *args, **kwargs: calls.append((args, kwargs)))
    g = GATES[gate]
    args = (X, X, X, BETA) if g is None else (X, X, X, g, BETA)
    alias(*args, output_final_state=True)
    (got, kwargs), = calls
    assert got[3] is BETA and (got[4] if len(got) > 4 else kwargs.get("g")) is g
    assert kwargs["mode"] == mode and kwargs["output_final_state"] is True
    fixed = f"mode is fixed to {mode!r} by {alias.__name__}"
    with pytest.raises(ValueError, match=re.escape(fixed)):
        alias(*args, mode="chunk")
    assert len(calls) == 1
