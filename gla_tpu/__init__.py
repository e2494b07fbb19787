"""gla_tpu: softmax flash attention and gated linear attention in Pallas (TPU first, GPU second)."""

from gla_tpu import ops

__version__ = "0.1.0"
__all__ = ["ops"]
