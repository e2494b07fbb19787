"""The results of a run, for reading: a Markdown table (a summary of ours against each peer at its
best options, then every record) and a plot of the same ratios, one small panel per op and pass."""

from __future__ import annotations

import itertools
import math
import pathlib

from bench.tpu_static.programs import GENERATIONS

PEER_ORDER = ("jax_flash", "jax_flash_bthd", "splash", "xla_dot_product_attention", "gla_tpu_xla",
              "deltanet_tpu", "deltanet_tpu_gdn2")

_PROFILER_SAFE_LABEL = "gla_tpu profiler_safe=True"
_PASS_ORDER = ("fwd", "fwd_bwd", "bwd")
_PASS_NAMES = {"fwd": "fwd", "fwd_bwd": "fwd+bwd", "bwd": "bwd"}
_PEER_NAMES = {"jax_flash": "jax_flash (JAX's Pallas flash_attention)",
               "jax_flash_bthd": "jax_flash_bthd (the same, from [B, T, H, D])",
               "splash": "splash (JAX's splash attention)",
               "xla_dot_product_attention": "jax.nn.dot_product_attention (xla)",
               "gla_tpu_xla": "gla_tpu_xla (our xla backend)",
               "deltanet_tpu": "deltanet_tpu (deltanet-tpu's chunk_gla)",
               "deltanet_tpu_gdn2": "deltanet_tpu_gdn2 (deltanet-tpu's chunk_gdn2)"}


def _label(r: dict) -> str:
    return r["impl"] + "".join(f" {k}={v}" for k, v in r["options"])


def _ours(by_label: dict):
    """The program's record of ours among records by label: the default kernels, or where the
    profiler takes only the profiler-safe ones (`_gla_options`), those; None if neither."""
    return by_label.get("gla_tpu") or by_label.get(_PROFILER_SAFE_LABEL)


def _cycles(r: dict) -> str:
    """A record's cycles; "≥" marks a lower bound (XLA ops the profiler could not take)."""
    return ("≥" if r.get("lower_bound") else "") + f"{r['cycles']:,}"


def _programs(records: list[dict]) -> list[tuple[tuple, dict]]:
    """[((op, shape, generation, passes), {label: record}), ...], sorted."""
    groups: dict = {}
    for r in records:
        key = (r["op"], tuple(r["shape"]), r["generation"], r["passes"])
        groups.setdefault(key, {})[_label(r)] = r
    return sorted(groups.items(), key=lambda kv: str(kv[0]))


def _best(by_label: dict, peer: str):
    """The peer's profiled record with the fewest cycles among a program's records, else None."""
    done = [r for r in by_label.values() if r["impl"] == peer and r.get("cycles")]
    return min(done, key=lambda r: r["cycles"]) if done else None


def write_table(records: list[dict], path: pathlib.Path) -> None:
    """Markdown: a summary (one row per program: ours, each peer at its best options, ours/peer)
    and every record."""
    ordered = _programs(records)
    peers = [p for p in PEER_ORDER if any(r["impl"] == p for r in records)]
    lines = ["## Summary: ours / peer at its best options (< 1 means ours estimates fewer cycles)",
             "", "≥: a lower bound, some of the program's XLA ops not profiled (the record's "
             "`unprofiled_ops`).", "",
             "| op | shape | gen | pass | ours (kernels) | " + " | ".join(peers) + " |",
             "|---|---|---|---|---|" + "---|" * len(peers)]
    for (op, shape, gen, p), by_label in ordered:
        ours = _ours(by_label) or {}
        if ours.get("cycles") is None:
            cell = "failed" if ours else "-"
        else:
            cell = f"{_cycles(ours)} ({ours['kernel_cycles']:,})" + (
                " profiler_safe" if _label(ours) == _PROFILER_SAFE_LABEL else "")
        row = [op, str(shape), gen, p, cell]
        for peer in peers:
            best = _best(by_label, peer)
            if best is None:
                tried = any(r["impl"] == peer for r in by_label.values())
                row.append("profiler failed" if tried else "")
                continue
            opts = "".join(f" {k}={v}" for k, v in best["options"])
            ratio = f", {ours['cycles'] / best['cycles']:.2f}x" if ours.get("cycles") else ""
            row.append(f"{_cycles(best)}{opts}{ratio}")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Every record", "",
              "| op | shape | gen | pass | impl | cycles | kernels | est. us | MXU util | "
              "/ ours |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (op, shape, gen, p), by_label in ordered:
        ours = (_ours(by_label) or {}).get("cycles")
        for label, r in sorted(by_label.items()):
            if r.get("cycles") is None:
                lines.append(f"| {op} | {shape} | {gen} | {p} | {label} | - | - | - | - | "
                             f"{r['error']} |")
                continue
            ratio = f"{r['cycles'] / ours:.2f}" if ours else "-"
            lines.append(f"| {op} | {shape} | {gen} | {p} | {label} | {_cycles(r)} | "
                         f"{r['kernel_cycles']:,} | {r['estimated_us']:.1f} | "
                         f"{r['mxu_utilization']:.1%} | {ratio} |")
    path.write_text("\n".join(lines) + "\n")


