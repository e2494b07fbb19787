"""Loading flash-linear-attention (fla) checkpoints into `layers.lm`.

`from_fla(path)` reads a model directory as fla's `save_pretrained` writes it (config.json and
model.safetensors, or model.safetensors.index.json with its shards) for the model types "gla",
"gated_deltanet", "kda" and "delta_net", fla's hybrids included (config "attn": the layers it
lists run fla's softmax `Attention` instead of the model's own mixer), and returns an lm.Config
and float32 params whose `lm.apply` computes fla's logits:

    cfg, params = from_fla("path/to/model", dtype="float32")
    logits, _ = lm.apply(params, tokens, cfg)      # tokens [B, T] int -> [B, T, vocab] float32

fla's model: embeddings [vocab, d]; per layer x + attn(attn_norm(x)), then + mlp(mlp_norm(.));
a final norm; lm_head. Where it differs from our defaults, the Config says fla's choice:
  every RMSNorm's eps        config norm_eps (fla's default 1e-6)    block.Config.norm_eps
  GatedMLP (SwiGLU) width    intermediate_size, or int(d hidden_ratio 2/3) rounded up to a
                             multiple of 256                          block.Config.mlp_hidden
  tied head                  logits = x embeddings^T, unscaled       lm.Config.tied_head_scale=1
  layer options beyond       gla use_output_gate; gated_deltanet use_gate; delta_net use_gate,
  block's fields             use_beta, qk_activation, qk_norm        block.Config.attention_options
  hybrid "attn" layers       softmax blocks: head_dim d // num_heads, num_kv_heads, rope_theta,
                             window_size w (flash-attn's (w-1, 0): keys i-w+1..i) = our window w;
                             each layer its own block.Config in lm.Config.layer_pattern

Tensors: `model.embeddings.weight` -> embed (as is); `model.norm.weight` -> final_norm["scale"];
`lm_head.weight` [vocab, d] -> head [d, vocab]; `model.layers.{i}.` + `attn_norm.weight`,
`mlp_norm.weight` -> {"scale"}, `mlp.{gate,up,down}_proj.weight` -> mlp w_gate, w_up, w_down,
`attn.*` -> the layer's params by the tables in its module docstring. Every nn.Linear weight
[out, in] becomes ours [in, out]; a short convolution's [C, 1, w] becomes [w, C].

Refused with a ValueError naming the config.json field, its value and what is accepted: other
model types; hidden_act other than "swish"; attnres_block_size; KDA safe_gate / lower_bound;
gated_deltanet output_gate_activation "sigmoid"; GLA feature maps other than relu and swish;
attn specs with qkv_bias true, qk_norm or keys fla 0.6 does not define. Missing, unexpected or
misshapen tensors: a ValueError listing them. Settings that do not change the forward (fuse_*,
attn_mode, use_l2warp, use_cache, max_position_embeddings, initializer_range, token ids) are
ignored, and so are fields fla's model classes never read (GLA use_gk / use_gv, DeltaNet
use_output_norm).
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from gla_tpu.layers import block, lm

# fla model_type -> our attention kind.
MODEL_TYPES = {"gla": "gla", "gated_deltanet": "gated_deltanet", "kda": "kda",
               "delta_net": "deltanet"}
# safetensors dtype names -> numpy dtypes.
SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
                      "BF16": ml_dtypes.bfloat16}

# fla 0.6's configuration defaults of the fields read here.
_COMMON_DEFAULTS = {
    "hidden_size": 2048, "vocab_size": 32000, "hidden_ratio": 4, "intermediate_size": None,
    "hidden_act": "swish", "norm_eps": 1e-6, "attn": None, "tie_word_embeddings": False,
    "fuse_norm": True, "attnres_block_size": None,
}
_DEFAULTS = {
    "gla": {"num_hidden_layers": 24, "num_heads": 4, "num_kv_heads": None, "expand_k": 0.5,
            "expand_v": 1.0, "feature_map": None, "use_short_conv": False, "conv_size": 4,
            "use_output_gate": True, "clamp_min": None, "elementwise_affine": True},
    "gated_deltanet": {"num_hidden_layers": 21, "num_heads": 6, "num_v_heads": None,
                       "head_dim": 256, "expand_v": 2.0, "use_gate": True,
                       "use_short_conv": True, "conv_size": 4, "allow_neg_eigval": False,
                       "output_gate_activation": "swish"},
    "kda": {"num_hidden_layers": 24, "num_heads": 16, "num_v_heads": None, "head_dim": 128,
            "expand_v": 1.0, "use_short_conv": True, "conv_size": 4, "allow_neg_eigval": False,
            "safe_gate": False, "lower_bound": None},
    "delta_net": {"num_hidden_layers": 24, "num_heads": 16, "expand_k": 1.0, "expand_v": 1.0,
                  "use_gate": False, "use_beta": True, "use_short_conv": True, "conv_size": 4,
                  "allow_neg_eigval": False, "qk_activation": "silu", "qk_norm": "l2"},
}
# fla's GLA feature maps (fla.modules.activations.ACT2FN names) -> ours.
_GLA_FEATURE_MAPS = {None: None, "relu": "relu", "swish": "swish", "silu": "swish"}
_ATTN_SPEC_KEYS = ("layers", "num_heads", "num_kv_heads", "qkv_bias", "window_size", "rope_theta")
# Our parameter names -> fla's module names, where they differ.
_RENAMES = {
    "softmax": {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"},
    "gla": {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
            "w_gate_a": "gk_proj.0", "w_gate_b": "gk_proj.1", "b_gate": "gk_proj.1.bias",
            "w_out_gate": "g_proj"},
    "kda": {"f_proj_a": "f_proj.0", "f_proj_b": "f_proj.1", "g_proj_a": "g_proj.0",
            "g_proj_b": "g_proj.1", "g_proj_bias": "g_proj.1.bias"},
    "mlp": {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"},
}


def from_fla(path, *, dtype: str = "float32", backend: str = "auto"):
    """An fla model directory as our LM.

    Args:
      path: the directory `save_pretrained` wrote: config.json and model.safetensors (or
        model.safetensors.index.json and the shards it names).
      dtype: the activations' dtype, lm.Config.dtype ("float32" to compare with fla in float32).
      backend: the ops' backend for every layer, block.Config.backend.
    Returns:
      (lm.Config, params): params float32 jax arrays laid out as `lm.init` makes them.

    Example:
      >>> cfg, params = from_fla("tests/fixtures/fla/gla", backend="xla")
      >>> logits, _ = lm.apply(params, jnp.zeros((1, 8), jnp.int32), cfg)  # [1, 8, vocab]
    """
    path = os.fspath(path)
    with open(os.path.join(path, "config.json")) as f:
        fla_config = json.load(f)
    config = lm_config(fla_config, dtype=dtype, backend=backend)
    return config, lm_params(_read_checkpoint(path), fla_config, config)


def lm_config(fla_config: dict, *, dtype: str = "float32", backend: str = "auto") -> lm.Config:
    """The lm.Config of an fla model from its config.json contents (ValueError naming a field
    whose value we cannot express)."""
    fields = _Fields(fla_config)
    d = fields["hidden_size"]
    fields.require("hidden_act", ("swish",))
    fields.require("attnres_block_size", (None,))
    shared = {"d_model": d, "norm_eps": float(fields["norm_eps"]), "backend": backend,
              "mlp_hidden": _mlp_hidden(d, fields["hidden_ratio"], fields["intermediate_size"])}
    num_layers = fields["num_hidden_layers"]
    specs = _attention_specs(fields["attn"], num_layers)
    native = _native_block(fields, shared)
    blocks = [native if i not in specs else _softmax_block(specs[i], shared)
              for i in range(num_layers)]
    try:
        return lm.Config(
            vocab_size=fields["vocab_size"], num_layers=num_layers,
            block=native,
            tie_embeddings=bool(fields["tie_word_embeddings"]), tied_head_scale=1.0,
            dtype=dtype, layer_pattern=tuple(blocks) if specs else None)
    except ValueError as e:
        raise ValueError(f"config.json gives a model we cannot build: {e}") from e


def lm_params(tensors: dict, fla_config: dict, config: lm.Config):
    """Our params from fla's tensors {name: array}: float32 jax arrays shaped as `lm.init`'s.

    ValueError listing the missing, unexpected and misshapen tensors.
    """
    shapes = jax.eval_shape(lambda: lm.init(jax.random.key(0), config))
    fields = _Fields(fla_config)
    reader = _Reader(tensors)
    params = {"embed": reader.take("model.embeddings.weight", shapes["embed"].shape),
              "final_norm": {"scale": reader.take("model.norm.weight", (config.d_model,))}}
    if "head" in shapes:
        params["head"] = reader.take("lm_head.weight", shapes["head"].shape, "linear")
    elif "lm_head.weight" in tensors:
        # A tied head saved anyway must be the embedding itself.
        head = reader.take("lm_head.weight", shapes["embed"].shape)
        if head is not None and not np.array_equal(head, params["embed"]):
            reader.errors.append("lm_head.weight differs from model.embeddings.weight, but "
                                 "config.json's tie_word_embeddings is true")
    params["blocks"] = [
        _block_params(reader, f"model.layers.{i}.", shapes["blocks"][i],
                      config.block_config(i), fields)
        for i in range(config.num_layers)]
    reader.check_done()
    return jax.tree.map(jnp.asarray, params)


def read_safetensors(path) -> dict:
    """{name: numpy array} of a .safetensors file, in the stored dtype (F64, F32, F16, BF16).

    The format: an 8-byte little-endian header length n, n bytes of JSON
    {name: {"dtype", "shape", "data_offsets": [begin, end]}} (and "__metadata__"), then the
    tensors' little-endian bytes, offsets counted from the end of the header.
    """
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path} is not a safetensors file: {len(data)} bytes.")
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):
        raise ValueError(f"{path}: header length {n} runs past the file's {len(data)} bytes.")
    header = json.loads(data[8:8 + n])
    body = memoryview(data)[8 + n:]
    return {name: _tensor(body, name, info, path)
            for name, info in header.items() if name != "__metadata__"}


def _tensor(body, name: str, info: dict, path):
    if info["dtype"] not in SAFETENSORS_DTYPES:
        raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']!r}; accepted: "
                         f"{tuple(SAFETENSORS_DTYPES)}.")
    dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]])
    shape = tuple(info["shape"])
    begin, end = info["data_offsets"]
    count = math.prod(shape)
    if end - begin != count * dtype.itemsize or end > len(body):
        raise ValueError(f"{path}: tensor {name} of shape {shape} and dtype {info['dtype']} "
                         f"does not fit its data_offsets {[begin, end]} ({len(body)} bytes).")
    # Little-endian unsigned words, made native, then read as the dtype (bfloat16 included).
    raw = np.frombuffer(body, dtype=f"<u{dtype.itemsize}", count=count, offset=begin)
    return raw.astype(f"=u{dtype.itemsize}").view(dtype).reshape(shape)


def _read_checkpoint(path: str) -> dict:
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return read_safetensors(single)
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        raise ValueError(f"{path} holds neither model.safetensors nor "
                         "model.safetensors.index.json.")
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for shard in shards:
        tensors.update(read_safetensors(os.path.join(path, shard)))
    return tensors


class _Fields:
    """config.json's fields, each with fla 0.6's default where the file leaves it out."""

    def __init__(self, fla_config: dict):
        self.raw = fla_config
        model_type = fla_config.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"config.json field model_type={model_type!r} is not supported; "
                             f"accepted: {tuple(MODEL_TYPES)}.")
        self.model_type = model_type
        self.defaults = {**_COMMON_DEFAULTS, **_DEFAULTS[model_type]}

    def __getitem__(self, name: str):
        return self.raw.get(name, self.defaults[name])

    def require(self, name: str, accepted: tuple) -> None:
        value = self[name]
        # Same type and value: True is not 1, False is not 0.
        if not any(type(value) is type(a) and value == a for a in accepted):
            raise ValueError(f"config.json field {name}={value!r} is not supported "
                             f"(model_type {self.model_type!r}); accepted: {accepted}.")


def _mlp_hidden(d: int, hidden_ratio, intermediate_size) -> int:
    """fla's GatedMLP width: intermediate_size, or int(d * hidden_ratio * 2/3) rounded up to a
    multiple of 256 (hidden_ratio None: 4)."""
    if intermediate_size is not None:
        return intermediate_size
    ratio = 4 if hidden_ratio is None else hidden_ratio
    return 256 * -(-int(d * ratio * 2 / 3) // 256)


def _native_block(fields: _Fields, shared: dict) -> block.Config:
    """The block of the model's own mixer."""
    model_type = fields.model_type
    common = {"num_heads": fields["num_heads"], "attention": MODEL_TYPES[model_type],
              "use_short_conv": fields["use_short_conv"], "conv_size": fields["conv_size"],
              "expand_v": float(fields["expand_v"]), **shared}
    return _block(fields, **common, **_LAYER_FIELDS[model_type](fields))


