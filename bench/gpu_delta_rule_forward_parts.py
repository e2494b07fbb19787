"""Where the "pallas_gpu" delta rule's forward spends its time, on one Hopper GPU (a diagnostic).

    python3 bench/gpu_delta_rule_forward_parts.py --out OUT [--shapes qwen3,deltanet,k64]
    python3 bench/gpu_delta_rule_forward_parts.py --out OUT --shapes tiny --interpret  # CPU check

1. The WY operands kernel (kernels_mosaic_operands.py) whole and with one part taken out: the
   inverse's levels after the first, the inverse's float32 products as one bfloat16 product
   instead of three, everything after the inverse (`_tail`), both, and the global stores. The
   variants replace the module's private functions, so this script follows that file; their
   outputs are wrong by design, only their times mean anything.
2. The forward state pass on the kernel's operands at value tiles 32 and 64, with S in one or
   two 16-bit parts (`vjp.Passes.out_parts`).
3. The whole forward and forward+backward at value tiles 32 and 64 (`entry.value_tile`).

Inputs as bench/gpu_delta_rule.py draws them (gates "peer", beta sigmoid(N(0, 1))). Timing:
bench.harness.time_jitted (20 calls per sync, median of 5 repeats after 2 warm-up calls).
Writes OUT/delta_rule_forward_parts.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from bench.gpu_delta_rule import _grouped, inputs, ours  # noqa: E402
from bench.harness import environment, time_jitted, write_json  # noqa: E402
from gla_tpu.ops.delta_rule.pallas_gpu import entry, vjp  # noqa: E402
from gla_tpu.ops.delta_rule.pallas_gpu import operands as wy_inputs  # noqa: E402
from gla_tpu.ops.delta_rule.pallas_gpu import kernels_mosaic_operands as kmo  # noqa: E402

SHAPES = {"qwen3": ("gated_deltanet", 2, 8192, 16, 32, 128, 128),
          "deltanet": ("deltanet", 4, 4096, 16, 16, 128, 128),
          "k64": ("gated_deltanet", 8, 2048, 16, 16, 64, 64),
          "tiny": ("gated_deltanet", 1, 128, 1, 2, 64, 64)}  # with --interpret, on CPU


def _inverse_level0(a, t_smem, y_smem, *, interpret):
    c = kmo.CHUNK
    r, x = kmo.iota((c, c), 0), kmo.iota((c, c), 1)
    return jnp.where(r == x, 1.0, 0.0) - jnp.where(kmo.level_pairs(0, c), a, 0.0)


def _one_part_product(left_parts, right_parts, shape, *, interpret, init=None):
    return kmo.matmul([(left_parts[0], right_parts[0])], shape, interpret=interpret, init=init)


def _no_tail(*args, **kwargs):
    plgpu.wait_smem_to_gmem(0)


class _NoGlobalStores(types.ModuleType):
    def __getattr__(self, name):
        if name == "copy_smem_to_gmem":
            return lambda *args, **kwargs: None
        return getattr(plgpu, name)


OPERAND_VARIANTS = {
    "whole": {},
    "inverse_level0_only": dict(_unit_lower_inverse=_inverse_level0),
    "inverse_one_part_products": dict(_parts_product=_one_part_product),
    "no_tail": dict(_tail=_no_tail),
    "no_tail_no_inverse": dict(_tail=_no_tail, _unit_lower_inverse=_inverse_level0),
    "no_global_stores": dict(plgpu=_NoGlobalStores("plgpu_without_global_stores")),
}


def _timed(fn, *args):
    try:
        t = time_jitted(fn, *args, warmup=2, iters=20, repeats=5)
        return dict(ms_median=t.median_ms, ms_min=t.min_ms, compile_s=t.compile_ms / 1e3)
    except Exception as e:  # noqa: BLE001  (recorded, the run goes on)
        return dict(error=f"{type(e).__name__}: {str(e)[:300]}")


def measure(name, shape, record, interpret=False):
    q, k, v, beta, g, ct = inputs(0, shape, "peer", "sigmoid")
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)] + [jnp.asarray(beta)]
    args.append(None if g is None else jnp.asarray(g))
    problem, grouped = _grouped(*args)
    kernel_inputs = wy_inputs.kernel_inputs(*grouped, problem)

    def operands(*xs):
        return kmo.wy_operands(*xs, group=problem.group, scale=problem.scale,
                               interpret=interpret)

    for variant, patch in OPERAND_VARIANTS.items():
        saved = {key: getattr(kmo, key) for key in patch}
        for key, value in patch.items():
            setattr(kmo, key, value)
        jax.clear_caches()
        try:
            record(name, "operands_kernel", variant=variant, **_timed(operands, *kernel_inputs))
        finally:
            for key, value in saved.items():
                setattr(kmo, key, value)
    jax.clear_caches()

    scores, q_in, k_out, w_neg, u0, last = jax.jit(operands)(*kernel_inputs)
    dtype = jnp.dtype(problem.dtype)
    for block_v in (32, 64):
        for out_parts in (2, 1):
            passes = vjp.Passes(block_v=block_v, out_parts=out_parts)
            record(name, "state_pass_forward", block_v=block_v, out_parts=out_parts, **_timed(
                lambda *xs, p=passes: vjp.state_passes(*xs[:3], None, *xs[3:], dtype, p,
                                                          interpret),
                k_out, u0, last, q_in, scores, w_neg))

    nargs = 4 if g is None else 5
    fn = ours("pallas_gpu")
    cotangent = jnp.asarray(ct, jnp.bfloat16)

    def forward(*xs):
        return fn(*xs, *([None] * (5 - nargs)))

    def loss(*xs):
        o = forward(*xs).astype(jnp.float32)
        return jnp.sum(o * jax.lax.optimization_barrier(cotangent).astype(jnp.float32))

    value_tile = entry.value_tile
    try:
        for block_v in (32, 64):
            entry.value_tile = lambda *a, block_v=block_v: block_v
            jax.clear_caches()
            record(name, "forward", block_v=block_v, **_timed(forward, *args[:nargs]))
            record(name, "forward+backward", block_v=block_v,
                   **_timed(jax.grad(loss, argnums=tuple(range(nargs))), *args[:nargs]))
    finally:
        entry.value_tile = value_tile


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--shapes", default="qwen3,deltanet,k64", help=f"from {sorted(SHAPES)}")
    parser.add_argument("--interpret", action="store_true",
                        help="the Mosaic GPU interpreter on CPU: a check of this script, no timing")
    args = parser.parse_args(argv)
    env = environment()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "delta_rule_forward_parts.json")
    records = []

    def record(shape_name, what, **fields):
        records.append(dict(shape=list(SHAPES[shape_name]), what=what, **fields,
                            dtype="bfloat16", gate="logsigmoid(N(0,1))", beta="sigmoid(N(0,1))",
                            device=env["device"], date=env["date"]))
        print(records[-1], flush=True)
        write_json(path, records)

    for name in args.shapes.split(","):
        measure(name, SHAPES[name], record, interpret=args.interpret)


if __name__ == "__main__":
    main()
