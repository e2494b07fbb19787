"""The ops on several devices of one host (docs/scale_out.md): batch sharding, and context-parallel
GLA, against one device, in one process.

Parts:
  batch  a training-size forward+backward (flash attention, GLA) with the batch split over every
         device: the op with `sharding=`, plain `jax.jit` on sharded inputs without it (what a
         user gets otherwise: an all-gather, or a refusal on TPU), and one device alone.
  cp     GLA (and with --cp-ops the Gated DeltaNet) forward+backward with T split over every
         device: weak scaling (T per device fixed) and strong scaling (T fixed), against one
         device; time and peak memory per device.
  ring   causal flash attention forward+backward with T split over every device (ring attention,
         zigzag-balanced): for each T per device n, one device at n and at P n, and the ring at
         P n. Strong scaling: one device at P n over P x ring; weak: P x (one device at n) over
         the ring (causal work per device grows P-fold with T = P n).
  lm     a language model's (GLA by default) training step (loss, gradients, AdamW update) through
         `lm.apply(..., sharding=)` on a (data, seq) mesh of every device (data 2 from 4 devices
         on), against the same step on one device; random tokens. The kind may be a layer
         pattern joined by '+': gated_deltanet+gated_deltanet+gated_deltanet+softmax is a 3:1
         Gated DeltaNet / softmax hybrid.
Inputs: q, k, v ~ N(0, 1) in bfloat16, GLA gates logsigmoid(N(0, 1)) per key (fla's op benchmark
draw); for the Gated DeltaNet, per-head gates logsigmoid(N(0, 1)), beta = sigmoid(N(0, 1)) and
q, k l2-normalized inside the op (fla's and jla's draw); named in every record. Timing: bench/harness.py's time_jitted (warmup, one
block_until_ready per batch of iterations, median of repeats). Each measured program prints one
line as it ends, counted "[n/N]" over the run.

Usage (on the machine with the devices):
  python bench/scale_out.py --part batch --part cp --out OUT
  python bench/scale_out.py --part cp --cp-ops gla,gated_deltanet --cp-lengths 16384,65536 \
      --part lm --lm 4096,1024,4,gated_deltanet+gated_deltanet+gated_deltanet+softmax --out OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from bench.harness import Progress, environment, format_table, peak_memory_bytes  # noqa: E402
from bench.harness import time_jitted, write_json  # noqa: E402
from gla_tpu import ops  # noqa: E402
from gla_tpu.ops.common.flops import attention_flops, delta_rule_flops, gla_flops  # noqa: E402

GATE = "logsigmoid(N(0,1))"
DELTA_RULE_INPUTS = ("g per head logsigmoid(N(0,1)), beta sigmoid(N(0,1)), q and k "
                     "l2-normalized in the op")
CP_OPS = ("gla", "gated_deltanet")
_DEVICES = None  # the devices used (--devices)
BATCH_IMPLS = ("sharding= (shard_map)", "plain jit on sharded inputs", "one device")
LM_IMPLS = ("lm.apply(sharding=P('data', 'seq'))", "one device")


@dataclasses.dataclass
class Log:
    """The run's records, the JSON they are rewritten to after each one, and the counter."""

    records: list
    path: str
    progress: Progress


def _devices():
    return _DEVICES or jax.devices()


def _inputs(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s, np.float32) for s in shapes]


def _grads(loss_fn, argnums):
    return jax.grad(loss_fn, argnums=argnums)


def _attention_loss(sharding, backend):
    def loss(q, k, v, ct):
        o = ops.flash_attention(q, k, v, causal=True, backend=backend, sharding=sharding)
        return jnp.sum(o.astype(jnp.float32) * ct)
    return loss


def _gla_loss(sharding, backend):
    def loss(q, k, v, g, ct):
        o, _ = ops.gla(q, k, v, g, backend=backend, sharding=sharding)
        return jnp.sum(o.astype(jnp.float32) * ct)
    return loss