# The plot: a panel holds one op and pass, its bar groups one per (shape, generation), laid out
# shape by shape; shapes go on to a further panel past this many groups or bars (so that each
# bar's label fits above it).
_GROUPS_PER_PANEL = 8
_BARS_PER_PANEL = 16
_PANEL_COLUMNS = 2


def _shape_label(op: str, shape: tuple) -> str:
    """A shape as the panels name it: attention (B, H, T, D, causal), GLA (B, T, H, K, V, gate,
    mode); T = 1 is a decode step."""
    if op == "attention" and len(shape) == 5:
        b, h, t, d, causal = shape
        return f"B{b} H{h} T{t} D{d}\n{'causal' if causal else 'non-causal'}"
    if op == "gla" and len(shape) == 7:
        b, t, h, k, v, gate, mode = shape
        step = "decode" if t == 1 else f"T{t}"
        return f"B{b} {step} H{h} K{k} V{v}\n{gate} gates, {mode}"
    if op == "delta_rule" and len(shape) == 7:
        b, t, h, hv, k, v, gate = shape
        variant = {"none": "DeltaNet", "head": "Gated DeltaNet", "key": "KDA"}[gate]
        return f"B{b} T{t} H{h} HV{hv} K{k} V{v}\n{variant}"
    return "x".join(map(str, shape))


def _bound(ours: dict, peer: dict) -> str:
    """How a ratio peer / ours relates to the true one where a lower bound enters it: "≥" (the
    peer's cycles are), "≤" (ours are), "~" (both)."""
    return {(True, False): "≥", (False, True): "≤", (True, True): "~"}.get(
        (bool(peer.get("lower_bound")), bool(ours.get("lower_bound"))), "")


def _plot_panels(records: list[dict]) -> list[dict]:
    """The panels of `write_plot`: [{"op", "passes", "part", "parts", "groups"}], each group
    {"shape", "generation", "profiler_safe", "bars": [(peer, cycles / ours, bound), ...]}, only
    the programs where ours and at least one peer have cycles."""
    by_op_pass: dict = {}
    for (op, shape, gen, passes), by_label in _programs(records):
        ours = _ours(by_label)
        if not ours or not ours.get("cycles"):
            continue
        bars = [(peer, best["cycles"] / ours["cycles"], _bound(ours, best))
                for peer in PEER_ORDER if (best := _best(by_label, peer)) is not None]
        if bars:
            shapes = by_op_pass.setdefault((op, passes), {})
            shapes.setdefault(shape, []).append(
                {"shape": shape, "generation": gen, "bars": bars,
                 "profiler_safe": _label(ours) == _PROFILER_SAFE_LABEL})
    gen_order = {g: n for n, g in enumerate(GENERATIONS)}
    panels = []
    for op, passes in sorted(by_op_pass, key=lambda k: (
            k[0], _PASS_ORDER.index(k[1]) if k[1] in _PASS_ORDER else len(_PASS_ORDER), k[1])):
        shapes = by_op_pass[(op, passes)]
        chunks: list[list] = [[]]
        for shape in _sorted_shapes(shapes):
            groups = sorted(shapes[shape], key=lambda g: gen_order.get(g["generation"], 99))
            bars = sum(len(g["bars"]) for g in chunks[-1] + groups)
            if chunks[-1] and (len(chunks[-1]) + len(groups) > _GROUPS_PER_PANEL
                               or bars > _BARS_PER_PANEL):
                chunks.append([])
            chunks[-1] += groups
        panels += [{"op": op, "passes": passes, "part": n + 1, "parts": len(chunks),
                    "groups": groups} for n, groups in enumerate(chunks)]
    return panels


def _sorted_shapes(shapes) -> list:
    try:
        return sorted(shapes)
    except TypeError:  # shapes of mixed kinds under one op
        return sorted(shapes, key=str)


