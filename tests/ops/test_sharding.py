"""The ops on a device mesh (`sharding=`): parity with the unsharded call, the partitioned HLO, and
the refusals. 8 host CPU devices (tests/conftest.py); meshes (8,), (2, 4) and (4, 2) over the batch
axis, the head axis and both. Sharded and unsharded runs execute the same kernels on the same
rows and heads, so they must agree to float32 rounding: XLA may order a contraction differently for
the smaller local shapes, and dk, dv are summed over devices where kv heads are replicated. The bar,
a relative RMS difference of 1e-5 per output and gradient, is far tighter than the pass rule.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gla_tpu import ops

B, T, H, D = 8, 40, 8, 64  # T: not a multiple of any block
TOL = dict(rtol=2e-5, atol=2e-5)
RELATIVE_RMS = 1e-5
PALLAS_GPU_RELATIVE_RMS = 2e-2  # bfloat16 inputs and outputs
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def _mesh(shape, names, explicit=False):
    devices = jax.devices()
    assert len(devices) >= 8, "tests/conftest.py sets --xla_force_host_platform_device_count=8"
    types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(shape)
    return Mesh(np.array(devices[: int(np.prod(shape))]).reshape(shape), names, axis_types=types)


# (mesh shape, axis names, q's spec): batch only, heads only, both, and both axes over one dim.
LAYOUTS = {
    "8-batch": ((8,), ("x",), P("x")),
    "8-heads": ((8,), ("x",), P(None, None, "x")),
    "2x4-batch-heads": ((2, 4), ("data", "model"), P("data", None, "model")),
    "2x4-batch-over-both": ((2, 4), ("data", "model"), P(("data", "model"))),
    "4x2-heads-batch": ((4, 2), ("data", "model"), P("model", None, "data")),
    "4x2-heads-over-both": ((4, 2), ("data", "model"), P(None, None, ("model", "data"))),
}


def _sharding(layout):
    shape, names, spec = LAYOUTS[layout]
    return NamedSharding(_mesh(shape, names), spec)


def _normal(key, shape):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _assert_trees_close(got, want, tolerance=RELATIVE_RMS):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape and np.all(np.isfinite(g))
        assert np.linalg.norm(g - w) <= tolerance * np.linalg.norm(w), (
            f"relative RMS difference {np.linalg.norm(g - w) / np.linalg.norm(w):.2e}")


def _value_and_grads(fn, args, argnums):
    """Outputs and the gradients of a random projection of them, jitted."""
    out = jax.jit(fn)(*args)
    weights = [_normal(100 + i, x.shape) for i, x in enumerate(jax.tree.leaves(out))]

    def loss(*a):
        return sum(jnp.sum(x * w) for x, w in zip(jax.tree.leaves(fn(*a)), weights))

    return out, jax.jit(jax.grad(loss, argnums=argnums))(*args)


def _attention_inputs(hkv, segments, h=H, b=B, t=T):
    q, k, v = _normal(0, (b, t, h, D)), _normal(1, (b, t, hkv, D)), _normal(2, (b, t, hkv, D))
    seg = None
    if segments:
        seg = jnp.cumsum(jax.random.bernoulli(jax.random.key(3), 0.1, (b, t)), axis=1)
    return q, k, v, seg


def _check_attention(sharding, backend, hkv=None, segments=False, causal=True, h=H, b=B, t=T,
                     **options):
    """options: local_window_size, logits_soft_cap."""
    q, k, v, seg = _attention_inputs(h if hkv is None else hkv, segments, h, b, t)

    def op(sharding):
        def fn(q, k, v):
            return ops.flash_attention(q, k, v, causal=causal, segment_ids=seg, backend=backend,
                                       interpret=backend != "xla", sharding=sharding, **options)
        return fn

    want = _value_and_grads(op(None), (q, k, v), (0, 1, 2))
    got = _value_and_grads(op(sharding), (q, k, v), (0, 1, 2))
    _assert_trees_close(got, want)


def _check_gla(sharding, backend, gate="key", segments=False, mode="chunk", b=B, h=H):
    """segments: False, True (random ids) or a [B, T] array of ids."""
    kd = vd = 64
    q, k, v = _normal(0, (b, T, h, kd)), _normal(1, (b, T, h, kd)), _normal(2, (b, T, h, vd))
    g = None if gate == "none" else jax.nn.log_sigmoid(
        _normal(3, (b, T, h, kd) if gate == "key" else (b, T, h)))
    s0 = _normal(4, (b, h, kd, vd))
    seg = segments if not isinstance(segments, bool) else (
        jnp.cumsum(jax.random.bernoulli(jax.random.key(5), 0.1, (b, T)), axis=1) if segments
        else None)

    def op(sharding):
        def fn(q, k, v, g, s0):
            return ops.gla(q, k, v, g, initial_state=s0, output_final_state=True, mode=mode,
                           segment_ids=seg, backend=backend, interpret=backend != "xla",
                           sharding=sharding)
        return fn

    args = (q, k, v, g, s0)
    argnums = (0, 1, 2, 4) if g is None else (0, 1, 2, 3, 4)
    want = _value_and_grads(op(None), args, argnums)
    got = _value_and_grads(op(sharding), args, argnums)
    _assert_trees_close(got, want)


# The layouts share one code path (common/sharding.py), exercised on all six by the GLA test.
@pytest.mark.parametrize("layout", [pytest.param("8-heads", marks=pytest.mark.full),
                                    "2x4-batch-heads",
                                    pytest.param("4x2-heads-over-both", marks=pytest.mark.full)])
def test_attention_sharded_matches_unsharded_xla(layout):
    _check_attention(_sharding(layout), "xla", segments=layout.startswith("2x4"))


# Default run: two layouts (heads then batch with segments, heads over both axes); --full runs
# all six.
GLA_LAYOUTS_FULL_ONLY = ("8-batch", "8-heads", "2x4-batch-over-both", "2x4-batch-heads")


@pytest.mark.parametrize("layout", [
    pytest.param(layout, marks=pytest.mark.full if layout in GLA_LAYOUTS_FULL_ONLY else ())
    for layout in LAYOUTS])
def test_gla_sharded_matches_unsharded_xla(layout):
    _check_gla(_sharding(layout), "xla", gate="head" if "heads" in layout else "key",
               segments=layout.startswith("4x2"))


# mosaic_tpu in interpret mode costs per (batch row, head): B2 H2 on a (2, 2) mesh.
SMALL = dict(b=2, h=2)
SMALL_MESH = ((2, 2), ("data", "model"))


@pytest.mark.full  # the kernels under shard_map:
# test_ring_attention_matches_unsharded_in_interpret_mode[mosaic_tpu]; batch x heads layouts: the
# xla tests above
def test_attention_sharded_matches_unsharded_mosaic_tpu():
    sharding = NamedSharding(_mesh(*SMALL_MESH), P("data", None, "model"))
    _check_attention(sharding, "mosaic_tpu", segments=True, hkv=2, **SMALL)


@pytest.mark.full  # the kernels under shard_map: test_context_parallel_gla_matches_unsharded_mosaic_tpu
def test_gla_sharded_matches_unsharded_mosaic_tpu():
    sharding = NamedSharding(_mesh(*SMALL_MESH), P("data", None, "model"))
    _check_gla(sharding, "mosaic_tpu", segments=True, **SMALL)


@pytest.mark.parametrize("hkv, heads_mesh", [
    (4, 4),  # kv heads split with the query heads
    (2, 4),  # replicated: two query heads per device share one kv head
    # replicated: one query head per device (--full only: (2, 4) keeps replicated kv heads)
    pytest.param(2, 8, marks=pytest.mark.full),
])
def test_attention_gqa_kv_heads_split_or_replicated(hkv, heads_mesh):
    mesh = _mesh((8 // heads_mesh, heads_mesh), ("data", "model"))
    _check_attention(NamedSharding(mesh, P("data", None, "model")), "xla", hkv=hkv)


def test_attention_gqa_kv_heads_repeated_when_groups_straddle_devices():
    """H = 6, Hkv = 3 on 2 head shards: 3 query heads per device, 2 per kv head, so a device's
    query heads read two kv heads, one of which the other device reads too."""
    mesh = _mesh((2,), ("model",))
    _check_attention(NamedSharding(mesh, P(None, None, "model")), "xla", hkv=3, h=6)


def test_explicit_mesh_axes_in_the_inputs_types_are_used():
    mesh = _mesh((2, 4), ("data", "model"), explicit=True)
    sharding = NamedSharding(mesh, P("data", None, "model"))
    q, k, v, _ = _attention_inputs(H, False)
    q, k, v = (jax.device_put(x, sharding) for x in (q, k, v))

    def fn(q, k, v):
        return ops.flash_attention(q, k, v, causal=True, backend="xla")

    text = jax.jit(fn).lower(q, k, v).as_text()
    assert "manual_computation" in text or "shard_map" in text
    want = ops.flash_attention(*(np.asarray(x) for x in (q, k, v)), causal=True, backend="xla")
    np.testing.assert_allclose(np.asarray(jax.jit(fn)(q, k, v)), np.asarray(want), **TOL)


def _collectives(compiled_text):
    return {c: len(re.findall(rf"\b{c}(-start)?\(", compiled_text)) for c in COLLECTIVES}


@pytest.mark.parametrize("op", ["attention", "gla"])
def test_batch_and_head_sharding_moves_nothing_between_devices(op):
    """The compiled forward+backward on a (2, 4) mesh has no collective at all."""
    sharding = _sharding("2x4-batch-heads")
    q, k, v, _ = _attention_inputs(H, False)
    g = jax.nn.log_sigmoid(_normal(3, (B, T, H, D)))
    if op == "attention":
        def loss(q, k, v, g):
            return jnp.sum(ops.flash_attention(q, k, v, causal=True, backend="xla",
                                               sharding=sharding) ** 2)
    else:
        def loss(q, k, v, g):
            return jnp.sum(ops.gla(q, k, v, g, backend="xla", sharding=sharding)[0] ** 2)
    placed = [jax.device_put(x, sharding) for x in (q, k, v, g)]
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*placed).compile().as_text()
    assert _collectives(text) == dict.fromkeys(COLLECTIVES, 0)


def test_replicated_kv_heads_sum_their_gradients_once():
    """Hkv = 2 on 4 head shards: the backward's only collectives are the all-reduces of dk, dv."""
    sharding = _sharding("2x4-batch-heads")
    q, k, v, _ = _attention_inputs(2, False)

    def loss(q, k, v):
        return jnp.sum(ops.flash_attention(q, k, v, backend="xla", sharding=sharding) ** 2)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    counts = _collectives(text)
    assert counts["all-gather"] == counts["all-to-all"] == counts["collective-permute"] == 0
    assert 1 <= counts["all-reduce"] <= 2


