"""The delta-rule layers (Gated DeltaNet, KDA, DeltaNet) and the GLA layer's short convolutions
and kv heads: each against a float64 hand-written version of fla's layer; decoding token by
token, a prompt in pieces and packed rows against the full forward; gradients; config errors.

The layer checks (decoding, pieces, packing, gradients) also run every layer kind (softmax with
and without a window, gla, simple_gla, linear, and the delta-rule kinds) on the Pallas backends in
interpret mode on CPU (mosaic_tpu: TPU interpret mode; pallas_gpu: the Triton kernels' CPU
interpreter, attention and gla only), each against the same layer on "xla" too."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_tpu.layers import delta_common, deltanet, gated_deltanet, kda
from gla_tpu.layers import gated_linear_attention as gla_layer
from gla_tpu.layers import multi_head_attention as mha
from gla_tpu.testing import relative_rms_error
from gla_tpu.testing.tolerance import FLOAT32_MAX_RELATIVE_RMS

B, T, D = 2, 24, 32
MODULES = {"gated_deltanet": gated_deltanet, "kda": kda, "deltanet": deltanet,
           "gla": gla_layer, "softmax": mha}
# Each variant off its defaults somewhere: GVA (HV = 2 H), allow_neg_eigval, conv bias, the
# DeltaNet output gate; the GLA layer with short convolutions and 2 of 4 kv heads.
CONFIGS = {
    "gated_deltanet": gated_deltanet.Config(d_model=D, num_heads=2, num_v_heads=4, head_dim=8,
                                            allow_neg_eigval=True, backend="xla"),
    "kda": kda.Config(d_model=D, num_heads=2, num_v_heads=4, head_dim=8, conv_bias=True,
                      backend="xla"),
    "deltanet": deltanet.Config(d_model=D, num_heads=2, use_gate=True, backend="xla"),
    "gla": gla_layer.Config(d_model=D, num_heads=4, num_kv_heads=2, use_short_conv=True,
                            conv_bias=True, backend="xla"),
}
# Checked against the hand-written layer only.
EXTRA_CONFIGS = {
    "gated_deltanet_no_conv_no_gate": ("gated_deltanet", gated_deltanet.Config(
        d_model=D, num_heads=2, use_short_conv=False, use_gate=False, expand_v=1.0,
        backend="xla")),
    "deltanet_elu_sum_no_beta": ("deltanet", deltanet.Config(
        d_model=D, num_heads=2, qk_activation="elu", qk_norm="sum", use_beta=False,
        allow_neg_eigval=True, conv_size=3, backend="xla")),
}
# The layer checks on the Pallas backends in interpret mode: (kind, config) at the smallest dims
# their kernels take (mosaic_tpu: attention head_dim 64, 128 or 256; gla K and V multiples of 64;
# the delta rule K, V in {64, 128, 256}; pallas_gpu takes these too), each off its defaults
# somewhere (GQA, a window with a soft cap, short convolutions, GVA, allow_neg_eigval, conv bias,
# DeltaNet's output gate). The test sets the backend.
KERNEL_CONFIGS = {
    "softmax": ("softmax", mha.Config(d_model=D, num_heads=2, num_kv_heads=1, head_dim=64)),
    "softmax_window": ("softmax", mha.Config(d_model=D, num_heads=2, num_kv_heads=1, head_dim=64,
                                             window=5, logits_soft_cap=5.0)),
    "gla": ("gla", gla_layer.Config(d_model=D, num_heads=1, expand_k=2.0, expand_v=2.0,
                                    use_short_conv=True)),
    "simple_gla": ("gla", gla_layer.simple_gla_config(D, 1, expand_k=2.0, expand_v=2.0)),
    "linear": ("gla", gla_layer.linear_attention_config(D, 1, expand_k=2.0, expand_v=2.0)),
    "gated_deltanet": ("gated_deltanet", gated_deltanet.Config(
        d_model=D, num_heads=1, num_v_heads=2, head_dim=64, expand_v=1.0,
        allow_neg_eigval=True)),
    "kda": ("kda", kda.Config(d_model=D, num_heads=1, head_dim=64, conv_bias=True)),
    "deltanet": ("deltanet", deltanet.Config(d_model=D, num_heads=1, expand_k=2.0, expand_v=2.0,
                                             use_gate=True)),
}
DELTA_KINDS = ("gated_deltanet", "kda", "deltanet")
# The default run takes one of the cheapest layers per op family (interpret mode is compile-bound:
# about 1 s a program; softmax on mosaic_tpu costs 1.6x pallas_gpu); the rest run with --full.
DEFAULT_KERNEL_CASES = {("softmax_window", "pallas_gpu"), ("simple_gla", "mosaic_tpu"),
                        ("deltanet", "mosaic_tpu")}
# jax 0.11.2 deprecates the Pallas Triton lowering of the pallas_gpu kernels (docs/gpu_gla.md).
TRITON_DEPRECATION = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def _cases(names):
    """(name, backend) params: each of `names` on "xla" (CONFIGS), then each of KERNEL_CONFIGS on
    mosaic_tpu and, but for the delta-rule kinds, on pallas_gpu (interpret mode)."""
    cases = [pytest.param(name, "xla", id=name) for name in names]
    for backend in ("mosaic_tpu", "pallas_gpu"):
        for name, (kind, _) in KERNEL_CONFIGS.items():
            if backend == "pallas_gpu" and kind in DELTA_KINDS:
                continue
            marks = [] if (name, backend) in DEFAULT_KERNEL_CASES else [pytest.mark.full]
            if backend == "pallas_gpu":
                marks.append(TRITON_DEPRECATION)
            cases.append(pytest.param(name, backend, id=f"{name}-{backend}", marks=marks))
    return cases


def _case(name, backend):
    """(kind, config, params, x) of a case: CONFIGS[name] on "xla", else KERNEL_CONFIGS[name] on
    `backend` in interpret mode."""
    if backend == "xla":
        kind, cfg = name, CONFIGS[name]
    else:
        kind, cfg = KERNEL_CONFIGS[name]
        cfg = dataclasses.replace(cfg, backend=backend, interpret=True)
    return (kind, *_setup(kind, cfg))


def _on_xla(cfg):
    return dataclasses.replace(cfg, backend="xla", interpret=False)


def _f64(tree):
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), tree)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x):
    return np.logaddexp(0.0, x)


def random_params(init, cfg, seed: int):
    """Parameters of init's structure drawn with numpy (no compilation): matrices N(0, 1/fan_in),
    vectors (biases, norm scales, dt_bias) N(0, 1) (scales 1 + N(0, 0.1^2)), A_log = log U(1, 16),
    conv filters U(-1/sqrt(width), 1/sqrt(width)). Biases are non-zero so a wrong wiring shows."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(functools.partial(init, config=cfg), jax.random.key(0))

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "A_log" in name:
            a = np.log(rng.uniform(1.0, 16.0, leaf.shape))
        elif "conv1d" in name and "weight" in name:
            a = rng.uniform(-1.0, 1.0, leaf.shape) / np.sqrt(leaf.shape[0])
        elif "scale" in name:
            a = 1.0 + 0.1 * rng.standard_normal(leaf.shape)
        elif len(leaf.shape) == 2:
            a = rng.standard_normal(leaf.shape) / np.sqrt(leaf.shape[0])
        else:
            a = rng.standard_normal(leaf.shape)
        return jnp.asarray(a, jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)


