"""`fla_checkpoint.from_fla` against flash-linear-attention's own logits.

The fixtures (tests/fixtures/fla/, made by scripts/gpu_fla_fixtures.py with fla 0.6 on a GPU) hold
tiny fla models (d_model 64, vocab 256, unit-scale weights) saved by `save_pretrained`, and fla's
float32 logits on fixed tokens: T = 40 from fla's fused_recurrent kernels (exact float32) and
T = 100 from its chunked Triton kernels, whose dot products run in TF32. Also: the loaded
structure, the tied head, the reader's dtypes and shards, and the refusals.
"""

from __future__ import annotations

import copy
import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from gla_tpu.layers import fla_checkpoint, lm
from gla_tpu.testing import relative_rms_error
from gla_tpu.testing.tolerance import FLOAT32_MAX_RELATIVE_RMS

FIXTURES = Path(__file__).parent.parent / "fixtures" / "fla"
# Relative RMS error of our float32 logits against fla's. T = 40: both sides compute in float32;
# measured 0.6e-6 .. 1.5e-6, the size of float32 rounding (our float32 forward differs from our
# float64 one by 4e-7 .. 7e-7); the bound is the float32 criterion 1e-5, 7x the largest.
# T = 100: fla's chunked kernels round the dot products' inputs to TF32 (unit roundoff
# 2^-11 = 4.9e-4); measured 3.1e-4 .. 5.0e-4, evenly over the positions; 2e-3 is 4x the
# largest, and far below what a wrong mapping gives (O(1)).
BOUNDS = {40: FLOAT32_MAX_RELATIVE_RMS, 100: 2e-3}
MODELS = ("gla", "gated_deltanet", "kda", "delta_net")
CASES = [(m, 40) for m in MODELS] + [(m, 100) for m in ("gla", "gated_deltanet", "kda")]


@functools.cache
def _load(model):
    """(config, params, jitted apply) of a fixture, once per model."""
    cfg, params = fla_checkpoint.from_fla(FIXTURES / model, backend="xla")
    return cfg, params, jax.jit(functools.partial(lm.apply, config=cfg))