def _gla_fields(fields: _Fields) -> dict:
    fields.require("feature_map", tuple(_GLA_FEATURE_MAPS))
    # fla's GLABlock leaves the layer's gate_logit_normalizer (16) and gate_low_rank_dim (16) at
    # their defaults, which are ours.
    return {"num_kv_heads": fields["num_kv_heads"], "expand_k": float(fields["expand_k"]),
            "clamp_min": fields["clamp_min"],
            "feature_map": _GLA_FEATURE_MAPS[fields["feature_map"]],
            "gate_logit_normalizer": 16.0,
            "attention_options": (("use_output_gate", fields["use_output_gate"]),)}


def _gated_deltanet_fields(fields: _Fields) -> dict:
    fields.require("output_gate_activation", ("swish", "silu"))
    return {"head_dim": fields["head_dim"], "num_v_heads": fields["num_v_heads"],
            "allow_neg_eigval": fields["allow_neg_eigval"],
            "attention_options": (("use_gate", fields["use_gate"]),)}


def _kda_fields(fields: _Fields) -> dict:
    fields.require("safe_gate", (False,))
    fields.require("lower_bound", (None,))
    return {"head_dim": fields["head_dim"], "num_v_heads": fields["num_v_heads"],
            "allow_neg_eigval": fields["allow_neg_eigval"]}


