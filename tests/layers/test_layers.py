"""Each layer against a hand-written version of its math (float64), dtypes, and argument checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_tpu.layers import basic, block, deltanet, gated_deltanet, kda, lm, mlp
from gla_tpu.layers import gated_linear_attention as gla_layer
from gla_tpu.layers import multi_head_attention as mha
from gla_tpu.ops import gla_recurrent_reference
from gla_tpu.testing import random_segment_ids, relative_rms_error
from gla_tpu.testing.tolerance import FLOAT32_MAX_RELATIVE_RMS

B, T, D_MODEL = 2, 24, 64
# A bfloat16 layer (inputs, weights and intermediate activations rounded to eps = 2^-8 at a few
# matmuls) stays within a few eps of the exact result; 2^-5 is 8 eps.
BF16_MAX_RELATIVE_RMS = 2.0**-5


def _x(key, dtype=jnp.float32, t=T):
    return jax.random.normal(key, (B, t, D_MODEL), jnp.float32).astype(dtype)


def _f64(tree):
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), tree)


def _rms_norm_by_hand(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _silu(x):
    return x / (1.0 + np.exp(-x))


# Hand-written references.


def _gla_by_hand(params, x, cfg: gla_layer.Config, state=None, segment_ids=None):
    """fla's GLA layer written out in float64 numpy, the recurrence by the float64 reference."""
    p, x = _f64(params), np.asarray(x, np.float64)
    b, t, _ = x.shape
    h, kd, vd = cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim
    q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]
    if cfg.feature_map == "relu":
        q, k = np.maximum(q, 0), np.maximum(k, 0)
    elif cfg.feature_map == "elu_p1":
        q, k = (np.where(a > 0, a, np.expm1(a)) + 1 for a in (q, k))
    g = None
    if cfg.gate != "none":
        if cfg.gate == "key":
            logits = (x @ p["w_gate_a"]) @ p["w_gate_b"] + p["b_gate"]
            shape = (b, t, h, kd)
        else:
            logits = x @ p["w_gate"] + p["b_gate"]
            shape = (b, t, h)
        g = -np.logaddexp(0.0, -logits) / cfg.gate_logit_normalizer  # logsigmoid
        if cfg.clamp_min is not None:
            g = np.maximum(g, cfg.clamp_min)
        g = g.reshape(shape)
    o, final = gla_recurrent_reference(
        q.reshape(b, t, h, kd), k.reshape(b, t, h, kd), v.reshape(b, t, h, vd), g,
        initial_state=state, output_final_state=True, segment_ids=segment_ids,
    )
    o = _rms_norm_by_hand(np.asarray(o), p["norm"]["scale"], cfg.norm_eps)
    if cfg.use_output_gate:
        o = o * _silu((x @ p["w_out_gate"]).reshape(b, t, h, vd))
    return o.reshape(b, t, h * vd) @ p["wo"], np.asarray(final)


