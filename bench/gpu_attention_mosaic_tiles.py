"""First GPU check of the Mosaic GPU attention forward: numerics against the Triton
forward and a float32 XLA reference (outputs and gradients, the backward being Triton's in both),
then forward timing of ForwardTiles variants beside cuDNN, our Triton forward and jla's FA3.

Kept as it ran (docs/results/2026-11-22_h200_attention_mosaic_tiles.json); the maintained
side-by-side benchmark is bench/gpu_side_by_side.py.

Usage (on the GPU machine): OUT=DIR python3 bench/gpu_attention_mosaic_tiles.py [check|time|all]
"""
import json, os, sys, traceback
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np, jax, jax.numpy as jnp
from bench.gpu_side_by_side import time_jax, fwd_bwd, rel_err
from gla_tpu.ops.common.flops import attention_flops
from gla_tpu import ops
from gla_tpu.ops.attention.pallas_gpu import ForwardTiles, default_block_sizes
import dataclasses
OUT = os.environ["OUT"]
recs = []
def log(**r):
    recs.append(r); print(json.dumps(r), flush=True)
    json.dump(recs, open(f"{OUT}/mosaic_exp.json", "w"), indent=1)

def sizes(d, fk, tiles=None):
    s = dataclasses.replace(default_block_sizes(d, jnp.bfloat16), forward_kernel=fk)
    return s if tiles is None else dataclasses.replace(s, mosaic_forward=tiles)

print(jax.devices(), jax.devices()[0].compute_capability, flush=True)
rng = np.random.default_rng(0)
part = sys.argv[1] if len(sys.argv) > 1 else "all"
if part in ("all", "check"):
    for (b, t, s, h, hkv, d, causal) in [(2, 1024, 1024, 4, 4, 128, False), (2, 1024, 1024, 4, 2, 128, True),
                                         (1, 1000, 1500, 4, 1, 128, True), (2, 1500, 1000, 4, 2, 64, True),
                                         (1, 777, 1029, 4, 4, 64, False), (1, 4096, 4096, 8, 8, 64, True)]:
        try:
            q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16)
            k = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.bfloat16)
            v = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.bfloat16)
            ct = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
            ref = lambda q, k, v: ops.flash_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), causal=causal, backend="xla")
            r = jax.jit(ref)(q, k, v)
            rg = jax.jit(fwd_bwd(ref, ct))(q, k, v)
            for fk in ("triton", "mosaic_gpu"):
                f = lambda q, k, v: ops.flash_attention(q, k, v, causal=causal, backend="pallas_gpu", block_sizes=sizes(d, fk))
                o = jax.jit(f)(q, k, v)
                g = jax.jit(fwd_bwd(f, ct))(q, k, v)
                log(kind="check", case=[b, t, s, h, hkv, d, causal], fk=fk, o_err=rel_err(o, r), nan=int(jnp.isnan(o).sum()),
                    g_err=[rel_err(a, bb) for a, bb in zip(g, rg)])
        except Exception as e:
            traceback.print_exc(); log(kind="check", case=[b, t, s, h, hkv, d, causal], error=str(e)[:500])

if part in ("all", "time"):
    from jla.ops.mosaic_gpu.attention import flash_attention as jla_fa
    SH = [(4, 16, 4096, 128, False), (4, 16, 4096, 128, True), (4, 16, 4096, 64, True),
          (1, 5, 16384, 128, False), (1, 5, 16384, 128, True), (16, 16, 1024, 128, True)]
    variants = [ForwardTiles(64, 128, 2), ForwardTiles(64, 64, 2), ForwardTiles(64, 128, 3), ForwardTiles(64, 64, 3), ForwardTiles(64, 192, 2)]
    for (b, h, t, d, causal) in SH:
        arrs = [jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.bfloat16) for _ in range(3)]
        ct = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
        fl = attention_flops(b, t, t, h, d, causal=causal, backward=False)
        flb = attention_flops(b, t, t, h, d, causal=causal, backward=True)
        impls = {"cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"),
                 "triton": lambda q, k, v: ops.flash_attention(q, k, v, causal=causal, backend="pallas_gpu", block_sizes=sizes(d, "triton"))}
        if causal:
            impls["jla"] = lambda q, k, v: jla_fa(q, k, v)
        for vt in variants:
            impls[f"mosaic_{vt.block_q}_{vt.block_kv}_{vt.stages}"] = (lambda vt: lambda q, k, v: ops.flash_attention(q, k, v, causal=causal, backend="pallas_gpu", block_sizes=sizes(d, "mosaic_gpu", vt)))(vt)
        base = None
        for name, fn in impls.items():
            try:
                o = jax.block_until_ready(jax.jit(fn)(*arrs))
                base = o if base is None else base
                ms = time_jax(fn, *arrs)
                rec = dict(kind="time", shape=[b, h, t, d, causal], impl=name, mode="fwd", ms=ms, tflops=fl / ms[0] / 1e9, err=rel_err(o, base))
                if name in ("cudnn", "triton", "jla", "mosaic_64_128_2"):
                    msb = time_jax(fwd_bwd(fn, ct), *arrs)
                    rec["fwdbwd_ms"] = msb; rec["fwdbwd_tflops"] = flb / msb[0] / 1e9
                log(**rec)
            except Exception as e:
                log(kind="time", shape=[b, h, t, d, causal], impl=name, error=(type(e).__name__ + str(e))[:400])