def _gated_deltanet_loss(sharding, backend):
    def loss(q, k, v, beta, g, ct):
        o, _ = ops.delta_rule(q, k, v, beta, g, use_qk_l2norm=True, backend=backend,
                              sharding=sharding)
        return jnp.sum(o.astype(jnp.float32) * ct)
    return loss


def _logsigmoid(x):
    return -np.logaddexp(0.0, -x)


def _cp_case(op, b, t, h, kd):
    """(loss maker, arrays, dtypes, argnums, flops, record fields) of one context-parallel op."""
    bf, f32 = jnp.bfloat16, jnp.float32
    q, k, v, ct = _inputs([(b, t, h, kd)] * 4)
    if op == "gla":
        g = _logsigmoid(_inputs([(b, t, h, kd)], seed=1)[0])  # per key
        return (_gla_loss, [q, k, v, g, ct], [bf, bf, bf, f32, f32], (0, 1, 2, 3),
                gla_flops(b, t, h, kd, kd, backward=True), dict(gate=GATE))
    x_beta, x_g = _inputs([(b, t, h)] * 2, seed=1)
    beta = 1.0 / (1.0 + np.exp(-x_beta))
    return (_gated_deltanet_loss, [q, k, v, beta, _logsigmoid(x_g), ct],
            [bf, bf, bf, f32, f32, f32], (0, 1, 2, 3, 4),
            delta_rule_flops(b, t, h, kd, kd, backward=True), dict(inputs=DELTA_RULE_INPUTS))


def _place(arrays, dtypes, sharding):
    return [jax.device_put(jnp.asarray(a, d), sharding) for a, d in zip(arrays, dtypes)]


def _record(log, **rec):
    log.records.append(rec)
    write_json(log.path, log.records)
    ms = rec.get("ms_median")
    print(f"{log.progress.step()} {rec['part']:6s} {rec['op']:10s} {rec['impl']:28s} "
          f"devices={rec['devices']} "
          f"{rec['shape']} {'-' if ms is None else f'{ms:.3f} ms'} "
          f"{rec.get('error', '')[:100]}", flush=True)


def _time(log, fn, args, *, flops, devices, **rec):
    try:
        t = time_jitted(fn, *args, warmup=2, iters=5, repeats=5)
        mem = [peak_memory_bytes(d) for d in devices]
        _record(log, ms_median=t.median_ms, ms_min=t.min_ms, ms_max=t.max_ms,
                tflops_per_device=flops / (t.median_ms * 1e-3) / 1e12 / len(devices),
                peak_bytes_per_device=mem, devices=len(devices), **rec)
    except Exception as e:  # a variant that fails is recorded, the others still run
        _record(log, ms_median=None, devices=len(devices),
                error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", **rec)


def bench_batch(log, env, backend, t=4096):
    devices = _devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("data",))
    split, one = NamedSharding(mesh, P("data")), NamedSharding(Mesh(np.array(devices[:1]),
                                                                     ("one",)), P())
    b, h, d = 2 * n, 16, 128
    bf = jnp.bfloat16
    q, k, v, ct = _inputs([(b, t, h, d)] * 4)
    g = np.log(1.0 / (1.0 + np.exp(-_inputs([(b, t, h, d)], seed=1)[0])))  # logsigmoid(N(0,1))
    cases = [
        ("attention", _attention_loss, [q, k, v, ct], [bf, bf, bf, jnp.float32], (0, 1, 2),
         attention_flops(b, t, t, h, d, causal=True, backward=True)),
        ("gla", _gla_loss, [q, k, v, g, ct], [bf, bf, bf, jnp.float32, jnp.float32],
         (0, 1, 2, 3), gla_flops(b, t, h, d, d, backward=True)),
    ]
    # BATCH_IMPLS: the op told its sharding, plain jit on the same sharded inputs, one device
    runs = [(split, split, devices), (None, split, devices), (None, one, devices[:1])]
    for op, make_loss, arrays, dtypes, argnums, flops in cases:
        common = dict(part="batch", op=op, shape=[b, t, h, d], backend=backend, gate=GATE,
                      env=env, flops=flops)
        for impl, (op_sharding, placement, devs) in zip(BATCH_IMPLS, runs):
            _time(log, _grads(make_loss(op_sharding, backend), argnums),
                  _place(arrays, dtypes, placement), devices=devs, impl=impl, **common)


