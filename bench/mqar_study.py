"""Multi-query associative recall as Zoology poses it: accuracy against model width, per kind.

The task (Arora et al., "Zoology", 2023): vocabulary 8192, keys from its lower half, values from
the upper half. A row of T tokens opens with P key-value pairs k_1 v_1 ... k_P v_P; each of the
P keys is queried once later, at a position drawn from a power law over the remaining even
offsets (most queries soon after the context, a few far), and the model is scored on predicting
the key's value at the query. Every other position holds a random token of the whole vocabulary,
unscored. Rows are drawn on the device, fresh each step.

The study: for each sequence length T, each kind and each width, one 2-layer LM is trained on
rows with 16, 32 and 64 pairs in equal parts (`--pairs`), once per peak learning rate of the
sweep, and evaluated on held-out rows per pair count. The table reports the best rate's accuracy
(best by the mean over pair counts). Heads are 64 wide (num_heads = d_model / 64); every kind runs
at its layer's defaults (fla's: short convolutions on the delta-rule kinds, none on the GLA kinds).

    python -m bench.mqar_study --out DIR                   # every configuration, in one process
    python -m bench.mqar_study --out DIR --shard 2/4       # the third quarter (one per GPU)
    python -m bench.mqar_study --merge DIR                 # the table and plot from DIR/*.json
    python bench/associative_recall.py --preset zoology --out DIR    # the same as the first

A run also records the backend each kind's ops ran on (the "auto" fallbacks it warned about).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import glob
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench.associative_recall import learning_rate, loss_and_accuracy
from gla_tpu.layers import block, lm, training
from gla_tpu.ops.common.backends import record_fallbacks

VOCAB = 8192
HEAD_DIM = 64
SLIDING_WINDOW = 64

# Study kind -> (layer kinds of the two layers, block fields). "sliding_window" is softmax over
# the last SLIDING_WINDOW keys; "hybrid" is a Gated DeltaNet layer under a sliding-window layer.
KINDS = {
    "softmax": (("softmax",), {}),
    "sliding_window": (("softmax",), {"window": SLIDING_WINDOW}),
    "gla": (("gla",), {}),
    "simple_gla": (("simple_gla",), {}),
    "linear": (("linear",), {}),
    "deltanet": (("deltanet",), {}),
    "gated_deltanet": (("gated_deltanet",), {}),
    "kda": (("kda",), {}),
    "hybrid": (("gated_deltanet", "softmax"), {"window": SLIDING_WINDOW}),
}


def mqar_batch(key, *, rows: int, seq_len: int, num_pairs: int, vocab: int = VOCAB,
               power_a: float = 0.01):
    """(inputs [rows, seq_len] int32, targets [rows, seq_len] int32, weights [rows, seq_len]
    float32): weight 1 at each query (an input equal to a context key) whose target is that key's
    value; targets elsewhere are 0 and unscored."""
    half = vocab // 2
    space = (seq_len - 2 * num_pairs) // 2  # even offsets after the context a query can take
    if num_pairs < 1 or space < num_pairs:
        raise ValueError(f"need 1 <= num_pairs <= seq_len / 4; got num_pairs={num_pairs}, "
                         f"seq_len={seq_len}.")
    k_keys, k_values, k_gaps, k_noise = jax.random.split(key, 4)
    # P distinct keys in [1, half) per row; values in [half, vocab), with replacement.
    keys = 1 + jax.lax.top_k(jax.random.uniform(k_keys, (rows, half - 1)), num_pairs)[1]
    values = jax.random.randint(k_values, (rows, num_pairs), half, vocab)
    # P distinct gaps per row, P(gap = g) ~ (g + 1)^(power_a - 1) (Gumbel top-k sampling).
    log_p = (power_a - 1.0) * jnp.log(jnp.arange(1, space + 1, dtype=jnp.float32))
    gumbel = jax.random.gumbel(k_gaps, (rows, space))
    gaps = jax.lax.top_k(log_p[None, :] + gumbel, num_pairs)[1]
    positions = 2 * num_pairs + 2 * gaps  # [rows, P]
    inputs = jax.random.randint(k_noise, (rows, seq_len), 0, vocab)
    context = jnp.stack([keys, values], axis=2).reshape(rows, 2 * num_pairs)
    inputs = inputs.at[:, : 2 * num_pairs].set(context)
    row = jnp.arange(rows)[:, None]
    inputs = inputs.at[row, positions].set(keys)
    targets = jnp.zeros((rows, seq_len), jnp.int32).at[row, positions].set(values)
    weights = jnp.zeros((rows, seq_len), jnp.float32).at[row, positions].set(1.0)
    return inputs.astype(jnp.int32), targets, weights


def model_config(kind: str, width: int, args) -> lm.Config:
    layers, fields = KINDS[kind]
    blk = block.Config(d_model=width, num_heads=max(width // HEAD_DIM, 1), attention=layers[0],
                       **fields)
    pattern = layers if len(layers) > 1 else None
    return lm.Config(vocab_size=VOCAB, num_layers=args.num_layers, block=blk, dtype=args.dtype,
                     layer_pattern=pattern)


def training_batch(key, seq_len: int, args):
    """`--rows-per-count` rows of each pair count of `--pairs`, concatenated."""
    parts = [mqar_batch(k, rows=args.rows_per_count, seq_len=seq_len, num_pairs=p)
             for k, p in zip(jax.random.split(key, len(args.pairs)), args.pairs)]
    return tuple(jnp.concatenate(xs, axis=0) for xs in zip(*parts))


def make_trainer(cfg: lm.Config, seq_len: int, args):
    """A jitted run of `--chunk` steps (a lax.scan, data drawn on the device) that takes the peak
    learning rate as an argument, so one compile serves the whole sweep."""
    schedule = functools.partial(learning_rate, peak=1.0, total=args.steps)
    tx = training.adamw(schedule, weight_decay=args.weight_decay)

    def step(carry, key):
        params, opt_state, peak = carry
        batch = training_batch(key, seq_len, args)
        (loss, acc), grads = jax.value_and_grad(loss_and_accuracy, has_aux=True)(
            params, *batch, cfg)
        updates, opt_state = tx.update(grads, opt_state, params)
        updates = jax.tree_util.tree_map(lambda u: (peak * u).astype(u.dtype), updates)
        return (optax.apply_updates(params, updates), opt_state, peak), (loss, acc)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def run(params, opt_state, peak, keys):
        (params, opt_state, _), (loss, acc) = jax.lax.scan(step, (params, opt_state, peak), keys)
        return params, opt_state, jnp.mean(loss), jnp.mean(acc)

    return tx, run


def evaluate(params, cfg, seq_len: int, args) -> dict:
    fn = jax.jit(functools.partial(loss_and_accuracy, cfg=cfg))
    accuracy = {}
    for p in args.pairs:
        key = jax.random.key(10_000 + p)  # the same held-out rows for every kind and rate
        accs = [float(fn(params, *mqar_batch(k, rows=args.eval_rows, seq_len=seq_len,
                                              num_pairs=p))[1])
                for k in jax.random.split(key, args.eval_batches)]
        accuracy[str(p)] = float(np.mean(accs))
    return accuracy


def run_configuration(kind: str, width: int, seq_len: int, args) -> dict:
    """Trains one LM per learning rate of the sweep; returns every rate's result."""
    cfg = model_config(kind, width, args)
    tx, run = make_trainer(cfg, seq_len, args)
    chunks = args.steps // args.chunk
    record = {"kind": kind, "width": width, "seq_len": seq_len, "runs": [], "fallbacks": []}
    with record_fallbacks() as fallbacks:
        for peak in args.lrs:
            params = lm.init(jax.random.key(args.seed), cfg)
            opt_state = tx.init(params)
            keys = jax.random.split(jax.random.key(args.seed + 1), chunks * args.chunk)
            keys = keys.reshape(chunks, args.chunk)
            start = time.perf_counter()
            params, opt_state, loss, acc = run(params, opt_state, jnp.float32(peak), keys[0])
            loss.block_until_ready()
            first_s = time.perf_counter() - start
            start = time.perf_counter()
            for c in range(1, chunks):
                params, opt_state, loss, acc = run(params, opt_state, jnp.float32(peak), keys[c])
            final_loss = float(loss)  # one synchronization per rate
            train_s = time.perf_counter() - start
            accuracy = evaluate(params, cfg, seq_len, args)
            record["runs"].append({
                "lr": peak, "accuracy": accuracy, "mean_accuracy": float(np.mean(
                    list(accuracy.values()))), "final_train_loss": final_loss,
                "first_chunk_s": first_s,
                "ms_per_step": 1e3 * train_s / max((chunks - 1) * args.chunk, 1)})
            record["params"] = lm.num_params(params)
            print(f"{seq_len:5d} {kind:>15} d{width:<4} lr {peak:.0e}: "
                  f"acc {record['runs'][-1]['mean_accuracy']:.3f} {accuracy} "
                  f"({first_s:.0f} s first chunk, "
                  f"{record['runs'][-1]['ms_per_step']:.1f} ms/step)", flush=True)
    record["fallbacks"] = sorted(set(fallbacks))
    record["best"] = max(record["runs"], key=lambda r: r["mean_accuracy"])
    return record


