"""Every bad input gets a ValueError (invalid) or NotImplementedError (backend cannot take it),
with a message that names the argument, the value and what is accepted; backend="auto" picks the
platform's kernel or falls back to "xla" with a one-time warning; the README's backend tables are
the backends' declared capabilities."""

import re
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from gla_tpu import ops
from gla_tpu.ops.attention import mosaic_tpu as attention_tpu
from gla_tpu.ops.attention import pallas_gpu as attention_gpu
from gla_tpu.ops.common import backends
from gla_tpu.ops.common.capabilities import Dims, backend_table
from gla_tpu.ops.gla import mosaic_tpu as gla_tpu_backend
from gla_tpu.ops.gla import pallas_gpu as gla_gpu_backend

B, T, H, D = 2, 16, 4, 32
Q = jnp.ones((B, T, H, D), jnp.float32)
KV = jnp.ones((B, T, 2, D), jnp.float32)
GK = -jnp.ones((B, T, H, D), jnp.float32)
SEG = jnp.zeros((B, T), jnp.int32)


def attention(**overrides):
    args = dict(q=Q, k=KV, v=KV)
    args.update(overrides)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    return ops.flash_attention(q, k, v, **args)


def gla(**overrides):
    args = dict(q=Q, k=Q, v=Q, g=GK)
    args.update(overrides)
    q, k, v, g = args.pop("q"), args.pop("k"), args.pop("v"), args.pop("g")
    return ops.gla(q, k, v, g, **args)


ATTENTION_BAD = [
    ({"q": jnp.ones((B, T, D))}, ValueError, r"q must have rank 4.*\(2, 16, 32\)"),
    ({"q": np.ones((B, T, H, D), np.int32)}, ValueError, r"q must have a floating dtype.*int32"),
    ({"k": jnp.ones((B, T, 2, 16))}, ValueError, r"k must have shape.*\(2, 16, 2, 32\).*\(2, 16, 2, 16\)"),
    ({"v": jnp.ones((B, T + 1, 2, D))}, ValueError, r"v must have shape"),
    ({"k": jnp.ones((B, T, 3, D)), "v": jnp.ones((B, T, 3, D))}, ValueError, r"H=4.*Hkv=3"),
    ({"q": Q.astype(jnp.bfloat16)}, ValueError, r"share one dtype.*bfloat16"),
    ({"q": jnp.ones((B, 0, H, D))}, ValueError, r"zero-sized"),
    ({"causal": "yes"}, ValueError, r"causal must be a bool; got 'yes'"),
    ({"sm_scale": -1.0}, ValueError, r"sm_scale must be a finite positive number; got -1.0"),
    ({"sm_scale": jnp.float32(0.1)}, ValueError, r"sm_scale must be None or a finite positive number"),
    ({"segment_ids": jnp.zeros((B, T), jnp.float32)}, ValueError, r"segment_ids \(queries\) must have an integer dtype"),
    ({"segment_ids": jnp.zeros((B, T + 1), jnp.int32)}, ValueError, r"segment_ids \(queries\) must have shape"),
    ({"segment_ids": (SEG,)}, ValueError, r"a pair.*length 1"),
    ({"k": jnp.ones((B, 8, 2, D)), "v": jnp.ones((B, 8, 2, D)), "segment_ids": SEG}, ValueError, r"T == S.*T=16, S=8"),
    ({"backend": "cuda"}, ValueError, r"backend must be one of .*'cuda'"),
    ({"backend": "xla", "block_sizes": object()}, NotImplementedError, r"'xla' backend takes None"),
]


@pytest.mark.parametrize("overrides,exc,pattern", ATTENTION_BAD)
def test_flash_attention_rejects(overrides, exc, pattern):
    with pytest.raises(exc, match=pattern):
        attention(**overrides)


