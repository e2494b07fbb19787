"""The LM: decoding equals the full forward for every attention kind, packed sequences, gradients,
jit / grad / vmap, sharded parameters, and the optax AdamW step."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gla_tpu.layers import block, lm, training
from gla_tpu.testing import assert_pass_rule, relative_rms_error
from gla_tpu.testing.tolerance import FLOAT32_MAX_RELATIVE_RMS

B, T, VOCAB, MAX_LEN = 2, 24, 64, 32
# The delta-rule kinds run here with --full only: test_delta_layers.py checks them layer by layer
# and test_hybrid_lm.py in an LM. So does simple_gla, the GLA layer with per-head gates in the
# LM code that "gla" (per-key gates) and "linear" (none) run here: test_delta_layers.py checks
# its decoding, pieces, packing and gradients layer by layer (mosaic_tpu, interpret mode), and
# test_layers.py the layer against the hand-written one. So does "linear", the GLA layer without
# gates in the same LM code as "gla" (test_layers.py checks it against the hand-written layer,
# the ops their gate-less cases).
_FULL_ONLY_KINDS = ("gated_deltanet", "kda", "deltanet", "simple_gla", "linear")
KINDS = [kind if kind not in _FULL_ONLY_KINDS else pytest.param(kind, marks=pytest.mark.full)
         for kind in block.ATTENTION_KINDS]


def _config(kind, dtype="float32", num_layers=2):
    blk = block.Config(d_model=64, num_heads=4, attention=kind)
    return lm.Config(vocab_size=VOCAB, num_layers=num_layers, block=blk, dtype=dtype)


def _tokens(key, shape=(B, T)):
    return jax.random.randint(key, shape, 0, VOCAB)


@functools.lru_cache(maxsize=None)
def _jitted(cfg):
    """(apply, decode_step) compiled once per config."""
    return (jax.jit(functools.partial(lm.apply, config=cfg)),
            jax.jit(functools.partial(lm.decode_step, config=cfg)))


def _decode_all(params, tokens, cfg, prompt_len):
    """Logits for every position: a prompt of `prompt_len` tokens through `apply` with a state,
    then one `decode_step` per remaining token."""
    apply, step = _jitted(cfg)
    state = lm.init_state(cfg, tokens.shape[0], MAX_LEN)
    out = []
    if prompt_len:
        logits, state = apply(params, tokens[:, :prompt_len], state=state)
        out.append(logits)
    for i in range(prompt_len, tokens.shape[1]):
        logits, state = step(params, tokens[:, i], state)
        out.append(logits[:, None])
    return jnp.concatenate(out, axis=1)


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_equals_full_forward(kind):
    """float32: token-by-token decoding and prompt-then-decode give the full forward's logits
    (T = 24 > 16, so the linear kinds' full forward runs the chunked mode, decoding the recurrent
    one). bfloat16: decoding passes the pass rule against the float32 forward with the bfloat16
    full forward as baseline."""
    params = lm.init(jax.random.key(0), _config(kind))
    tokens = _tokens(jax.random.key(1))
    cfg32, cfg16 = _config(kind), _config(kind, "bfloat16")
    full32, _ = _jitted(cfg32)[0](params, tokens)
    for prompt_len in (0, 5):
        decoded = _decode_all(params, tokens, cfg32, prompt_len)
        assert relative_rms_error(decoded, full32) <= FLOAT32_MAX_RELATIVE_RMS, prompt_len
    full16, _ = _jitted(cfg16)[0](params, tokens)
    decoded16 = _decode_all(params, tokens, cfg16, 0)
    assert decoded16.dtype == full16.dtype == jnp.float32
    assert_pass_rule(decoded16, full16, full32, dtype=jnp.bfloat16)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_sequences_equal_separate_rows(kind):
    """Two segments of 12 tokens packed in one row give the logits of two rows of 12 tokens."""
    cfg = _config(kind)
    params = lm.init(jax.random.key(2), cfg)
    tokens = _tokens(jax.random.key(3))
    half = T // 2
    seg = jnp.broadcast_to((jnp.arange(T) >= half).astype(jnp.int32)[None] + 7, (B, T))
    apply = jax.jit(functools.partial(lm.apply, config=cfg))
    packed, _ = apply(params, tokens, segment_ids=seg)
    rows, _ = apply(params, jnp.concatenate([tokens[:, :half], tokens[:, half:]], axis=0))
    separate = jnp.concatenate([rows[:B], rows[B:]], axis=1)
    assert relative_rms_error(packed, separate) <= FLOAT32_MAX_RELATIVE_RMS


def _loss(params, tokens, cfg):
    logits, _ = lm.apply(params, tokens[:, :-1], cfg)
    return lm.cross_entropy(logits, tokens[:, 1:])


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_finite_and_reach_every_parameter(kind):
    cfg = _config(kind, "bfloat16")
    params = lm.init(jax.random.key(4), cfg)
    loss, grads = jax.jit(jax.value_and_grad(functools.partial(_loss, cfg=cfg)))(
        params, _tokens(jax.random.key(5), (B, T + 1)))
    assert np.isfinite(float(loss))
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        name = jax.tree_util.keystr(path)
        assert g.dtype == jnp.float32, name
        assert np.all(np.isfinite(g)), name
        assert float(jnp.max(jnp.abs(g))) > 0.0, f"zero gradient for {name}"


def test_untied_head_and_vmap_over_models_and_batches():
    blk = block.Config(d_model=64, num_heads=4, attention="gla")
    cfg = lm.Config(vocab_size=VOCAB, num_layers=1, block=blk, tie_embeddings=False,
                    dtype="float32")
    keys = jax.random.split(jax.random.key(6), 3)
    ensemble = jax.vmap(lambda k: lm.init(k, cfg))(keys)  # 3 models, stacked leaves
    assert ensemble["head"].shape == (3, 64, VOCAB)
    tokens = _tokens(jax.random.key(7), (3, B, T))
    apply = jax.jit(functools.partial(lm.apply, config=cfg))
    logits, _ = jax.jit(jax.vmap(apply))(ensemble, tokens)
    for i in range(3):
        one = jax.tree_util.tree_map(lambda a: a[i], ensemble)
        expected, _ = apply(one, tokens[i])
        assert relative_rms_error(logits[i], expected) <= FLOAT32_MAX_RELATIVE_RMS
    grads = jax.jit(jax.vmap(jax.grad(functools.partial(_loss, cfg=cfg))))(
        ensemble, _tokens(jax.random.key(8), (3, B, T + 1)))
    assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))


def _param_spec(leaf):
    """Megatron-like rule for the test: matrices split their output dim over "model"."""
    if leaf.ndim == 2 and leaf.shape[1] % 2 == 0:
        return P(None, "model")
    return P()


# softmax with --full only: the parameters' sharding is the LM's, the same for every kind
@pytest.mark.parametrize("kind", [pytest.param("softmax", marks=pytest.mark.full), "gla"])
def test_sharded_parameters_on_four_cpu_devices(kind):
    devices = jax.devices()
    assert len(devices) >= 4, "tests/conftest.py sets --xla_force_host_platform_device_count=8"
    mesh = Mesh(np.array(devices[:4]).reshape(2, 2), ("data", "model"))
    cfg = _config(kind, num_layers=1)
    params = lm.init(jax.random.key(9), cfg)
    tokens = _tokens(jax.random.key(10), (4, T + 1))
    shardings = jax.tree_util.tree_map(lambda a: NamedSharding(mesh, _param_spec(a)), params)
    sharded = jax.device_put(params, shardings)
    tokens_sharded = jax.device_put(tokens, NamedSharding(mesh, P("data", None)))
    assert sharded["blocks"][0]["attn"]["wq"].sharding.spec == P(None, "model")

    value_and_grad = jax.jit(jax.value_and_grad(functools.partial(_loss, cfg=cfg)))
    loss, grads = value_and_grad(sharded, tokens_sharded)
    loss_ref, grads_ref = value_and_grad(params, tokens)
    assert abs(float(loss) - float(loss_ref)) <= 1e-5 * abs(float(loss_ref))
    for g, g_ref in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads_ref)):
        assert relative_rms_error(g, g_ref) <= FLOAT32_MAX_RELATIVE_RMS


def _two_layer_lm(attention="gla", backend="xla"):
    blk = block.Config(d_model=64, num_heads=4, attention=attention, backend=backend)
    return lm.Config(vocab_size=VOCAB, num_layers=2, block=blk, dtype="float32")


def _sharded_loss(params, tokens, cfg, sharding):
    logits, _ = lm.apply(params, tokens[:, :-1], cfg, sharding=sharding)
    return lm.cross_entropy(logits, tokens[:, 1:])


# softmax's ring (collective-permute) runs with --full only; tests/ops/test_sharding.py checks
# ring attention itself in the default run
@pytest.mark.parametrize("attention, collective", [
    ("gla", "all-gather"),
    pytest.param("softmax", "collective-permute", marks=pytest.mark.full)])
def test_data_and_sequence_parallel_on_eight_cpu_devices(attention, collective):
    """lm.apply(..., sharding=P("data", "seq")) under jit on a (2, 4) mesh: GLA layers run context
    parallel over "seq" (T = 64, 16 tokens per device), softmax layers ring attention. Loss and
    every gradient pass the pass rule against float64 with the unsharded float32 run as the
    baseline (the two differ by float32 reassociation, up to ~4e-5 relative on the first layer's
    q/k projections, where the unsharded run is itself ~2e-5 from float64), and the program's
    collectives are the state all-gathers (GLA) or the ring's permutes (softmax)."""
    devices = jax.devices()
    assert len(devices) >= 8, "tests/conftest.py sets --xla_force_host_platform_device_count=8"
    mesh = Mesh(np.array(devices[:8]).reshape(2, 4), ("data", "seq"))
    cfg = _two_layer_lm(attention)
    params = lm.init(jax.random.key(11), cfg)
    tokens = _tokens(jax.random.key(12), (4, 65))
    sharded = jax.jit(jax.value_and_grad(functools.partial(
        _sharded_loss, cfg=cfg, sharding=NamedSharding(mesh, P("data", "seq")))))
    got = sharded(params, jax.device_put(tokens, NamedSharding(mesh, P("data"))))
    baseline = jax.jit(jax.value_and_grad(functools.partial(_sharded_loss, cfg=cfg,
                                                            sharding=None)))(params, tokens)
    with jax.enable_x64():
        cfg64 = dataclasses.replace(cfg, dtype="float64")
        params64 = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
        want = jax.jit(jax.value_and_grad(functools.partial(_sharded_loss, cfg=cfg64,
                                                            sharding=None)))(params64, tokens)
        names = ["loss"] + [jax.tree_util.keystr(p)
                            for p, _ in jax.tree_util.tree_flatten_with_path(got[1])[0]]
        leaves = [jax.tree_util.tree_leaves(x) for x in (got, baseline, want)]
        for name, g, b, w in zip(names, *leaves):
            err, err_baseline = relative_rms_error(g, w), relative_rms_error(b, w)
            assert err <= max(2 * err_baseline, FLOAT32_MAX_RELATIVE_RMS), (
                f"{name}: sharded {err:.2e} vs unsharded {err_baseline:.2e} (float64 reference)")
    assert collective in sharded.lower(params, tokens).compile().as_text()


