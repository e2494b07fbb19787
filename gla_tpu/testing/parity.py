"""Parity checks of a backend against the float64 reference under the pass rule.

Each check draws fresh inputs for a case, runs the backend under test, the "xla" backend in the
same dtype (the baseline of the rule) and the float64 reference, and compares outputs, final state
and every gradient through one scalar loss with random cotangents. The "xla" backend itself, having
no baseline below it, is held to fixed bounds per dtype (tolerance.XLA_MAX_RELATIVE_RMS).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gla_tpu.ops.attention.api import flash_attention
from gla_tpu.ops.attention.reference import attention_reference
from gla_tpu.ops.gla.api import gla
from gla_tpu.ops.gla.reference import gla_recurrent_reference, gla_reference
from gla_tpu.testing.grads import outputs_and_grads
from gla_tpu.testing.problems import (
    AttentionCase,
    GLACase,
    make_attention_inputs,
    make_gla_inputs,
)
from gla_tpu.testing.tolerance import assert_accuracy, assert_pass_rule

# Above this many elements of the [T, T, K] decay tensor the token-by-token reference is used.
QUADRATIC_REFERENCE_MAX_ELEMENTS = 2**24


def check_attention_parity(case: AttentionCase, key, *, dtype=jnp.float32, backend="xla",
                           interpret=False, block_sizes=None, grads=True):
    """Asserts the pass rule for flash_attention on `case`; returns the comparisons."""
    inputs = make_attention_inputs(case, key, dtype)
    seg = inputs.pop("segment_ids")
    common = dict(causal=case.causal, segment_ids=seg)
    kernel = functools.partial(flash_attention, **common, backend=backend, interpret=interpret,
                               block_sizes=block_sizes)
    baseline = (None if backend == "xla"
                else functools.partial(flash_attention, **common, backend="xla"))
    reference = functools.partial(attention_reference, **common)
    return _check(kernel, baseline, reference, inputs, key, dtype, grads)


def check_gla_parity(case: GLACase, key, *, dtype=jnp.float32, mode="chunk", backend="xla",
                     interpret=False, chunk_size=None, grads=True, gate_dtype=jnp.float32):
    """Asserts the pass rule for gla on `case` (outputs, final state and every gradient)."""
    inputs = make_gla_inputs(case, key, dtype, gate_dtype=gate_dtype)
    seg = inputs.pop("segment_ids")
    common = dict(segment_ids=seg, output_final_state=case.output_final_state)
    kernel = functools.partial(gla, **common, mode=mode, chunk_size=chunk_size, backend=backend,
                               interpret=interpret)
    baseline = (None if backend == "xla" else
                functools.partial(gla, **common, mode=mode, chunk_size=chunk_size, backend="xla"))
    quadratic_size = case.seq_len**2 * case.key_dim * case.batch * case.num_heads
    ref_fn = (gla_reference if quadratic_size <= QUADRATIC_REFERENCE_MAX_ELEMENTS
              else gla_recurrent_reference)
    reference = functools.partial(ref_fn, **common)
    return _check(kernel, baseline, reference, inputs, key, dtype, grads)


def _check(kernel, baseline, reference, inputs, key, dtype, grads):
    ct_key = jax.random.fold_in(key, 1)
    if grads:
        k_out = outputs_and_grads(kernel, inputs, ct_key)
        r_out = outputs_and_grads(reference, inputs, ct_key, float64=True)
    else:
        k_out = kernel(**inputs)
        with jax.enable_x64(True):
            r_out = reference(**inputs)
    if baseline is None:
        return assert_accuracy(_named(k_out), _named(r_out), dtype=dtype)
    b_out = outputs_and_grads(baseline, inputs, ct_key) if grads else baseline(**inputs)
    return assert_pass_rule(_named(k_out), _named(b_out), _named(r_out), dtype=dtype)


def _named(result):
    """Gives outputs and gradients readable names in failure messages."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        out, grads = result
        return {"out": out, **{f"d{name}": g for name, g in grads.items()}}
    return {"out": result}
