"""TPU speed without a TPU: libtpu's static cycle estimate of whole programs, side by side.

For each (op, implementation, shape, generation, pass) a child process compiles the program for
one core of the generation on abstract inputs (the deviceless compile of gla_tpu.testing) with
`LIBTPU_INIT_ARGS=--xla_jf_dump_static_llo_profile_to=DIR`; libtpu then writes one
`*_static_llo_profile.textproto` per HLO op with its `estimated_cycles`, from the compiler's own
schedule and DMA latency model. The program's estimate is their sum. It is an estimate, never a
timing: the same model for every program, so ratios on one shape and generation mean something.
Each program compiles in its own process: the profiler aborts the process on kernels it cannot
model (splash attention), and long grids cost minutes and gigabytes.

Implementations: ours (mosaic_tpu, and our xla backend), JAX's Pallas TPU flash attention (its
default blocks and a sweep for its best), splash attention, jax.nn.dot_product_attention("xla"),
and deltanet-tpu's chunk_gla (the `tpu-bench` extra). deltanet-tpu picks interpret mode whenever
jax.default_backend() is not "tpu", so the child makes it see "tpu" while tracing.

    python -m bench.tpu_static --out DIR [--generations v5e,v6e] [--ops attention,gla]
                               [--impls ...] [--passes fwd,fwd_bwd] [--jobs 2]

writes DIR/tpu_static.json (one record per program), DIR/tpu_static.md and DIR/tpu_static.png;
records go to DIR/tpu_static.partial.jsonl as they come, and a rerun skips those already there.
A line `[n/N] key: cycles (seconds)` reports each program as it is done. `--from-json` rewrites
the three files from stored records without compiling; `--help` lists every option.

    programs.py  the generations, `Spec`, the shapes and each implementation's program
    __init__.py  `profile`: a child process per program, its record from libtpu's profiles
    report.py    the Markdown table and the plot
    __main__.py  the command line
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

from bench.tpu_static.programs import (  # noqa: F401 - the builders are imported from here too
    ATTENTION_SHAPES,
    CROSSOVER_T,
    DECODE_SHAPE,
    GENERATIONS,
    GLA_MODES,
    GLA_SHAPES,
    JAX_FLASH_BLOCKS,
    JAX_FLASH_BTHD_BLOCKS,
    PROFILER_SAFE_GENERATIONS,
    Spec,
    _attention_backward_program,
    _attention_program,
    _flops,
    _gla_program,
    _program,
    calibration_specs,
    clock_ghz,
    crossover_specs,
    specs_for,
)
from bench.tpu_static.report import PEER_ORDER, write_plot, write_table

__all__ = [
    "ATTENTION_SHAPES", "CROSSOVER_T", "DECODE_SHAPE", "GENERATIONS", "GLA_MODES", "GLA_SHAPES",
    "JAX_FLASH_BLOCKS", "JAX_FLASH_BTHD_BLOCKS", "PEER_ORDER", "PROFILER_SAFE_GENERATIONS", "Spec",
    "calibration_specs", "clock_ghz", "crossover_specs", "kernel_cycles", "profile", "specs_for",
    "unprofiled_twins", "write_plot", "write_table",
]

# The child processes run `python -m bench.tpu_static` from the repository's root.
_REPO = pathlib.Path(__file__).resolve().parents[2]


# The child: build one program and compile it.


def _child(spec: Spec, list_ops: bool = False) -> None:
    """Compiles the program of `spec`; with `list_ops`, prints its entry computation's ops as
    JSON [[name, opcode], ...]."""
    import jax

    from gla_tpu.testing.tpu_compile import compile_for_tpu

    # deltanet-tpu runs in interpret mode unless the default backend is "tpu" while tracing.
    jax.default_backend = lambda: "tpu"
    if spec.passes == "bwd":
        fn, args = _attention_backward_program(spec)
    else:
        fn, args = _program(spec)
    compiled = compile_for_tpu(fn, *args, generation=spec.generation)
    if list_ops:
        print(json.dumps(_entry_ops(compiled.as_text())))


_ENTRY_OP = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\(")
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# Entry ops the profiler writes no profile for.
_UNPROFILED_OPCODES = {"parameter", "bitcast", "tuple", "get-tuple-element", "constant",
                       "copy-start", "copy-done"}
# ... and the asynchronous slices of a parameter (DMAs the ops that wait on them carry).
_NO_PROFILE_BY_DESIGN = _UNPROFILED_OPCODES | {"slice-start", "slice-done"}


def _entry_ops(hlo_text: str) -> list:
    """[name, opcode, result type, custom-call target or None] of the instructions of an
    optimized HLO module's entry computation."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    ops_ = []
    for line in entry.splitlines()[1:]:
        match = _ENTRY_OP.match(line)
        if match:
            target = _CUSTOM_CALL_TARGET.search(line)
            ops_.append([match.group(1), match.group(3), match.group(2),
                         target.group(1) if target else None])
    return ops_