def test_bad_activation_sharding_is_named():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "seq"))
    tokens = _tokens(jax.random.key(13), (4, 65))
    softmax = _config("softmax", num_layers=1)
    params = lm.init(jax.random.key(14), softmax)
    with pytest.raises(ValueError, match="batch and time axes"):
        _sharded_loss(params, tokens, softmax, NamedSharding(mesh, P("data", "seq", None)))
    with pytest.raises(ValueError, match="NamedSharding"):
        _sharded_loss(params, tokens, softmax, P("data"))


def test_adamw_step_matches_formula_and_training_lowers_loss():
    tx = training.adamw(0.01, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=None)
    params = {"w": jnp.array([[1.0, -2.0]]), "b": jnp.array([0.5])}
    grads = {"w": jnp.array([[0.1, 0.2]]), "b": jnp.array([-0.3])}
    updates, state = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    # First step: m_hat = g, v_hat = g^2, so the update is lr * (sign(g) + wd * p) (p matrices).
    np.testing.assert_allclose(new["w"], [[1.0 - 0.01 * (1 + 0.1), -2.0 - 0.01 * (1 - 0.2)]],
                               rtol=1e-6)
    np.testing.assert_allclose(new["b"], [0.5 + 0.01], rtol=1e-6)
    assert int(optax.tree_utils.tree_get(state, "count")) == 1

    model = _config("simple_gla")
    params = lm.init(jax.random.key(11), model)
    tx = training.adamw(3e-3)  # the defaults: clip 1.0, weight decay 0.1 on matrices
    opt = tx.init(params)
    tokens = jnp.tile(jnp.arange(8, dtype=jnp.int32)[None], (B, 4))  # a periodic sequence

    @jax.jit
    def train_step(params, opt):
        loss, grads = jax.value_and_grad(functools.partial(_loss, cfg=model))(params, tokens)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    losses = []
    for _ in range(15):
        params, opt, loss = train_step(params, opt)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses


