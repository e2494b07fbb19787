"""A hybrid LM (Gated DeltaNet, sliding-window softmax, GLA with short convolutions): decoding
equals the full forward; the layer pattern's validation. With --full the same LM at head dims the
mosaic_tpu kernels take, in TPU interpret mode: decoding, packed rows and gradients, and its logits
and gradients against the same LM on "xla"."""

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


def kernel_hybrid(backend: str) -> lm.Config:
    """HYBRID at dims the mosaic_tpu kernels take (head_dim 64; Gated DeltaNet K = V = 64, GLA
    K = V = 64 with one head), on `backend`, a Pallas one in interpret mode."""
    run = {"backend": backend, "interpret": backend != "xla"}
    blk = dataclasses.replace(BLOCK, num_heads=1, head_dim=64, num_v_heads=2, expand_v=1.0, **run)
    gla = dataclasses.replace(GLA_CONV, num_heads=1, expand_k=2.0, expand_v=2.0, **run)
    return dataclasses.replace(HYBRID, block=blk, layer_pattern=("gated_deltanet", "softmax", gla))


# A Pallas backend only with --full (tests/layers/test_delta_layers.py runs each layer kind).
BACKENDS = ["xla", pytest.param("mosaic_tpu", marks=pytest.mark.full)]


def _setup(backend):
    """(config, params, tokens [B, T], the jitted apply): HYBRID on "xla", else kernel_hybrid."""
    cfg = HYBRID if backend == "xla" else kernel_hybrid(backend)
    params = jax.jit(functools.partial(lm.init, config=cfg))(jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (B, T)), jnp.int32)
    return cfg, params, tokens, jax.jit(functools.partial(lm.apply, config=cfg))


@pytest.mark.parametrize("backend", BACKENDS)
def test_hybrid_decoding_equals_full_forward(backend):
    """Token-by-token decoding and a 5-token prompt then decoding give the full forward's logits;
    the softmax layer's window (4 keys) is shorter than the prompt and the sequence. A Pallas
    backend's full forward also equals the same LM's on "xla"."""
    cfg, params, tokens, apply = _setup(backend)
    assert cfg.layer_kinds == ("gated_deltanet", "softmax", "gla")
    step = jax.jit(functools.partial(lm.decode_step, config=cfg))
    full, _ = apply(params, tokens)
    if backend != "xla":
        on_xla, _ = lm.apply(params, tokens, kernel_hybrid("xla"))
        assert relative_rms_error(full, on_xla) <= FLOAT32_MAX_RELATIVE_RMS
    for prompt_len in (0, 5):
        state = lm.init_state(cfg, B, MAX_LEN)
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


@pytest.mark.full
@pytest.mark.parametrize("backend", BACKENDS)
def test_hybrid_packed_rows_and_gradients(backend):
    """Two segments of 8 and 12 tokens packed in one row give the logits of two separate rows;
    the loss's gradients are finite and non-zero for every parameter (and, on a Pallas backend,
    equal to the same LM's on "xla")."""
    cfg, params, tokens, apply = _setup(backend)
    cut = 8
    seg = jnp.broadcast_to((jnp.arange(T) >= cut).astype(jnp.int32)[None] + 2, (B, T))
    packed, _ = apply(params, tokens, segment_ids=seg)
    first, _ = apply(params, tokens[:, :cut])
    second, _ = apply(params, tokens[:, cut:])
    separate = jnp.concatenate([first, second], axis=1)
    assert relative_rms_error(packed, separate) <= FLOAT32_MAX_RELATIVE_RMS

    def grads(cfg):
        def loss(params):
            logits, _ = lm.apply(params, tokens[:, :-1], cfg)
            return lm.cross_entropy(logits, tokens[:, 1:])

        return jax.jit(jax.grad(loss))(params)

    got = grads(cfg)
    want = None if backend == "xla" else jax.tree_util.tree_leaves(grads(kernel_hybrid("xla")))
    for i, (path, g) in enumerate(jax.tree_util.tree_flatten_with_path(got)[0]):
        name = jax.tree_util.keystr(path)
        assert g.dtype == jnp.float32 and np.all(np.isfinite(g)), name
        assert float(jnp.max(jnp.abs(g))) > 0.0, f"zero gradient for {name}"
        if want is not None:
            err = relative_rms_error(g, want[i])
            assert err <= FLOAT32_MAX_RELATIVE_RMS, f"{name}: {err:.2e}"


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
