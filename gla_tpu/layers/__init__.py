"""Pure-functional layers (no Haiku, no Flax): frozen configs, `init(key, config) -> params`
(dicts of float32 arrays), `apply(params, x, config, *, state=None, segment_ids=None)`.

    from gla_tpu import layers
    cfg = layers.lm.Config(vocab_size=256, num_layers=2,
                           block=layers.block.Config(d_model=64, num_heads=4, attention="gla"))
    params = layers.lm.init(jax.random.key(0), cfg)
    logits, _ = layers.lm.apply(params, tokens, cfg)

A hybrid: `layers.lm.Config(..., layer_pattern=("gated_deltanet", "gated_deltanet", "softmax"))`
repeats the pattern of attention kinds over the layers (docs/layers.md).

Modules (each with Config / init / apply; the attention layers and short_conv also init_state):
  multi_head_attention    causal softmax attention, GQA, RoPE, sliding window, logit soft cap;
                          state = KV cache
  gated_linear_attention  fla's GLA layer (kv heads, optional short convolutions); simple GLA and
                          linear attention as configurations; state = recurrent state
                          [B, H, K, V] float32, or a dict with the convolution states
  gated_deltanet          fla's GatedDeltaNet: delta rule with a per-head decay, GVA
  kda                     fla's KimiDeltaAttention: delta rule with a per-key decay
  deltanet                fla's DeltaNet: delta rule without decay
                          (the delta-rule layers' state: {"recurrent": [B, HV, K, V] float32,
                          "conv_q", "conv_k", "conv_v"})
  short_conv              causal depthwise convolution over time (fla's ShortConvolution)
  qkv                     q, k, v projections with optional short convolutions (shared)
  delta_common            what the delta-rule layers share: beta, decay gate, gated output norm
  mlp                     SwiGLU feed-forward
  block                   pre-norm block; attention kind one of ATTENTION_KINDS: "softmax", "gla",
                          "simple_gla", "linear", "gated_deltanet", "kda", "deltanet"
  lm                      embedding, blocks (one kind, or a cyclic layer_pattern), final norm,
                          head; apply, decode_step, cross_entropy
  fla_checkpoint          from_fla(path) -> (lm.Config, params): an fla model directory
                          (gla, gated_deltanet, kda, delta_net, hybrids) as our LM
  training                adamw(lr): optax AdamW with global-norm clipping, weight decay on
                          rank >= 2 leaves (needs optax, the `train` extra)
  basic                   dense, rms_norm, gated_rms_norm, rotary, segment_positions
"""

from gla_tpu.layers import (
    basic,
    block,
    delta_common,
    deltanet,
    fla_checkpoint,
    gated_deltanet,
    gated_linear_attention,
    kda,
    lm,
    mlp,
    multi_head_attention,
    qkv,
    short_conv,
    training,
)
from gla_tpu.layers.basic import (
    dense,
    dense_init,
    gated_rms_norm,
    rms_norm,
    rms_norm_init,
    rotary,
    segment_positions,
)
from gla_tpu.layers.block import ATTENTION_KINDS
from gla_tpu.layers.fla_checkpoint import from_fla
from gla_tpu.layers.gated_linear_attention import linear_attention_config, simple_gla_config

__all__ = [
    "ATTENTION_KINDS",
    "basic",
    "block",
    "delta_common",
    "deltanet",
    "dense",
    "dense_init",
    "fla_checkpoint",
    "from_fla",
    "gated_deltanet",
    "gated_linear_attention",
    "gated_rms_norm",
    "kda",
    "linear_attention_config",
    "lm",
    "mlp",
    "multi_head_attention",
    "qkv",
    "rms_norm",
    "rms_norm_init",
    "rotary",
    "segment_positions",
    "short_conv",
    "simple_gla_config",
    "training",
]
