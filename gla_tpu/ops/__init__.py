"""Public ops: softmax flash attention and gated linear attention.

    from gla_tpu import ops
    o = ops.flash_attention(q, k, v, causal=True)
    o, final_state = ops.gla(q, k, v, g, output_final_state=True)
"""

from gla_tpu.ops.attention.api import flash_attention
from gla_tpu.ops.attention.reference import attention_reference
from gla_tpu.ops.common.backends import BACKENDS, BackendFallbackWarning
from gla_tpu.ops.gla.api import chunk_gla, fused_chunk_gla, fused_recurrent_gla, gla
from gla_tpu.ops.gla.reference import gla_recurrent_reference, gla_reference

__all__ = [
    "BACKENDS",
    "BackendFallbackWarning",
    "attention_reference",
    "chunk_gla",
    "flash_attention",
    "fused_chunk_gla",
    "fused_recurrent_gla",
    "gla",
    "gla_recurrent_reference",
    "gla_reference",
]
