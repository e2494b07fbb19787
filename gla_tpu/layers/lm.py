"""A small decoder-only language model: embedding, pre-norm blocks, final RMSNorm, tied or
untied output head. Parameters are float32; activations run in `Config.dtype`; logits are float32.

Layers: every layer is `block` (a block.Config), or with `layer_pattern` a cycle of kinds or block
Configs, e.g. three Gated DeltaNet layers then one sliding-window softmax layer:

    lm.Config(vocab_size=256, num_layers=8,
              block=block.Config(d_model=256, num_heads=4, window=64),
              layer_pattern=("gated_deltanet", "gated_deltanet", "gated_deltanet", "softmax"))

Layer i is pattern[i % len(pattern)]: a kind name means `block` with that attention kind (every
other field from `block`), a block.Config is used as it is (its d_model must be block's).

Decoding: `init_state` gives one state per layer, each of its own kind (a KV cache for softmax
layers, a [B, H, K, V] float32 recurrent state or a dict with it and the short-convolution states
for the recurrent kinds); `apply` with a state continues from it (a prompt), `decode_step` feeds
one token per row. Both equal the full-sequence forward.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gla_tpu.layers import block
from gla_tpu.layers.basic import (
    check_activation_sharding,
    check_positive,
    check_segment_ids,
    dense_init,
    rms_norm,
    rms_norm_init,
)
from gla_tpu.ops.common import validation as checks


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int
    num_layers: int
    block: block.Config
    tie_embeddings: bool = True
    # The tied head is embed^T * tied_head_scale; None: d_model**-0.5 (unit-variance embedding
    # rows then give unit-scale logits); 1.0 is the plain embed^T of fla and most checkpoints
    tied_head_scale: float | None = None
    dtype: str = "bfloat16"  # activations
    # None: every layer is `block`; else a tuple of kinds (block.ATTENTION_KINDS) and/or
    # block.Configs, repeated over the layers
    layer_pattern: tuple[str | block.Config, ...] | None = None

    def __post_init__(self):
        check_positive("vocab_size", self.vocab_size)
        check_positive("num_layers", self.num_layers)
        if not isinstance(self.block, block.Config):
            raise ValueError(f"block must be a layers.block.Config; got {self.block!r}.")
        checks.check_choice("dtype", self.dtype, ("bfloat16", "float32", "float16", "float64"))
        object.__setattr__(self, "tied_head_scale",
                           checks.check_scale("tied_head_scale", self.tied_head_scale))
        if isinstance(self.layer_pattern, list):
            object.__setattr__(self, "layer_pattern", tuple(self.layer_pattern))
        if self.layer_pattern is not None:
            self._check_pattern()

    def _check_pattern(self) -> None:
        pattern = self.layer_pattern
        if not isinstance(pattern, tuple) or not pattern:
            raise ValueError("layer_pattern must be None or a non-empty tuple of attention kinds "
                             f"{block.ATTENTION_KINDS} and/or block.Configs; got {pattern!r}.")
        for i, entry in enumerate(pattern):
            if isinstance(entry, block.Config):
                if entry.d_model != self.block.d_model:
                    raise ValueError(
                        f"layer_pattern[{i}] has d_model={entry.d_model}; every layer must have "
                        f"block's d_model={self.block.d_model}.")
            elif isinstance(entry, str):
                checks.check_choice(f"layer_pattern[{i}]", entry, block.ATTENTION_KINDS)
                # Validates the block config of that kind (fields the kind needs).
                dataclasses.replace(self.block, attention=entry)
            else:
                raise ValueError(f"layer_pattern[{i}] must be an attention kind "
                                 f"{block.ATTENTION_KINDS} or a block.Config; got {entry!r}.")

    @property
    def d_model(self) -> int:
        return self.block.d_model

    @property
    def head_scale(self) -> float:
        """The tied head's factor: tied_head_scale, or d_model**-0.5 when it is None."""
        return self.d_model**-0.5 if self.tied_head_scale is None else self.tied_head_scale

    def block_config(self, layer: int) -> block.Config:
        """The block.Config of layer `layer` (0-based)."""
        if self.layer_pattern is None:
            return self.block
        entry = self.layer_pattern[layer % len(self.layer_pattern)]
        if isinstance(entry, block.Config):
            return entry
        return dataclasses.replace(self.block, attention=entry)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """The attention kind of every layer."""
        return tuple(self.block_config(i).attention for i in range(self.num_layers))


