"""The main job: time softmax attention, the GLA variants and the delta rules on whatever device is
present.

For each variant (softmax flash attention; GLA with per-key, per-head and no gate; each GLA mode;
DeltaNet, Gated DeltaNet and KDA) it first checks numerics against the float64 reference at a
small size, then times forward and forward+backward at the benchmark size, prints a table and
writes JSON. Inputs are drawn as the peers' benchmarks draw them: q, k, v ~ N(0, 1),
g = logsigmoid(N(0, 1)), and for the delta rules beta = sigmoid(N(0, 1)) with q and k
l2-normalized inside the op (`use_qk_l2norm`, fla's benchmarks' `use_qk_l2norm_in_kernel`).

    python -m bench.attention_variants                 # sizes picked for the device
    python -m bench.attention_variants --seq-len 2048 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp

from gla_tpu.ops.common import flops as flops_lib
from bench import harness
from gla_tpu import ops
from gla_tpu.testing import (
    AttentionCase,
    DeltaRuleCase,
    GLACase,
    make_attention_inputs,
    make_delta_rule_inputs,
    make_gla_inputs,
)
from gla_tpu.testing.parity import (
    check_attention_parity,
    check_delta_rule_parity,
    check_gla_parity,
)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    op: str  # "softmax", "gla" or "delta_rule"
    gate: str = "none"  # GLA / delta-rule gate kind
    mode: str = "chunk"  # GLA / delta-rule mode


VARIANTS = (
    Variant("softmax causal", "softmax"),
    Variant("gla chunk", "gla", "key", "chunk"),
    Variant("gla fused_chunk", "gla", "key", "fused_chunk"),
    Variant("gla fused_recurrent", "gla", "key", "fused_recurrent"),
    Variant("simple_gla chunk", "gla", "head", "chunk"),
    Variant("linear_attn chunk", "gla", "none", "chunk"),
    Variant("deltanet chunk", "delta_rule", "none", "chunk"),
    Variant("gated_deltanet chunk", "delta_rule", "head", "chunk"),
    Variant("kda chunk", "delta_rule", "key", "chunk"),
)


@dataclasses.dataclass(frozen=True)
class Size:
    batch: int
    seq_len: int
    heads: int
    head_dim: int


def default_size(platform: str) -> Size:
    if platform == "cpu":
        return Size(batch=1, seq_len=512, heads=2, head_dim=64)
    return Size(batch=4, seq_len=4096, heads=16, head_dim=128)


def dtype_for(platform: str):
    return jnp.float32 if platform == "cpu" else jnp.bfloat16


def build(variant: Variant, size: Size, dtype, backend: str):
    """Returns (loss-free forward fn, forward+backward fn, args, flops fwd, flops fwd+bwd)."""
    key = jax.random.key(0)
    if variant.op == "softmax":
        case = AttentionCase(size.batch, size.seq_len, size.seq_len, size.heads, size.heads,
                             size.head_dim, causal=True)
        inputs = make_attention_inputs(case, key, dtype)
        args = (inputs["q"], inputs["k"], inputs["v"])
        fwd = functools.partial(ops.flash_attention, causal=True, backend=backend)
        fl = functools.partial(flops_lib.attention_flops, size.batch, size.seq_len,
                               size.seq_len, size.heads, size.head_dim, causal=True)
    elif variant.op == "delta_rule":
        case = DeltaRuleCase(size.batch, size.seq_len, size.heads, size.heads, size.head_dim,
                             size.head_dim, gate=variant.gate, use_qk_l2norm=True)
        inputs = make_delta_rule_inputs(case, key, dtype)
        # beta = sigmoid(N(0, 1)), as fla's benchmarks draw it
        beta = jax.nn.sigmoid(jax.random.normal(jax.random.fold_in(key, 2),
                                                inputs["beta"].shape, jnp.float32))
        args = (inputs["q"], inputs["k"], inputs["v"], beta, inputs["g"])

        def fwd(q, k, v, beta, g):
            return ops.delta_rule(q, k, v, beta, g, use_qk_l2norm=True, mode=variant.mode,
                                  backend=backend)[0]

        fl = functools.partial(flops_lib.delta_rule_flops, size.batch, size.seq_len, size.heads,
                               size.head_dim, size.head_dim)
    else:
        case = GLACase(size.batch, size.seq_len, size.heads, size.head_dim, size.head_dim,
                       gate=variant.gate)
        inputs = make_gla_inputs(case, key, dtype)
        args = (inputs["q"], inputs["k"], inputs["v"], inputs["g"])

        def fwd(q, k, v, g):
            return ops.gla(q, k, v, g, mode=variant.mode, backend=backend)[0]

        fl = functools.partial(flops_lib.gla_flops, size.batch, size.seq_len, size.heads,
                               size.head_dim, size.head_dim)
    diff_argnums = tuple(i for i, a in enumerate(args) if a is not None)

    def fwd_bwd(*a):
        return jax.grad(lambda *x: jnp.sum(fwd(*x).astype(jnp.float32)), argnums=diff_argnums)(*a)

    return fwd, fwd_bwd, args, fl(backward=False), fl(backward=True)


def check_numerics(variant: Variant, dtype, backend: str) -> None:
    """Pass rule (or the xla bounds) at a small size, outputs and gradients, before any timing."""
    key = jax.random.key(1)
    if variant.op == "softmax":
        case = AttentionCase(1, 160, 160, 2, 2, 64, causal=True)
        check_attention_parity(case, key, dtype=dtype, backend=backend)
    elif variant.op == "delta_rule":
        case = DeltaRuleCase(1, 160, 2, 2, 64, 64, gate=variant.gate, initial_state=True,
                             use_qk_l2norm=True)
        check_delta_rule_parity(case, key, dtype=dtype, mode=variant.mode, backend=backend)
    else:
        case = GLACase(1, 160, 2, 64, 64, gate=variant.gate, initial_state=True)
        check_gla_parity(case, key, dtype=dtype, mode=variant.mode, backend=backend)


def run(size: Size, dtype, backend: str, variants, repeats: int, budget_ms: float) -> list[dict]:
    env = harness.environment()
    records = []
    for variant in variants:
        check_numerics(variant, dtype, backend)
        fwd, fwd_bwd, args, fl_fwd, fl_bwd = build(variant, size, dtype, backend)
        for direction, fn, fl in (("fwd", fwd, fl_fwd), ("fwd+bwd", fwd_bwd, fl_bwd)):
            iters = harness.iters_for_budget(fn, *args, budget_ms=budget_ms)
            t = harness.time_jitted(fn, *args, warmup=1, iters=iters, repeats=repeats)
            tokens = size.batch * size.seq_len
            records.append({
                "variant": variant.name, "op": variant.op, "gate": variant.gate,
                "mode": "flash" if variant.op == "softmax" else variant.mode,
                "direction": direction,
                "shape": f"B{size.batch} T{size.seq_len} H{size.heads} D{size.head_dim}",
                "dtype": jnp.dtype(dtype).name, "backend": backend,
                "ms": t.median_ms, "ms_min": t.min_ms, "ms_max": t.max_ms,
                "compile_ms": t.compile_ms, "tflops": fl / (t.median_ms * 1e-3) / 1e12,
                "tokens_per_s": tokens / (t.median_ms * 1e-3),
                "peak_mem_mb": (lambda m: None if m is None else m / 2**20)(
                    harness.peak_memory_bytes()),
                **env,
            })
            print(f"  {variant.name:22s} {direction:8s} {t.median_ms:9.3f} ms", file=sys.stderr)
    return records


def main(argv=None) -> None:
    platform = jax.devices()[0].platform
    default = default_size(platform)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=default.batch)
    p.add_argument("--seq-len", type=int, default=default.seq_len)
    p.add_argument("--heads", type=int, default=default.heads)
    p.add_argument("--head-dim", type=int, default=default.head_dim)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--backend", default="auto", choices=list(ops.BACKENDS))
    p.add_argument("--variants", nargs="*", default=None,
                   help="subset of: " + ", ".join(repr(v.name) for v in VARIANTS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget-ms", type=float, default=200.0, help="target time per repeat")
    p.add_argument("--json", default="bench/results/attention_variants.json")
    a = p.parse_args(argv)
    size = Size(a.batch, a.seq_len, a.heads, a.head_dim)
    dtype = jnp.dtype(a.dtype) if a.dtype else dtype_for(platform)
    variants = VARIANTS if a.variants is None else [v for v in VARIANTS if v.name in a.variants]
    if not variants:
        p.error(f"--variants matched none of {[v.name for v in VARIANTS]}")
    print(f"device {jax.devices()[0]}, {size}, {jnp.dtype(dtype).name}, backend={a.backend}",
          file=sys.stderr)
    records = run(size, dtype, a.backend, variants, a.repeats, a.budget_ms)
    harness.write_json(a.json, records)
    print(harness.format_table(records, ["variant", "direction", "shape", "dtype", "ms", "ms_min",
                                         "ms_max", "tflops", "tokens_per_s", "peak_mem_mb"]))
    print(f"\nJSON: {a.json}")


if __name__ == "__main__":
    main()