GLA_BAD = [
    ({"q": jnp.ones((B, T, D))}, ValueError, r"q must have rank 4"),
    ({"k": jnp.ones((B, T, H, D + 1))}, ValueError, r"k must have shape.*\(2, 16, 4, 32\)"),
    ({"v": jnp.ones((B, T + 1, H, D))}, ValueError, r"v must have shape"),
    ({"v": Q.astype(jnp.bfloat16)}, ValueError, r"share one dtype"),
    ({"q": jnp.ones((B, T, H, D), jnp.int8)}, ValueError, r"floating dtype.*int8"),
    ({"g": jnp.ones((B, T))}, ValueError, r"g must be None, a per-head gate \[B, T, H\] or a per-key gate"),
    ({"g": jnp.ones((B, T, H + 1))}, ValueError, r"g must have shape \[B, T, H\]"),
    ({"g": jnp.ones((B, T, H, D), jnp.int32)}, ValueError, r"g must have a floating dtype"),
    ({"g": -jnp.ones((B, T, H, 8))}, ValueError, r"g must have shape \[B, T, H, K\]"),
    ({"scale": 0.0}, ValueError, r"scale must be a finite positive number; got 0.0"),
    ({"initial_state": jnp.ones((B, H, D))}, ValueError, r"initial_state must have rank 4"),
    ({"initial_state": jnp.ones((B, H, D, D + 1))}, ValueError, r"initial_state must have shape"),
    ({"output_final_state": 1}, ValueError, r"output_final_state must be a bool; got 1"),
    ({"segment_ids": jnp.zeros((B, T), jnp.float32)}, ValueError, r"segment_ids must have an integer dtype"),
    ({"segment_ids": jnp.zeros((B, T - 1), jnp.int32)}, ValueError, r"segment_ids must have shape"),
    ({"mode": "parallel"}, ValueError, r"mode must be one of .*'parallel'"),
    ({"chunk_size": 32}, ValueError, r"chunk_size must be one of \(64, 128, None\); got 32"),
    ({"chunk_size": True}, ValueError, r"chunk_size must be one of"),
    ({"backend": "triton"}, ValueError, r"backend must be one of .*'triton'"),
    ({"backend": "xla", "block_sizes": object()}, NotImplementedError, r"'xla' backend takes None"),
]


@pytest.mark.parametrize("overrides,exc,pattern", GLA_BAD)
def test_gla_rejects(overrides, exc, pattern):
    with pytest.raises(exc, match=pattern):
        gla(**overrides)


def test_gla_aliases_fix_the_mode():
    with pytest.raises(ValueError, match=re.escape("mode is fixed to 'chunk'")):
        ops.chunk_gla(Q, Q, Q, GK, mode="fused_recurrent")
    o1, _ = ops.chunk_gla(Q, Q, Q, GK)
    o2, _ = ops.fused_recurrent_gla(Q, Q, Q, GK)
    np.testing.assert_allclose(o1, o2, rtol=2e-5, atol=2e-5)


HV, DV = 2 * H, 16  # delta_rule: two value heads per q/k head, V != K
V_DR = jnp.ones((B, T, HV, DV), jnp.float32)
BETA = jnp.full((B, T, HV), 0.5, jnp.float32)
G_HEAD = -jnp.ones((B, T, HV), jnp.float32)
G_KEY = -jnp.ones((B, T, HV, D), jnp.float32)


def delta_rule(**overrides):
    args = dict(q=Q, k=Q, v=V_DR, beta=BETA, g=G_KEY)
    args.update(overrides)
    q, k, v, beta, g = (args.pop(n) for n in ("q", "k", "v", "beta", "g"))
    return ops.delta_rule(q, k, v, beta, g, **args)


