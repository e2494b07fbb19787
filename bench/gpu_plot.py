"""Plots of the side-by-side GPU results: ms vs T per implementation (the GLA / softmax
crossover), or ms per shape and implementation for a run of several shapes (attention, gla).

Usage: python bench/gpu_plot.py results/crossover.json --out results/crossover.png
       python bench/gpu_plot.py results/gla.json --out results/gla.png
"""

from __future__ import annotations

import argparse
import collections
import json


def plot_crossover(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = collections.defaultdict(list)
    for r in records:
        if r["op"] == "crossover" and r.get("ms_median") is not None:
            series[r["impl"]].append((r["shape"][2], r["ms_median"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for impl, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("T (B=2, H=16, D=K=V=128)")
    ax.set_ylabel("fwd+bwd ms (median)")
    device = records[0]["device"] if records else ""
    ax.set_title(f"GLA chunk vs causal flash attention, {device}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_shapes(records, path):
    """One panel per mode (fwd, fwd+bwd): ms (log) per shape, one marker series per impl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the breakdown parts' kernels alone are left out: their times are parts of the totals
    timed = [r for r in records
             if r.get("ms_median") is not None and r["op"] not in ("gla_kernel", "gla_pair_kernel")]
    modes = sorted({r["mode"] for r in timed})
    shapes = list(dict.fromkeys(str(tuple(r["shape"])) for r in timed))
    impls = sorted({r["impl"] for r in timed})
    color = {impl: f"C{i % 10}" for i, impl in enumerate(impls)}  # the same in every panel
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        series = collections.defaultdict(dict)
        for r in timed:
            if r["mode"] == mode:
                series[r["impl"]][str(tuple(r["shape"]))] = r["ms_median"]
        for impl, points in sorted(series.items()):
            xs = [i for i, s in enumerate(shapes) if s in points]
            ax.plot(xs, [points[shapes[i]] for i in xs], marker="o", linestyle="", label=impl,
                    color=color[impl])
        ax.set_xticks(range(len(shapes)), shapes, rotation=60, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel(f"{mode} ms (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    device = timed[0]["device"] if timed else ""
    fig.suptitle(f"{timed[0]['op'] if timed else ''}, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    with open(args.json) as f:
        records = json.load(f)
    if any(r["op"] == "crossover" for r in records):
        plot_crossover(records, args.out)
    else:
        plot_shapes(records, args.out)


if __name__ == "__main__":
    main()