def configurations(args):
    """(seq_len, kind, width), the costliest first, so shards balance by round-robin."""
    configs = [(t, k, w) for t in args.seq_lens for k in args.kinds for w in args.widths]
    return sorted(configs, key=lambda c: (-c[0] * c[2], c[1]))


def finished(directory: str | None) -> set:
    """(seq_len, kind, width) of every configuration a shard in `directory` completed."""
    done = set()
    for path in glob.glob(os.path.join(directory or "", "mqar_shard*.json")):
        with open(path) as f:
            done |= {(r["seq_len"], r["kind"], r["width"]) for r in json.load(f)["results"]
                     if "best" in r}
    return done


def study(args) -> dict:
    index, count = args.shard
    skip = finished(args.resume_from) if args.resume_from else set()
    mine = [c for c in configurations(args) if c not in skip][index::count]
    deadline = time.monotonic() + args.time_limit if args.time_limit else None
    report = {"benchmark": "mqar_study", "date": datetime.date.today().isoformat(),
              "jax": jax.__version__, "device": jax.devices()[0].device_kind,
              "platform": platform.platform(), "shard": f"{index}/{count}",
              "args": {k: v for k, v in vars(args).items()
                       if k not in ("out", "merge", "resume_from", "tag")},
              "results": [], "skipped": []}
    tag = f"{args.tag}_" if args.tag else ""
    path = os.path.join(args.out, f"mqar_shard{tag}{index}of{count}.json")
    os.makedirs(args.out, exist_ok=True)
    for n, (seq_len, kind, width) in enumerate(mine):
        if deadline is not None and time.monotonic() > deadline:
            report["skipped"] = [list(c) for c in mine[n:]]
            break
        try:
            report["results"].append(run_configuration(kind, width, seq_len, args))
        except Exception as e:  # recorded and reported; the other configurations still run
            report["results"].append({"kind": kind, "width": width, "seq_len": seq_len,
                                      "error": f"{type(e).__name__}: {e}"[:2000]})
            print(f"{seq_len} {kind} d{width}: {type(e).__name__}: {e}"[:500], flush=True)
        _write(report, path)  # after every configuration: a killed run keeps its part
    _write(report, path)
    return report


