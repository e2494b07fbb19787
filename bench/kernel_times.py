"""Device time per kernel of a jitted call, from a jax.profiler trace (a diagnostic).

    python3 bench/kernel_times.py --out OUT [--shapes 4,6,7] [--gate peer]

times ops.delta_rule(backend="pallas_gpu") forward and forward+backward at bench/gpu_delta_rule.py's
SHAPES (indices; inputs drawn as that file draws them) and writes OUT/kernel_times.json: per call,
each kernel's device time (ms) and launch count, the largest first, and their sum.

`kernel_times(fn, *args)` works for any jitted function: it runs `fn` twice, traces `iters` more
calls and sums the events of the device planes' stream lines by name (CUDA kernels on a GPU: a
Mosaic GPU kernel by its name, an XLA fusion by its HLO name). It is a trace, not a timing: use
bench.harness for times; this says where they go.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402


def kernel_times(fn, *args, iters: int = 10, plane_prefix: str = "/device:GPU",
                 line_filter=lambda name: "tream" in name):
    """[(kernel name, ms per call, launches per call)], the largest first, of `fn(*args)` over
    `iters` traced calls, from the planes whose names start with `plane_prefix` and their lines
    that `line_filter` takes (a GPU's "Stream #N" lines by default)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(iters):
                result = fn(*args)
            jax.block_until_ready(result)
        path, = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        profile = jax.profiler.ProfileData.from_file(path)
        total, count = collections.Counter(), collections.Counter()
        for plane in profile.planes:
            if not plane.name.startswith(plane_prefix):
                continue
            for line in plane.lines:
                if not line_filter(line.name):
                    continue
                for event in line.events:
                    total[event.name] += event.duration_ns
                    count[event.name] += 1
    return [(name, ns / iters / 1e6, count[name] // iters) for name, ns in total.most_common()]


def main(argv=None):
    from bench.gpu_delta_rule import GATES, SHAPES, device_args, gate_free, inputs, ours
    from bench.gpu_side_by_side import fwd_bwd
    from bench.harness import environment

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--shapes", default="4,6,7", help="indices into gpu_delta_rule.SHAPES")
    parser.add_argument("--gate", default="peer", choices=sorted(GATES))
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    import jax.numpy as jnp

    records = []
    os.makedirs(args.out, exist_ok=True)
    for index in args.shapes.split(","):
        shape = SHAPES[int(index)]
        q, k, v, beta, g, ct = inputs(0, shape, args.gate, "sigmoid")
        call = device_args(q, k, v, beta, g)
        fn = ours("pallas_gpu") if g is not None else gate_free(ours("pallas_gpu"))
        for mode, jitted in (("fwd", jax.jit(fn)),
                             ("fwd+bwd", jax.jit(fwd_bwd(fn, jnp.asarray(ct))))):
            kernels = kernel_times(jitted, *call, iters=args.iters)
            gate = None if g is None else GATES[args.gate][0]
            records.append(dict(shape=shape, mode=mode, gate=gate, beta="sigmoid(N(0,1))",
                                total_ms=sum(k[1] for k in kernels),
                                kernels=[dict(name=n, ms=ms, calls=c) for n, ms, c in kernels]))
            print(json.dumps(dict(shape=shape, mode=mode, total_ms=records[-1]["total_ms"])),
                  flush=True)
            for name, ms, calls in kernels[:20]:
                print(f"  {ms:8.4f} ms x{calls}  {name[:100]}", flush=True)
            with open(os.path.join(args.out, "kernel_times.json"), "w") as f:
                command = " ".join(["python3 bench/kernel_times.py", *sys.argv[1:]])
                json.dump(dict(env=environment(), command=command, records=records), f,
                          indent=1)


if __name__ == "__main__":
    main()
