"""Writes the jaxprs (kernel bodies included) of the public ops' forward+backward for a sample of
configurations per backend, one text file each, so a refactor can be checked to change nothing:

    python scripts/jaxpr_snapshot.py OUT_BEFORE   # on the old commit
    python scripts/jaxpr_snapshot.py OUT_AFTER    # on the new one
    diff -r OUT_BEFORE OUT_AFTER

Only tracing, no execution: runs on a CPU in seconds. Where a refactor changes a jaxpr on purpose
(an equivalent comparison, a reordering), `--run NAME_FILTER` also executes the matching
configurations on fixed random inputs (Pallas kernels in interpret mode) and writes their values
and gradients to OUT/NAME.npz, to be compared bitwise between the two commits. Names of Python
functions that the jaxpr prints (custom_vjp rules, jitted helpers) are replaced by placeholders,
since a refactor may rename them without changing the computation.
"""

from __future__ import annotations

import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gla_tpu import ops  # noqa: E402
from gla_tpu.ops.attention.mosaic_tpu import BlockSizes as TpuAttentionBlocks  # noqa: E402
from gla_tpu.ops.attention.pallas_gpu import BlockSizes as GpuAttentionBlocks  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
RUN = False  # set by --run: execute instead of tracing


def _concrete(args):
    """Fixed random arrays for abstract arguments (None stays None)."""
    key = jax.random.key(0)
    out = []
    for i, a in enumerate(args):
        if a is None:
            out.append(None)
            continue
        x = jax.random.normal(jax.random.fold_in(key, i), a.shape, jnp.float32)
        if i == 3:  # gla's g: log gates <= 0
            x = jax.nn.log_sigmoid(x)
        out.append(x.astype(a.dtype))
    return out


def _trace_or_run(fn, args):
    if not RUN:
        return jax.make_jaxpr(fn)(*args)
    return jax.tree_util.tree_map(np.asarray, fn(*_concrete(args)))


def _attention(b, t, s, h, hkv, d, dtype, **kw):
    q = jax.ShapeDtypeStruct((b, t, h, d), dtype)
    kv = jax.ShapeDtypeStruct((b, s, hkv, d), dtype)
    seg = kw.pop("segments", None)

    def loss(q, k, v):
        segment_ids = None
        if seg == "pair":
            segment_ids = (jnp.arange(b * t, dtype=jnp.int32).reshape(b, t) % 3,
                           jnp.arange(b * s, dtype=jnp.int32).reshape(b, s) % 2)
        elif seg == "shared":
            segment_ids = jnp.arange(b * t, dtype=jnp.int32).reshape(b, t) // 7
        o = ops.flash_attention(q, k, v, segment_ids=segment_ids, **kw)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    return _trace_or_run(jax.value_and_grad(loss, argnums=(0, 1, 2)), [q, kv, kv])