def _cp_runs(t_local, n):
    """[(impl, T)] of the context-parallel part at T per device t_local on n devices."""
    runs = [("one device", t_local),  # weak scaling's baseline
            ("context parallel (weak)", t_local * n),
            ("context parallel (strong)", t_local)]
    return runs if n > 1 else runs[:1]


def _ring_runs(t_local, n):
    """[(impl, T)] of the ring part at T per device t_local on n devices."""
    return [("one device", t_local), ("one device", t_local * n), ("ring attention", t_local * n)]


def bench_context_parallel(log, env, backend, lengths, cp_ops=("gla",)):
    devices = _devices()
    n = len(devices)
    b, h, kd = 1, 16, 128
    mesh = Mesh(np.array(devices), ("seq",))
    split = NamedSharding(mesh, P(None, "seq"))
    one = NamedSharding(Mesh(np.array(devices[:1]), ("one",)), P())
    for op in cp_ops:
        for t_local in lengths:
            for impl, t in _cp_runs(t_local, n):
                sharding, devs = (one, devices[:1]) if impl == "one device" else (split, devices)
                make_loss, arrays, dtypes, argnums, flops, fields = _cp_case(op, b, t, h, kd)
                args = _place(arrays, dtypes, sharding)
                loss = make_loss(sharding if len(devs) > 1 else None, backend)
                _time(log, _grads(loss, argnums), args, devices=devs, impl=impl, part="cp",
                      op=op, shape=[b, t, h, kd, kd], backend=backend, env=env, flops=flops,
                      t_local=t // len(devs), **fields)
                del args


def bench_ring(log, env, backend, lengths):
    devices = _devices()
    n = len(devices)
    b, h, d = 1, 16, 128
    bf = jnp.bfloat16
    split = NamedSharding(Mesh(np.array(devices), ("seq",)), P(None, "seq"))
    one = NamedSharding(Mesh(np.array(devices[:1]), ("one",)), P())
    for t_local in lengths:
        for impl, t in _ring_runs(t_local, n):
            sharding, devs = (one, devices[:1]) if impl == "one device" else (split, devices)
            q, k, v, ct = _inputs([(b, t, h, d)] * 4)
            args = _place([q, k, v, ct], [bf, bf, bf, jnp.float32], sharding)
            loss = _attention_loss(sharding if len(devs) > 1 else None, backend)
            _time(log, _grads(loss, (0, 1, 2)), args, devices=devs, impl=impl,
                  part="ring", op="attention", shape=[b, t, h, d], backend=backend,
                  inputs="q, k, v ~ N(0,1)", env=env,
                  flops=attention_flops(b, t, t, h, d, causal=True, backward=True),
                  t_local=t // len(devs))
            del args


def bench_lm_step(log, env, backend, t, d_model, num_layers, attention="gla", vocab=4096):
    import optax

    from gla_tpu.layers import block, lm, training

    devices = _devices()
    n = len(devices)
    data = 2 if n >= 4 and n % 2 == 0 else 1
    mesh = Mesh(np.array(devices).reshape(data, n // data), ("data", "seq"))
    b = 2 * data
    pattern = tuple(attention.split("+"))  # one kind, or a hybrid's layer pattern
    blk = block.Config(d_model=d_model, num_heads=max(1, d_model // 256), attention=pattern[0],
                       backend=backend)
    cfg = lm.Config(vocab_size=vocab, num_layers=num_layers, block=blk, dtype="bfloat16",
                    layer_pattern=pattern if len(pattern) > 1 else None)
    params = lm.init(jax.random.key(0), cfg)
    tx = training.adamw(1e-3)
    tokens = np.random.default_rng(0).integers(0, vocab, (b, t + 1)).astype(np.int32)

    def make_step(sharding):
        def step(params, opt_state, tokens):
            def loss(p):
                logits, _ = lm.apply(p, tokens[:, :-1], cfg, sharding=sharding)
                return lm.cross_entropy(logits, tokens[:, 1:])

            value, grads = jax.value_and_grad(loss)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value
        return step

    flops = 6 * lm.num_params(params) * b * t  # dense layers only, the usual estimate
    runs = [(LM_IMPLS[0], NamedSharding(mesh, P("data", "seq")),
             NamedSharding(mesh, P()), NamedSharding(mesh, P("data")), devices),
            (LM_IMPLS[1], None, *[NamedSharding(Mesh(np.array(devices[:1]), ("one",)), P())] * 2,
             devices[:1])]
    for impl, sharding, replicated, token_sharding, devs in runs:
        placed = jax.device_put(params, replicated)
        args = (placed, jax.device_put(tx.init(params), replicated),
                jax.device_put(tokens, token_sharding))
        _time(log, make_step(sharding), args, flops=flops, devices=devs, impl=impl,
              part="lm", op=f"{attention}_lm_step", shape=[b, t, d_model, num_layers],
              backend=backend, env=env, mesh=[data, n // data],
              gate="the model's" if attention != "softmax" else None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", action="append", choices=["batch", "cp", "ring", "lm"],
                        required=True)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="scale_out")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--cp-lengths", default="32768,65536",
                        help="comma-separated T per device for the context-parallel part")
    parser.add_argument("--cp-ops", default="gla",
                        help=f"comma-separated ops of the context-parallel part, from {CP_OPS}")
    parser.add_argument("--ring-lengths", default="16384,32768",
                        help="comma-separated T per device for the ring part")
    parser.add_argument("--batch-t", type=int, default=4096, help="T of the batch part")
    parser.add_argument("--lm", default="4096,1024,4,gla",
                        help="T, d_model, layers[, attention kind] of the lm part's model")
    parser.add_argument("--devices", type=int, default=None,
                        help="use the first N devices (default: all)")
    args = parser.parse_args(argv)
    global _DEVICES
    _DEVICES = jax.devices()[: args.devices] if args.devices else jax.devices()
    env = environment()
    env["devices"] = [str(d) for d in _devices()]
    n = len(_devices())
    cp_lengths = [int(x) for x in args.cp_lengths.split(",")]
    ring_lengths = [int(x) for x in args.ring_lengths.split(",")]
    cp_ops = tuple(args.cp_ops.split(","))
    if not set(cp_ops) <= set(CP_OPS):
        parser.error(f"--cp-ops takes {CP_OPS}; got {args.cp_ops!r}")
    programs = {  # per part, from the same run lists its function walks
        "batch": 2 * len(BATCH_IMPLS),  # flash attention and GLA
        "cp": len(cp_ops) * sum(len(_cp_runs(t, n)) for t in cp_lengths),
        "ring": sum(len(_ring_runs(t, n)) for t in ring_lengths),
        "lm": len(LM_IMPLS),
    }
    log = Log(records=[], path=os.path.join(args.out, f"{args.tag}.json"),
              progress=Progress(sum(programs[part] for part in args.part)))
    print(f"{log.progress.total} programs on {n} devices", flush=True)
    for part in args.part:
        start = log.progress.done
        try:
            if part == "batch":
                bench_batch(log, env, args.backend, args.batch_t)
            elif part == "ring":
                bench_ring(log, env, args.backend, ring_lengths)
            elif part == "lm":
                t, d_model, layers, *kind = args.lm.split(",")
                bench_lm_step(log, env, args.backend, int(t), int(d_model), int(layers), *kind)
            else:
                bench_context_parallel(log, env, args.backend, cp_lengths, cp_ops)
        except Exception as e:  # the other parts still run; the traceback says what failed
            traceback.print_exc()
            left = programs[part] - (log.progress.done - start)
            print(f"{log.progress.step(left)} {part}: {left} programs not measured: "
                  f"{type(e).__name__}", flush=True)
    rows = [dict(r, shape=str(tuple(r["shape"]))) for r in log.records]
    print(format_table(rows, ["part", "op", "impl", "devices", "shape", "ms_median",
                              "tflops_per_device", "error"]))


if __name__ == "__main__":
    main()