@pytest.mark.parametrize("spec, match", [
    (P(None, None, None, "x"), "splits the head dim"),
    (P("x", None, None, None, None), "at most 4"),
])
def test_specs_the_ops_cannot_serve_are_refused(spec, match):
    mesh = _mesh((2,), ("x",))
    q = _normal(0, (2, 16, 2, D))
    g = jax.nn.log_sigmoid(q)
    with pytest.raises(ValueError, match=match):
        ops.flash_attention(q, q, q, backend="xla", sharding=NamedSharding(mesh, spec))
    with pytest.raises(ValueError, match=match):
        ops.gla(q, q, q, g, backend="xla", sharding=NamedSharding(mesh, spec))


def test_ring_attention_refuses_what_it_cannot_split():
    sharding = NamedSharding(_mesh((2,), ("x",)), P(None, "x"))
    q, kv = _normal(0, (2, 16, 2, D)), _normal(1, (2, 32, 2, D))
    with pytest.raises(NotImplementedError, match=r"self-attention.*T = 16, S = 32"):
        ops.flash_attention(q, kv, kv, backend="xla", sharding=sharding)
    q = _normal(0, (2, 18, 2, D))  # causal on 2 devices: 4 zigzag halves
    with pytest.raises(ValueError, match=r"multiple of 4; got T = 18"):
        ops.flash_attention(q, q, q, causal=True, backend="xla", sharding=sharding)
    ops.flash_attention(q, q, q, backend="xla", sharding=sharding)  # not causal: T / 2 blocks