# Hand-written references (float64 numpy, one token at a time).


def _conv(x, p, activation, width):
    """Causal depthwise convolution: y_t = act(sum_i w[i] x_{t-width+1+i} + bias)."""
    w = p["weight"]
    xp = np.concatenate([np.zeros(x.shape[:1] + (width - 1,) + x.shape[2:]), x], axis=1)
    y = sum(xp[:, i:i + x.shape[1]] * w[i] for i in range(width))
    if "bias" in p:
        y = y + p["bias"]
    return _silu(y) if activation == "silu" else y


def _qkv(p, x, cfg, names, activations):
    out = []
    for i, (name, n) in enumerate(zip(names, "qkv")):
        y = x @ p[name]
        if f"{n}_conv1d" in p:
            y = _conv(y, p[f"{n}_conv1d"], activations[i], cfg.conv_size)
        elif activations[i] == "silu":
            y = _silu(y)
        out.append(y)
    return out


def _delta_rule(q, k, v, beta, g, l2norm):
    """S_t = (I - beta k k^T) diag(exp(g)) S_{t-1} + beta k v^T, o_t = S_t^T q / sqrt(K); value
    head j reads q, k head j // (HV / H)."""
    b, t, h, dk = q.shape
    hv = v.shape[2]
    if l2norm:
        q, k = (a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6) for a in (q, k))
    o = np.zeros(v.shape)
    for r in range(b):
        for j in range(hv):
            i = j // (hv // h)
            s = np.zeros((dk, v.shape[-1]))
            for n in range(t):
                if g is not None:
                    decay = np.exp(g[r, n, j])  # a scalar or [K]
                    s = (decay * np.ones(dk))[:, None] * s
                kn = k[r, n, i]
                s = s + beta[r, n, j] * np.outer(kn, v[r, n, j] - s.T @ kn)
                o[r, n, j] = s.T @ q[r, n, i] / np.sqrt(dk)
    return o


