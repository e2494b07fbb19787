"""The command line of bench.tpu_static (its docstring says what a run does):

    python -m bench.tpu_static --out DIR [--generations v5e,v6e] [--ops attention,gla]
                               [--impls ...] [--passes fwd,fwd_bwd] [--jobs 2]
    python -m bench.tpu_static --from-json A.json [B.json ...] --out DIR [--name NAME]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import pathlib
import sys
import time

from bench import tpu_static
from bench.tpu_static.programs import (
    GENERATIONS,
    Spec,
    calibration_specs,
    crossover_specs,
    specs_for,
)
from bench.tpu_static.report import _cycles, write_plot, write_table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tpu_static",
                                     description=tpu_static.__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--list-ops", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--generations", default="v5e,v6e")
    parser.add_argument("--ops", default="attention,gla")
    parser.add_argument("--impls", default="")
    parser.add_argument("--passes", default="fwd,fwd_bwd")
    parser.add_argument("--exclude", default="",
                        help="OP:IMPL,... programs left out, e.g. attention:gla_tpu_xla")
    parser.add_argument("--crossover", action="store_true")
    parser.add_argument("--calibration", action="store_true")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--from-json", nargs="+", metavar="JSON",
                        help="no compiling: merge these results (later files win on equal "
                             "keys), recompute the derived fields and write --out/NAME.*")
    parser.add_argument("--name", default=None, help="file stem of the results")
    args = parser.parse_args(argv)
    if args.child:
        raw = json.loads(args.child)
        raw["shape"] = tuple(raw["shape"])
        raw["options"] = tuple(tuple(o) for o in raw["options"])
        tpu_static._child(Spec(**raw), list_ops=args.list_ops)
        return
    if args.from_json:
        merged, env = {}, {}
        for path in args.from_json:
            data = json.loads(pathlib.Path(path).read_text())
            env = data["env"]
            for r in data["records"]:
                merged[r["key"]] = _rederived(r)
        _write_results(list(merged.values()), env, pathlib.Path(args.out),
                       args.name or "tpu_static")
        return
    gens = args.generations.split(",")
    for gen in gens:
        if gen not in GENERATIONS:
            parser.error(f"--generations: {gen!r} is not one of {sorted(GENERATIONS)}")
        if not GENERATIONS[gen]["profiled"]:
            parser.error(f"--generations: libtpu has no static profile for {gen!r} "
                         "(no DMA latency model); the compile tests cover it")
    if args.crossover:
        specs, name = crossover_specs(gens), "tpu_static_crossover"
    elif args.calibration:
        specs, name = calibration_specs(), "tpu_static_calibration"
    else:
        specs = specs_for(args.ops.split(","), [i for i in args.impls.split(",") if i], gens,
                          args.passes.split(","))
        excluded = {tuple(item.split(":")) for item in args.exclude.split(",") if item}
        specs = [s for s in specs if (s.op, s.impl) not in excluded]
        name = "tpu_static"
    out = pathlib.Path(args.out)
    records = _profile_all(specs, out, args.name or name, args.jobs, args.timeout)
    env = {"date": datetime.date.today().isoformat(), "python": sys.version.split()[0]}
    try:
        from importlib.metadata import version
        env.update({p: version(p) for p in ("jax", "jaxlib", "libtpu")})
        env["deltanet-tpu"] = version("deltanet-tpu")
    except Exception as e:  # noqa: BLE001 - a missing optional package is only recorded
        env["versions_note"] = repr(e)
    _write_results(records, env, out, args.name or name)
    (out / f"{args.name or name}.partial.jsonl").unlink()


def _profile_all(specs: list[Spec], out: pathlib.Path, name: str, jobs: int,
                 timeout: int) -> list[dict]:
    """The records of `specs`, in their order, profiled `jobs` at a time, with a line
    `[n/N] key: cycles (seconds)` as each program is done. Each record is appended to
    out/NAME.partial.jsonl as it comes, and the programs already there are not profiled again:
    a long run that is stopped loses nothing."""
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f"{name}.partial.jsonl"
    done = {}
    if partial.exists():
        for line in partial.read_text().splitlines():
            record = json.loads(line)
            done[record["key"]] = record
    todo = [s for s in specs if s.key not in done]
    print(f"{len(specs)} programs: {len(todo)} to profile, {len(specs) - len(todo)} already in "
          f"{partial}", flush=True)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool, partial.open("a") as log:
        futures = [pool.submit(_timed_profile, s, timeout) for s in todo]
        for n, future in enumerate(concurrent.futures.as_completed(futures), 1):
            record, seconds = future.result()
            done[record["key"]] = record
            log.write(json.dumps(record) + "\n")
            log.flush()
            result = (f"{_cycles(record)} cycles" if record.get("cycles") is not None
                      else f"failed: {record['error']}")
            print(f"[{n}/{len(todo)}] {record['key']}: {result} ({seconds:.1f} s)", flush=True)
    return [done[s.key] for s in specs if s.key in done]


def _timed_profile(spec: Spec, timeout: int) -> tuple[dict, float]:
    start = time.perf_counter()
    record = tpu_static.profile(spec, timeout)
    return record, time.perf_counter() - start


def _rederived(record: dict) -> dict:
    """A stored record with its derived fields (estimates, kernel cycles) recomputed."""
    if record.get("cycles") is None:
        return record
    raw = {k: record[k] for k in ("op", "impl", "generation", "passes")}
    spec = Spec(shape=tuple(record["shape"]),
                options=tuple(tuple(o) for o in record["options"]), **raw)
    return tpu_static._with_estimates(dict(record), spec, record["cycles"])


def _write_results(records: list[dict], env: dict, out: pathlib.Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"env": env, "records": records}, indent=1))
    write_table(records, out / f"{name}.md")
    write_plot(records, out / f"{name}.png")
    print(f"wrote {out / name}.json, .md and .png", flush=True)


if __name__ == "__main__":
    main()