def test_gla_time_axis_that_does_not_divide_t_is_refused():
    q = _normal(0, (2, 18, 2, D))  # T = 18 on 4 devices
    with pytest.raises(ValueError, match=r"time dim \(18\).*4 devices"):
        ops.gla(q, q, q, backend="xla", sharding=NamedSharding(_mesh((4,), ("x",)), P(None, "x")))


# Context-parallel GLA: the time axis split (alone or with batch or heads). T = 40 gives blocks
# of 5, 10 or 20 tokens, none a multiple of a chunk.
CP_LAYOUTS = {
    "8-time": ((8,), ("x",), P(None, "x")),
    "2x4-batch-time": ((2, 4), ("data", "seq"), P("data", "seq")),
    "4x2-time-heads": ((4, 2), ("seq", "model"), P(None, "seq", "model")),
    "2x4-time-over-both": ((2, 4), ("data", "seq"), P(None, ("data", "seq"))),
}


def _boundary_segments(b=B):
    """Segment ids that change at block boundaries of every layout (t = 20, 30, 35), inside
    blocks (t = 7, 23) and not at all in row 1's second half."""
    seg = np.zeros((b, T), np.int32)
    for t in (7, 20, 23, 30, 35):
        seg[::2, t:] += 1
    seg[1::2, 10:] += 1
    return jnp.asarray(seg)


# Default run: each layout once (per-key gates where no other gate takes it); --full adds per-key
# gates on the layouts the other gates take.
@pytest.mark.parametrize("layout, gate", [
    pytest.param(layout, "key",
                 marks=pytest.mark.full if layout in ("2x4-batch-time", "4x2-time-heads",
                                                      "2x4-time-over-both") else ())
    for layout in CP_LAYOUTS] + [("2x4-batch-time", "head"), ("4x2-time-heads", "none")])
def test_context_parallel_gla_matches_unsharded_xla(layout, gate):
    shape, names, spec = CP_LAYOUTS[layout]
    _check_gla(NamedSharding(_mesh(shape, names), spec), "xla", gate=gate,
               segments=_boundary_segments() if gate == "key" else None)


@pytest.mark.full  # the context-parallel composition is the xla tests' above; the kernels' own
# initial-state path is tests/ops/test_gla.py's
def test_context_parallel_gla_matches_unsharded_mosaic_tpu():
    """mode "chunk"; the other modes differ only in the per-device call (xla runs
    fused_recurrent in test_context_parallel_gla_fused_recurrent_xla)."""
    sharding = NamedSharding(_mesh(*SMALL_MESH), P("data", "model"))  # batch and T
    _check_gla(sharding, "mosaic_tpu", segments=_boundary_segments(2), **SMALL)