def _gated_norm(o, scale, gate, activation, eps):
    y = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + eps) * scale
    if gate is None:
        return y
    return y * (_silu(gate) if activation == "swish" else _sigmoid(gate))


def _delta_layer_by_hand(kind, params, x, cfg):
    p, x = _f64(params), np.asarray(x, np.float64)
    b, t, _ = x.shape
    h, hv, dk, dv = cfg.num_heads, cfg.v_heads, cfg.head_k_dim, cfg.head_v_dim
    acts = ["silu", "silu", "silu"]
    if kind == "deltanet" and cfg.qk_activation != "silu":
        acts = [None, None, "silu"]
    q, k, v = _qkv(p, x, cfg, ("q_proj", "k_proj", "v_proj"), acts)
    q, k, v = q.reshape(b, t, h, dk), k.reshape(b, t, h, dk), v.reshape(b, t, hv, dv)
    if kind == "deltanet" and cfg.qk_activation == "elu":
        q, k = (np.where(a > 0, a, np.expm1(a)) + 1 for a in (q, k))
    l2norm = kind != "deltanet" or cfg.qk_norm == "l2"
    if not l2norm:
        q, k = q / q.sum(-1, keepdims=True), k / k.sum(-1, keepdims=True)
    beta = _sigmoid(x @ p["b_proj"]) if "b_proj" in p else np.ones((b, t, hv))
    if cfg.allow_neg_eigval:
        beta = 2 * beta
    g, gate, act = None, None, "swish"
    if kind == "gated_deltanet":
        g = -np.exp(p["A_log"]) * _softplus(x @ p["a_proj"] + p["dt_bias"])
    elif kind == "kda":
        f = (x @ p["f_proj_a"] @ p["f_proj_b"] + p["dt_bias"]).reshape(b, t, hv, dk)
        g = -np.exp(p["A_log"])[:, None] * _softplus(f)
        gate, act = x @ p["g_proj_a"] @ p["g_proj_b"] + p["g_proj_bias"], "sigmoid"
    if "g_proj" in p:
        gate = x @ p["g_proj"]
    o = _delta_rule(q, k, v, beta, g, l2norm)
    if gate is not None:
        gate = gate.reshape(b, t, hv, dv)
    o = _gated_norm(o, p["o_norm"]["scale"], gate, act, cfg.norm_eps)
    return o.reshape(b, t, hv * dv) @ p["o_proj"]


def _gla_by_hand(params, x, cfg):
    """GLA with short convolutions and kv heads: per head the recurrence S_t = diag(exp(g)) S +
    k v^T, o = S^T q / sqrt(K)."""
    p, x = _f64(params), np.asarray(x, np.float64)
    b, t, _ = x.shape
    h, hkv, dk, dv = cfg.num_heads, cfg.kv_heads, cfg.head_k_dim, cfg.head_v_dim
    q, k, v = _qkv(p, x, cfg, ("wq", "wk", "wv"), ["silu"] * 3)
    rep = h // hkv
    q = q.reshape(b, t, h, dk)
    k = np.repeat(k.reshape(b, t, hkv, dk), rep, axis=2)
    v = np.repeat(v.reshape(b, t, hkv, dv), rep, axis=2)
    logits = (x @ p["w_gate_a"]) @ p["w_gate_b"] + p["b_gate"]
    g = np.repeat((-_softplus(-logits) / cfg.gate_logit_normalizer).reshape(b, t, hkv, dk),
                  rep, axis=2)
    o = np.zeros((b, t, h, dv))
    for r in range(b):
        for i in range(h):
            s = np.zeros((dk, dv))
            for n in range(t):
                s = np.exp(g[r, n, i])[:, None] * s + np.outer(k[r, n, i], v[r, n, i])
                o[r, n, i] = s.T @ q[r, n, i] / np.sqrt(dk)
    o = _gated_norm(o, p["norm"]["scale"], (x @ p["w_out_gate"]).reshape(b, t, h, dv), "swish",
                    cfg.norm_eps)
    return o.reshape(b, t, h * dv) @ p["wo"]


