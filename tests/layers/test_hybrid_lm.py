"""A hybrid LM (Gated DeltaNet, sliding-window softmax, GLA with short convolutions): decoding
equals the full forward; the layer pattern's validation."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_tpu.layers import block, lm
from gla_tpu.testing import relative_rms_error
from gla_tpu.testing.tolerance import FLOAT32_MAX_RELATIVE_RMS

B, T, VOCAB, MAX_LEN, WINDOW = 2, 20, 48, 24, 4

BLOCK = block.Config(d_model=32, num_heads=2, head_dim=8, num_v_heads=4, window=WINDOW,
                     logits_soft_cap=5.0, backend="xla")
GLA_CONV = block.Config(d_model=32, num_heads=2, attention="gla", num_kv_heads=1,
                        use_short_conv=True, backend="xla")
HYBRID = lm.Config(vocab_size=VOCAB, num_layers=3, block=BLOCK, dtype="float32",
                   layer_pattern=("gated_deltanet", "softmax", GLA_CONV))


def test_hybrid_decoding_equals_full_forward():
    """Token-by-token decoding and a 5-token prompt then decoding give the full forward's logits;
    the softmax layer's window (4 keys) is shorter than the prompt and the sequence."""
    assert HYBRID.layer_kinds == ("gated_deltanet", "softmax", "gla")
    params = jax.jit(functools.partial(lm.init, config=HYBRID))(jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (B, T)), jnp.int32)
    apply = jax.jit(functools.partial(lm.apply, config=HYBRID))
    step = jax.jit(functools.partial(lm.decode_step, config=HYBRID))
    full, _ = apply(params, tokens)
    for prompt_len in (0, 5):
        state = lm.init_state(HYBRID, B, MAX_LEN)
        assert isinstance(state[0], dict) and set(state[1]) == {"k", "v", "pos"}
        out = []
        if prompt_len:
            logits, state = apply(params, tokens[:, :prompt_len], state=state)
            out.append(logits)
        for i in range(prompt_len, T):
            logits, state = step(params, tokens[:, i], state)
            out.append(logits[:, None])
        decoded = jnp.concatenate(out, axis=1)
        assert relative_rms_error(decoded, full) <= FLOAT32_MAX_RELATIVE_RMS, prompt_len


def test_layer_pattern_cycles_and_validates():
    cfg = lm.Config(vocab_size=VOCAB, num_layers=5, block=BLOCK,
                    layer_pattern=["kda", "softmax"])  # a list is taken as a tuple
    assert cfg.layer_pattern == ("kda", "softmax")
    assert cfg.layer_kinds == ("kda", "softmax", "kda", "softmax", "kda")
    assert cfg.block_config(2) == dataclasses.replace(BLOCK, attention="kda")
    shapes = jax.eval_shape(functools.partial(lm.init, config=cfg), jax.random.key(0))
    assert "A_log" in shapes["blocks"][0]["attn"] and "wq" in shapes["blocks"][1]["attn"]
    for pattern, match in (((), "non-empty"), (("softmax", "mamba"), "layer_pattern\\[1\\]"),
                           ((block.Config(d_model=16, num_heads=2),), "d_model"),
                           ((3,), "layer_pattern\\[0\\]"), ("softmax", "tuple")):
        with pytest.raises(ValueError, match=match):
            lm.Config(vocab_size=VOCAB, num_layers=2, block=BLOCK, layer_pattern=pattern)
    # A kind whose layer cannot take the block's fields: 3 heads do not divide num_v_heads 4.
    with pytest.raises(ValueError, match="num_v_heads"):
        lm.Config(vocab_size=VOCAB, num_layers=2, layer_pattern=("softmax", "gated_deltanet"),
                  block=block.Config(d_model=48, num_heads=3, num_v_heads=4))