def _gla(b, t, h, kd, vd, dtype, gate, *, s0=False, seg=False, forward_only=False, **kw):
    q = jax.ShapeDtypeStruct((b, t, h, kd), dtype)
    v = jax.ShapeDtypeStruct((b, t, h, vd), dtype)
    g = {"key": jax.ShapeDtypeStruct((b, t, h, kd), F32),
         "head": jax.ShapeDtypeStruct((b, t, h), F32), "none": None}[gate]
    state = jax.ShapeDtypeStruct((b, h, kd, vd), F32) if s0 else None

    def loss(q, k, v, g, state):
        segment_ids = (jnp.arange(b * t, dtype=jnp.int32).reshape(b, t) // 5) if seg else None
        o, final = ops.gla(q, k, v, g, initial_state=state, segment_ids=segment_ids,
                           output_final_state=True, **kw)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(final ** 2)

    args = [q, q, v, g, state]
    if forward_only:
        return _trace_or_run(loss, args)
    argnums = tuple(i for i, a in enumerate(args) if a is not None)
    return _trace_or_run(jax.value_and_grad(loss, argnums=argnums), args)


SMALL = TpuAttentionBlocks(block_q=128, block_kv=128, block_q_dq=128, block_kv_dq=128,
                           block_q_dkv=128, block_kv_dkv=128)
TPU = dict(backend="mosaic_tpu", interpret=True)
GPU = dict(backend="pallas_gpu", interpret=True)

CONFIGS = {
    "attn_xla_causal_gqa_pair": lambda: _attention(1, 100, 130, 4, 2, 64, F32, causal=True,
                                                   segments="pair", backend="xla"),
    "attn_xla_shared_bf16": lambda: _attention(2, 70, 70, 2, 2, 32, BF16, segments="shared",
                                               backend="xla"),
    "attn_tpu_causal_gqa_small": lambda: _attention(1, 100, 260, 4, 2, 64, F32, causal=True,
                                                    block_sizes=SMALL, **TPU),
    "attn_tpu_pair_d128_bf16": lambda: _attention(1, 129, 257, 4, 2, 128, BF16,
                                                  segments="pair", **TPU),
    "attn_tpu_d256_causal": lambda: _attention(1, 257, 257, 2, 1, 256, F32, causal=True, **TPU),
    "attn_gpu_d64_causal_seg": lambda: _attention(1, 100, 100, 2, 1, 64, BF16, causal=True,
                                                  segments="shared", **GPU),
    "attn_gpu_d128_gqa_f32": lambda: _attention(2, 65, 130, 4, 2, 128, F32, **GPU),
    "attn_gpu_d256_causal_bf16": lambda: _attention(1, 130, 100, 2, 2, 256, BF16, causal=True,
                                                    **GPU),
    "attn_gpu_mosaic_forward": lambda: _attention(
        1, 200, 200, 2, 1, 64, BF16, causal=True,
        block_sizes=GpuAttentionBlocks(forward_kernel="mosaic_gpu"), **GPU),
    "gla_xla_chunk_key_s0_seg": lambda: _gla(1, 100, 2, 32, 16, F32, "key", s0=True, seg=True,
                                             mode="chunk", backend="xla"),
    "gla_xla_chunk128_none_bf16": lambda: _gla(2, 130, 1, 16, 48, BF16, "none", mode="chunk",
                                               chunk_size=128, backend="xla"),
    "gla_xla_fused_chunk_head": lambda: _gla(1, 70, 2, 16, 16, F32, "head", seg=True,
                                             mode="fused_chunk", backend="xla"),
    "gla_xla_recurrent_head_seg": lambda: _gla(1, 20, 2, 16, 8, F32, "head", s0=True, seg=True,
                                               mode="fused_recurrent", backend="xla"),
    "gla_tpu_chunk_key_s0_seg": lambda: _gla(1, 100, 2, 64, 128, F32, "key", s0=True, seg=True,
                                             mode="chunk", **TPU),
    "gla_tpu_fused_chunk_head_bf16": lambda: _gla(2, 65, 1, 128, 64, BF16, "head", seg=True,
                                                  mode="fused_chunk", **TPU),
    "gla_tpu_chunk128_none": lambda: _gla(1, 130, 1, 128, 256, F32, "none", s0=True,
                                          mode="chunk", chunk_size=128, **TPU),
    "gla_tpu_recurrent_key_s0_seg": lambda: _gla(1, 40, 2, 64, 64, F32, "key", s0=True, seg=True,
                                                 mode="fused_recurrent", **TPU),
    "gla_tpu_recurrent_head_k192": lambda: _gla(1, 20, 1, 192, 128, BF16, "head",
                                                mode="fused_recurrent", **TPU),
    "gla_tpu_decode_key_s0": lambda: _gla(2, 1, 16, 128, 128, BF16, "key", s0=True,
                                          mode="fused_recurrent", **TPU),
    "gla_gpu_chunk_key_s0_seg_bf16": lambda: _gla(1, 100, 2, 64, 128, BF16, "key", s0=True,
                                                  seg=True, mode="chunk", **GPU),
    "gla_gpu_recurrent_head_f32": lambda: _gla(1, 70, 1, 128, 128, F32, "head",
                                               mode="fused_recurrent", **GPU),
    "gla_gpu_few_tokens_key_s0": lambda: _gla(2, 3, 2, 64, 64, BF16, "key", s0=True,
                                              mode="chunk", **GPU),
    "gla_gpu_none_wide": lambda: _gla(1, 64, 1, 256, 512, BF16, "none", mode="fused_chunk",
                                      **GPU),
}

# Printed names of Python callables, which a refactor may change without changing the program.
_RENAMEABLE = re.compile(r"\b(fwd|bwd|jvp|call_jaxpr|fun_jaxpr|name)=([A-Za-z_][\w.<>]*)")


def normalize(text: str) -> str:
    return _RENAMEABLE.sub(lambda m: f"{m.group(1)}=<fn>", text)


def main(argv) -> None:
    global RUN
    out_dir, rest = argv[0], argv[1:]
    only = None
    if rest and rest[0] == "--run":
        RUN, rest = True, rest[1:]
    if rest:
        only = rest[0]
    os.makedirs(out_dir, exist_ok=True)
    for name, build in CONFIGS.items():
        if only and only not in name:
            continue
        if RUN:
            leaves = jax.tree_util.tree_leaves(build())
            np.savez(os.path.join(out_dir, f"{name}.npz"), *leaves)
        else:
            with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
                f.write(normalize(str(build())))
        print(name, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