# --full only: the modes differ only in the per-device call; the chunk runs above take the
# context-parallel code.
@pytest.mark.full
def test_context_parallel_gla_fused_recurrent_xla():
    shape, names, spec = CP_LAYOUTS["2x4-batch-time"]
    _check_gla(NamedSharding(_mesh(shape, names), spec), "xla", mode="fused_recurrent",
               segments=_boundary_segments())


@pytest.fixture
def closed_form_passes(monkeypatch):
    """The xla backend with context parallelism's two states-only passes (which pallas_gpu's
    pair-level kernels have, and the GPU interpreter cannot run under shard_map) in closed form:
    the sharded call then takes the path of the backward's own rule."""
    from gla_tpu.ops.gla import context_parallel
    from gla_tpu.ops.gla import xla as gla_xla

    def zero_state(k, v, g, *, segment_ids, **_):
        return context_parallel.zero_state_of_block(k, v, g, segment_ids)[0]

    def entering_cotangent(q, do, g, *, problem, segment_ids, **_):
        return context_parallel.entering_cotangent_of_block(q, do, g, segment_ids,
                                                            problem.scale)

    monkeypatch.setattr(gla_xla, "block_zero_state", zero_state, raising=False)
    monkeypatch.setattr(gla_xla, "block_entering_cotangent", entering_cotangent, raising=False)


@pytest.mark.parametrize("layout, gate", [
    ("8-time", "key"), pytest.param("2x4-batch-time", "head", marks=pytest.mark.full),
    pytest.param("4x2-time-heads", "none", marks=pytest.mark.full)])
def test_context_parallel_gla_with_states_passes(closed_form_passes, layout, gate):
    """The backward's own rule (D_p, its all-gather, the reverse scan, the op's backward from
    the leaving state's cotangent): initial and final states, segment starts at and inside
    block boundaries, every gradient, against the unsharded call."""
    shape, names, spec = CP_LAYOUTS[layout]
    _check_gla(NamedSharding(_mesh(shape, names), spec), "xla", gate=gate,
               segments=_boundary_segments() if gate != "none" else None)


@pytest.mark.parametrize("passes", [False, True], ids=["derivative", "states_passes"])
def test_context_parallel_gla_moves_states_not_tokens(request, passes):
    """Forward+backward over 8 time shards: the collectives carry the blocks' states and decays
    ([P, B, H, K, V] and [P, B, H, K] float32, gathered forward; reduce-scattered backward, or
    with the states-only passes the entering states' cotangents gathered and the final state's
    summed), nothing of length T."""
    if passes:
        request.getfixturevalue("closed_form_passes")
    sharding = NamedSharding(_mesh((8,), ("x",)), P(None, "x"))
    t, kd = 256, 64
    x = _normal(0, (B, t, H, kd))
    g = jax.nn.log_sigmoid(x)

    def loss(q, k, v, g):
        return jnp.sum(ops.gla(q, k, v, g, backend="xla", sharding=sharding)[0] ** 2)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(x, x, x, g).compile().as_text()
    shapes = re.findall(r"= \w+\[([\d,]*)\][^=]*? (?:all-gather|all-reduce|reduce-scatter|"
                        r"collective-permute|all-to-all)(?:-start)?\(", text)
    assert shapes, "expected the state all-gather"
    elements = [int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes]
    assert sum(elements) <= 2 * 8 * B * H * (kd * kd + kd) + passes * B * H * kd * kd
    assert all(t not in map(int, filter(None, s.split(","))) for s in shapes)


def _check_delta_rule(sharding, backend="xla", gate="key", segments=None, mode="chunk", b=B,
                      h=H, group=2, initial_state=True, t=T, dtype=jnp.float32,
                      tolerance=RELATIVE_RMS):
    """Sharded against unsharded ops.delta_rule: outputs, final state and every gradient; value
    heads HV = group * H, beta in (0, 2); q, k, v in `dtype`."""
    kd = vd = 64
    hv = group * h
    q, k = _normal(0, (b, t, h, kd)).astype(dtype), _normal(1, (b, t, h, kd)).astype(dtype)
    v = _normal(2, (b, t, hv, vd)).astype(dtype)
    beta = 2 * jax.nn.sigmoid(_normal(6, (b, t, hv)))
    g = None if gate == "none" else jax.nn.log_sigmoid(
        _normal(3, (b, t, hv, kd) if gate == "key" else (b, t, hv)))
    s0 = _normal(4, (b, hv, kd, vd)) if initial_state else None

    def op(sharding):
        def fn(q, k, v, beta, g, s0):
            return ops.delta_rule(q, k, v, beta, g, initial_state=s0, output_final_state=True,
                                  use_qk_l2norm=True, mode=mode, segment_ids=segments,
                                  backend=backend, interpret=backend != "xla",
                                  sharding=sharding)
        return fn

    args = (q, k, v, beta, g, s0)
    argnums = tuple(i for i, a in enumerate(args) if a is not None)
    want = _value_and_grads(op(None), args, argnums)
    got = _value_and_grads(op(sharding), args, argnums)
    _assert_trees_close(got, want, tolerance)


