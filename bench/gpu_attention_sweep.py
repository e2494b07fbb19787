"""Block-size sweep of the pallas_gpu flash attention against cuDNN (one GPU, bfloat16).

For each shape: cuDNN forward and forward+backward are timed once (the reference), then block-size
candidates of our kernel are timed, the forward ones (part "fwd", timed forward only) and the
backward ones (part "bwd", timed forward+backward with the forward tiles at their default).
Candidates are a pruned product of the knobs below, ordered by expected value: the default, a few
known-good FA2-Triton settings, every one-knob change, then up to two adaptive combinations of the
one-knob changes that beat the default, then two-knob changes. Every candidate's output (or
gradients) is compared with cuDNN's; a candidate that fails to compile (shared memory, Triton
errors) or disagrees is recorded with an error and skipped for "best".

ratio_vs_cudnn = cuDNN ms / our ms (1.0 = as fast as cuDNN; the targets are >= 0.75 forward,
>= 0.6 forward+backward). Timing is bench/gpu_side_by_side.py's time_jax (compile, 3 warm-up
calls, 7 repeats of 50 calls with one sync each, median / min / max per call).

--budget-s bounds the whole sweep (compile time included): each (shape, part) section gets an
equal share of the time left, unused time rolls over, and no candidate starts if the average cost
of its part says it would end past the budget. DIR/attention_sweep.json is rewritten after every
record, so a run that is cut off keeps what it measured.

Usage (on the GPU machine):
  python3 bench/gpu_attention_sweep.py --out DIR [--budget-s 420]
  python3 bench/gpu_attention_sweep.py --out DIR --shapes 0 --parts fwd   # a subset
  python3 bench/gpu_attention_sweep.py --dry-run                         # candidate lists only
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from gla_tpu.ops.common.flops import attention_flops  # noqa: E402
from bench.gpu_side_by_side import MATCH_TOLERANCE, fwd_bwd, time_jax, versions  # noqa: E402
from bench.harness import environment, write_json  # noqa: E402
from gla_tpu.ops.attention.pallas_gpu import BlockSizes, default_block_sizes  # noqa: E402

SHAPES = [  # (B, H, T, D, causal)
    (4, 16, 4096, 128, False),
    (4, 16, 4096, 128, True),
    (4, 16, 4096, 64, True),
]
DTYPE = jnp.bfloat16
GRAD_TOLERANCE = 5e-2  # relative RMS error of each of dq, dk, dv vs cuDNN's (bf16 gradients)
FWD_LIMIT = 24  # candidates per shape, adaptive combinations included
BWD_LIMIT = 24
N_ADAPTIVE = 2
SMEM_LIMIT = 227 * 1024  # Hopper's shared memory per block, bytes

# A knob is a tuple of BlockSizes fields moved together and the values it may take.
FWD_KNOBS = [
    (("block_q",), [(64,), (128,)]),
    (("block_kv",), [(32,), (64,), (128,)]),
    (("num_warps",), [(4,), (8,)]),
    (("num_stages",), [(2,), (3,), (4,)]),
]
BWD_KNOBS = [
    (("block_q_dq", "block_kv_dq"), [(64, 32), (128, 32), (64, 64), (128, 64)]),
    (("block_q_dkv", "block_kv_dkv"), [(32, 128), (64, 64), (64, 128), (32, 64)]),
    (("num_warps_dq",), [(4,), (8,)]),
    (("num_warps_dkv",), [(4,), (8,)]),
    (("num_stages_bwd",), [(1,), (2,), (3,)]),
]
# Two-knob changes of the backward worth a compile, by knob index in BWD_KNOBS, in this order
# (a kernel's tile with its own warps first; the dq and dk/dv kernels are otherwise independent).
BWD_PAIRS = [(0, 2), (1, 3), (2, 3), (2, 4), (3, 4), (0, 1), (0, 4), (1, 4)]


def known_good(part: str, head_dim: int) -> list[tuple[str, dict]]:
    """FA2-Triton style settings (label, BlockSizes fields) for this part and head dim."""
    if part == "fwd":
        if head_dim >= 128:
            return [
                ("fa2 128x128 w8 s3", dict(block_q=128, block_kv=128, num_warps=8, num_stages=3)),
                ("jax-mha 128x128 w8 s2", dict(block_q=128, block_kv=128, num_warps=8,
                                                num_stages=2)),
                ("fa2 128x64 w8 s3", dict(block_q=128, block_kv=64, num_warps=8, num_stages=3)),
                ("tutorial 64x64 w4 s3", dict(block_q=64, block_kv=64, num_warps=4,
                                               num_stages=3)),
            ]
        return [
            ("fa2 128x128 w4 s3", dict(block_q=128, block_kv=128, num_warps=4, num_stages=3)),
            ("jax-mha 128x128 w4 s2", dict(block_q=128, block_kv=128, num_warps=4,
                                            num_stages=2)),
            ("fa2 128x64 w4 s3", dict(block_q=128, block_kv=64, num_warps=4, num_stages=3)),
            ("128x128 w8 s3", dict(block_q=128, block_kv=128, num_warps=8, num_stages=3)),
        ]
    tutorial = dict(block_q_dq=128, block_kv_dq=32, block_q_dkv=32, block_kv_dkv=128,
                    num_warps_dq=4, num_warps_dkv=4, num_stages_bwd=3)
    big = dict(block_q_dq=128, block_kv_dq=64, block_q_dkv=64, block_kv_dkv=128,
               num_warps_dq=8, num_warps_dkv=8, num_stages_bwd=2)
    square = dict(block_q_dq=64, block_kv_dq=64, block_q_dkv=64, block_kv_dkv=64,
                  num_warps_dq=4, num_warps_dkv=4, num_stages_bwd=2)
    return [("tutorial dq128x32 dkv32x128 w4 s3", tutorial),
            ("big dq128x64 dkv64x128 w8 s2", big),
            ("square dq64x64 dkv64x64 w4 s2", square)]


def knob_value(sizes: BlockSizes, fields) -> tuple:
    return tuple(getattr(sizes, f) for f in fields)


def with_knobs(base: BlockSizes, changes) -> BlockSizes:
    """base with [(fields, values), ...] applied."""
    kw = {}
    for fields, values in changes:
        kw.update(zip(fields, values))
    return dataclasses.replace(base, **kw)


def describe(base: BlockSizes, sizes: BlockSizes, knobs) -> str:
    """The knobs where sizes differs from base, e.g. 'block_kv=128 num_stages=2'."""
    parts = []
    for fields, _ in knobs:
        a, b = knob_value(base, fields), knob_value(sizes, fields)
        if a != b:
            parts.append("/".join(fields) + "=" + "x".join(map(str, b)))
    return " ".join(parts) or "default"


def smem_estimate(part: str, sizes: BlockSizes, head_dim: int, itemsize: int = 2) -> int:
    """Rough shared memory bytes (pipelined tiles only); used only to order candidates."""
    if part == "fwd":
        return itemsize * head_dim * (sizes.block_q + 2 * sizes.num_stages * sizes.block_kv)
    dq = sizes.block_q_dq + 2 * sizes.num_stages_bwd * sizes.block_kv_dq
    dkv = 2 * sizes.block_kv_dkv + 2 * sizes.num_stages_bwd * sizes.block_q_dkv
    return itemsize * head_dim * max(dq, dkv)


def candidates(part: str, head_dim: int, dtype=DTYPE, limit: int | None = None):
    """Fixed candidates [(label, BlockSizes)], best guesses first, at most limit - N_ADAPTIVE.

    Order: default, known-good, one-knob changes, then two-knob changes (for the backward only
    the pairs in BWD_PAIRS), each group in knob order with candidates whose estimated shared
    memory exceeds Hopper's 227 KiB moved to its end (they are still tried: the estimate is rough).
    """
    knobs = FWD_KNOBS if part == "fwd" else BWD_KNOBS
    limit = (FWD_LIMIT if part == "fwd" else BWD_LIMIT) if limit is None else limit
    base = default_block_sizes(head_dim, dtype)
    out, seen = [], set()

    def add(label, sizes):
        if sizes not in seen and len(out) < limit - N_ADAPTIVE:
            seen.add(sizes)
            out.append((label, sizes))

    add("default", base)
    for label, fields in known_good(part, head_dim):
        add(label, dataclasses.replace(base, **fields))

    def group(level, pairs):
        found = []
        for idx in pairs:
            choices = []
            for i in idx:
                fields, values = knobs[i]
                choices.append([(fields, v) for v in values if v != knob_value(base, fields)])
            for combo in itertools.product(*choices):
                sizes = with_knobs(base, combo)
                found.append((f"d{level}: {describe(base, sizes, knobs)}", sizes))
        # stable sort: knob (pair) priority kept, likely shared-memory failures moved last
        return sorted(found, key=lambda c: smem_estimate(part, c[1], head_dim) > SMEM_LIMIT)

    for label, sizes in group(1, [(i,) for i in range(len(knobs))]):
        add(label, sizes)
    pairs = (list(itertools.combinations(range(len(knobs)), 2)) if part == "fwd"
             else BWD_PAIRS)
    for label, sizes in group(2, pairs):
        add(label, sizes)
    return out


def adaptive(part: str, head_dim: int, timed: dict, dtype=DTYPE):
    """Up to N_ADAPTIVE new candidates combining the one-knob changes that beat the default.

    timed: BlockSizes -> ms_median of the candidates measured so far (correct ones only).
    1. default + every improving one-knob change (the best value per knob);
    2. the best candidate so far + those improving changes on knobs it leaves at the default.
    """
    knobs = FWD_KNOBS if part == "fwd" else BWD_KNOBS
    base = default_block_sizes(head_dim, dtype)
    if base not in timed:
        return []
    best_change = {}  # knob index -> (ms, values)
    for sizes, ms in timed.items():
        diff = [i for i, (f, _) in enumerate(knobs) if knob_value(sizes, f) != knob_value(base, f)]
        if len(diff) == 1 and ms < timed[base]:
            i = diff[0]
            if i not in best_change or ms < best_change[i][0]:
                best_change[i] = (ms, knob_value(sizes, knobs[i][0]))
    out = []
    if len(best_change) >= 2:
        combo = with_knobs(base, [(knobs[i][0], v) for i, (_, v) in best_change.items()])
        out.append(("adaptive: default + improving knobs", combo))
    best = min(timed, key=timed.get)
    if best != base and best_change:
        free = [(knobs[i][0], v) for i, (_, v) in best_change.items()
                if knob_value(best, knobs[i][0]) == knob_value(base, knobs[i][0])]
        if free:
            out.append(("adaptive: best + improving knobs", with_knobs(best, free)))
    return [(label, s) for label, s in out if s not in timed]


# Measurement.


def rel_err(a, b) -> float:
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def short_error(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    # Triton's "out of resource: shared memory, Required: N, Hardware limit: M" is the useful line
    for ln in lines:
        if "out of resource" in ln or "shared memory" in ln.lower():
            return f"{type(e).__name__}: {ln.strip()[:300]}"
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


class Sweep:
    def __init__(self, out_dir: str | None, budget_s: float, parts):
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.parts = parts
        self.path = os.path.join(out_dir, "attention_sweep.json") if out_dir else None
        self.env = environment()
        self.env["versions"] = versions()
        self.records = []
        self.cost = {"fwd": [], "bwd": []}  # seconds per candidate, for the budget check

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def expected_cost(self, part) -> float:
        c = self.cost[part]
        return sum(c) / len(c) if c else 0.0

    def record(self, **rec):
        rec = dict(rec, device=self.env["device"], date=self.env["date"],
                   jax=self.env["jax"], elapsed_s=round(self.elapsed(), 1))
        self.records.append(rec)
        if self.path:
            write_json(self.path, self.records)
        ms = rec.get("ms_median")
        ratio = rec.get("ratio_vs_cudnn")
        b, h, t, d = rec["shape"]
        print(f"[{rec['elapsed_s']:6.1f}s] {b},{h},{t},{d} {'causal' if rec['causal'] else 'full':6s} "
              f"{rec['part']:4s} {rec['impl']:6s} "
              f"{'-' if ms is None else f'{ms:7.3f} ms'} "
              f"{'' if ratio is None else f'{ratio:5.3f}x cuDNN'} "
              f"{'' if rec.get('tflops') is None else '%4.0f TF/s' % rec['tflops']} "
              f"{rec.get('label', '')}"
              f"{'' if rec.get('error') is None else '  ERROR ' + rec['error'][:160]}",
              flush=True)
        return rec

    def run_shape(self, shape, n_sections_left):
        b, h, t, d, causal = shape
        key = jax.random.key(hash(shape) % (2**31))
        kq, kk, kv, kc = jax.random.split(key, 4)
        q, k, v = (jax.random.normal(kk_, (b, t, h, d), jnp.float32).astype(DTYPE)
                   for kk_ in (kq, kk, kv))
        ct = jax.random.normal(kc, (b, t, h, d), jnp.float32)
        args = (q, k, v)
        common = dict(shape=[b, h, t, d], causal=causal, dtype="bfloat16")

        def cudnn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

        # reference: cuDNN output / grads and time per timed mode
        ref, ref_ms = {}, {}
        for part in self.parts:
            fn = cudnn if part == "fwd" else fwd_bwd(cudnn, ct)
            try:
                ref[part] = jax.block_until_ready(jax.jit(fn).lower(*args).compile()(*args))
                timing = time_jax(fn, *args)
                ref_ms[part] = timing[0]
                self.record(**common, part=part, impl="cudnn", label="cuDNN", block_sizes=None,
                            timed="fwd" if part == "fwd" else "fwd+bwd",
                            ms_median=timing[0], ms_min=timing[1], ms_max=timing[2],
                            ratio_vs_cudnn=1.0, tflops=self.tflops(shape, part, timing[0]),
                            error=None)
            except Exception as e:  # no cuDNN: ratios stay None, the default is the reference
                self.record(**common, part=part, impl="cudnn", label="cuDNN", block_sizes=None,
                            timed="fwd" if part == "fwd" else "fwd+bwd", ms_median=None,
                            ms_min=None, ms_max=None, ratio_vs_cudnn=None, error=short_error(e))

        best = {}
        for part in self.parts:
            n_sections_left -= 1
            section_end = self.elapsed() + max(0.0, self.left()) / (n_sections_left + 1)
            best[part] = self.sweep_part(shape, part, args, ct, ref.get(part), ref_ms.get(part),
                                         common, section_end)
        return best

    def tflops(self, shape, part, ms):
        b, h, t, d, causal = shape
        return attention_flops(b, t, t, h, d, causal=causal, backward=part == "bwd") / (
            ms * 1e-3) / 1e12

    def sweep_part(self, shape, part, args, ct, ref, ref_ms, common, section_end):
        from gla_tpu import ops

        b, h, t, d, causal = shape
        fixed = candidates(part, d)
        queue = list(fixed)
        timed = {}  # BlockSizes -> ms (correct candidates only)
        adaptive_done = False
        done = 0
        while queue or not adaptive_done:
            # the adaptive combinations go right after the one-knob changes
            if not adaptive_done and (not queue or queue[0][0].startswith("d2")):
                adaptive_done = True
                queue[:0] = adaptive(part, d, timed)
                continue
            label, sizes = queue.pop(0)
            if self.left() < self.expected_cost(part):
                print(f"budget: {self.elapsed():.0f}s of {self.budget_s:.0f}s used, stopping", flush=True)
                return self.best_of(timed)
            if self.elapsed() >= section_end and done > 0:
                print(f"section share used ({shape}, {part}), moving on", flush=True)
                return self.best_of(timed)
            done += 1
            t0 = time.perf_counter()
            rec = dict(common, part=part, impl="ours", label=label,
                       block_sizes=dataclasses.asdict(sizes),
                       timed="fwd" if part == "fwd" else "fwd+bwd",
                       ms_median=None, ms_min=None, ms_max=None, ratio_vs_cudnn=None,
                       compile_s=None, rel_err=None, error=None)

            def ours(q, k, v, sizes=sizes):
                return ops.flash_attention(q, k, v, causal=causal, backend="pallas_gpu",
                                           block_sizes=sizes)

            fn = ours if part == "fwd" else fwd_bwd(ours, ct)
            try:
                compiled = jax.jit(fn).lower(*args).compile()  # time_jax's compile hits this
                rec["compile_s"] = round(time.perf_counter() - t0, 2)
                out = jax.block_until_ready(compiled(*args))
                if ref is None and sizes == default_block_sizes(d, DTYPE):
                    ref = out
                if ref is not None:
                    outs = (out,) if part == "fwd" else out
                    refs = (ref,) if part == "fwd" else ref
                    rec["rel_err"] = max(rel_err(a, r) for a, r in zip(outs, refs))
                del out
                timing = time_jax(fn, *args)
                rec.update(ms_median=timing[0], ms_min=timing[1], ms_max=timing[2],
                           tflops=self.tflops(shape, part, timing[0]))
                if ref_ms is not None:
                    rec["ratio_vs_cudnn"] = ref_ms / timing[0]
                tol = MATCH_TOLERANCE if part == "fwd" else GRAD_TOLERANCE
                if rec["rel_err"] is not None and not rec["rel_err"] <= tol:
                    rec["error"] = f"mismatch vs reference: rel err {rec['rel_err']:.2e} > {tol:g}"
                else:
                    timed[sizes] = timing[0]
            except Exception as e:  # noqa: BLE001 - a failing candidate is data, not a stop
                rec["error"] = short_error(e)
                if os.environ.get("SWEEP_TRACEBACK"):
                    traceback.print_exc()
            self.cost[part].append(time.perf_counter() - t0)
            rec["wall_s"] = round(time.perf_counter() - t0, 2)
            self.record(**rec)
        return self.best_of(timed)

    @staticmethod
    def best_of(timed):
        if not timed:
            return None
        best = min(timed, key=timed.get)
        return best, timed[best]


def print_candidates(parts):
    for d in sorted({s[3] for s in SHAPES}, reverse=True):
        base = default_block_sizes(d, DTYPE)
        print(f"D={d} default: {base}")
        for part in parts:
            cands = candidates(part, d)
            print(f"  {part}: {len(cands)} fixed + up to {N_ADAPTIVE} adaptive")
            for i, (label, sizes) in enumerate(cands):
                print(f"    {i:2d} {label:45s} est smem {smem_estimate(part, sizes, d) / 1024:4.0f} KiB")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for attention_sweep.json")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="wall-clock budget of the sweep, compiles included")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated indices into SHAPES (default: all)")
    parser.add_argument("--parts", default="fwd,bwd", help="fwd, bwd or fwd,bwd")
    parser.add_argument("--dry-run", action="store_true", help="print the candidate lists only")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if any(p not in ("fwd", "bwd") for p in parts):
        parser.error("--parts takes fwd, bwd or fwd,bwd")
    shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    if args.dry_run:
        print("shapes:", shapes)
        print_candidates(parts)
        return
    if args.out is None:
        parser.error("--out is required (unless --dry-run)")

    sweep = Sweep(args.out, args.budget_s, parts)
    print(f"device {sweep.env['device']}, budget {args.budget_s:.0f}s, shapes {shapes}, "
          f"parts {parts}", flush=True)
    results = {}
    n_sections = len(shapes) * len(parts)
    for i, shape in enumerate(shapes):
        if sweep.left() <= max(sweep.expected_cost("fwd"), 5.0):
            print(f"budget: no time left for {shape}", flush=True)
            break
        results[shape] = sweep.run_shape(shape, n_sections - i * len(parts))
        jax.clear_caches()

    print("\nbest per shape (ms, ratio vs cuDNN):")
    summary = []
    for shape, best in results.items():
        b, h, t, d, causal = shape
        ref = {r["part"]: r["ms_median"] for r in sweep.records
               if r["impl"] == "cudnn" and r["shape"] == [b, h, t, d] and r["causal"] == causal}
        base = default_block_sizes(d, DTYPE)
        merged = base
        for part in parts:
            if best.get(part) is None:
                print(f"  {shape} {part}: no successful candidate")
                continue
            sizes, ms = best[part]
            ratio = ref[part] / ms if ref.get(part) else None
            print(f"  {shape} {part}: {ms:.3f} ms"
                  f"{'' if ratio is None else f' ({ratio:.3f}x cuDNN)'}  {sizes!r}")
            fields = ([f.name for f in dataclasses.fields(BlockSizes)
                       if f.name in ("block_q", "block_kv", "num_warps", "num_stages")]
                      if part == "fwd" else
                      [f.name for f in dataclasses.fields(BlockSizes)
                       if f.name not in ("block_q", "block_kv", "num_warps", "num_stages")])
            merged = dataclasses.replace(merged, **{f: getattr(sizes, f) for f in fields})
            summary.append(dict(shape=[b, h, t, d], causal=causal, part=part,
                                block_sizes=dataclasses.asdict(sizes), ms_median=ms,
                                ratio_vs_cudnn=ratio))
        print(f"  {shape} merged: {merged!r}")
    if summary:
        write_json(os.path.join(args.out, "attention_sweep_best.json"), summary)
    print(f"done in {sweep.elapsed():.0f}s; {len(sweep.records)} records in {sweep.path}")


if __name__ == "__main__":
    main()
