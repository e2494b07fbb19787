"""Compile time of the TPU attention kernels beside JAX's own, on a CPU host (deviceless).

A user pays a program's compile at every new shape, restart and eval program, so it is part of
a kernel's speed. For each (implementation, shape, generation, pass) a child process builds the
program of `bench.tpu_static` (the same programs its cycle estimates profile), compiles a small
program first (libtpu's one-time start-up), then times `jax.jit(f).lower(...)` and `.compile()`
once for one core of the generation (the deviceless compile of gla_tpu.testing, no profiler).
Each program is measured in `--repeats` fresh processes (within one, libtpu caches a kernel it
has compiled) and the fastest is reported: seconds of wall time on this host, whose CPU is slower
than a TPU host's, so ratios to JAX's kernel are what carries over.

    python -m bench.tpu_compile_time --out DIR [--generations v5e,v6e] [--heads 8,16,32,64]
                                     [--head-dims 64,128,256] [--passes fwd,fwd_bwd]
                                     [--batch 1] [--seq-len 4096] [--full] [--ours-only]

writes DIR/tpu_compile_time.json and DIR/tpu_compile_time.md (ours, JAX's flash_attention at its
default blocks and at blocks 512 and 1024, and the ratios). Nothing else should run on the host
meanwhile: the figures are wall times.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import subprocess
import sys
import time

from bench.tpu_static import Spec

# Our kernels, and JAX's flash_attention at its defaults (128-blocks) and at the blocks its
# cycle estimates are compared at (512: the anchors'; 1024: its best on v5e and v6e).
IMPLS = (("gla_tpu", ()), ("jax_flash", ()), ("jax_flash", (("block", 512),)),
         ("jax_flash", (("block", 1024),)))


def _label(impl: str, options: tuple) -> str:
    return impl + "".join(f" {k}={v}" for k, v in options)


def _child(spec: Spec) -> None:
    """Builds `spec`'s program, compiles a warm-up program, and prints the seconds of one lower
    and compile of `spec`'s as JSON."""
    import jax
    import jax.numpy as jnp

    from bench.tpu_static import _program
    from gla_tpu.testing.tpu_compile import _single_device_sharding, compile_for_tpu, targeting

    compile_for_tpu(lambda x: x * 2, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                    generation=spec.generation)
    # deltanet-tpu runs in interpret mode unless the default backend is "tpu" while tracing
    # (as in bench.tpu_static's children).
    jax.default_backend = lambda: "tpu"
    fn, args = _program(spec)
    sharding = _single_device_sharding(spec.generation)
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    with targeting(spec.generation):
        start = time.perf_counter()
        lowered = jax.jit(fn).lower(*placed)
        middle = time.perf_counter()
        lowered.compile()
        end = time.perf_counter()
    print(json.dumps({"lower_s": middle - start, "compile_s": end - middle,
                      "total_s": end - start}))


def measure(spec: Spec, repeats: int, timeout: int) -> dict:
    """The record of `spec`: the lower, compile and total seconds of its fastest child (all
    totals in `totals_s`), or the error."""
    cmd = [sys.executable, "-m", "bench.tpu_compile_time", "--child",
           json.dumps(dataclasses.asdict(spec))]
    record = dataclasses.asdict(spec)
    record.update(key=spec.key, label=_label(spec.impl, spec.options))
    runs = []
    for _ in range(repeats):
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                 cwd=pathlib.Path(__file__).resolve().parents[1],
                                 env=_child_env())
        except subprocess.TimeoutExpired:
            return dict(record, error=f"timeout after {timeout} s")
        if run.returncode:
            lines = [ln for ln in run.stderr.strip().splitlines() if "Error" in ln]
            return dict(record, error=(lines or ["failed"])[-1][:300])
        runs.append(json.loads(run.stdout.strip().splitlines()[-1]))
    best = min(runs, key=lambda r: r["total_s"])
    return dict(record, error=None, totals_s=[r["total_s"] for r in runs], **best)


def _child_env() -> dict:
    import os

    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env.pop("LIBTPU_INIT_ARGS", None)
    return env


def specs_for(generations, heads, head_dims, passes, t: int, causal: bool, batch: int = 1,
              impls=IMPLS) -> list[Spec]:
    return [Spec("attention", impl, (batch, h, t, d, causal), gen, p, options)
            for gen in generations for p in passes for d in head_dims for h in heads
            for impl, options in impls]


def write_table(records: list[dict], path: pathlib.Path, env: dict) -> None:
    """Markdown: one row per program, ours and JAX's seconds, ours / JAX's."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["generation"], r["passes"], tuple(r["shape"])), {})[r["label"]] = r
    peers = [_label(i, o) for i, o in IMPLS[1:]]
    lines = [f"Compile seconds (lower + compile, fastest of {env['repeats']} processes), "
             f"{env['date']}, "
             f"jax {env.get('jax')}, libtpu {env.get('libtpu')}; (B, H, T, D, causal).", "",
             "| gen | pass | shape | ours | " + " | ".join(peers) + " | ours / JAX's: "
             + " / ".join(p.split(" ", 1)[1] if " " in p else "default" for p in peers) + " |",
             "|---|---|---|---|" + "---|" * len(peers) + "---|"]
    for (gen, p, shape), by_label in sorted(groups.items()):
        ours = by_label.get("gla_tpu", {}).get("total_s")
        cells = [f"{ours:.2f}" if ours else "failed"]
        ratios = []
        for peer in peers:
            seconds = by_label.get(peer, {}).get("total_s")
            cells.append(f"{seconds:.2f}" if seconds else "failed")
            ratios.append(f"{ours / seconds:.1f}" if ours and seconds else "-")
        lines.append(f"| {gen} | {p} | {shape} | " + " | ".join(cells) + " | "
                     + " / ".join(ratios) + " |")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--generations", default="v5e,v6e")
    parser.add_argument("--heads", default="8,16,32,64")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--passes", default="fwd,fwd_bwd")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ours-only", action="store_true", help="no JAX kernel")
    parser.add_argument("--full", action="store_true", help="no causal mask (default: causal)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--name", default="tpu_compile_time")
    args = parser.parse_args(argv)
    if args.child:
        raw = json.loads(args.child)
        raw["shape"] = tuple(raw["shape"])
        raw["options"] = tuple(tuple(o) for o in raw["options"])
        _child(Spec(**raw))
        return
    specs = specs_for(args.generations.split(","), [int(h) for h in args.heads.split(",")],
                      [int(d) for d in args.head_dims.split(",")], args.passes.split(","),
                      args.seq_len, not args.full, args.batch,
                      IMPLS[:1] if args.ours_only else IMPLS)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for n, spec in enumerate(specs, 1):
        record = measure(spec, args.repeats, args.timeout)
        records.append(record)
        seconds = record.get("total_s")
        print(f"[{n}/{len(specs)}] {spec.key}: "
              f"{f'{seconds:.2f} s' if seconds is not None else record['error']}", flush=True)
    env = {"date": datetime.date.today().isoformat(), "python": sys.version.split()[0],
           "host_cpus": _cpu_count(), "repeats": args.repeats,
           "command": "python -m bench.tpu_compile_time " + " ".join(argv or sys.argv[1:])}
    from importlib.metadata import version
    env.update({p: version(p) for p in ("jax", "jaxlib", "libtpu")})
    (out / f"{args.name}.json").write_text(json.dumps({"env": env, "records": records},
                                                      indent=1))
    write_table(records, out / f"{args.name}.md", env)


def _cpu_count() -> int:
    import os

    return os.cpu_count() or 0


if __name__ == "__main__":
    main()