def init(key, config: Config):
    """{"embed": [vocab, d_model], "blocks": [per-layer dicts], "final_norm", "head"?}, float32.

    The embedding has unit-variance rows; with tied embeddings the head is embed^T * head_scale
    (1 / sqrt(d_model) unless tied_head_scale is set).
    """
    k_embed, k_head, k_blocks = jax.random.split(key, 3)
    params = {
        "embed": jax.random.normal(k_embed, (config.vocab_size, config.d_model), jnp.float32),
        "blocks": [block.init(k, config.block_config(i))
                   for i, k in enumerate(jax.random.split(k_blocks, config.num_layers))],
        "final_norm": rms_norm_init(config.d_model),
    }
    if not config.tie_embeddings:
        params["head"] = dense_init(k_head, config.d_model, config.vocab_size)
    return params


def init_state(config: Config, batch: int, max_len: int):
    """A list of per-layer decoding states for `batch` rows and up to `max_len` tokens, each of
    its layer's kind (block.init_state)."""
    return [block.init_state(config.block_config(i), batch, max_len, jnp.dtype(config.dtype))
            for i in range(config.num_layers)]


def apply(params, tokens, config: Config, *, state=None, segment_ids=None, sharding=None):
    """Logits for every position.

    Args:
      params: from `init`.
      tokens: [B, T] int token ids.
      config: the LM's Config.
      state: None, or the per-layer states from `init_state` / a previous call to continue from.
      segment_ids: [B, T] int ids for packed sequences (full sequence only): tokens see only their
        own segment (a maximal run of equal ids), as if each segment were its own row.
      sharding: None, or a NamedSharding over tokens' [batch, time] axes, e.g.
        NamedSharding(mesh, P("data", "seq")), for data and sequence parallelism under jit:
        the tokens are constrained to it and every attention op runs on the mesh (GLA kinds
        context parallel over a time axis; softmax attention takes batch axes only). The
        partitioner shards the rest from the inputs' and parameters' shardings.
    Returns:
      (logits [B, T, vocab] float32, new per-layer states or None).

    Example:
      >>> cfg = Config(vocab_size=128, num_layers=2,
      ...              block=block.Config(d_model=64, num_heads=4, attention="gla"))
      >>> params = init(jax.random.key(0), cfg)
      >>> logits, _ = apply(params, jnp.zeros((2, 32), jnp.int32), cfg)
    """
    checks.check_array("tokens", tokens, rank=2, layout="[batch, time]")
    checks.check_integer("tokens", tokens)
    b, t = tokens.shape
    check_segment_ids(segment_ids, b, t)
    check_activation_sharding(sharding)
    if state is not None and len(state) != config.num_layers:
        raise ValueError(
            f"state must hold num_layers={config.num_layers} layer states; got {len(state)}."
        )
    dtype = jnp.dtype(config.dtype)
    with jax.named_scope("lm"):
        if sharding is not None:
            tokens = jax.lax.with_sharding_constraint(tokens, sharding)
        x = jnp.take(params["embed"], tokens, axis=0).astype(dtype)  # [B, T, d_model]
        new_states = []
        for i, layer_params in enumerate(params["blocks"]):
            x, s = block.apply(layer_params, x, config.block_config(i),
                               state=None if state is None else state[i], segment_ids=segment_ids,
                               sharding=sharding)
            new_states.append(s)
        x = rms_norm(params["final_norm"], x, eps=config.block.norm_eps)
        if config.tie_embeddings:
            head = params["embed"].T * config.head_scale
        else:
            head = params["head"]
        logits = jnp.einsum("btd,dv->btv", x, head.astype(dtype), preferred_element_type=jnp.float32)
    return logits, (None if state is None else new_states)


def decode_step(params, tokens, state, config: Config):
    """One decoding step: tokens [B] int -> (logits [B, vocab] float32, new per-layer states).

    Example:
      >>> state = init_state(cfg, batch=2, max_len=64)
      >>> logits, state = apply(params, prompt, cfg, state=state)  # prompt [2, P]
      >>> token = jnp.argmax(logits[:, -1], axis=-1)
      >>> for _ in range(8):
      ...     logits, state = decode_step(params, token, state, cfg)
      ...     token = jnp.argmax(logits, axis=-1)
    """
    checks.check_array("tokens", tokens, rank=1, layout="[batch]")
    logits, state = apply(params, tokens[:, None], config, state=state)
    return logits[:, 0], state


def cross_entropy(logits, targets, weights=None):
    """Mean token cross-entropy in float32 over positions with weight > 0.

    Args:
      logits: [B, T, vocab]; targets: [B, T] int; weights: [B, T] (None: all ones).
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    if weights is None:
        return jnp.mean(nll)
    weights = weights.astype(jnp.float32)
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def num_params(params) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