DELTA_RULE_BAD = [
    ({"q": jnp.ones((B, T, D))}, ValueError, r"q must have rank 4.*\(2, 16, 32\)"),
    ({"k": jnp.ones((B, T, H, D + 1))}, ValueError, r"k must have shape.*\(2, 16, 4, 32\)"),
    ({"v": jnp.ones((B, T + 1, HV, DV))}, ValueError, r"v must have shape \[B, T, HV, V\]"),
    ({"v": jnp.ones((B, T, 6, DV))}, ValueError, r"v's heads HV=6 must be a multiple of q and k's heads H=4"),
    ({"v": V_DR.astype(jnp.bfloat16)}, ValueError, r"share one dtype.*v bfloat16"),
    ({"q": jnp.ones((B, T, H, D), jnp.int8)}, ValueError, r"q must have a floating dtype.*int8"),
    ({"beta": 0.5}, ValueError, r"beta must be an array \[B, T, HV\]; got 0.5"),
    ({"beta": jnp.ones((B, T, HV, 1))}, ValueError, r"beta must have rank 3"),
    ({"beta": jnp.ones((B, T, H))}, ValueError, r"beta must have shape \[B, T, HV\] = \(2, 16, 8\); got .*\(2, 16, 4\)"),
    ({"beta": jnp.ones((B, T, HV), jnp.int32)}, ValueError, r"beta must have a floating dtype.*int32"),
    ({"g": jnp.ones((B, T))}, ValueError, r"g must be None \(DeltaNet\), a per-head gate \[B, T, HV\] \(Gated DeltaNet\) or a per-key gate \[B, T, HV, K\] \(KDA\); got .*\(2, 16\)"),
    ({"g": -jnp.ones((B, T, H))}, ValueError, r"g must have shape \[B, T, HV\] \(per-head gate, Gated DeltaNet\) = \(2, 16, 8\)"),
    ({"g": -jnp.ones((B, T, HV, 8))}, ValueError, r"g must have shape \[B, T, HV, K\] \(per-key gate, KDA\)"),
    ({"g": jnp.ones((B, T, HV), jnp.int32)}, ValueError, r"g must have a floating dtype"),
    ({"scale": 0.0}, ValueError, r"scale must be a finite positive number; got 0.0"),
    ({"initial_state": jnp.ones((B, HV, D))}, ValueError, r"initial_state must have rank 4"),
    ({"initial_state": jnp.ones((B, H, D, DV))}, ValueError, r"initial_state must have shape \[B, HV, K, V\] = \(2, 8, 32, 16\)"),
    ({"initial_state": jnp.ones((B, HV, D, DV), jnp.int32)}, ValueError, r"initial_state must have a floating dtype"),
    ({"output_final_state": 1}, ValueError, r"output_final_state must be a bool; got 1"),
    ({"use_qk_l2norm": "yes"}, ValueError, r"use_qk_l2norm must be a bool; got 'yes'"),
    ({"segment_ids": jnp.zeros((B, T), jnp.float32)}, ValueError, r"segment_ids must have an integer dtype"),
    ({"segment_ids": jnp.zeros((B, T - 1), jnp.int32)}, ValueError, r"segment_ids must have shape"),
    ({"mode": "fused_chunk"}, ValueError, r"mode must be one of \('auto', 'chunk', 'fused_recurrent'\); got 'fused_chunk'"),
    ({"chunk_size": 32}, ValueError, r"chunk_size must be one of \(64, 128, None\); got 32"),
    ({"backend": "triton"}, ValueError, r"backend must be one of .*'triton'"),
    ({"backend": "xla", "block_sizes": object()}, NotImplementedError, r"'xla' backend takes None"),
    ({"backend": "mosaic_tpu"}, NotImplementedError, r"the 'mosaic_tpu' delta_rule takes K 64, 128, 256; got K=32. backend='xla' takes it"),
    ({"backend": "pallas_gpu"}, NotImplementedError, r"the 'pallas_gpu' delta_rule takes bfloat16, float16 q, k, v; got float32. backend='xla' takes it"),
]


@pytest.mark.parametrize("overrides,exc,pattern", DELTA_RULE_BAD)
def test_delta_rule_rejects(overrides, exc, pattern):
    with pytest.raises(exc, match=pattern):
        delta_rule(**overrides)


