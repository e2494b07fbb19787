"""backend="auto": the platform's kernel, or "xla" with a one-time warning; named backends raise."""

import warnings

import jax.numpy as jnp
import pytest

from gla_tpu import ops
from gla_tpu.ops.common import backends

Q = jnp.ones((1, 8, 2, 48), jnp.float32)  # head dim 48: no Pallas backend takes it


def test_auto_on_cpu_runs_xla_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.flash_attention(Q, Q, Q)
        ops.gla(Q, Q, Q)


@pytest.mark.parametrize("platform,kernel", [("tpu", "mosaic_tpu"), ("gpu", "pallas_gpu")])
def test_auto_falls_back_to_xla_once_with_reason(monkeypatch, platform, kernel):
    monkeypatch.setattr(backends, "default_platform", lambda: platform)
    monkeypatch.setattr(backends, "_warned", set())
    with pytest.warns(ops.BackendFallbackWarning, match=f"from '{kernel}' to 'xla'"):
        ops.flash_attention(Q, Q, Q)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.flash_attention(Q, Q, Q)  # the same reason warns only once


# A head dim each Pallas backend refuses (docs/api.md lists what each takes).
UNSUPPORTED_GLA_DIM = {"mosaic_tpu": 48, "pallas_gpu": 576}


@pytest.mark.parametrize("backend", ["mosaic_tpu", "pallas_gpu"])
def test_named_backend_never_falls_back(backend):
    with pytest.raises(NotImplementedError, match=backend):
        ops.flash_attention(Q, Q, Q, backend=backend, interpret=True)
    x = jnp.ones((1, 8, 2, UNSUPPORTED_GLA_DIM[backend]), jnp.float32)
    with pytest.raises(NotImplementedError, match=backend):
        ops.gla(x, x, x, jnp.zeros((1, 8, 2)), backend=backend, interpret=True)


@pytest.mark.parametrize("op", ["flash_attention", "gla"])
def test_mosaic_tpu_refuses_float16_and_auto_falls_back(monkeypatch, op):
    x = jnp.ones((1, 8, 2, 64), jnp.float16)
    call = (lambda **kw: ops.flash_attention(x, x, x, **kw)) if op == "flash_attention" else (
        lambda **kw: ops.gla(x, x, x, **kw))
    with pytest.raises(NotImplementedError, match="bfloat16 or float32.*float16"):
        call(backend="mosaic_tpu", interpret=True)
    monkeypatch.setattr(backends, "default_platform", lambda: "tpu")
    monkeypatch.setattr(backends, "_warned", set())
    with pytest.warns(ops.BackendFallbackWarning, match="float16"):
        call()