def _rope_by_hand(x, positions, base):
    """Rotary embedding as complex rotation of the pairs (x_i, x_{i + D/2})."""
    d = x.shape[-1]
    z = x[..., : d // 2] + 1j * x[..., d // 2 :]
    theta = positions[:, :, None, None] * base ** (-np.arange(d // 2) * 2.0 / d)
    z = z * np.exp(1j * theta)
    return np.concatenate([z.real, z.imag], axis=-1)


def _mha_by_hand(params, x, cfg: mha.Config, segment_ids=None):
    """Causal softmax attention with explicit scores, mask and repeated kv heads, float64; with
    cfg.window a query sees the keys j with i - window < j <= i, with cfg.logits_soft_cap the
    scores s become c tanh(s / c)."""
    p, x = _f64(params), np.asarray(x, np.float64)
    b, t, _ = x.shape
    h, hkv, d = cfg.num_heads, cfg.kv_heads, cfg.dim
    q = (x @ p["wq"]).reshape(b, t, h, d)
    k = (x @ p["wk"]).reshape(b, t, hkv, d)
    v = (x @ p["wv"]).reshape(b, t, hkv, d)
    seg = np.zeros((b, t), np.int64) if segment_ids is None else np.asarray(segment_ids)
    positions = np.zeros((b, t))
    for r in range(b):
        for i in range(1, t):
            positions[r, i] = positions[r, i - 1] + 1 if seg[r, i] == seg[r, i - 1] else 0
    if cfg.rope_base is not None:
        q, k = _rope_by_hand(q, positions, cfg.rope_base), _rope_by_hand(k, positions, cfg.rope_base)
    k, v = np.repeat(k, h // hkv, axis=2), np.repeat(v, h // hkv, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(d)
    if cfg.logits_soft_cap is not None:
        s = cfg.logits_soft_cap * np.tanh(s / cfg.logits_soft_cap)
    causal = np.tril(np.ones((t, t), bool))
    if cfg.window is not None:
        causal &= ~np.tril(np.ones((t, t), bool), -cfg.window)
    # Segments are runs of equal ids, so "same id and j <= i" is the packed-sequence mask.
    mask = causal[None] & (seg[:, :, None] == seg[:, None, :])
    s = np.where(mask[:, None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    o = np.einsum("bhij,bjhd->bihd", w, v)
    return o.reshape(b, t, h * d) @ p["wo"]




GLA_CONFIGS = {
    "gla": gla_layer.Config(d_model=D_MODEL, num_heads=4),
    "simple_gla": gla_layer.simple_gla_config(D_MODEL, 4),
    "linear": gla_layer.linear_attention_config(D_MODEL, 2),
    "gla_clamp_featuremap_no_output_gate": gla_layer.Config(
        d_model=D_MODEL, num_heads=2, expand_k=1.0, expand_v=0.5, clamp_min=-0.05,
        feature_map="elu_p1", use_output_gate=False, gate_logit_normalizer=1.0),
}


# Without a state (and segment ids) for "gla" only in the default run: the other configs differ
# from it in the layer's own code (feature maps, gates, output gate), which the runs with a state
# and segment ids take as well; --full runs every config both ways.
@pytest.mark.parametrize("name,with_state", [
    pytest.param(name, with_state, id=f"{with_state}-{name}",
                 marks=pytest.mark.full if not with_state and name != "gla" else ())
    for with_state in (False, True) for name in GLA_CONFIGS])
def test_gla_layer_matches_hand_written(name, with_state):
    cfg = GLA_CONFIGS[name]
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = gla_layer.init(k1, cfg)
    # Non-zero gate biases so a wrong bias wiring shows.
    params = {n: (jax.random.normal(k4, a.shape) if n == "b_gate" else a) for n, a in params.items()}
    x = _x(k2)
    state = seg = None
    if with_state:
        state = jax.random.normal(k3, gla_layer.init_state(cfg, B).shape, jnp.float32)
        seg = random_segment_ids(k3, B, T)
    y, final = gla_layer.apply(params, x, cfg, state=state, segment_ids=seg)
    y_ref, final_ref = _gla_by_hand(params, x, cfg, state, seg)
    assert y.dtype == jnp.float32
    assert relative_rms_error(y, y_ref) <= FLOAT32_MAX_RELATIVE_RMS
    if with_state:
        assert final.dtype == jnp.float32
        assert relative_rms_error(final, final_ref) <= FLOAT32_MAX_RELATIVE_RMS
    else:
        assert final is None


@pytest.mark.parametrize("num_kv_heads,rope,segments,window,soft_cap", [
    (4, True, False, None, None), (2, True, True, None, None), (1, False, False, None, None),
    (2, True, True, 5, 3.0)])
def test_mha_matches_explicit_softmax(num_kv_heads, rope, segments, window, soft_cap):
    cfg = mha.Config(d_model=D_MODEL, num_heads=4, num_kv_heads=num_kv_heads,
                     rope_base=10000.0 if rope else None, window=window,
                     logits_soft_cap=soft_cap)
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    params = mha.init(k1, cfg)
    x = _x(k2)
    seg = random_segment_ids(k3, B, T) if segments else None
    y, state = mha.apply(params, x, cfg, segment_ids=seg)
    assert state is None and y.dtype == jnp.float32 and y.shape == x.shape
    assert relative_rms_error(y, _mha_by_hand(params, x, cfg, seg)) <= FLOAT32_MAX_RELATIVE_RMS


@pytest.mark.parametrize("layer", ["softmax", "gla"])
def test_layer_prompt_in_pieces_equals_full(layer):
    """A state carried over pieces of 1, 7 and 16 tokens gives the full-sequence outputs."""
    if layer == "softmax":
        cfg, mod = mha.Config(d_model=D_MODEL, num_heads=4, num_kv_heads=2), mha
        state = mha.init_state(cfg, B, 32, jnp.float32)
    else:
        cfg, mod = gla_layer.Config(d_model=D_MODEL, num_heads=4), gla_layer
        state = gla_layer.init_state(cfg, B)
    params = mod.init(jax.random.key(2), cfg)
    x = _x(jax.random.key(3))
    full, _ = mod.apply(params, x, cfg)
    pieces = []
    for start, stop in ((0, 1), (1, 8), (8, 24)):
        y, state = mod.apply(params, x[:, start:stop], cfg, state=state)
        pieces.append(y)
    assert relative_rms_error(jnp.concatenate(pieces, axis=1), full) <= FLOAT32_MAX_RELATIVE_RMS


def test_building_blocks_match_hand_written():
    k1, k2, k3 = jax.random.split(jax.random.key(4), 3)
    x = _x(k1)
    cfg = mlp.Config(d_model=D_MODEL)
    assert cfg.hidden_dim == 176
    p = mlp.init(k2, cfg)
    pf, xf = _f64(p), np.asarray(x, np.float64)
    ref = (_silu(xf @ pf["w_gate"]) * (xf @ pf["w_up"])) @ pf["w_down"]
    assert relative_rms_error(mlp.apply(p, x, cfg), ref) <= FLOAT32_MAX_RELATIVE_RMS
    scale = {"scale": jax.random.normal(k3, (D_MODEL,))}
    ref = _rms_norm_by_hand(xf, np.asarray(scale["scale"], np.float64), 1e-5)
    assert relative_rms_error(basic.rms_norm(scale, x), ref) <= FLOAT32_MAX_RELATIVE_RMS
    xh = jax.random.normal(k3, (B, T, 2, 16))
    pos = basic.segment_positions(None, B, T)
    ref = _rope_by_hand(np.asarray(xh, np.float64), np.asarray(pos, np.float64), 10000.0)
    assert relative_rms_error(basic.rotary(xh, pos), ref) <= FLOAT32_MAX_RELATIVE_RMS
    seg = jnp.array([[3, 3, 5, 5, 5, 3], [0, 1, 2, 2, 2, 2]])
    np.testing.assert_array_equal(basic.segment_positions(seg, 2, 6),
                                  [[0, 1, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3]])


def test_rms_norm_runs_in_float32():
    x = _x(jax.random.key(5), jnp.bfloat16)
    scale = {"scale": jnp.full((D_MODEL,), 1.5, jnp.float32)}
    y = basic.rms_norm(scale, x)
    x32 = x.astype(jnp.float32)
    expected = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5) * 1.5)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32),
                                  np.asarray(expected.astype(jnp.bfloat16), np.float32))


# [B, HV, K, V] at d_model 64, 4 heads: Gated DeltaNet's V is 2 K (expand_v 2), the gla kinds'
# K is d/8 (expand_k 0.5).
RECURRENT_SHAPES = {"gated_deltanet": (B, 4, 16, 32), "kda": (B, 4, 16, 16),
                    "deltanet": (B, 4, 16, 16)}


# The delta-rule kinds with --full (test_delta_layers.py checks their bfloat16 dtypes).
@pytest.mark.parametrize("kind", [
    kind if kind not in RECURRENT_SHAPES else pytest.param(kind, marks=pytest.mark.full)
    for kind in block.ATTENTION_KINDS])
def test_block_bfloat16_dtypes_and_accuracy(kind):
    """bfloat16 activations in and out, float32 recurrent state, bfloat16 KV cache; the bfloat16
    block stays within a few bfloat16 eps of the float32 block."""
    cfg = block.Config(d_model=D_MODEL, num_heads=4, attention=kind)
    params = block.init(jax.random.key(6), cfg)
    x = _x(jax.random.key(7))
    state = block.init_state(cfg, B, 32, jnp.bfloat16)
    y16, s16 = block.apply(params, x.astype(jnp.bfloat16), cfg, state=state)
    y32, _ = block.apply(params, x, cfg)
    assert y16.dtype == jnp.bfloat16 and y16.shape == x.shape
    if kind == "softmax":
        assert s16["k"].dtype == s16["v"].dtype == jnp.bfloat16
        assert s16["k"].shape == (B, 32, 4, D_MODEL // 4) and int(s16["pos"]) == T
    else:
        # gla kinds: the recurrent state itself; delta-rule kinds: {"recurrent", "conv_*"}
        recurrent = s16["recurrent"] if isinstance(s16, dict) else s16
        assert all(a.dtype == jnp.float32 for a in jax.tree_util.tree_leaves(s16))
        assert recurrent.shape == RECURRENT_SHAPES.get(kind, (B, 4, 8, 16))
    assert relative_rms_error(y16, y32) <= BF16_MAX_RELATIVE_RMS


@pytest.mark.parametrize("make", [
    lambda: gla_layer.Config(d_model=64, num_heads=3),
    lambda: gla_layer.Config(d_model=64, gate="vector"),
    lambda: gla_layer.Config(d_model=64, clamp_min=0.5),
    lambda: gla_layer.Config(d_model=64, mode="parallel"),
    lambda: mha.Config(d_model=64, num_heads=4, num_kv_heads=3),
    lambda: mha.Config(d_model=60, num_heads=4, head_dim=15),
    lambda: mha.Config(d_model=64, num_heads=4, window=0),
    lambda: mha.Config(d_model=64, num_heads=4, logits_soft_cap=-1.0),
    lambda: block.Config(d_model=64, num_heads=4, attention="mamba"),
    # attention_options: a field the layer lacks, one block sets itself, not (name, value) pairs
    lambda: block.Config(d_model=64, num_heads=4, attention="gla",
                         attention_options={"use_beta": False}),
    lambda: block.Config(d_model=64, num_heads=4, attention="deltanet",
                         attention_options={"norm_eps": 1e-6}),
    lambda: block.Config(d_model=64, num_heads=4, attention_options=("window",)),
    lambda: block.Config(d_model=64, num_heads=4, attention="gla",
                         attention_options={"interpret": True}),
    lambda: lm.Config(vocab_size=8, num_layers=1, block=block.Config(d_model=64, num_heads=4),
                      tied_head_scale=0.0),
    lambda: mlp.Config(d_model=0),
])
def test_invalid_configs_raise_value_error(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("config", [mha.Config, gla_layer.Config, gated_deltanet.Config, kda.Config,
                                    deltanet.Config, block.Config])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_interpret_must_be_a_bool(config, value):
    """Every layer Config with a backend takes interpret=True/False (Pallas interpret mode) and
    names anything else."""
    assert config(d_model=64, num_heads=4, interpret=True).interpret is True
    with pytest.raises(ValueError, match=f"^interpret must be a bool; got {value!r}\\.$"):
        config(d_model=64, num_heads=4, interpret=value)


def test_invalid_inputs_raise_value_error():
    cfg = mha.Config(d_model=D_MODEL, num_heads=4)
    params = mha.init(jax.random.key(8), cfg)
    with pytest.raises(ValueError, match="d_model"):
        mha.apply(params, jnp.ones((B, T, 32)), cfg)
    with pytest.raises(ValueError, match="segment_ids"):
        mha.apply(params, jnp.ones((B, T, D_MODEL)), cfg, segment_ids=jnp.ones((B, T + 1), jnp.int32))
    with pytest.raises(ValueError, match="state=None"):
        mha.apply(params, jnp.ones((B, T, D_MODEL)), cfg, state=mha.init_state(cfg, B, 32),
                  segment_ids=jnp.ones((B, T), jnp.int32))
    with pytest.raises(ValueError, match="max_len"):
        mha.apply(params, jnp.ones((B, T, D_MODEL)), cfg, state=mha.init_state(cfg, B, 8))