@pytest.mark.parametrize("alias,g,pattern", [
    ("chunk_kda", G_HEAD, r"chunk_kda takes a per-key gate g \[B, T, HV, K\] \(KDA\); got g=array of shape \(2, 16, 8\)"),
    ("fused_recurrent_kda", None, r"fused_recurrent_kda takes a per-key gate .*; got g=None"),
    ("chunk_gated_delta_rule", G_KEY, r"chunk_gated_delta_rule takes a per-head gate g \[B, T, HV\] \(Gated DeltaNet\); got g=array of shape \(2, 16, 8, 32\)"),
    ("fused_recurrent_gated_delta_rule", None, r"fused_recurrent_gated_delta_rule takes a per-head gate"),
    ("chunk_delta_rule", G_HEAD, r"chunk_delta_rule takes no gate \(g=None: DeltaNet\); got g=array"),
    ("fused_recurrent_delta_rule", G_KEY, r"fused_recurrent_delta_rule takes no gate"),
])
def test_delta_rule_aliases_reject_another_variant(alias, g, pattern):
    fn = getattr(ops, alias)
    with pytest.raises(ValueError, match=pattern):
        if "gated" in alias or "kda" in alias:
            fn(Q, Q, V_DR, g, BETA)
        else:
            fn(Q, Q, V_DR, BETA, g=g)


# backend="auto" and named backends.


X48 = jnp.ones((1, 8, 2, 48), jnp.float32)  # head dim 48: no Pallas backend takes it


def test_auto_on_cpu_runs_xla_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.flash_attention(X48, X48, X48)
        ops.gla(X48, X48, X48)


@pytest.mark.parametrize("platform,kernel", [("tpu", "mosaic_tpu"), ("gpu", "pallas_gpu")])
def test_auto_falls_back_to_xla_once_with_reason(monkeypatch, platform, kernel):
    monkeypatch.setattr(backends, "default_platform", lambda: platform)
    monkeypatch.setattr(backends, "_warned", set())
    with pytest.warns(ops.BackendFallbackWarning, match=f"from '{kernel}' to 'xla'"):
        ops.flash_attention(X48, X48, X48)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.flash_attention(X48, X48, X48)  # the same reason warns only once
    with backends.record_fallbacks() as messages:  # but a recorder sees every fallback
        ops.flash_attention(X48, X48, X48)
    assert len(messages) == 1 and f"from '{kernel}' to 'xla'" in messages[0]


# A head dim each Pallas backend refuses (docs/api.md lists what each takes).
UNSUPPORTED_GLA_DIM = {"mosaic_tpu": 48, "pallas_gpu": 576}


@pytest.mark.parametrize("backend", ["mosaic_tpu", "pallas_gpu"])
def test_named_backend_never_falls_back(backend):
    with pytest.raises(NotImplementedError, match=backend):
        ops.flash_attention(X48, X48, X48, backend=backend, interpret=True)
    x = jnp.ones((1, 8, 2, UNSUPPORTED_GLA_DIM[backend]), jnp.float32)
    with pytest.raises(NotImplementedError, match=backend):
        ops.gla(x, x, x, jnp.zeros((1, 8, 2)), backend=backend, interpret=True)


@pytest.mark.parametrize("op", ["flash_attention", "gla"])
def test_mosaic_tpu_refuses_float16_and_auto_falls_back(monkeypatch, op):
    x = jnp.ones((1, 8, 2, 64), jnp.float16)
    call = (lambda **kw: ops.flash_attention(x, x, x, **kw)) if op == "flash_attention" else (
        lambda **kw: ops.gla(x, x, x, **kw))
    with pytest.raises(NotImplementedError, match="takes bfloat16, float32 q, k, v; got float16"):
        call(backend="mosaic_tpu", interpret=True)
    monkeypatch.setattr(backends, "default_platform", lambda: "tpu")
    monkeypatch.setattr(backends, "_warned", set())
    with pytest.warns(ops.BackendFallbackWarning, match="float16"):
        call()


