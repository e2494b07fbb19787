"""Plots of the side-by-side GPU results: ms vs T per implementation (the GLA / softmax crossover).

Usage: python bench/gpu_plot.py results/crossover.json --out results/crossover.png
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    with open(args.json) as f:
        plot_crossover(json.load(f), args.out)


if __name__ == "__main__":
    main()