@functools.cache
def _setup(name, cfg=None):
    """(config, params, x), made once per layer config (the tests only read them); `name` is the
    layer kind, and the params do not depend on the config's backend."""
    cfg = CONFIGS[name] if cfg is None else cfg
    seed = sorted(MODULES).index(name)
    params = random_params(MODULES[name].init, cfg, seed)
    x = jnp.asarray(np.random.default_rng(100 + seed).standard_normal((B, T, D)), jnp.float32)
    return cfg, params, x


@functools.cache
def _jitted(name, cfg):
    return jax.jit(functools.partial(MODULES[name].apply, config=cfg))


@pytest.mark.parametrize("name", [*CONFIGS, *EXTRA_CONFIGS])
def test_layer_matches_hand_written(name):
    kind, cfg = EXTRA_CONFIGS.get(name, (name, None))
    cfg, params, x = _setup(kind, cfg)
    y, state = _jitted(kind, cfg)(params, x)
    assert state is None and y.dtype == jnp.float32 and y.shape == x.shape
    ref = (_gla_by_hand(params, x, cfg) if kind == "gla"
           else _delta_layer_by_hand(kind, params, x, cfg))
    assert relative_rms_error(y, ref) <= FLOAT32_MAX_RELATIVE_RMS


def _random_state(cfg, module, seed):
    """A decoding state of init_state's structure with random entries."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype),
        jax.eval_shape(lambda: module.init_state(cfg, B)))


def _decode(apply, params, x, state, bounds):
    """Outputs over the pieces x[:, a:b] for consecutive (a, b) in bounds, and the last state."""
    outs = []
    for a, b in itertools.pairwise(bounds):
        y, state = apply(params, x[:, a:b], state=state)
        outs.append(y)
    return jnp.concatenate(outs, axis=1), state


def _init_state(module, cfg):
    """A zero decoding state (softmax: a float32 KV cache of T slots)."""
    if module is mha:
        return mha.init_state(cfg, B, T, jnp.float32)
    return module.init_state(cfg, B)


@pytest.mark.parametrize("name,backend", _cases(CONFIGS))
def test_decoding_pieces_and_packing_equal_full(name, backend):
    """Token-by-token decoding and a prompt in pieces of 9 and 15 tokens give the full forward's
    outputs (T = 24: the full forward runs the chunked mode, the pieces the recurrent one); a row
    packed with two segments of 9 and 15 tokens and a given state gives the first segment
    continued from that state and the second from zeros, as separate rows, and the second's final
    state (softmax: a row packed without a state, the separate rows each a prompt into an empty
    KV cache). On a Pallas backend (interpret mode) the full forward also equals the same layer's
    on "xla"."""
    kind, cfg, params, x = _case(name, backend)
    module, apply = MODULES[kind], _jitted(kind, cfg)
    full, _ = apply(params, x)
    if backend != "xla":
        on_xla, _ = _jitted(kind, _on_xla(cfg))(params, x)
        assert relative_rms_error(full, on_xla) <= FLOAT32_MAX_RELATIVE_RMS
    by_token, _ = _decode(apply, params, x, _init_state(module, cfg), list(range(T + 1)))
    assert relative_rms_error(by_token, full) <= FLOAT32_MAX_RELATIVE_RMS
    cut = 9
    in_pieces, _ = _decode(apply, params, x, _init_state(module, cfg), [0, cut, T])
    assert relative_rms_error(in_pieces, full) <= FLOAT32_MAX_RELATIVE_RMS

    seg = jnp.broadcast_to((jnp.arange(T) >= cut).astype(jnp.int32)[None] + 4, (B, T))
    if module is mha:  # the pieces' programs: a prompt of 9 tokens, then one of 15
        packed, _ = apply(params, x, segment_ids=seg)
        first, _ = apply(params, x[:, :cut], state=_init_state(mha, cfg))
        second, _ = apply(params, x[:, cut:], state=_init_state(mha, cfg))
        separate = jnp.concatenate([first, second], axis=1)
        assert relative_rms_error(packed, separate) <= FLOAT32_MAX_RELATIVE_RMS
        return
    s0 = _random_state(cfg, module, 5)
    packed, final = apply(params, x, state=s0, segment_ids=seg)
    first, _ = apply(params, x[:, :cut], state=s0)
    second, final_ref = apply(params, x[:, cut:], state=module.init_state(cfg, B))
    separate = jnp.concatenate([first, second], axis=1)
    assert relative_rms_error(packed, separate) <= FLOAT32_MAX_RELATIVE_RMS
    for a, b in zip(jax.tree_util.tree_leaves(final), jax.tree_util.tree_leaves(final_ref)):
        assert relative_rms_error(a, b) <= FLOAT32_MAX_RELATIVE_RMS


# mosaic_tpu's chunked delta rule forms per-head dg as a reverse chunk-local sum of d loss / d
# (running gate sum) (ops/delta_rule/mosaic_tpu/vjp.py, _reverse_chunk_sums): an absolute error of
# about 1e-8 on every token, however small dg is. At this layer's strong gates (g from -1.3 to -40)
# that is 9e-6 relative in dg (xla: 4e-7) and 2.4e-5 in d A_log, 1.7e-5 in d dt_bias (xla: 2e-7).
# On the Pallas backends with --full only: the kernels' gradients are the op tests' (every
# gradient against the float64 reference in tests/ops), every parameter's gradient the "xla"
# runs' here; test_decoding_pieces_and_packing_equal_full keeps the default run's layer checks in
# interpret mode.
def _gradient_cases(names):
    return [p if p.values[1] == "xla" else
            pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.full])
            for p in _cases(names)]


@pytest.mark.parametrize("name,backend", _gradient_cases(DELTA_KINDS))
def test_gradients_finite_and_reach_every_parameter(name, backend):
    """Gradients of every parameter and of x, finite and non-zero. "xla": through 8 tokens
    (ops.delta_rule's own gradients are checked in tests/ops). A Pallas backend (interpret mode):
    through all T = 24 tokens (the chunked backward kernels, which training runs), each gradient
    equal to the same layer's on "xla"."""
    kind, cfg, params, x = _case(name, backend)
    if backend == "xla":
        x = x[:, :8]
    apply = MODULES[kind].apply
    cot = jnp.asarray(np.random.default_rng(6).standard_normal(x.shape), jnp.float32)

    def grads(cfg):
        def loss(params, x):
            y, _ = apply(params, x, cfg)
            return jnp.sum(y * cot)

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)

    got = grads(cfg)
    for path, g in jax.tree_util.tree_flatten_with_path(got)[0]:
        name = jax.tree_util.keystr(path)
        assert g.dtype == jnp.float32, name
        assert np.all(np.isfinite(g)), name
        assert float(jnp.max(jnp.abs(g))) > 0.0, f"zero gradient for {name}"
    if backend != "xla":
        want = jax.tree_util.tree_leaves(grads(_on_xla(cfg)))
        for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], want):
            err = relative_rms_error(g, w)
            assert err <= FLOAT32_MAX_RELATIVE_RMS, f"{jax.tree_util.keystr(path)}: {err:.2e}"