@pytest.mark.parametrize("layout", ["2x4-batch-heads", pytest.param("8-heads",
                                                                    marks=pytest.mark.full)])
def test_delta_rule_sharded_matches_unsharded_xla(layout):
    _check_delta_rule(_sharding(layout), gate="head", segments=_boundary_segments())


# Context-parallel delta rule: each time layout, every gate kind among them, segment ids that
# change inside blocks and at block boundaries, an initial state. The default run takes
# fused_recurrent on xla (the cheapest to compile) over batch and T with per-key gates (per-head
# gates on that layout: test_context_parallel_delta_rule_in_two_runs_where_v_plus_k_is_refused;
# T with heads: GLA's test_context_parallel_gla_matches_unsharded_xla, the same composition);
# --full adds the other layouts, chunk on xla and on mosaic_tpu (interpret mode; the
# context-parallel code is the same for every backend).
@pytest.mark.parametrize("layout, gate, mode", [
    pytest.param("8-time", "key", "chunk", marks=pytest.mark.full),
    pytest.param("4x2-time-heads", "head", "fused_recurrent", marks=pytest.mark.full),
    ("2x4-batch-time", "key", "fused_recurrent"),
    pytest.param("2x4-batch-time", "none", "chunk", marks=pytest.mark.full),
    pytest.param("2x4-time-over-both", "key", "fused_recurrent", marks=pytest.mark.full),
])
def test_context_parallel_delta_rule_matches_unsharded_xla(layout, gate, mode):
    shape, names, spec = CP_LAYOUTS[layout]
    _check_delta_rule(NamedSharding(_mesh(shape, names), spec), gate=gate, mode=mode,
                      segments=_boundary_segments())


def test_context_parallel_delta_rule_in_two_runs_where_v_plus_k_is_refused(monkeypatch):
    """The block's state and transition come from one run on V + K value columns; a backend that
    refuses that width gets two runs (zero state; zero values from the identity): same results."""
    from gla_tpu.ops.delta_rule import api as delta_rule_api
    from gla_tpu.ops.delta_rule import mosaic_tpu, validation

    problem, _, _ = validation.validate_delta_rule(
        *(jnp.zeros((1, 64, 1, d)) for d in (128, 128, 256)), jnp.zeros((1, 64, 1)), None,
        scale=None, initial_state=None, output_final_state=False, segment_ids=None,
        use_qk_l2norm=False, mode="chunk", chunk_size=None)
    assert not delta_rule_api._takes_value_dim(mosaic_tpu, problem, None, 256 + 128)
    assert delta_rule_api._takes_value_dim(mosaic_tpu, problem, None, 128 + 128)
    monkeypatch.setattr(delta_rule_api, "_takes_value_dim", lambda *args: False)
    shape, names, spec = CP_LAYOUTS["2x4-batch-time"]
    _check_delta_rule(NamedSharding(_mesh(shape, names), spec), gate="head",
                      mode="fused_recurrent", segments=_boundary_segments())


# jax 0.11.2's Mosaic GPU interpreter fails under shard_map on several CPU devices once a kernel
# has a grid of more than one block or a TMA store ("Barrier remains allocated"; the minimal
# kernel is in docs/scale_out.md, "Tests"), and the failure leaves the interpreter's state broken
# for every later kernel of the process: mode "chunk" is skipped here, for the GPUs.
INTERPRETER_UNDER_SHARD_MAP = pytest.mark.skip(
    reason="the Mosaic GPU interpreter fails under shard_map (jax 0.11.2; docs/scale_out.md)")


@pytest.mark.full
@pytest.mark.parametrize("mode", [pytest.param("chunk", marks=INTERPRETER_UNDER_SHARD_MAP),
                                  "fused_recurrent"])
def test_context_parallel_delta_rule_matches_unsharded_pallas_gpu(mode):
    """The "pallas_gpu" kernels under context parallelism in their interpreters, T over two
    devices: mode "chunk" (the operands kernel, the state passes, the cotangents kernel) at
    T = 140, and "fused_recurrent" (the token-by-token Triton kernel) at T = 16, in bfloat16 (the
    sharded call rounds its outputs at other places than the unsharded one)."""
    sharding = NamedSharding(_mesh((2,), ("seq",)), P(None, "seq"))
    t = 140 if mode == "chunk" else 16
    _check_delta_rule(sharding, "pallas_gpu", gate="head", mode=mode, b=1, h=1, t=t,
                      segments=jnp.asarray(np.cumsum(np.isin(np.arange(t), [5, 70]))[None]),
                      dtype=jnp.bfloat16, tolerance=PALLAS_GPU_RELATIVE_RMS)


