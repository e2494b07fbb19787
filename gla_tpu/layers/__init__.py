"""Pure-functional layers (no Haiku, no Flax): frozen configs, `init(key, config) -> params`
(dicts of float32 arrays), `apply(params, x, config, *, state=None, segment_ids=None)`.

    from gla_tpu import layers
    cfg = layers.lm.Config(vocab_size=256, num_layers=2,
                           block=layers.block.Config(d_model=64, num_heads=4, attention="gla"))
    params = layers.lm.init(jax.random.key(0), cfg)
    logits, _ = layers.lm.apply(params, tokens, cfg)

Modules (each with Config / init / apply; the attention layers also init_state):
  multi_head_attention    causal softmax attention, GQA, RoPE; state = KV cache
  gated_linear_attention  fla's GLA layer; simple GLA and linear attention as configurations;
                          state = recurrent state [B, H, K, V] float32
  mlp                     SwiGLU feed-forward
  block                   pre-norm block; attention kind "softmax" | "gla" | "simple_gla" | "linear"
  lm                      embedding, blocks, final norm, head; apply, decode_step, cross_entropy
  training                adamw(lr): optax AdamW with global-norm clipping, weight decay on
                          rank >= 2 leaves (needs optax, the `train` extra)
  basic                   dense, rms_norm, rotary, segment_positions
"""

from gla_tpu.layers import (
    basic,
    block,
    gated_linear_attention,
    lm,
    mlp,
    multi_head_attention,
    training,
)
from gla_tpu.layers.basic import (
    dense,
    dense_init,
    rms_norm,
    rms_norm_init,
    rotary,
    segment_positions,
)
from gla_tpu.layers.block import ATTENTION_KINDS
from gla_tpu.layers.gated_linear_attention import linear_attention_config, simple_gla_config

__all__ = [
    "ATTENTION_KINDS",
    "basic",
    "block",
    "dense",
    "dense_init",
    "gated_linear_attention",
    "linear_attention_config",
    "lm",
    "mlp",
    "multi_head_attention",
    "rms_norm",
    "rms_norm_init",
    "rotary",
    "segment_positions",
    "simple_gla_config",
    "training",
]