# --full: the kinds but DeltaNet (the op's own tests cover each gate kind in the interpreter)
@pytest.mark.parametrize("kind", [pytest.param(k, marks=() if k == "deltanet" else pytest.mark.full)
                                  for k in DELTA_KINDS])
def test_pallas_gpu_delta_rule_takes_16_bit_layers(kind):
    """The delta rule's pallas_gpu kernels (the Mosaic GPU interpreter here) take a delta-rule
    layer in bfloat16, computing what "xla" computes in bfloat16; in float32 they refuse with the
    op's NotImplementedError, which names the backend that takes it."""
    _, cfg = KERNEL_CONFIGS[kind]
    _, params, x = _setup(kind, cfg)
    cfg = dataclasses.replace(cfg, backend="pallas_gpu", interpret=True)
    with pytest.raises(NotImplementedError, match="the 'pallas_gpu' delta_rule takes bfloat16, "
                                                  "float16 q, k, v; got float32.*'xla' takes it"):
        jax.eval_shape(functools.partial(MODULES[kind].apply, config=cfg), params, x)
    x16 = x.astype(jnp.bfloat16)
    got = MODULES[kind].apply(params, x16, config=cfg)[0]
    want = MODULES[kind].apply(params, x16, config=_on_xla(cfg))[0]
    assert got.dtype == jnp.bfloat16
    assert relative_rms_error(got, want) <= 2e-2