def _delta_net_fields(fields: _Fields) -> dict:
    options = ("qk_activation", "qk_norm", "use_beta", "use_gate")
    return {"expand_k": float(fields["expand_k"]),
            "allow_neg_eigval": fields["allow_neg_eigval"],
            "attention_options": tuple((name, fields[name]) for name in options)}


_LAYER_FIELDS = {"gla": _gla_fields, "gated_deltanet": _gated_deltanet_fields,
                 "kda": _kda_fields, "delta_net": _delta_net_fields}


def _softmax_block(spec: dict, shared: dict) -> block.Config:
    """fla's `Attention` layer: head_dim = hidden_size // num_heads, RoPE (half-split, positions
    from 0), an optional sliding window of `window_size` keys (the query's own included)."""
    num_heads = spec["num_heads"]
    return block.Config(num_heads=num_heads, attention="softmax",
                        num_kv_heads=spec.get("num_kv_heads") or num_heads,
                        head_dim=shared["d_model"] // num_heads,
                        rope_base=float(spec.get("rope_theta", 10000.0)),
                        window=spec.get("window_size"), **shared)


def _block(fields: _Fields, **kwargs) -> block.Config:
    try:
        return block.Config(**kwargs)
    except ValueError as e:
        raise ValueError(f"config.json (model_type {fields.model_type!r}) gives a layer we "
                         f"cannot build: {e}") from e