# The parent: one child per program, estimates parsed from the dumped profiles. It lives in the
# package's own module so that the names `profile` calls are those of `bench.tpu_static` (the
# tests replace `_run_child`, `_profile_one` and `unprofiled_twins` there).

_CYCLES = re.compile(r'hlo_op_name: "([^"]+)"\s+estimated_cycles: (\d+)')


def profile(spec: Spec, timeout: int = 900, twins: bool = True) -> dict:
    """Compiles `spec` in a child process and returns its record (cycles, per-op breakdown, or
    the error). Our attention's forward+backward is the sum of its forward program and of its
    backward program (the profiler cannot take our forward kernel in one program with the
    backward; `_attention_backward_program`). With `twins`, each program is compiled once more
    without the profiler to find the ops that have no profile of their own
    (`unprofiled_twins`); `cycles` stays the sum of the profiles."""
    if spec.op == "attention" and spec.impl == "gla_tpu" and spec.passes == "fwd_bwd":
        parts = [profile(dataclasses.replace(spec, passes=p), timeout, twins)
                 for p in ("fwd", "bwd")]
        record = dict(parts[0], passes="fwd_bwd", key=spec.key, method="fwd + bwd programs")
        if any(p.get("cycles") is None for p in parts):
            record.update(cycles=None, error="; ".join(str(p["error"]) for p in parts))
            return record
        record["ops"] = {f"{p['passes']}:{k}": v for p in parts for k, v in p["ops"].items()}
        record = _with_estimates(record, spec, sum(p["cycles"] for p in parts))
        if twins:
            missing = [[f"{p['passes']}:{name}", *rest] for p in parts
                       for name, *rest in (p.get("unprofiled_twins") or [])]
            _with_twins(record, None if any(p.get("unprofiled_twins") is None for p in parts)
                        else missing)
        return record
    record = _profile_one(spec, timeout)
    # a lower bound already lists what has no profile (`unprofiled_ops`)
    if twins and record.get("cycles") is not None and not record.get("lower_bound"):
        _with_twins(record, unprofiled_twins(spec, record["ops"], timeout))
    return record


# HLO ops XLA itself emits (names are the opcode plus a suffix); every other profiled op of a
# program is a Pallas kernel, named after its kernel function.
_XLA_OPCODES = (
    "copy|fusion|transpose|bitcast|convert|reduce|pad|slice|broadcast|concatenate|dot|"
    "convolution|reshape|select|dynamic|update|iota|add|multiply|subtract|divide|negate|"
    "exponential|log|maximum|minimum|compare|and|or|not|tuple|get-tuple-element|constant|"
    "custom-call|while|conditional|call|parameter|scatter|gather|sort|cumsum|rng|rsqrt|sqrt|"
    "power|tanh|logistic|clamp|abs|sign|floor|ceil|round|remainder|xor")
# An XLA op's name is its opcode, or the opcodes of a fusion joined by "_", then a suffix.
_XLA_OP = re.compile(rf"^(?:{_XLA_OPCODES})(?:_(?:{_XLA_OPCODES}))*(?:[.-]|$)")


def kernel_cycles(ops_cycles: dict) -> int:
    """The cycles of a program's Pallas kernels (its other ops are XLA's: layout copies, padding,
    the gate cumsum, casts)."""
    return sum(c for name, c in ops_cycles.items() if _is_kernel(name))


def _with_estimates(record: dict, spec: Spec, cycles: int) -> dict:
    gen = GENERATIONS[spec.generation]
    flops = _flops(spec)
    record.update(cycles=cycles, kernel_cycles=kernel_cycles(record.get("ops", {})),
                  estimated_us=cycles / (clock_ghz(spec.generation) * 1e3),
                  mxu_utilization=flops / (cycles * 2 * gen["mxu_macs"]),
                  clock_ghz=clock_ghz(spec.generation), useful_flops=flops, error=None)
    return record


def _run_child(spec: Spec, timeout: int, profile_dir: str | None = None,
               list_ops: bool = False) -> subprocess.CompletedProcess:
    """Compiles `spec` in a child process, with libtpu's static profile written to `profile_dir`
    (None: no profile). Raises subprocess.TimeoutExpired."""
    # libtpu's own logs (tpu_driver.*.log under /tmp/tpu_logs) reach gigabytes per profiled
    # program; a sweep filled a 250 GB disk. The profile itself goes to `profile_dir`.
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    env.setdefault("TPU_LOG_DIR", "disabled")
    env.pop("LIBTPU_INIT_ARGS", None)
    if profile_dir is not None:
        env["LIBTPU_INIT_ARGS"] = f"--xla_jf_dump_static_llo_profile_to={profile_dir}"
    cmd = [sys.executable, "-m", "bench.tpu_static", *(["--list-ops"] if list_ops else []),
           "--child", json.dumps(dataclasses.asdict(spec))]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=_REPO)