def test_initialization_follows_fla():
    """A_log = log U(0, 16) (Gated DeltaNet) or log U(1, 16) (KDA); dt_bias = softplus^-1(dt),
    dt in [0.001, 0.1]; the shapes of GVA layers' parameters and states, and their dtypes with
    bfloat16 activations (float32 states, bfloat16 outputs)."""
    decay = jax.jit(delta_common.init_decay, static_argnums=(1, 2, 3))
    for a_range in (gated_deltanet.A_INIT_RANGE, kda.A_INIT_RANGE):
        params = decay(jax.random.key(7), 64, 512, a_range)
        a = np.exp(np.asarray(params["A_log"], np.float64))
        assert np.all(np.isfinite(params["A_log"]))
        assert np.all((a >= a_range[0] * (1 - 1e-6)) & (a <= a_range[1]))
        dt = np.logaddexp(0.0, np.asarray(params["dt_bias"], np.float64))
        assert params["dt_bias"].shape == (512,)
        assert np.all((dt >= 0.001 * (1 - 1e-5)) & (dt <= 0.1 * (1 + 1e-5)))
    assert gated_deltanet.A_INIT_RANGE == (0.0, 16.0) and kda.A_INIT_RANGE == (1.0, 16.0)
    x16 = jax.ShapeDtypeStruct((B, 3, 64), jnp.bfloat16)
    for module in (gated_deltanet, kda):
        cfg = module.Config(d_model=64, num_heads=2, num_v_heads=8, head_dim=8)
        p = jax.eval_shape(functools.partial(module.init, config=cfg), jax.random.key(0))
        assert p["A_log"].shape == (8,)
        assert p["dt_bias"].shape == ((8 * 8,) if module is kda else (8,))
        assert p["q_conv1d"]["weight"].shape == (4, 16)
        assert p["v_conv1d"]["weight"].shape == (4, 8 * cfg.head_v_dim)
        state = module.init_state(cfg, B)
        assert state["recurrent"].shape == (B, 8, 8, cfg.head_v_dim)
        assert state["conv_k"].shape == (B, 3, 16)
        y, new = jax.eval_shape(functools.partial(module.apply, config=cfg), p, x16, state=state)
        assert y.dtype == jnp.bfloat16
        assert jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), new) == \
            jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), state)
    assert p["f_proj_b"].shape == (8, 64) and p["g_proj_b"].shape == (8, 64)


@pytest.mark.parametrize("make", [
    lambda: gated_deltanet.Config(d_model=64, num_heads=4, num_v_heads=6),
    lambda: gated_deltanet.Config(d_model=60, num_heads=8),
    lambda: gated_deltanet.Config(d_model=64, expand_v=0.3),
    lambda: gated_deltanet.Config(d_model=64, mode="fused_chunk"),
    lambda: gated_deltanet.Config(d_model=64, use_gate="yes"),
    lambda: kda.Config(d_model=64, conv_size=0),
    lambda: kda.Config(d_model=64, chunk_size=32),
    lambda: kda.Config(d_model=64, norm_eps=0.0),
    lambda: deltanet.Config(d_model=64, num_heads=3),
    lambda: deltanet.Config(d_model=64, qk_activation="tanh"),
    lambda: deltanet.Config(d_model=64, qk_norm="none"),
    lambda: gla_layer.Config(d_model=64, num_heads=4, num_kv_heads=3),
    lambda: gla_layer.Config(d_model=64, use_short_conv=1),
])
def test_invalid_configs_raise_value_error(make):
    with pytest.raises(ValueError):
        make()


def test_invalid_inputs_raise_value_error():
    cfg, params, x = _setup("gated_deltanet")
    with pytest.raises(ValueError, match="d_model"):
        gated_deltanet.apply(params, x[..., :16], cfg)
    with pytest.raises(ValueError, match="segment_ids"):
        gated_deltanet.apply(params, x, cfg, segment_ids=jnp.zeros((B, T + 1), jnp.int32))
