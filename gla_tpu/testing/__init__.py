"""Test and verification helpers, importable by users too: the pass rule, gradient helpers,
random problems and hypothesis strategies, and the TPU AOT-compile harness."""

from gla_tpu.testing.grads import outputs_and_grads, random_cotangents
from gla_tpu.testing.problems import (
    GATE_STRENGTHS,
    AttentionCase,
    DeltaRuleCase,
    GLACase,
    make_attention_inputs,
    make_delta_rule_inputs,
    make_gla_inputs,
    random_segment_ids,
)
from gla_tpu.testing.tolerance import assert_pass_rule, compare, relative_rms_error
from gla_tpu.testing.tpu_compile import TPU_GENERATIONS, abstract, compile_for_tpu, libtpu_available

__all__ = [
    "GATE_STRENGTHS",
    "TPU_GENERATIONS",
    "AttentionCase",
    "DeltaRuleCase",
    "GLACase",
    "abstract",
    "assert_pass_rule",
    "compare",
    "compile_for_tpu",
    "libtpu_available",
    "make_attention_inputs",
    "make_delta_rule_inputs",
    "make_gla_inputs",
    "outputs_and_grads",
    "random_cotangents",
    "random_segment_ids",
    "relative_rms_error",
]