def _write_safetensors(path, tensors):
    """A .safetensors file of {name: numpy array} (F64, F32, F16 or BF16)."""
    names = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32",
             np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16"}
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, x in tensors.items():
        raw = np.ascontiguousarray(x).astype(x.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": names[x.dtype], "shape": list(x.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    Path(path).write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def _fixture_config(model):
    return json.loads((FIXTURES / model / "config.json").read_text())


def _fixture_tensors(model):
    return fla_checkpoint.read_safetensors(FIXTURES / model / "model.safetensors")


def _model_dir(tmp_path, config, tensors=None, source="delta_net"):
    """A model directory with `config` and `tensors` (None: the source fixture's file)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if tensors is None:
        shutil.copy(FIXTURES / source / "model.safetensors", tmp_path / "model.safetensors")
    else:
        _write_safetensors(tmp_path / "model.safetensors", tensors)
    return tmp_path


@pytest.mark.parametrize("model, t", CASES)
def test_logits_match_fla(model, t):
    _, params, apply = _load(model)
    tokens = np.load(FIXTURES / model / f"tokens_{t}.npy")
    expected = np.load(FIXTURES / model / f"logits_{t}.npy")
    logits, _ = apply(params, jnp.asarray(tokens))
    assert logits.shape == expected.shape == (2, t, 256)
    assert relative_rms_error(logits, expected) <= BOUNDS[t]


def test_loaded_structure_and_layout():
    """The hybrid's layers, fla's MLP width and norm eps, params shaped as lm.init's, and the
    layouts: linear weights transposed, convolutions [C, 1, w] -> [w, C]."""
    cfg, params, _ = _load("gated_deltanet")
    assert cfg.layer_kinds == ("gated_deltanet", "softmax", "gated_deltanet")
    soft = cfg.block_config(1).attention_config()
    assert (soft.num_heads, soft.kv_heads, soft.dim, soft.window, soft.rope_base) == (
        4, 2, 16, 16, 10000.0)
    gdn = cfg.block_config(0)
    assert (gdn.mlp_hidden, gdn.norm_eps, gdn.head_dim, gdn.num_v_heads) == (256, 1e-6, 32, 4)
    assert not cfg.tie_embeddings and cfg.dtype == "float32"
    shapes = jax.eval_shape(lambda: lm.init(jax.random.key(0), cfg))
    assert jax.tree.structure(params) == jax.tree.structure(shapes)
    for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(shapes), strict=True):
        assert p.shape == s.shape and p.dtype == jnp.float32
    fla = _fixture_tensors("gated_deltanet")
    attn = params["blocks"][0]["attn"]
    np.testing.assert_array_equal(attn["q_proj"], fla["model.layers.0.attn.q_proj.weight"].T)
    np.testing.assert_array_equal(attn["v_conv1d"]["weight"],
                                  fla["model.layers.0.attn.v_conv1d.weight"][:, 0, :].T)
    np.testing.assert_array_equal(params["blocks"][1]["attn"]["wk"],
                                  fla["model.layers.1.attn.k_proj.weight"].T)
    np.testing.assert_array_equal(params["head"], fla["lm_head.weight"].T)


def test_tied_head_is_the_unscaled_embedding(tmp_path):
    """tie_word_embeddings: logits = x embeddings^T (no 1/sqrt(d)), equal to the untied model
    whose head is the embedding; a saved lm_head.weight must equal the embedding."""
    config = {**_fixture_config("delta_net"), "tie_word_embeddings": True}
    tensors = _fixture_tensors("delta_net")
    del tensors["lm_head.weight"]
    cfg, params = fla_checkpoint.from_fla(_model_dir(tmp_path, config, tensors), backend="xla")
    assert cfg.tie_embeddings and cfg.head_scale == 1.0 and "head" not in params
    _, untied, apply = _load("delta_net")
    tokens = jnp.asarray(np.load(FIXTURES / "delta_net" / "tokens_40.npy"))
    expected, _ = apply({**untied, "head": untied["embed"].T}, tokens)
    logits, _ = jax.jit(functools.partial(lm.apply, config=cfg))(params, tokens)
    # The same computation in two programs: equal up to XLA's choices of fusion.
    assert relative_rms_error(logits, expected) <= 1e-6
    tensors["lm_head.weight"] = tensors["model.embeddings.weight"]
    assert "head" not in fla_checkpoint.lm_params(tensors, config, cfg)
    tensors["lm_head.weight"] = tensors["model.embeddings.weight"] + 1.0
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        fla_checkpoint.lm_params(tensors, config, cfg)


def test_reader_dtypes_and_shards(tmp_path):
    """F64, F16 and BF16 read exactly; a sharded checkpoint (index.json) in bfloat16 loads as the
    float32 values of its bfloat16 weights."""
    rng = np.random.default_rng(0)
    tensors = {f"t_{np.dtype(t).name}": rng.normal(size=(3, 5)).astype(t)
               for t in (np.float64, np.float16, ml_dtypes.bfloat16)}
    _write_safetensors(tmp_path / "one.safetensors", tensors)
    read = fla_checkpoint.read_safetensors(tmp_path / "one.safetensors")
    for name, x in tensors.items():
        assert read[name].dtype == x.dtype
        np.testing.assert_array_equal(read[name], x)

    fla = {k: v.astype(ml_dtypes.bfloat16) for k, v in _fixture_tensors("delta_net").items()}
    names = sorted(fla)
    shards = {"model-00001-of-00002.safetensors": names[:10],
              "model-00002-of-00002.safetensors": names[10:]}
    weight_map = {}
    for shard, keys in shards.items():
        _write_safetensors(tmp_path / shard, {k: fla[k] for k in keys})
        weight_map.update(dict.fromkeys(keys, shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(_fixture_config("delta_net")))
    (tmp_path / "one.safetensors").unlink()
    _, params = fla_checkpoint.from_fla(tmp_path)
    np.testing.assert_array_equal(params["embed"],
                                  fla["model.embeddings.weight"].astype(np.float32))


def test_missing_unexpected_and_misshapen_tensors_are_listed(tmp_path):
    tensors = _fixture_tensors("delta_net")
    del tensors["model.layers.1.attn.b_proj.weight"]
    tensors["model.layers.0.attn.extra.weight"] = np.zeros((2, 2), np.float32)
    tensors["model.layers.0.attn.o_norm.weight"] = np.ones((16,), np.float32)
    path = _model_dir(tmp_path, _fixture_config("delta_net"), tensors)
    with pytest.raises(ValueError, match="missing model.layers.1.attn.b_proj.weight") as info:
        fla_checkpoint.from_fla(path)
    message = str(info.value)
    assert "unexpected model.layers.0.attn.extra.weight" in message
    assert "model.layers.0.attn.o_norm.weight has shape [16]; expected [32]" in message


def test_unknown_model_type_is_refused(tmp_path):
    path = _model_dir(tmp_path, {**_fixture_config("delta_net"), "model_type": "mamba"})
    with pytest.raises(ValueError, match="model_type='mamba' is not supported"):
        fla_checkpoint.from_fla(path)


def _changed(model, **fields):
    return {**copy.deepcopy(_fixture_config(model)), **fields}


def _attn(**fields):
    return {"layers": [1], "num_heads": 4, "num_kv_heads": 2, "window_size": 16, **fields}


@pytest.mark.parametrize("config, match", [
    (_changed("kda", safe_gate=True, lower_bound=-5.0), "safe_gate=True"),
    (_changed("kda", lower_bound=-5.0), "lower_bound=-5.0"),
    (_changed("gla", hidden_act="powlu"), "hidden_act='powlu'"),
    (_changed("gla", feature_map="sqrelu"), "feature_map='sqrelu'"),
    (_changed("delta_net", attnres_block_size=2), "attnres_block_size=2"),
    (_changed("gated_deltanet", output_gate_activation="sigmoid"),
     "output_gate_activation='sigmoid'"),
    (_changed("gated_deltanet", attn=_attn(qkv_bias=True)), "attn.qkv_bias=True"),
    (_changed("gated_deltanet", attn=[_attn(qk_norm=True)]), r"attn\[0\] has keys \['qk_norm'\]"),
    (_changed("gated_deltanet", attn=_attn(layers=[3])), "attn.layers=\\[3\\]"),
    (_changed("gated_deltanet", num_v_heads=3), "num_v_heads"),
])
def test_inexpressible_configs_are_refused(config, match):
    with pytest.raises(ValueError, match=match):
        fla_checkpoint.lm_config(config)


def test_layer_options_reach_the_layers(tmp_path):
    """fla options beyond block's fields go through block.Config.attention_options: GLA without
    its output gate (no g_proj), DeltaNet without beta and with the sum norm (no b_proj)."""
    tensors = _fixture_tensors("gla")
    for i in range(2):
        del tensors[f"model.layers.{i}.attn.g_proj.weight"]
    cfg, params = fla_checkpoint.from_fla(
        _model_dir(tmp_path / "gla", _changed("gla", use_output_gate=False), tensors))
    assert not cfg.block.attention_config().use_output_gate
    assert "w_out_gate" not in params["blocks"][0]["attn"]

    tensors = _fixture_tensors("delta_net")
    for i in range(2):
        del tensors[f"model.layers.{i}.attn.b_proj.weight"]
    config = _changed("delta_net", use_beta=False, qk_norm="sum", qk_activation="relu")
    cfg, _ = fla_checkpoint.from_fla(_model_dir(tmp_path / "dn", config, tensors))
    layer = cfg.block.attention_config()
    assert (layer.use_beta, layer.qk_norm, layer.qk_activation) == (False, "sum", "relu")