def _profile_one(spec: Spec, timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as dump:
        try:
            run = _run_child(spec, timeout, profile_dir=dump)
            error = (None if run.returncode == 0
                     else f"exit {run.returncode}: {_last_error(run.stderr)}")
        except subprocess.TimeoutExpired:
            error = f"timeout after {timeout} s"
        ops_cycles = {}
        for path in pathlib.Path(dump).glob("*_static_llo_profile.textproto"):
            for name, cycles in _CYCLES.findall(path.read_text()):
                ops_cycles[name] = ops_cycles.get(name, 0) + int(cycles)
    record = dataclasses.asdict(spec)
    record.update(key=spec.key, dtype="bfloat16", error=error, method="one program")
    if error is not None and "LLO_CHECK" in error and ops_cycles:
        # libtpu's LLO type check aborts the profile of some XLA layout ops on v5e (a relayout
        # lowered to a masked bf16 matmul). Where every op it did not reach is XLA's, not a
        # kernel, the estimate stands as a lower bound that names the ops left out.
        missing = _unprofiled_ops(spec, ops_cycles, timeout)
        if missing is not None and not any(_is_kernel(name) for name, _ in missing):
            record.update(lower_bound=True, unprofiled_ops=missing,
                          note=f"lower bound, {len(missing)} XLA op(s) not profiled: {error}")
            error = record["error"] = None
    if error is None and ops_cycles:
        record["ops"] = dict(sorted(ops_cycles.items(), key=lambda kv: -kv[1]))
        return _with_estimates(record, spec, sum(ops_cycles.values()))
    if error is None:
        record["error"] = "no static profile written"
    return record


def _listed_entry_ops(spec: Spec, timeout: int) -> list | None:
    """`_entry_ops` of `spec`'s program, compiled again without the profiler; None if that
    compile fails."""
    try:
        run = _run_child(spec, timeout, list_ops=True)
        return json.loads(run.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError):
        return None


def _unprofiled_ops(spec: Spec, ops_cycles: dict, timeout: int) -> list | None:
    """The entry ops of `spec`'s program that have no profile; None if the compile fails."""
    ops_ = _listed_entry_ops(spec, timeout)
    if ops_ is None:
        return None
    return [[name, opcode] for name, opcode, *_ in ops_
            if opcode not in _UNPROFILED_OPCODES and name not in ops_cycles]


def unprofiled_twins(spec: Spec, ops_cycles: dict, timeout: int) -> list | None:
    """The entry ops of `spec`'s program that cost time but have no profile of their own, each
    with its candidate twins: [[name, opcode, result type, {profiled op: cycles}], ...] (None if
    the compile fails).

    libtpu writes one profile per distinct compiled op, so an op that XLA compiles to the same
    code as another (the relayout of v beside those of q and k, the layout copy of dv beside
    dk's) has none, and the sum of the profiles counts that code once. Its twins are the
    profiled ops of the same opcode and result type; which one it repeats is not known, so a
    record brackets the program by the cheapest and the dearest twin (`cycles_with_twins`)."""
    ops_ = _listed_entry_ops(spec, timeout)
    if ops_ is None:
        return None
    signature = {name: (opcode, type_) for name, opcode, type_, _ in ops_}
    missing = []
    for name, opcode, type_, target in ops_:
        if name in ops_cycles or opcode in _NO_PROFILE_BY_DESIGN:
            continue
        if opcode == "custom-call" and target != "tpu_custom_call":
            continue  # XLA's own custom calls here (ConcatBitcast) are free views
        twins = {other: cycles for other, cycles in ops_cycles.items()
                 if signature.get(other) == (opcode, type_)}
        missing.append([name, opcode, type_, twins])
    return missing


def _with_twins(record: dict, missing: list | None) -> dict:
    """Adds `unprofiled_twins` and the bracket `cycles_with_twins` [low, high] (None where an
    unprofiled op has no twin) to a profiled record."""
    if missing is None:
        record.update(unprofiled_twins=None, cycles_with_twins=None)
        return record
    record["unprofiled_twins"] = missing
    if any(not twins for *_, twins in missing):
        record["cycles_with_twins"] = None
    else:
        record["cycles_with_twins"] = [
            record["cycles"] + sum(min(t.values()) for *_, t in missing),
            record["cycles"] + sum(max(t.values()) for *_, t in missing)]
    return record


def _is_kernel(op_name: str) -> bool:
    return not _XLA_OP.match(op_name.split(":")[-1])


def _last_error(stderr: str) -> str:
    """The line that says why a child failed: the profiler's abort, or the Python exception."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    for marker in (" failed: ", "Error:", "Exception", "Check failed"):
        hits = [ln for ln in lines if marker in ln and "worker hostname" not in ln]
        if hits:
            return hits[-1][:400]
    return (lines or ["failed"])[-1][:400]
