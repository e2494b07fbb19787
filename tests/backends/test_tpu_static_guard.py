"""A regression guard on TPU speed without a TPU: libtpu's static cycle estimate of one attention
and one GLA program (`bench.tpu_static`) must not grow by more than 10% over the values recorded
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


# Default run: the attention forward, the attention backward (in one kernel) and one GLA program
# on one generation, v6e, so that CI guards both op families (3-15 s of profiling each on a 2-core
# host); --full adds the v5e attention program.
@pytest.mark.parametrize("recorded", [
    pytest.param(r, id=f"{r['op']}-{r['generation']}-{r['passes']}",
                 marks=() if r["generation"] == "v6e" else pytest.mark.full)
    for r in RECORDED["records"]])
def test_static_cycle_estimate_does_not_grow(recorded):
    from bench.tpu_static import Spec, profile

    spec = Spec(recorded["op"], recorded["impl"], tuple(recorded["shape"]), recorded["generation"],
                recorded["passes"])
    record = profile(spec, timeout=300, twins=False)
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


# libtpu writes one profile per distinct compiled op: an op compiled to the same code as another
# has none of its own, and the bench brackets it by its candidate twins (same opcode and type).
HLO_WITH_TWINS = """HloModule m
ENTRY %main.1 (args_0_.1: bf16[1,4096,8,128]) -> (bf16[1,4096,1024]) {
  %reshape.10.refs_0_ = bf16[1,4096,1024]{2,1,0:T(8,128)(2,1)S(1)} reshape(%args_0_.1), metadata={}
  %reshape.12.refs_2_ = bf16[1,4096,1024]{2,1,0:T(8,128)(2,1)S(1)} reshape(%bitcast.32), metadata={}
  %copy = bf16[512,8,8,128]{3,2,1,0:T(8,128)(2,1)} copy(%bitcast.35)
  %custom-call = bf16[2048,2048]{1,0} custom-call(%a, %b), custom_call_target="ConcatBitcast"
  %k.1 = (bf16[1,4096,1024]{2,1,0}, f32[1,8,1,4096]{3,2,1,0}) custom-call(%x), custom_call_target="tpu_custom_call"
  ROOT %tuple = (bf16[1,4096,1024]) tuple(%reshape.12.refs_2_)
}
"""


def test_entry_ops_and_twin_bracket():
    from bench.tpu_static import _entry_ops, _with_twins

    ops_ = _entry_ops(HLO_WITH_TWINS)
    assert [o[:2] for o in ops_] == [
        ["reshape.10.refs_0_", "reshape"], ["reshape.12.refs_2_", "reshape"], ["copy", "copy"],
        ["custom-call", "custom-call"], ["k.1", "custom-call"], ["tuple", "tuple"]]
    assert ops_[1][2] == "bf16[1,4096,1024]{2,1,0:T(8,128)(2,1)S(1)}"
    assert ops_[4][2].startswith("(bf16[1,4096,1024]") and ops_[4][3] == "tpu_custom_call"
    assert ops_[3][3] == "ConcatBitcast" and ops_[0][3] is None
    record = _with_twins({"cycles": 1000},
                         [["reshape.12.refs_2_", "reshape", ops_[1][2],
                           {"reshape.10.refs_0_": 30, "reshape.11.refs_1_": 20}]])
    assert record["cycles_with_twins"] == [1020, 1030]
    assert _with_twins({"cycles": 1000}, [["x", "copy", "t", {}]])["cycles_with_twins"] is None


def test_unprofiled_twins_names_ops_without_a_profile(monkeypatch):
    import subprocess

    from bench import tpu_static

    listing = json.dumps(tpu_static._entry_ops(HLO_WITH_TWINS))
    monkeypatch.setattr(tpu_static, "_run_child", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, stdout=listing + "\n", stderr=""))
    spec = tpu_static.Spec("gla", "gla_tpu", (1, 4096, 8, 128, 128, "key", "chunk"), "v6e",
                           "fwd_bwd")
    profiled = {"reshape.10.refs_0_": 30, "copy": 7, "k.1": 500}
    missing = tpu_static.unprofiled_twins(spec, profiled, timeout=1)
    # the kernel and the copy have profiles; ConcatBitcast and the tuple cost nothing
    assert missing == [["reshape.12.refs_2_", "reshape",
                        "bf16[1,4096,1024]{2,1,0:T(8,128)(2,1)S(1)}", {"reshape.10.refs_0_": 30}]]


def test_a_lower_bound_gets_no_twins_pass(monkeypatch):
    from bench import tpu_static

    bound = {"cycles": 1000, "ops": {"k.1": 1000}, "lower_bound": True, "error": None,
             "unprofiled_ops": [["copy.2", "copy"]]}
    monkeypatch.setattr(tpu_static, "_profile_one", lambda spec, timeout: dict(bound))
    monkeypatch.setattr(tpu_static, "unprofiled_twins",
                        lambda *a: pytest.fail("a lower bound lists its unprofiled ops already"))
    spec = tpu_static.Spec("gla", "gla_tpu", (1, 4096, 8, 128, 128, "key", "chunk"), "v5e", "fwd")
    assert "cycles_with_twins" not in tpu_static.profile(spec)


# "Inside projections" (docs/results/history.md): the kernels' arguments projected from one
# x, as a layer calls them; the programs must trace, and an attention forward+backward is refused.
@pytest.mark.parametrize("op,impl,shape,passes", [
    ("gla", "gla_tpu", (1, 256, 2, 128, 128, "key", "chunk"), "fwd_bwd"),
    ("attention", "gla_tpu", (1, 2, 1024, 128, True), "fwd"),
    ("attention", "jax_flash", (1, 2, 1024, 128, True), "fwd")])
def test_inside_projections_programs_trace(op, impl, shape, passes):
    import jax

    from bench.tpu_static import Spec, _program
    from gla_tpu.testing.tpu_compile import targeting

    spec = Spec(op, impl, shape, "v6e", passes, (("inside_projections", True),))
    fn, args = _program(spec)
    assert args[0].shape[:2] == ((1, 256) if op == "gla" else (1, 1024))
    with targeting("v6e"):
        jax.jit(fn).trace(*args)


@pytest.mark.parametrize("passes", ["fwd_bwd", "bwd"])
def test_inside_projections_refuses_an_attention_backward(passes):
    from bench.tpu_static import Spec

    with pytest.raises(ValueError, match="forward only"):
        Spec("attention", "gla_tpu", (1, 2, 1024, 128, True), "v6e", passes,
             (("inside_projections", True),))
