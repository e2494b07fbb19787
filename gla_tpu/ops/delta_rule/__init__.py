"""The delta rule family (DeltaNet, Gated DeltaNet, KDA): the op (api.py), its validation, the
"xla" backend and the float64 references."""

from gla_tpu.ops.delta_rule.reference import (
    delta_rule_chunked,
    delta_rule_recurrent,
    delta_rule_recurrent_jax,
)

__all__ = ["delta_rule_chunked", "delta_rule_recurrent", "delta_rule_recurrent_jax"]