def _load_bench():
    path = Path(__file__).resolve().parents[2] / "bench" / "associative_recall.py"
    spec = importlib.util.spec_from_file_location("associative_recall", path)
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_associative_recall_data_and_script(tmp_path, capsys):
    bench = _load_bench()
    task = bench.Task(num_keys=16, num_values=8, num_pairs=6, num_queries=4)
    inputs, targets, weights = bench.make_batch(np.random.default_rng(0), task, 3)
    assert inputs.shape == targets.shape == weights.shape == (3, task.seq_len)
    for row in range(3):
        pairs = dict(zip(inputs[row, 0:12:2], inputs[row, 1:12:2]))
        assert len(pairs) == 6 and all(k < 16 <= v < 24 for k, v in pairs.items())
        scored = np.flatnonzero(weights[row])
        assert len(scored) == 4
        for t in scored:  # each scored input is a queried key whose target is its value
            assert targets[row, t] == pairs[inputs[row, t]]
    with pytest.raises(ValueError):
        bench.Task(num_keys=4, num_values=4, num_pairs=5, num_queries=2)

    out = tmp_path / "r.json"
    report = bench.main(["--kinds", "linear", "--steps", "2", "--batch", "4", "--eval-batches", "1",
                         "--num-pairs", "4", "--num-queries", "2", "--json", str(out)])
    assert "| linear |" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["results"][0]["kind"] == "linear" == report["results"][0]["kind"]
    assert 0.0 <= saved["results"][0]["accuracy"] <= 1.0