@pytest.mark.full
def test_context_parallel_delta_rule_matches_unsharded_mosaic_tpu():
    """mode "chunk" over batch and T on a (2, 2) mesh, TPU interpret mode; blocks of 20 tokens."""
    sharding = NamedSharding(_mesh(*SMALL_MESH), P("data", "model"))
    _check_delta_rule(sharding, "mosaic_tpu", gate="head", segments=_boundary_segments(2), b=2,
                      h=1)


def test_context_parallel_delta_rule_moves_states_not_tokens():
    """Forward+backward over 8 time shards: the collectives carry the blocks' states and
    transitions ([P, B, HV, K, V + K] float32, gathered forward and reduce-scattered backward)
    and the segment flags, nothing of length T."""
    sharding = NamedSharding(_mesh((8,), ("x",)), P(None, "x"))
    t, kd, hv = 256, 64, 2 * H
    x = _normal(0, (B, t, H, kd))
    v = _normal(1, (B, t, hv, kd))
    beta = jax.nn.sigmoid(_normal(2, (B, t, hv)))
    g = jax.nn.log_sigmoid(_normal(3, (B, t, hv)))

    def loss(q, k, v, beta, g):
        return jnp.sum(ops.delta_rule(q, k, v, beta, g, backend="xla", sharding=sharding)[0] ** 2)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(x, x, v, beta, g).compile(
    ).as_text()
    shapes = re.findall(r"= \w+\[([\d,]*)\][^=]*? (?:all-gather|all-reduce|reduce-scatter|"
                        r"collective-permute|all-to-all)(?:-start)?\(", text)
    assert shapes, "expected the state all-gather"
    elements = [int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes]
    assert sum(elements) <= 3 * 8 * B * hv * kd * (kd + kd)
    assert all(t not in map(int, filter(None, s.split(","))) for s in shapes)


# Eager calls (no jax.jit around the op or its gradient, as in a notebook) of every sharded op:
# batch and heads, context-parallel GLA, ring attention. Run one primitive at a time, the
# shard_map bodies once crashed XLA's CPU compiler with a segmentation fault (a concatenate with a
# zero-size operand, docs/scale_out.md); the ops jit them. A regression kills the test process.
EAGER = {
    "gla-8-time": ("gla", ((8,), ("x",), P(None, "x"))),
    "gla-2x4-batch-heads": ("gla", LAYOUTS["2x4-batch-heads"]),
    "gla-2-time-T64": ("gla", ((2,), ("x",), P(None, "x"))),
    "attention-2x4-batch-time": ("attention", CP_LAYOUTS["2x4-batch-time"]),
    "attention-8-heads": ("attention", LAYOUTS["8-heads"]),
    "gla-passes-2-time-T64": ("gla", ((2,), ("x",), P(None, "x"))),
    "delta_rule-2-time-T64": ("delta_rule", ((2,), ("x",), P(None, "x"))),
    "delta_rule-8-time": ("delta_rule", ((8,), ("x",), P(None, "x"))),
    "delta_rule-2x4-batch-heads": ("delta_rule", LAYOUTS["2x4-batch-heads"]),
}
# The default run keeps one context-parallel GLA call: two devices with one chunk per block, the
# crash's condition, in less than half of 8-time's time; and one batch x heads call of a linear
# op (GLA's: the delta rule's goes through the same shard_map of common/sharding.py).
EAGER_FULL_ONLY = ("gla-8-time", "attention-8-heads", "delta_rule-8-time",
                   "delta_rule-2-time-T64", "gla-passes-2-time-T64", "delta_rule-2x4-batch-heads")


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.full if n in EAGER_FULL_ONLY else ()) for n in EAGER])
def test_eager_sharded_calls_match_jitted(request, name):
    op, (shape, names, spec) = EAGER[name]
    if "-passes-" in name:  # context-parallel GLA with the backward's own rule
        request.getfixturevalue("closed_form_passes")
    sharding = NamedSharding(_mesh(shape, names), spec)
    # the shape the crash was first seen at on 8 devices; B2 H4 (the smallest the (2, 4) meshes
    # divide) elsewhere
    b, h, t = (1, 1, 64) if name.endswith("T64") else (B, H, T) if "8-" in name else (2, 4, T)
    x = [_normal(i, (b, t, h, 64)) for i in range(3)]
    if op == "gla":
        g = jax.nn.log_sigmoid(_normal(3, (b, t, h, 64)))

        def fn(q, k, v):
            return ops.gla(q, k, v, g, mode="chunk", backend="xla", sharding=sharding)[0]
    elif op == "delta_rule":
        beta = jax.nn.sigmoid(_normal(3, (b, t, h)))

        def fn(q, k, v):
            return ops.delta_rule(q, k, v, beta, mode="chunk", backend="xla",
                                  use_qk_l2norm=True, sharding=sharding)[0]
    else:
        def fn(q, k, v):
            return ops.flash_attention(q, k, v, causal=True, backend="xla", sharding=sharding)

    def loss(*a):
        return jnp.sum(fn(*a) * x[0])

    eager = (fn(*x), jax.grad(loss, argnums=(0, 1, 2))(*x))
    jitted = (jax.jit(fn)(*x), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*x))
    _assert_trees_close(eager, jitted)


