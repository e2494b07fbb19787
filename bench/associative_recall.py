"""Multi-query associative recall (MQAR) with small LMs of each attention kind.

A sequence lists `num_pairs` key-value pairs, then `num_queries` of those keys again, each
followed by its value:  k_1 v_1 ... k_P v_P  q_1 a_1 ... q_Q a_Q  (keys distinct within a row,
values drawn with replacement). The LM is trained, and scored, only on predicting each answer a_j
from the prefix ending in q_j: the value has to be recalled from context, which a softmax layer
does by looking back and a linear-attention layer only through its fixed-size state.

Every variant gets the same width, depth, head count (so about the same parameter count), batch,
steps and learning-rate schedule. Reported per variant: answer accuracy and loss on held-out
sequences, training throughput in tokens/s (after compilation), parameter count. Training uses
optax (`gla_tpu.layers.training.adamw`), which the `train`, `bench` and `test` extras install.

    python bench/associative_recall.py      # default: ~220 CPU-seconds, ~4 min on a 2-core CPU
    python bench/associative_recall.py --steps 200 --kinds softmax gla --json /tmp/r.json
    python bench/associative_recall.py --preset zoology --out DIR   # the Zoology study on a GPU

`--preset zoology` runs `bench.mqar_study` (T 256 and 512, 16-64 pairs, vocabulary 8192, widths
64-256, a learning-rate sweep, every kind and a hybrid); the arguments after it are that module's.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gla_tpu.layers import block, lm, training

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                            "associative_recall.json")


@dataclasses.dataclass(frozen=True)
class Task:
    num_keys: int  # key vocabulary: token ids [0, num_keys)
    num_values: int  # value vocabulary: ids [num_keys, num_keys + num_values)
    num_pairs: int  # P key-value pairs in the context
    num_queries: int  # Q queried keys (distinct, drawn from the P)

    def __post_init__(self):
        if not 0 < self.num_queries <= self.num_pairs <= self.num_keys:
            raise ValueError(
                f"need 0 < num_queries <= num_pairs <= num_keys; got {self.num_queries=}, "
                f"{self.num_pairs=}, {self.num_keys=}."
            )
        if self.num_values <= 0:
            raise ValueError(f"num_values must be positive; got {self.num_values}.")

    @property
    def vocab_size(self) -> int:
        return self.num_keys + self.num_values

    @property
    def seq_len(self) -> int:
        """Model input length (the full sequence less its last token)."""
        return (self.num_pairs + self.num_queries) * 2 - 1


def make_batch(rng: np.random.Generator, task: Task, batch: int):
    """Returns (inputs [B, T] int32, targets [B, T] int32, weights [B, T] float32): weight 1 where
    the input is a queried key and the target its value."""
    p, q = task.num_pairs, task.num_queries
    keys = np.argsort(rng.random((batch, task.num_keys)), axis=1)[:, :p]  # distinct per row
    values = task.num_keys + rng.integers(0, task.num_values, (batch, p))
    picks = np.argsort(rng.random((batch, p)), axis=1)[:, :q]
    q_keys = np.take_along_axis(keys, picks, axis=1)
    q_values = np.take_along_axis(values, picks, axis=1)
    context = np.stack([keys, values], axis=2).reshape(batch, 2 * p)
    queries = np.stack([q_keys, q_values], axis=2).reshape(batch, 2 * q)
    seq = np.concatenate([context, queries], axis=1).astype(np.int32)
    weights = np.zeros((batch, 2 * (p + q) - 1), np.float32)
    weights[:, 2 * p :: 2] = 1.0  # inputs q_j (at 2p + 2j) predict a_j
    return seq[:, :-1], seq[:, 1:], weights


def model_config(kind: str, task: Task, args) -> lm.Config:
    blk = block.Config(d_model=args.d_model, num_heads=args.num_heads, attention=kind,
                       mode=args.gla_mode)
    return lm.Config(vocab_size=task.vocab_size, num_layers=args.num_layers, block=blk,
                     dtype=args.dtype)


def learning_rate(step, *, peak: float, total: int):
    """Warm-up, stable, decay: linear warm-up over the first fifth of the steps, the peak until
    the last fifth, then cosine decay to a tenth of the peak. Recall appears abruptly (an
    induction-like circuit forms) and needs the peak rate held long enough for that."""
    step = step.astype(jnp.float32)
    phase = max(total // 5, 1)
    warm = peak * (step + 1.0) / phase
    frac = jnp.clip((step - (total - phase)) / phase, 0.0, 1.0)
    decay = peak * (0.1 + 0.45 * (1.0 + jnp.cos(jnp.pi * frac)))
    return jnp.where(step < phase, warm, decay)


def loss_and_accuracy(params, inputs, targets, weights, cfg):
    logits, _ = lm.apply(params, inputs, cfg)
    loss = lm.cross_entropy(logits, targets, weights)
    hits = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32) * weights
    return loss, jnp.sum(hits) / jnp.sum(weights)


def make_optimizer(args):
    """optax AdamW (clip 1.0, decay on matrices) on the schedule; the schedule gets the step
    count from 0."""
    schedule = functools.partial(learning_rate, peak=args.lr, total=args.steps)
    return training.adamw(schedule, weight_decay=args.weight_decay)


def make_train_step(cfg: lm.Config, tx):
    @jax.jit
    def train_step(params, opt_state, inputs, targets, weights):
        (loss, acc), grads = jax.value_and_grad(loss_and_accuracy, has_aux=True)(
            params, inputs, targets, weights, cfg)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    return train_step


class ProgressBar:
    """A plain-text bar on stderr, redrawn in place."""

    def __init__(self, label: str, total: int, width: int = 30):
        self.label, self.total, self.width = label, total, width
        self.start = time.perf_counter()

    def update(self, done: int, info: str = "") -> None:
        filled = int(self.width * done / self.total)
        elapsed = time.perf_counter() - self.start
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"\r{self.label:>10} [{bar}] {done}/{self.total} {elapsed:5.0f}s {info}")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


def train_variant(kind: str, task: Task, args) -> dict:
    cfg = model_config(kind, task, args)
    params = lm.init(jax.random.key(args.seed), cfg)
    tx = make_optimizer(args)
    opt_state = tx.init(params)
    train_step = make_train_step(cfg, tx)
    rng = np.random.default_rng(args.seed)
    bar = ProgressBar(kind, args.steps)

    t0 = time.perf_counter()
    params, opt_state, loss, acc = train_step(params, opt_state, *make_batch(rng, task, args.batch))
    loss.block_until_ready()
    compile_s = time.perf_counter() - t0
    bar.update(1, f"loss {float(loss):.3f} (first step, compile {compile_s:.1f}s)")

    t0 = time.perf_counter()
    for step in range(2, args.steps + 1):
        params, opt_state, loss, acc = train_step(params, opt_state,
                                                  *make_batch(rng, task, args.batch))
        if step % args.log_every == 0 or step == args.steps:
            # One synchronization per `log_every` steps.
            bar.update(step, f"loss {float(loss):.3f} acc {float(acc):.3f}")
    loss.block_until_ready()
    train_s = time.perf_counter() - t0
    bar.close()

    eval_fn = jax.jit(functools.partial(loss_and_accuracy, cfg=cfg))
    eval_rng = np.random.default_rng(args.seed + 1)  # held-out draws, the same for every variant
    losses, accs = [], []
    for _ in range(args.eval_batches):
        loss, acc = eval_fn(params, *make_batch(eval_rng, task, args.batch))
        losses.append(float(loss))
        accs.append(float(acc))
    tokens = (args.steps - 1) * args.batch * task.seq_len
    return {
        "kind": kind,
        "params": lm.num_params(params),
        "accuracy": float(np.mean(accs)),
        "loss": float(np.mean(losses)),
        "train_tokens_per_s": tokens / train_s,
        "train_s": train_s,
        "compile_s": compile_s,
    }


def format_table(results, task: Task, args) -> str:
    lines = [
        f"MQAR: {task.num_pairs} pairs, {task.num_queries} queries, {task.num_keys} keys x "
        f"{task.num_values} values, T={task.seq_len}; d_model={args.d_model}, "
        f"{args.num_layers} layers, {args.num_heads} heads, {args.steps} steps x batch {args.batch}",
        "| variant | params | accuracy | loss | train tokens/s | train s | compile s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['kind']} | {r['params']} | {r['accuracy']:.3f} | {r['loss']:.3f} | "
            f"{r['train_tokens_per_s']:.0f} | {r['train_s']:.1f} | {r['compile_s']:.1f} |"
        )
    order = sorted(results, key=lambda r: (-r["accuracy"], r["loss"]))
    lines.append("ordering by accuracy: " + " > ".join(r["kind"] for r in order))
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", choices=("zoology",),
                   help="run bench.mqar_study instead, with the arguments that follow")
    p.add_argument("--kinds", nargs="+", default=list(block.ATTENTION_KINDS),
                   choices=block.ATTENTION_KINDS)
    p.add_argument("--num-keys", type=int, default=32)
    p.add_argument("--num-values", type=int, default=32)
    p.add_argument("--num-pairs", type=int, default=8)
    p.add_argument("--num-queries", type=int, default=8)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="activations (bfloat16 is slow on CPU; use it on TPU/GPU)")
    p.add_argument("--gla-mode", default="fused_recurrent",
                   choices=("auto", "chunk", "fused_chunk", "fused_recurrent"),
                   help="ops.gla mode of the linear kinds; all compute the same function, the "
                        "token-by-token one is the fastest on CPU at these lengths")
    p.add_argument("--steps", type=int, default=350)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=DEFAULT_JSON, help="where to write the results")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"--steps must be at least 2; got {args.steps}")
    return args


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--preset" in argv:
        i = argv.index("--preset")
        if argv[i + 1 : i + 2] != ["zoology"]:
            raise SystemExit(f"--preset takes 'zoology'; got {argv[i + 1 : i + 2]}")
        # Run as a file, this script's directory is on sys.path; the study imports `bench.`.
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from bench import mqar_study

        return mqar_study.main(argv[:i] + argv[i + 2 :])
    args = parse_args(argv)
    task = Task(args.num_keys, args.num_values, args.num_pairs, args.num_queries)
    start = time.perf_counter()
    results = [train_variant(kind, task, args) for kind in args.kinds]
    total_s = time.perf_counter() - start
    print(format_table(results, task, args))
    print(f"total {total_s:.0f}s on {jax.devices()[0].device_kind} ({os.cpu_count()} CPUs)")
    report = {
        "benchmark": "associative_recall",
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "device": jax.devices()[0].device_kind,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "task": dataclasses.asdict(task) | {"seq_len": task.seq_len},
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "total_s": total_s,
        "results": results,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