def _attention_specs(attn, num_layers: int) -> dict:
    """{layer index: its attn spec} from config.json's "attn" (None, a dict or a list of dicts)."""
    if attn is None:
        return {}
    specs = [attn] if isinstance(attn, dict) else attn
    if not isinstance(specs, list) or not all(isinstance(s, dict) for s in specs):
        raise ValueError(f"config.json field attn={attn!r} must be null, a dict or a list of "
                         "dicts.")
    by_layer = {}
    for i, spec in enumerate(specs):
        where = "attn" if isinstance(attn, dict) else f"attn[{i}]"
        absent = [key for key in ("layers", "num_heads") if key not in spec]
        if absent:
            raise ValueError(f"config.json field {where}={spec!r} lacks {absent}, which fla "
                             "requires.")
        unknown = sorted(set(spec) - set(_ATTN_SPEC_KEYS))
        if unknown:
            raise ValueError(f"config.json field {where} has keys {unknown} (e.g. "
                             f"{unknown[0]}={spec[unknown[0]]!r}); accepted keys: "
                             f"{_ATTN_SPEC_KEYS}.")
        if spec.get("qkv_bias", False):
            raise ValueError(f"config.json field {where}.qkv_bias={spec['qkv_bias']!r} is not "
                             "supported (our softmax attention has no projection biases); "
                             "accepted: False.")
        for layer in spec["layers"]:
            if not isinstance(layer, int) or not 0 <= layer < num_layers or layer in by_layer:
                raise ValueError(f"config.json field {where}.layers={spec['layers']!r}: each "
                                 f"must be a layer index in [0, {num_layers}), once.")
            by_layer[layer] = spec
    return by_layer