def write_plot(records: list[dict], path: pathlib.Path) -> None:
    """Small multiples of each peer's estimated cycles relative to ours (ours = 1, the black
    line; a bar above it: the peer needs more cycles than ours). One panel per op and pass (more
    where it holds many shapes), a group of bars per (shape, generation), each peer at its best
    options, log scale. Skipped without matplotlib (the bench extra)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        return
    panels = _plot_panels(records)
    if not panels:
        fig = plt.figure(figsize=(6, 1.5))
        fig.text(0.5, 0.5, "No program has cycles of both ours and a peer (see the table).",
                 ha="center", va="center")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return
    colors = dict(zip(PEER_ORDER, plt.get_cmap("tab10").colors, strict=False))
    ratios = [r for p in panels for g in p["groups"] for _, r, _ in g["bars"]]
    # Shared y limits, at least 1/2 .. 2 so near-equal ratios do not fill a panel.
    low, high = min(ratios + [0.5]) / 1.5, max(ratios + [2.0]) * 1.5
    columns = min(_PANEL_COLUMNS, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.4 * columns, 3.4 * rows + 1.0),
                             squeeze=False, layout="constrained")
    for ax, panel in zip(axes.flat, panels, strict=False):
        _draw_panel(ax, panel, colors)
        ax.set_yscale("log")
        ax.set_ylim(low, high)
        ax.yaxis.set_major_locator(ticker.FixedLocator(
            [2.0 ** e for e in range(math.floor(math.log2(low)), math.ceil(math.log2(high)) + 1)]))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_locator(ticker.NullLocator())
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("peer cycles / ours")
    shown = [p for p in PEER_ORDER
             if any(b[0] == p for panel in panels for g in panel["groups"] for b in g["bars"])]
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in shown]
    fig.legend(handles, [_PEER_NAMES.get(p, p) for p in shown], loc="outside upper center",
               ncols=min(len(shown), 4), frameon=False, fontsize=9, title_fontsize=10,
               title="libtpu's static cycle estimate: each peer at its best options relative to "
                     "ours (= 1, the black line; above it, ours needs fewer cycles)")
    notes = [("A generation or shape left out: ours or every peer failed or was not profiled "
              "(the table says which).")]
    if any(b[2] for p in panels for g in p["groups"] for b in g["bars"]):
        notes.append("Hatched: a lower bound enters the ratio (≥: the peer's cycles, ≤: ours, "
                     "~: both), XLA ops the profiler could not take.")
    if any(g["profiler_safe"] for p in panels for g in p["groups"]):
        notes.append("*: ours with BlockSizes(profiler_safe=True), the kernels this "
                     "generation's profiler takes.")
    fig.supxlabel("\n".join(notes), x=0.01, ha="left", fontsize=7.5)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _draw_panel(ax, panel: dict, colors: dict) -> None:
    """One panel of `write_plot`: its groups left to right, a gap between shapes, the shape
    named under its groups."""
    groups = panel["groups"]
    width = 0.8 / max(len(g["bars"]) for g in groups)
    x, positions, spans = 0.0, [], {}
    for n, g in enumerate(groups):
        if n and g["shape"] != groups[n - 1]["shape"]:
            x += 0.6
        positions.append(x)
        spans.setdefault(g["shape"], []).append(x)
        x += 1.0
    span = max(x - 1.0, 3.0) + 1.2
    # Labels stand on end where they would be wider than their bars (about 0.3 in, on a panel
    # about 5.5 in wide).
    rotation = 90 if width * 5.5 / span < 0.3 else 0
    for pos, g in zip(positions, groups, strict=True):
        start = pos - width * (len(g["bars"]) - 1) / 2
        for n, (peer, ratio, bound) in enumerate(g["bars"]):
            bx = start + n * width
            ax.bar(bx, ratio - 1.0, width=width * 0.92, bottom=1.0, color=colors[peer],
                   hatch="////" if bound else None, edgecolor="white" if bound else None,
                   linewidth=0)
            ax.annotate(f"{bound}{ratio:.2f}" if ratio < 10 else f"{bound}{ratio:.0f}",
                        (bx, ratio), xytext=(0, 2 if ratio >= 1 else -2),
                        textcoords="offset points", ha="center",
                        va="bottom" if ratio >= 1 else "top", fontsize=7, rotation=rotation)
    ax.axhline(1.0, color="black", linewidth=1.0)
    ax.set_xticks(positions, [g["generation"] + ("*" if g["profiler_safe"] else "")
                              for g in groups])
    ax.tick_params(axis="x", length=0)
    middle = (x - 1.0) / 2
    ax.set_xlim(middle - span / 2, middle + span / 2)
    for shape, xs in spans.items():
        ax.annotate(_shape_label(panel["op"], shape), (sum(xs) / len(xs), 0),
                    xycoords=("data", "axes fraction"), xytext=(0, -16),
                    textcoords="offset points", ha="center", va="top", fontsize=8,
                    color="0.25")
    for a, b in itertools.pairwise(positions):
        if b - a > 1.0:
            ax.axvline((a + b) / 2, color="0.85", linewidth=0.8)
    part = f" ({panel['part']} of {panel['parts']})" if panel["parts"] > 1 else ""
    ax.set_title(f"{panel['op']} {_PASS_NAMES.get(panel['passes'], panel['passes'])}{part}",
                 fontsize=10, loc="left")
    ax.grid(axis="y", color="0.92")
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
