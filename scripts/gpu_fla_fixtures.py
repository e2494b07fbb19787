"""Makes the fla checkpoint fixtures of tests/layers/test_fla_checkpoint.py, on a GPU machine with
torch, triton, transformers and fla 0.6 (`pip download --no-deps fla-core flash-linear-attention`).

For each model (GLA with short convolutions; Gated DeltaNet with grouped value heads and a
sliding-window softmax layer; KDA; DeltaNet): a tiny fla model (d_model 64, vocab 256), its
weights drawn at unit scale (fla's own init, normal(0, 0.02), would leave the logits near
uniform and the comparison weak), saved with `save_pretrained` (config.json, model.safetensors),
and fla's float32 logits on fixed tokens: T = 40 (fla's layers run their fused_recurrent kernels
at T <= 64 in eval mode) and T = 100 (chunked kernels; DeltaNet's chunked kernel refuses float32,
so its fixture has T = 40 only). fla's softmax attention layer calls
flash-attn, which the machine lacks: a plain PyTorch stand-in with flash-attn's signature and
window rule (keys i - (w - 1) .. i) takes its place.

    python3 scripts/gpu_fla_fixtures.py OUT_DIR
"""

import json
import os
import sys

import numpy as np
import torch


def _attention(q, k, v, causal=True, window_size=(-1, -1), softmax_scale=None, **_):
    """flash_attn_func's meaning, in PyTorch: q [B, T, H, D], k, v [B, S, Hkv, D]."""
    b, t, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // hkv, dim=2)
    v = v.repeat_interleave(h // hkv, dim=2)
    scale = softmax_scale or d ** -0.5
    scores = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * scale
    i = torch.arange(t, device=q.device)[:, None] + (s - t)
    j = torch.arange(s, device=q.device)[None, :]
    visible = j <= i if causal else torch.ones_like(j <= i)
    left = window_size[0]
    if left >= 0:
        visible = visible & (j >= i - left)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v.float()).to(q.dtype)


def _draw(model, seed):
    """Unit-scale weights: matrices normal(0, 1 / fan_in) (embeddings normal(0, 1)), convolution
    kernels normal(0, 0.5), vectors (norm scales, A_log, dt_bias, biases) + normal(0, 0.1)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "embeddings" in name:
                value = noise
            elif p.dim() == 2:
                value = noise * p.shape[1] ** -0.5
            elif p.dim() == 3:
                value = noise * 0.5
            else:
                value = p.detach().cpu() + 0.1 * noise
            p.copy_(value.to(p.dtype))


def patch_flash_attn():
    """fla's softmax attention layer calls flash_attn_func: our stand-in takes its place."""
    import fla.layers.attn as fla_attn

    fla_attn.flash_attn_func = _attention


def model_configs(hidden_size=64, vocab_size=256, num_heads=2, head_dim=32, window_size=16):
    """The four fla configs {name: config}; the defaults are the fixtures' (tiny) models. The
    hybrid's softmax layer has 4 heads, 2 kv heads (head_dim hidden_size // 4)."""
    from fla.models import DeltaNetConfig, GatedDeltaNetConfig, GLAConfig, KDAConfig

    common = dict(hidden_size=hidden_size, vocab_size=vocab_size, fuse_norm=False,
                  fuse_swiglu=False, fuse_cross_entropy=False, tie_word_embeddings=False)
    return {
        "gla": GLAConfig(num_hidden_layers=2, num_heads=num_heads, use_short_conv=True, **common),
        "gated_deltanet": GatedDeltaNetConfig(
            num_hidden_layers=3, num_heads=num_heads, num_v_heads=2 * num_heads,
            head_dim=head_dim, expand_v=1.0,
            attn={"layers": [1], "num_heads": 4, "num_kv_heads": 2, "window_size": window_size},
            **common),
        "kda": KDAConfig(num_hidden_layers=2, num_heads=num_heads, head_dim=head_dim, **common),
        "delta_net": DeltaNetConfig(num_hidden_layers=2, num_heads=num_heads, **common),
    }


def build(config, i):
    """fla's float32 model of `config` with unit-scale weights (seeds i and 100 + i), on the GPU,
    in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(i)
    model = AutoModelForCausalLM.from_config(config).float()
    _draw(model, seed=100 + i)
    return model.cuda().eval()


def main(out):
    patch_flash_attn()
    models = model_configs()
    gen = torch.Generator(device="cpu").manual_seed(0)
    summary = {}
    for i, (name, config) in enumerate(models.items()):
        model = build(config, i)
        folder = os.path.join(out, name)
        model.save_pretrained(folder, safe_serialization=True)
        for t in (40,) if name == "delta_net" else (40, 100):
            tokens = torch.randint(0, 256, (2, t), generator=gen)
            with torch.no_grad():
                logits = model(input_ids=tokens.cuda(), use_cache=False).logits.float().cpu()
            np.save(os.path.join(folder, f"tokens_{t}.npy"), tokens.numpy().astype(np.int32))
            np.save(os.path.join(folder, f"logits_{t}.npy"), logits.numpy())
            summary[f"{name}_{t}"] = float(logits.std())
        print(name, sorted(os.listdir(folder)), flush=True)
    import fla

    summary["fla"] = fla.__version__
    summary["torch"] = torch.__version__
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1])