class _Reader:
    """Takes fla's tensors by name as float32 numpy arrays, noting what is missing, misshapen
    and (at the end) left over."""

    def __init__(self, tensors: dict):
        self.tensors = tensors
        self.taken = set()
        self.errors = []

    def take(self, name: str, shape: tuple, layout: str = "as_is"):
        """The tensor `name` as ours of `shape`: layout "as_is", "linear" (fla [out, in] -> ours
        [in, out]) or "conv" (fla [C, 1, w] -> ours [w, C]); None if missing or misshapen."""
        if name not in self.tensors:
            self.errors.append(f"missing {name}")
            return None
        self.taken.add(name)
        x = np.asarray(self.tensors[name], np.float32)
        shape = tuple(shape)
        expected = {"as_is": shape, "linear": shape[::-1],
                    "conv": shape[1:] + (1,) + shape[:1]}[layout]
        if x.shape != tuple(expected):
            self.errors.append(f"{name} has shape {list(x.shape)}; expected {list(expected)}")
            return None
        if layout == "linear":
            return x.T
        if layout == "conv":
            return x[:, 0, :].T
        return x

    def check_done(self) -> None:
        unexpected = sorted(set(self.tensors) - self.taken)
        errors = self.errors + [f"unexpected {name}" for name in unexpected]
        if errors:
            raise ValueError("the checkpoint's tensors do not match its config.json: "
                             + "; ".join(errors) + ".")


def _block_params(reader: _Reader, prefix: str, shapes: dict, config: block.Config,
                  fields: _Fields) -> dict:
    d = config.d_model
    kind = config.attention
    renames = dict(_RENAMES.get(kind, {}))
    if kind == "gla":
        # fla's GLA names its output norm after whether it is fused with the swish gate.
        fused = fields["fuse_norm"] and fields["use_output_gate"]
        renames["norm"] = "g_norm_swish_gate" if fused else "g_norm"
    attn = {}
    for name, leaf in shapes["attn"].items():
        fla_name = prefix + "attn." + renames.get(name, name)
        if isinstance(leaf, dict):
            attn[name] = {sub: _sub_param(reader, fla_name, sub, s.shape, fields, kind)
                          for sub, s in leaf.items()}
        elif len(leaf.shape) == 2:
            attn[name] = reader.take(fla_name + ".weight", leaf.shape, "linear")
        else:
            attn[name] = reader.take(fla_name, leaf.shape)
    mlp = {name: reader.take(f"{prefix}mlp.{_RENAMES['mlp'][name]}.weight", s.shape, "linear")
           for name, s in shapes["mlp"].items()}
    return {"attn_norm": {"scale": reader.take(prefix + "attn_norm.weight", (d,))},
            "attn": attn,
            "mlp_norm": {"scale": reader.take(prefix + "mlp_norm.weight", (d,))},
            "mlp": mlp}


def _sub_param(reader: _Reader, module: str, sub: str, shape: tuple, fields: _Fields,
               kind: str):
    """A norm's "scale" (fla's `weight`) or a short convolution's "weight" / "bias"."""
    if sub == "scale":
        if kind == "gla" and not fields["elementwise_affine"]:
            # fla's GLA norm without elementwise_affine has no weight: a scale of ones.
            return np.ones(shape, np.float32)
        return reader.take(module + ".weight", shape)
    return reader.take(f"{module}.{sub}", shape, "conv" if sub == "weight" else "as_is")
