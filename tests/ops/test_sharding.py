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


def _assert_trees_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape and np.all(np.isfinite(g))
        assert np.linalg.norm(g - w) <= RELATIVE_RMS * np.linalg.norm(w), (
            f"relative RMS difference {np.linalg.norm(g - w) / np.linalg.norm(w):.2e}")


def _value_and_grads(fn, args, argnums):
    """Outputs and the gradients of a random projection of them, jitted."""
    out = jax.jit(fn)(*args)
    weights = [_normal(100 + i, x.shape) for i, x in enumerate(jax.tree.leaves(out))]

    def loss(*a):
        return sum(jnp.sum(x * w) for x, w in zip(jax.tree.leaves(fn(*a)), weights))

    return out, jax.jit(jax.grad(loss, argnums=argnums))(*args)


def _attention_inputs(hkv, segments, h=H):
    q, k, v = _normal(0, (B, T, h, D)), _normal(1, (B, T, hkv, D)), _normal(2, (B, T, hkv, D))
    seg = None
    if segments:
        seg = jnp.cumsum(jax.random.bernoulli(jax.random.key(3), 0.1, (B, T)), axis=1)
    return q, k, v, seg


def _check_attention(sharding, backend, hkv=H, segments=False, causal=True, h=H):
    q, k, v, seg = _attention_inputs(hkv, segments, h)

    def op(sharding):
        def fn(q, k, v):
            return ops.flash_attention(q, k, v, causal=causal, segment_ids=seg, backend=backend,
                                       interpret=backend != "xla", sharding=sharding)
        return fn

    want = _value_and_grads(op(None), (q, k, v), (0, 1, 2))
    got = _value_and_grads(op(sharding), (q, k, v), (0, 1, 2))
    _assert_trees_close(got, want)


def _check_gla(sharding, backend, gate="key", segments=False, mode="chunk"):
    kd = vd = 64
    q, k, v = _normal(0, (B, T, H, kd)), _normal(1, (B, T, H, kd)), _normal(2, (B, T, H, vd))
    g = jax.nn.log_sigmoid(_normal(3, (B, T, H, kd) if gate == "key" else (B, T, H)))
    s0 = _normal(4, (B, H, kd, vd))
    seg = jnp.cumsum(jax.random.bernoulli(jax.random.key(5), 0.1, (B, T)), axis=1) if segments \
        else None

    def op(sharding):
        def fn(q, k, v, g, s0):
            return ops.gla(q, k, v, g, initial_state=s0, output_final_state=True, mode=mode,
                           segment_ids=seg, backend=backend, interpret=backend != "xla",
                           sharding=sharding)
        return fn

    args = (q, k, v, g, s0)
    want = _value_and_grads(op(None), args, (0, 1, 2, 3, 4))
    got = _value_and_grads(op(sharding), args, (0, 1, 2, 3, 4))
    _assert_trees_close(got, want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention_sharded_matches_unsharded_xla(layout):
    _check_attention(_sharding(layout), "xla", segments=layout.startswith("2x4"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gla_sharded_matches_unsharded_xla(layout):
    _check_gla(_sharding(layout), "xla", gate="head" if "heads" in layout else "key",
               segments=layout.startswith("4x2"))


@pytest.mark.parametrize("layout", ["2x4-batch-heads", "8-heads"])
def test_attention_sharded_matches_unsharded_mosaic_tpu(layout):
    _check_attention(_sharding(layout), "mosaic_tpu", segments=layout == "2x4-batch-heads")


@pytest.mark.parametrize("layout", ["2x4-batch-heads", "8-batch"])
def test_gla_sharded_matches_unsharded_mosaic_tpu(layout):
    _check_gla(_sharding(layout), "mosaic_tpu", segments=layout == "2x4-batch-heads")


@pytest.mark.parametrize("hkv, heads_mesh", [
    (4, 4),  # kv heads split with the query heads
    (2, 4),  # replicated: two query heads per device share one kv head
    (2, 8),  # replicated: one query head per device
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


@pytest.mark.parametrize("spec, error, match", [
    (P(None, None, None, "x"), ValueError, "splits the head dim"),
    (P(None, "x"), NotImplementedError, "context parallelism"),
    (P("x", None, None, None, None), ValueError, "at most 4"),
])
def test_specs_the_ops_cannot_serve_are_refused(spec, error, match):
    mesh = _mesh((2,), ("x",))
    q = _normal(0, (2, 16, 2, D))
    g = jax.nn.log_sigmoid(q)
    with pytest.raises(error, match=match):
        ops.flash_attention(q, q, q, backend="xla", sharding=NamedSharding(mesh, spec))
    with pytest.raises(error, match=match):
        ops.gla(q, q, q, g, backend="xla", sharding=NamedSharding(mesh, spec))


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