# Ring attention over the CP layouts. T = 48: zigzag halves of 3 tokens on 8 devices (6 on 4),
# none a multiple of a block.
RING_T = 48


@pytest.mark.parametrize("layout, causal, hkv, segments", [
    pytest.param("8-time", True, H, False, marks=pytest.mark.full),
    ("2x4-batch-time", True, 2, True),
    ("4x2-time-heads", False, 4, True),
    pytest.param("2x4-time-over-both", True, 1, False, marks=pytest.mark.full),
])
def test_ring_attention_matches_unsharded_xla(layout, causal, hkv, segments):
    shape, names, spec = CP_LAYOUTS[layout]
    _check_attention(NamedSharding(_mesh(shape, names), spec), "xla", hkv=hkv,
                     segments=segments, causal=causal, t=RING_T)


# Ring attention under a local window (contiguous blocks of n = 6 tokens on 8 devices, 12 on 4):
# windows narrower than a block, a few blocks wide, covering the ring, two-sided; a soft cap.
@pytest.mark.parametrize("layout, causal, window, cap", [
    ("8-time", True, 4, None),
    ("8-time", False, (7, 5), 2.0),  # two blocks back, one ahead, of the eight
    pytest.param("2x4-batch-time", False, (13, 5), None, marks=pytest.mark.full),  # every block
    pytest.param("8-time", True, 15, None, marks=pytest.mark.full),
    pytest.param("8-time", False, (40, 50), None, marks=pytest.mark.full),
    pytest.param("4x2-time-heads", True, (30, 0), 1.0, marks=pytest.mark.full),
])
def test_ring_attention_with_a_window_matches_unsharded_xla(layout, causal, window, cap):
    shape, names, spec = CP_LAYOUTS[layout]
    _check_attention(NamedSharding(_mesh(shape, names), spec), "xla", hkv=2, segments=True,
                     causal=causal, t=RING_T, local_window_size=window, logits_soft_cap=cap)


@pytest.mark.full
@pytest.mark.parametrize("backend", ["mosaic_tpu", "pallas_gpu"])
def test_ring_attention_with_a_window_in_interpret_mode(backend):
    """Kernel blocks with block-local windows of negative sides, over 4 devices (pallas_gpu:
    the Triton kernels; a row that sees no key of a block gets no weight in the merge)."""
    sharding = NamedSharding(_mesh((4,), ("seq",)), P(None, "seq"))
    _check_attention(sharding, backend, hkv=1, causal=True, h=2, b=1, t=256,
                     local_window_size=70, logits_soft_cap=3.0)


@pytest.mark.parametrize("backend", ["mosaic_tpu", "pallas_gpu"])
def test_ring_attention_matches_unsharded_in_interpret_mode(backend):
    """T over two devices (the xla tests take the mixes with batch and heads), GQA, segment ids:
    causal on mosaic_tpu; on pallas_gpu not causal, where a row can see no key of a block (its
    forward marks such rows apart)."""
    sharding = NamedSharding(_mesh((2,), ("seq",)), P(None, "seq"))
    _check_attention(sharding, backend, segments=True, hkv=1, causal=backend == "mosaic_tpu",
                     t=64, b=1, h=2)


def test_ring_attention_moves_blocks_not_sequences():
    """Causal forward+backward over 8 time shards: the only collectives are collective-permutes
    of one device's blocks (the zigzag reordering, k and v each step, dk and dv back)."""
    sharding = NamedSharding(_mesh((8,), ("x",)), P(None, "x"))
    t = 256
    q, k, v, _ = _attention_inputs(2, False, t=t)

    def loss(q, k, v):
        return jnp.sum(ops.flash_attention(q, k, v, causal=True, backend="xla",
                                           sharding=sharding) ** 2)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    counts = _collectives(text)
    assert counts["collective-permute"] > 0
    assert all(counts[name] == 0 for name in COLLECTIVES if name != "collective-permute")
    shapes = re.findall(r"= \w+\[([\d,]*)\][^=]*? collective-permute(?:-start)?\(", text)
    assert all(int(dims.split(",")[1]) <= t // 8 for dims in shapes if dims), shapes


def test_ring_attention_bfloat16_meets_the_pass_rule():
    """bfloat16 over 8 time shards, causal: outputs and gradients within 2x the unsharded call's
    error against the float64 reference."""
    b, t, h = 2, 128, 2
    q, k, v = (_normal(i, (b, t, h, D)) for i in range(3))
    w = _normal(9, (b, t, h, D))
    sharding = NamedSharding(_mesh((8,), ("x",)), P(None, "x"))

    def grads(sharding, dtype, fn=None):
        def loss(q, k, v):
            o = fn(q, k, v) if fn else ops.flash_attention(
                q, k, v, causal=True, backend="xla", sharding=sharding)
            return jnp.sum(o * w.astype(o.dtype)), o
        out = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
            *(x.astype(dtype) for x in (q, k, v)))
        return [np.asarray(x, np.float64) for x in (out[0][1], *out[1])]

    with jax.enable_x64():
        want = grads(None, jnp.float64,
                     lambda q, k, v: ops.attention_reference(q, k, v, causal=True))
    got, baseline = grads(sharding, jnp.bfloat16), grads(None, jnp.bfloat16)
    for name, g, bl, wt in zip(("o", "dq", "dk", "dv"), got, baseline, want):
        error = lambda x: np.linalg.norm(x - wt) / np.linalg.norm(wt)  # noqa: E731
        assert error(g) <= 2 * error(bl), f"{name}: {error(g):.2e} vs {error(bl):.2e}"


