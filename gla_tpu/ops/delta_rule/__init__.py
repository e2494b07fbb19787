"""The delta rule family (DeltaNet, Gated DeltaNet, KDA): float64 references."""

from gla_tpu.ops.delta_rule.reference import delta_rule_chunked, delta_rule_recurrent

__all__ = ["delta_rule_chunked", "delta_rule_recurrent"]
