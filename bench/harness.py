"""Timing of JAX functions, done right: compile once (timed apart), warm up, then time batches of
iterations with one block_until_ready per batch, and report the median and spread over repeats."""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import statistics
import time
from typing import Any, Callable

import jax


@dataclasses.dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    compile_ms: float
    iters: int
    repeats: int


def time_jitted(fn: Callable, *args, warmup: int = 2, iters: int = 10, repeats: int = 5) -> Timing:
    """Times `jax.jit(fn)(*args)`; each repeat runs `iters` calls and syncs once."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_ms = (time.perf_counter() - start) * 1e3
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for _ in range(iters):
            out = compiled(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) * 1e3 / iters)
    return Timing(statistics.median(per_call), min(per_call), max(per_call), compile_ms, iters,
                  repeats)


def iters_for_budget(fn: Callable, *args, budget_ms: float = 300.0, max_iters: int = 50) -> int:
    """Iterations per repeat so one repeat takes about `budget_ms` (at least 1)."""
    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    one = (time.perf_counter() - start) * 1e3
    return int(max(1, min(max_iters, budget_ms // max(one, 1e-3))))


def peak_memory_bytes(device=None) -> int | None:
    """Peak device memory in use, where the backend reports it (GPU/TPU); None on CPU."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats:
        return None
    return stats.get("peak_bytes_in_use")


def environment() -> dict[str, Any]:
    """Device, date and versions recorded beside every result."""
    dev = jax.devices()[0]
    return {
        "device": f"{dev.platform}:{dev.device_kind}",
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "python": platform.python_version(),
    }


class Progress:
    """The "[n/N]" counter a long run prints at the head of each measured program's line."""

    def __init__(self, total: int):
        self.total = total
        self.done = 0

    def step(self, programs: int = 1) -> str:
        """Counts `programs` more as done (a line that stands for several, e.g. a peer refused
        before its modes are timed) and returns the counter."""
        self.done += programs
        return f"[{self.done}/{self.total}]"


def write_json(path: str, records: list[dict]) -> None:
    import os

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(records, f, indent=2)


def format_table(rows: list[dict], columns: list[str]) -> str:
    """A plain-text table of `rows` (dicts) with the given columns; floats to 4 significant digits."""

    def fmt(x):
        if isinstance(x, float):
            return f"{x:.4g}"
        return "-" if x is None else str(x)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c)
              for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
