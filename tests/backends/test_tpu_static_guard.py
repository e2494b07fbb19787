"""A regression guard on TPU speed without a TPU: libtpu's static cycle estimate of one attention
and one GLA program (bench/tpu_static.py) must not grow by more than 10% over the values recorded
in docs/results/tpu_static_guard.json. libtpu is pinned, so the estimate is deterministic; when a
change makes a program cheaper, record the new value there."""

import json
from pathlib import Path

import pytest

from gla_tpu.testing.tpu_compile import libtpu_available

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(not libtpu_available(), reason="needs libtpu (pip install .[test])"),
]

RECORDED = json.loads(
    (Path(__file__).parents[2] / "docs" / "results" / "tpu_static_guard.json").read_text())
GROWTH_ALLOWED = 1.10


# Default run: GLA on v6e; --full adds the attention programs.
@pytest.mark.parametrize("recorded", [
    pytest.param(r, id=f"{r['op']}-{r['generation']}",
                 marks=() if (r["op"], r["generation"]) == ("gla", "v6e") else pytest.mark.full)
    for r in RECORDED["records"]])
def test_static_cycle_estimate_does_not_grow(recorded):
    from bench.tpu_static import Spec, profile

    spec = Spec(recorded["op"], recorded["impl"], tuple(recorded["shape"]), recorded["generation"],
                recorded["passes"])
    record = profile(spec, timeout=300)
    assert record["error"] is None, record["error"]
    assert record["cycles"] <= GROWTH_ALLOWED * recorded["cycles"], (
        f"{spec.key}: {record['cycles']:,} cycles, recorded {recorded['cycles']:,} "
        f"(+{record['cycles'] / recorded['cycles'] - 1:.1%}); per op: {record['ops']}")


# Every program the bench builds must at least trace: an attention forward+backward is profiled
# as two programs, and its backward program is built from abstract residuals that must match what
# the custom_vjp saves (a field it read once went missing from the kernel config unnoticed).
@pytest.mark.parametrize("op,shape", [("attention", (1, 2, 1024, 128, True)),
                                      ("gla", (1, 256, 2, 128, 128, "key", "chunk"))])
def test_bench_programs_trace(op, shape):
    import jax

    from bench.tpu_static import Spec, _attention_backward_program, _program
    from gla_tpu.testing.tpu_compile import targeting

    spec = Spec(op, "gla_tpu", shape, "v6e", "fwd_bwd")
    programs = [_program(spec)] + ([_attention_backward_program(spec)] if op == "attention"
                                   else [])
    with targeting("v6e"):
        for fn, args in programs:
            jax.jit(fn).trace(*args)
        if op == "attention":
            # the backward's gradients come back in the API's layout [B, T, H, D]
            b, h, t, d, _ = shape
            backward, args = programs[1]
            grads = jax.eval_shape(backward, *args)
            assert [g.shape for g in grads] == [(b, t, h, d)] * 3