# block_sizes: a wrong type is a ValueError for every Pallas backend (so "auto" does not hide it
# behind a fallback); the right type for another backend is a wrong type.
@pytest.mark.parametrize("op,backend,sizes", [
    ("flash_attention", "mosaic_tpu", attention_gpu.BlockSizes()),
    ("flash_attention", "pallas_gpu", attention_tpu.BlockSizes()),
    ("gla", "mosaic_tpu", gla_gpu_backend.BlockSizes()),
    ("gla", "pallas_gpu", gla_tpu_backend.BlockSizes()),
    ("gla", "pallas_gpu", (64, 64)),
])
def test_block_sizes_of_another_backend_raise_value_error(op, backend, sizes):
    x = jnp.ones((1, 8, 2, 64), jnp.float32)
    call = ops.flash_attention if op == "flash_attention" else ops.gla
    with pytest.raises(ValueError, match=f"block_sizes for backend='{backend}'"):
        call(x, x, x, backend=backend, block_sizes=sizes, interpret=True)


@pytest.mark.parametrize("backend", ["mosaic_tpu", "pallas_gpu"])
def test_gla_chunk_size_is_honoured_or_refused(backend):
    x = jnp.ones((1, 70, 1, 64), jnp.float32)
    call = lambda: ops.gla(x, x, x, mode="chunk", chunk_size=128, backend=backend,  # noqa: E731
                           interpret=True)
    if 128 in backends.backend_module("gla", backend).CAPABILITIES.chunk_sizes:
        call()
    else:
        with pytest.raises(NotImplementedError, match="chunk_size 64; got chunk_size=128"):
            call()


def test_interpret_of_wrong_type_raises_value_error():
    x = jnp.ones((1, 8, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="interpret"):
        ops.flash_attention(x, x, x, backend="mosaic_tpu", interpret="yes")


@pytest.mark.parametrize("dims,accepted,refused,text", [
    (Dims(values=(64, 128, 256)), (64, 256), (32, 192), "64, 128, 256"),
    (Dims(multiple=64, low=64, high=512), (64, 192, 512), (32, 96, 576),
     "multiples of 64 from 64 to 512"),
    (Dims(high=512), (1, 48, 512), (513,), "up to 512"),
    (Dims(), (1, 4096), (), "any"),
])
def test_dims_accept_and_describe(dims, accepted, refused, text):
    assert all(dims.accepts(d) for d in accepted)
    assert not any(dims.accepts(d) for d in refused)
    assert dims.describe() == text


def _readme_table(op):
    text = (Path(__file__).parents[2] / "README.md").read_text()
    start, end = f"<!-- {op} backends: start -->\n", f"<!-- {op} backends: end -->"
    if start not in text or end not in text:
        raise AssertionError(f"README.md has no {start.strip()} ... {end} section")
    return text[text.index(start) + len(start):text.index(end)]


@pytest.mark.parametrize("op_family,op", [("attention", "flash_attention"), ("gla", "gla"),
                                         ("delta_rule", "delta_rule")])
def test_readme_backend_tables_are_the_declared_capabilities(op_family, op):
    expected = backend_table(backends.capabilities(op_family))
    assert _readme_table(op) == expected, (
        f"README.md's {op} table differs from the backends' CAPABILITIES; it should read:\n"
        f"{expected}")


@pytest.mark.parametrize("op,backend", [("flash_attention", "mosaic_tpu"), ("gla", "mosaic_tpu"),
                                        ("flash_attention", "pallas_gpu"), ("gla", "pallas_gpu")])
def test_support_is_checked_once_per_call(monkeypatch, op, backend):
    family = "attention" if op == "flash_attention" else "gla"
    module = backends.backend_module(family, backend)
    calls = []
    original = type(module.CAPABILITIES).check

    def counted(self, *args):
        calls.append(self.backend)
        return original(self, *args)

    monkeypatch.setattr(type(module.CAPABILITIES), "check", counted)
    x = jnp.ones((1, 8, 2, 64), jnp.float32)
    (ops.flash_attention if op == "flash_attention" else ops.gla)(x, x, x, backend=backend,
                                                                    interpret=True)
    assert calls == [backend]
