"""Public ops: softmax flash attention, gated linear attention and the delta rule.

    from gla_tpu import ops
    o = ops.flash_attention(q, k, v, causal=True)
    o, final_state = ops.gla(q, k, v, g, output_final_state=True)
    o, final_state = ops.delta_rule(q, k, v, beta, g, output_final_state=True)
"""

from gla_tpu.ops.attention.api import flash_attention
from gla_tpu.ops.attention.reference import attention_reference
from gla_tpu.ops.common.backends import BACKENDS, BackendFallbackWarning
from gla_tpu.ops.delta_rule.api import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_kda,
    delta_rule,
    fused_recurrent_delta_rule,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_kda,
)
from gla_tpu.ops.delta_rule.reference import (
    delta_rule_recurrent_jax as delta_rule_reference,
)
from gla_tpu.ops.gla.api import chunk_gla, fused_chunk_gla, fused_recurrent_gla, gla
from gla_tpu.ops.gla.reference import gla_recurrent_reference, gla_reference

__all__ = [
    "BACKENDS",
    "BackendFallbackWarning",
    "attention_reference",
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_gla",
    "chunk_kda",
    "delta_rule",
    "delta_rule_reference",
    "flash_attention",
    "fused_chunk_gla",
    "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gla",
    "fused_recurrent_kda",
    "gla",
    "gla_recurrent_reference",
    "gla_reference",
]
