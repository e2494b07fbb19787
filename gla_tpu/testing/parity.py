"""Parity checks of a backend against the float64 reference under the pass rule.

Each check draws fresh inputs for a case, runs the backend under test, the "xla" backend in the
same dtype (the baseline of the rule) and the float64 reference, and compares outputs, final state
and every gradient through one scalar loss with random cotangents. The "xla" backend itself, having
no baseline below it, is held to fixed bounds per dtype (tolerance.XLA_MAX_RELATIVE_RMS).

The baseline and the reference of a check depend on the case, not on the backend under test: they
are computed once per process and reused when several backends are checked on one case.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp

from gla_tpu.ops.attention.api import flash_attention
from gla_tpu.ops.attention.reference import attention_reference
from gla_tpu.ops.delta_rule.api import delta_rule
from gla_tpu.ops.delta_rule.reference import delta_rule_recurrent_jax
from gla_tpu.ops.gla.api import gla
from gla_tpu.ops.gla.reference import gla_recurrent_reference, gla_reference
from gla_tpu.testing.grads import outputs_and_grads
from gla_tpu.testing.problems import (
    AttentionCase,
    DeltaRuleCase,
    GLACase,
    make_attention_inputs,
    make_delta_rule_inputs,
    make_gla_inputs,
)
from gla_tpu.testing.tolerance import (
    XLA_FLOAT32_STRONG_GATE_DG,
    assert_accuracy,
    assert_pass_rule,
)

# Above this many elements of the [T, T, K] decay tensor the token-by-token reference is used.
QUADRATIC_REFERENCE_MAX_ELEMENTS = 2**24


def case_seed(case, *extra) -> int:
    """A seed that depends only on the case's values (Python's hash() of strings changes from
    process to process, so it must not pick inputs)."""
    return zlib.crc32(repr((case, *extra)).encode())


def check_attention_parity(case: AttentionCase, key=None, *, dtype=jnp.float32, backend="xla",
                           interpret=False, block_sizes=None, grads=True, sharding=None):
    """Asserts the pass rule for flash_attention on `case`; returns the comparisons.
    `key` defaults to one derived from the case; `sharding` runs the kernel on a mesh (the
    baseline and the reference stay on one device)."""
    key = jax.random.key(case_seed(case)) if key is None else key
    kernel = functools.partial(flash_attention, **case.options(), backend=backend,
                               interpret=interpret, block_sizes=block_sizes, sharding=sharding)
    inputs = _attention_inputs(case, key, dtype)
    # The "xla" backend with default arguments is the baseline itself: not run twice.
    baseline = _is_baseline(backend, block_sizes) and sharding is None
    k_out = None if baseline else _run(kernel, inputs, key, dtype, grads)
    truth = _cached(("attention", case, _key_bytes(key), jnp.dtype(dtype).name, grads),
                    lambda: _attention_truth(case, key, dtype, grads))
    return _compare(k_out, truth, backend, dtype)


def check_gla_parity(case: GLACase, key=None, *, dtype=jnp.float32, mode="chunk", backend="xla",
                     interpret=False, chunk_size=None, block_sizes=None, grads=True,
                     gate_dtype=jnp.float32, final_state_only=False, sharding=None):
    """Asserts the pass rule for gla on `case` (outputs, final state and every gradient).
    `key` defaults to one derived from the case. final_state_only: the loss and the comparison
    see the final state alone (the outputs' cotangent is a symbolic zero). `sharding` runs the
    kernel on a mesh (the baseline and the reference stay on one device)."""
    key = jax.random.key(case_seed(case)) if key is None else key
    kernel = functools.partial(gla, output_final_state=case.output_final_state, mode=mode,
                               chunk_size=chunk_size, backend=backend, interpret=interpret,
                               block_sizes=block_sizes, sharding=sharding)
    if final_state_only:
        kernel = _final_state_of(kernel)
    inputs = _gla_inputs(case, key, dtype, gate_dtype)
    k_out = None if _is_baseline(backend, block_sizes) else _run(kernel, inputs, key, dtype, grads)
    truth = _cached(("gla", case, _key_bytes(key), jnp.dtype(dtype).name,
                     jnp.dtype(gate_dtype).name, mode, chunk_size, grads, final_state_only),
                    lambda: _gla_truth(case, key, dtype, gate_dtype, mode, chunk_size, grads,
                                       final_state_only))
    bounds = None
    if (jnp.dtype(dtype) == jnp.float32 and case.gate != "none" and case.gate_strength < 1
            and mode != "fused_recurrent"):
        bounds = {"dg": XLA_FLOAT32_STRONG_GATE_DG}
    return _compare(k_out, truth, backend, dtype, bounds)


def check_delta_rule_parity(case: DeltaRuleCase, key=None, *, dtype=jnp.float32, mode="chunk",
                            backend="xla", interpret=False, chunk_size=None, block_sizes=None,
                            grads=True):
    """Asserts the pass rule for delta_rule on `case` (outputs, final state and every gradient:
    dq, dk, dv, dbeta, dg, d initial_state) against the float64 token recurrence; for the "xla"
    backend, its fixed bounds. `key` defaults to one derived from the case."""
    key = jax.random.key(case_seed(case)) if key is None else key
    semantics = dict(output_final_state=case.output_final_state,
                     use_qk_l2norm=case.use_qk_l2norm)
    kernel = functools.partial(delta_rule, **semantics, mode=mode, chunk_size=chunk_size,
                               backend=backend, interpret=interpret, block_sizes=block_sizes)
    inputs = _delta_rule_inputs(case, key, dtype)
    k_out = None if _is_baseline(backend, block_sizes) else _run(kernel, inputs, key, dtype, grads)

    def truth():
        baseline = _run(functools.partial(delta_rule, **semantics, mode=mode,
                                          chunk_size=chunk_size, backend="xla"),
                        inputs, key, dtype, grads)
        reference = _run_float64(functools.partial(delta_rule_recurrent_jax, **semantics),
                                 inputs, key, dtype, grads)
        return baseline, reference

    truth = _cached(("delta_rule", case, _key_bytes(key), jnp.dtype(dtype).name, mode,
                     chunk_size, grads), truth)
    return _compare(k_out, truth, backend, dtype)


def _is_baseline(backend, block_sizes) -> bool:
    return backend == "xla" and block_sizes is None


def _compare(k_out, truth, backend, dtype, bounds=None):
    """The pass rule for a kernel; for the "xla" backend, its fixed bounds. `bounds` overrides the
    float32 criterion of some outputs, by name (strong gates' dg, docs/testing.md)."""
    baseline, reference = truth
    if backend == "xla":
        return assert_accuracy(_named(baseline if k_out is None else k_out), _named(reference),
                               dtype=dtype, bounds=bounds)
    return assert_pass_rule(_named(k_out), _named(baseline), _named(reference), dtype=dtype,
                            float32_bounds=bounds)


def _attention_inputs(case, key, dtype):
    inputs = make_attention_inputs(case, key, dtype)
    seg = inputs.pop("segment_ids")
    # Segment ids are not differentiated: bind them as a static part of the function's inputs.
    return inputs, seg


def _gla_inputs(case, key, dtype, gate_dtype):
    inputs = make_gla_inputs(case, key, dtype, gate_dtype=gate_dtype)
    return inputs, inputs.pop("segment_ids")


def _delta_rule_inputs(case, key, dtype):
    inputs = make_delta_rule_inputs(case, key, dtype)
    return inputs, inputs.pop("segment_ids")


def _run(fn, inputs_and_segments, key, dtype, grads):
    inputs, seg = inputs_and_segments
    fn = functools.partial(fn, segment_ids=seg)
    ct_key = jax.random.fold_in(key, 1)
    if grads:
        return outputs_and_grads(fn, inputs, ct_key, cotangent_dtype=dtype)
    return jax.jit(fn)(**inputs)


def _run_float64(fn, inputs_and_segments, key, dtype, grads):
    inputs, seg = inputs_and_segments
    fn = functools.partial(fn, segment_ids=seg)
    ct_key = jax.random.fold_in(key, 1)
    if grads:
        return outputs_and_grads(fn, inputs, ct_key, float64=True, cotangent_dtype=dtype)
    with jax.enable_x64(True):
        return fn(**inputs)


_TRUTHS: dict = {}
_TRUTHS_KEPT = 32


def _key_bytes(key) -> bytes:
    return jax.random.key_data(key).tobytes()


def _cached(name, compute):
    """compute() once per process for `name`; the oldest entries are dropped past _TRUTHS_KEPT."""
    if name not in _TRUTHS:
        if len(_TRUTHS) >= _TRUTHS_KEPT:
            _TRUTHS.pop(next(iter(_TRUTHS)))
        _TRUTHS[name] = compute()
    return _TRUTHS[name]


def _attention_truth(case, key, dtype, grads):
    """(same-dtype XLA baseline, float64 reference) of an attention case."""
    inputs = _attention_inputs(case, key, dtype)
    baseline = _run(functools.partial(flash_attention, **case.options(), backend="xla"),
                    inputs, key, dtype, grads)
    reference = _run_float64(functools.partial(attention_reference, **case.options()), inputs,
                             key, dtype, grads)
    return baseline, reference


def _gla_truth(case, key, dtype, gate_dtype, mode, chunk_size, grads, final_state_only=False):
    """(same-dtype XLA baseline, float64 reference) of a GLA case."""
    inputs = _gla_inputs(case, key, dtype, gate_dtype)
    common = dict(output_final_state=case.output_final_state)
    only = _final_state_of if final_state_only else (lambda fn: fn)
    baseline = _run(only(functools.partial(gla, **common, mode=mode, chunk_size=chunk_size,
                                           backend="xla")), inputs, key, dtype, grads)
    quadratic_size = case.seq_len**2 * case.key_dim * case.batch * case.num_heads
    ref_fn = (gla_reference if quadratic_size <= QUADRATIC_REFERENCE_MAX_ELEMENTS
              else gla_recurrent_reference)
    reference = _run_float64(only(functools.partial(ref_fn, **common)), inputs, key, dtype,
                             grads)
    return baseline, reference


def _final_state_of(fn):
    """fn returning (o, final state) -> a function returning the final state alone."""
    return lambda **inputs: fn(**inputs)[1]


def _named(result):
    """Gives outputs and gradients readable names in failure messages."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        out, grads = result
        return {"out": out, **{f"d{name}": g for name, g in grads.items()}}
    return {"out": result}