def test_mesh_axes_that_do_not_divide_the_dims_are_refused():
    mesh = _mesh((4,), ("x",))
    q = _normal(0, (2, 16, 4, D))  # B = 2 on 4 devices
    with pytest.raises(ValueError, match=r"batch dim \(2\).*4 devices"):
        ops.flash_attention(q, q, q, backend="xla", sharding=NamedSharding(mesh, P("x")))
    q = _normal(0, (4, 16, 2, D))  # H = 2 on 4 devices
    with pytest.raises(ValueError, match=r"heads dim \(2\).*4 devices"):
        ops.gla(q, q, q, backend="xla", sharding=NamedSharding(mesh, P(None, None, "x")))


def test_a_sharding_that_is_not_a_named_sharding_is_refused():
    q = _normal(0, (2, 16, 2, D))
    with pytest.raises(ValueError, match="NamedSharding"):
        ops.flash_attention(q, q, q, backend="xla", sharding=P("x"))


@pytest.mark.full  # explicit mesh axes in the inputs' types:
# test_explicit_mesh_axes_in_the_inputs_types_are_used; context-parallel GLA on 8 time shards:
# test_context_parallel_gla_matches_unsharded_xla[8-time-key]
def test_context_parallel_gla_on_an_explicit_mesh():
    """T over Explicit mesh axes (jax.make_mesh's default): outputs, final state and gradients."""
    mesh = _mesh((8,), ("x",), explicit=True)
    sharding = NamedSharding(mesh, P(None, "x"))
    q, k, v = _normal(0, (2, T, 2, D)), _normal(1, (2, T, 2, D)), _normal(2, (2, T, 2, D))
    g = jax.nn.log_sigmoid(_normal(3, (2, T, 2, D)))

    def op(sharding):
        def fn(q, k, v, g):
            return ops.gla(q, k, v, g, output_final_state=True, backend="xla",
                           sharding=sharding)
        return fn

    want = _value_and_grads(op(None), (q, k, v, g), (0, 1, 2, 3))
    placed = [jax.device_put(x, sharding) for x in (q, k, v, g)]
    got = _value_and_grads(op(None), placed, (0, 1, 2, 3))  # sharding from the inputs' types
    _assert_trees_close(got, want)


# --full only with the states-only passes: the default run checks them in float32 against the
# unsharded call (test_context_parallel_gla_with_states_passes[8-time-key]).
@pytest.mark.parametrize("passes", [
    False, pytest.param(True, marks=pytest.mark.full)], ids=["derivative", "states_passes"])
def test_context_parallel_gla_bfloat16_meets_the_pass_rule(request, passes):
    """bfloat16: the blocks' zero-state states (and with the passes the entering states'
    cotangents) come from bfloat16 products (float32 sums); the outputs, the final state and
    every gradient stay within the pass rule against the float64 reference, with the unsharded
    call as the baseline."""
    if passes:
        request.getfixturevalue("closed_form_passes")
    from gla_tpu.testing.grads import outputs_and_grads
    from gla_tpu.testing.tolerance import assert_pass_rule

    b, t, h, kd = 2, 256, 2, 64
    bf16 = jnp.bfloat16
    inputs = dict(q=_normal(0, (b, t, h, kd)).astype(bf16), k=_normal(1, (b, t, h, kd)).astype(bf16),
                  v=_normal(2, (b, t, h, kd)).astype(bf16),
                  g=jax.nn.log_sigmoid(_normal(3, (b, t, h, kd))) / 16,  # slow decay: states carry
                  initial_state=_normal(4, (b, h, kd, kd)))
    sharding = NamedSharding(_mesh((8,), ("x",)), P(None, "x"))

    def op(sharding):
        def fn(q, k, v, g, initial_state):
            return ops.gla(q, k, v, g, initial_state=initial_state, output_final_state=True,
                           backend="xla", sharding=sharding)
        return fn

    key = jax.random.key(7)
    got = outputs_and_grads(op(sharding), inputs, key, cotangent_dtype=bf16)
    baseline = outputs_and_grads(op(None), inputs, key, cotangent_dtype=bf16)

    def reference(q, k, v, g, initial_state):
        return ops.gla_reference(q, k, v, g, initial_state=initial_state,
                                 output_final_state=True)

    want = outputs_and_grads(reference, inputs, key, float64=True, cotangent_dtype=bf16)
    assert_pass_rule(got, baseline, want, dtype=bf16)