def _write(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def merge(directory: str) -> str:
    """The best-rate accuracy table (markdown) and a plot, from every shard's JSON."""
    results, skipped, meta = [], [], None
    for path in sorted(glob.glob(os.path.join(directory, "mqar_shard*.json"))):
        with open(path) as f:
            report = json.load(f)
        meta = meta or report
        results += report["results"]
        skipped += report["skipped"]
    done = [r for r in results if "best" in r]
    args = meta["args"]
    lines = [f"MQAR (Zoology): vocab {VOCAB}, 2 layers, head dim {HEAD_DIM}, "
             f"{args['steps']} steps x {args['rows_per_count'] * len(args['pairs'])} rows, "
             f"pairs {args['pairs']} mixed; best of peak lr {args['lrs']}; seed {args['seed']}; "
             f"{meta['device']}, jax {meta['jax']}, {meta['date']}", ""]
    for seq_len in sorted({r["seq_len"] for r in done}):
        widths = sorted({r["width"] for r in done if r["seq_len"] == seq_len})
        header = " | ".join(f"d{w} P{p}" for w in widths for p in args["pairs"])
        lines += [f"T = {seq_len}: accuracy at the best rate (its lr)", "",
                  f"| kind | {header} | best lr by width |",
                  "|---|" + "---|" * (len(widths) * len(args["pairs"]) + 1)]
        for kind in args["kinds"]:
            row = {r["width"]: r for r in done if r["seq_len"] == seq_len and r["kind"] == kind}
            cells = [f"{row[w]['best']['accuracy'][str(p)]:.3f}" if w in row else "-"
                     for w in widths for p in args["pairs"]]
            lrs = ", ".join(f"{row[w]['best']['lr']:.0e}" if w in row else "-" for w in widths)
            lines.append(f"| {kind} | " + " | ".join(cells) + f" | {lrs} |")
        lines.append("")
    errors = [r for r in results if "error" in r]
    lines += [f"failed: {r['seq_len']} {r['kind']} d{r['width']}: {r['error'][:200]}"
              for r in errors]
    lines += [f"not run (time limit): {s}" for s in skipped]
    fallbacks = sorted({(r["kind"], f) for r in done for f in r["fallbacks"]})
    lines += [f"backend fallback ({k}): {f}" for k, f in fallbacks]
    table = "\n".join(lines)
    with open(os.path.join(directory, "mqar_study.md"), "w") as f:
        f.write(table + "\n")
    _plot(done, args, os.path.join(directory, "mqar_study.png"))
    return table


def _plot(done, args, path) -> None:
    """accuracy against d_model, a line per kind, a panel per (T, pairs); needs matplotlib (the
    bench extra): without it, no plot."""
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'gla_tpu[bench]')")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seq_lens = sorted({r["seq_len"] for r in done})
    fig, axes = plt.subplots(len(seq_lens), len(args["pairs"]), squeeze=False,
                             figsize=(4 * len(args["pairs"]), 3.2 * len(seq_lens)),
                             sharex=True, sharey=True)
    for i, seq_len in enumerate(seq_lens):
        for j, p in enumerate(args["pairs"]):
            ax = axes[i][j]
            for kind in args["kinds"]:
                row = sorted((r["width"], r["best"]["accuracy"][str(p)]) for r in done
                             if r["seq_len"] == seq_len and r["kind"] == kind)
                if row:
                    ax.plot(*zip(*row), marker="o", label=kind)
            ax.set_xscale("log", base=2)
            ax.set_title(f"T = {seq_len}, {p} pairs")
            ax.set_xlabel("d_model")
            ax.set_ylabel("accuracy")
            ax.set_ylim(-0.02, 1.02)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=os.path.join("bench", "results", "mqar_study"))
    p.add_argument("--merge", metavar="DIR", help="only write the table and plot of DIR")
    p.add_argument("--shard", default="0/1", help="I/N: every N-th configuration from the I-th")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--seq-lens", nargs="+", type=int, default=[256, 512])
    p.add_argument("--widths", nargs="+", type=int, default=[64, 128, 256])
    p.add_argument("--pairs", nargs="+", type=int, default=[16, 32, 64])
    p.add_argument("--lrs", nargs="+", type=float, default=[3e-4, 1e-3, 3e-3])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--chunk", type=int, default=100, help="steps per jitted call")
    p.add_argument("--rows-per-count", type=int, default=32, help="rows per pair count a step")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-rows", type=int, default=256)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume-from", metavar="DIR",
                   help="leave out the configurations some shard JSON in DIR completed")
    p.add_argument("--tag", default="", help="a name for this run's shard files")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="seconds; configurations not started by then are listed as skipped")
    args = p.parse_args(argv)
    try:
        index, count = (int(x) for x in args.shard.split("/"))
        if not 0 <= index < count:
            raise ValueError
    except ValueError:
        p.error(f"--shard must be I/N with 0 <= I < N; got {args.shard!r}")
    args.shard = (index, count)
    if args.steps < args.chunk or args.steps % args.chunk:
        p.error(f"--steps must be a positive multiple of --chunk ({args.chunk}); "
                f"got {args.steps}")
    for t in args.seq_lens:
        if 4 * max(args.pairs) > t:
            p.error(f"every --seq-lens value must be at least 4 x the largest --pairs "
                    f"({4 * max(args.pairs)}); got {t}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        table = merge(args.merge)
        print(table)
        return table
    report = study(args)
    return report


if __name__ == "__main__":
    main()
