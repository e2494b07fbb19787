"""Our `from_fla` models against fla 0.6 itself on a GPU, in float32 and bfloat16, in one process.

    pip install --no-deps .whl/*.whl && python3 scripts/gpu_fla_compare.py $OUT/fla_compare

(optionally: --models gla,kda --sizes tiny,real; TRITON_CACHE_DIR=$PWD/_tc keeps Triton's
compiles.) For each model of scripts/gpu_fla_fixtures.py (GLA with short convolutions; Gated
DeltaNet with grouped value heads around a sliding-window softmax layer; KDA; DeltaNet) at two
sizes, "tiny" (the fixtures' d_model 64, vocab 256; T = 40, 100) and "real" (d_model 256, 4 heads,
head_dim 64, vocab 1024, window 256; T = 512, 2048), batch 2: fla's model with unit-scale weights
(the fixtures' builder), saved by save_pretrained and loaded by our `from_fla(dir, dtype,
backend="auto")` (on a GPU our pallas_gpu kernels where they exist, "xla" where "auto" falls back:
the BackendFallbackWarnings are recorded). Logits on the same tokens:
  reference  fla float32 with every mixer in its fused_recurrent mode (float32 state math, no
             tl.dot; TF32 off for torch): fla's chunked kernels round float32 dot inputs to TF32
             (rel. error ~5e-4 at T = 100, docs/layers.md) and DeltaNet's refuses float32
  fla_f32    fla float32 in its default modes (chunked above T = 64), against the reference
  fla_bf16   fla in bfloat16 (model.to(torch.bfloat16)), default modes
  ours_f32   ours, dtype float32, under jax.default_matmul_precision("highest")
  ours_bf16  ours, dtype bfloat16
Each: relative RMS error against the reference, max abs difference, fraction of positions whose
argmax token agrees; ratio = ours_bf16 / fla_bf16 error (docs/testing.md's pass rule: <= 2).
fla's softmax layer runs the fixtures' PyTorch stand-in for flash-attn (scores in float32, also in
bfloat16). Writes results.json and results.md to the output dir (after every case), prints the
table; exit 1 if a ratio exceeds 2, an ours_f32 error exceeds 1e-3 or a case raised.

    python3 scripts/gpu_fla_compare.py OUT --dry-run-jax tests/fixtures/fla

runs only our side, on the fixture directories' tokens_T.npy, against their logits_T.npy (fla's
float32 logits from the GPU) on this machine's default device; no torch (no fla_bf16, no ratio).
"""

import argparse
import contextlib
import datetime
import functools
import glob
import json
import os
import sys
import tempfile
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BATCH = 2
MAX_RATIO, MAX_F32 = 2.0, 1e-3
OPS = {"gla": "gla", "softmax": "flash_attention"}  # layer kind -> op (the others: delta_rule)
SIZES = {"tiny": ({}, (40, 100)),
         "real": ({"hidden_size": 256, "vocab_size": 1024, "num_heads": 4, "head_dim": 64,
                   "window_size": 256}, (512, 2048))}


def compare(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    rel = np.linalg.norm(x - ref) / np.linalg.norm(ref) if np.all(np.isfinite(x)) else np.inf
    return {"rel_rms": float(rel), "max_abs": float(np.max(np.abs(x - ref))),
            "argmax_agree": float(np.mean(x.argmax(-1) == ref.argmax(-1)))}


def ours(folder, tokens):
    """Our logits {"ours_f32", "ours_bf16"} (float32 numpy) and what "auto" ran."""
    import jax
    import jax.numpy as jnp

    from gla_tpu.layers import fla_checkpoint, lm
    from gla_tpu.ops.common import backends

    logits, fallbacks = {}, set()
    for dtype, key in (("float32", "ours_f32"), ("bfloat16", "ours_bf16")):
        with backends.record_fallbacks() as messages:
            cfg, params = fla_checkpoint.from_fla(folder, dtype=dtype, backend="auto")
            apply = jax.jit(functools.partial(lm.apply, config=cfg))
            highest = jax.default_matmul_precision("highest") if dtype == "float32" else None
            with highest or contextlib.nullcontext():
                out, _ = apply(params, jnp.asarray(tokens, jnp.int32))
            logits[key] = np.asarray(out.astype(jnp.float32))
        fallbacks |= set(messages)
    candidate = backends.kernel_backend_for_platform(backends.default_platform())
    fallen = {m.split(":")[0] for m in fallbacks}  # "<op name>: backend='auto' falls back ..."
    ops = sorted({OPS.get(kind, "delta_rule") for kind in cfg.layer_kinds})
    ran = ", ".join(f"{op} {'xla' if op in fallen else candidate}" for op in ops)
    return logits, {"ours_ran": ran, "fallbacks": sorted(fallbacks),
                    "jax_device": str(jax.devices()[0].device_kind)}


def fla_logits(model, tokens, recurrent=False):
    """fla's logits as float32 numpy; recurrent: every mixer with a `mode` (GLA, Gated DeltaNet,
    KDA, DeltaNet: fused_recurrent at T <= 64 in eval mode without grad, `mode` above) in
    fused_recurrent at every T; the softmax layers have none."""
    import torch

    mixers = [layer.attn for layer in model.model.layers
              if isinstance(getattr(layer.attn, "mode", None), str)]
    saved = [m.mode for m in mixers]
    try:
        for m in mixers:
            m.mode = "fused_recurrent" if recurrent else m.mode
        with torch.no_grad():
            out = model(input_ids=tokens.cuda(), use_cache=False).logits
        return out.float().cpu().numpy()
    finally:
        for m, mode in zip(mixers, saved):
            m.mode = mode


def measure(logits, reference):
    """The per-logits metrics against the reference, the ratio and the verdict."""
    row = {k: compare(v, reference) for k, v in logits.items() if isinstance(v, np.ndarray)}
    row.update({k: v for k, v in logits.items() if not isinstance(v, np.ndarray)})
    if "fla_bf16" in row and "ours_bf16" in row:
        row["ratio"] = row["ours_bf16"]["rel_rms"] / max(row["fla_bf16"]["rel_rms"], 1e-30)
    row["passed"] = (row["ours_f32"]["rel_rms"] <= MAX_F32
                     and row.get("ratio", 0.0) <= MAX_RATIO)
    return row


def run_fla(models, sizes, record):
    import gpu_fla_fixtures as fixtures
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    fixtures.patch_flash_attn()
    for size in sizes:
        overrides, lengths = SIZES[size]
        configs = fixtures.model_configs(**overrides)
        gen = torch.Generator(device="cpu").manual_seed(0)
        for i, name in enumerate(configs):
            if name not in models:
                continue
            case = {"model": name, "size": size, "d_model": configs[name].hidden_size}
            try:
                model = fixtures.build(configs[name], i)
                model_bf16 = fixtures.build(configs[name], i).to(torch.bfloat16)
                with tempfile.TemporaryDirectory() as folder:
                    model.save_pretrained(folder, safe_serialization=True)
                    for t in lengths:
                        start, case["T"] = time.time(), t  # an error row names its T
                        tokens = torch.randint(0, configs[name].vocab_size, (BATCH, t),
                                               generator=gen)
                        reference = fla_logits(model, tokens, recurrent=True)
                        logits = {"fla_bf16": fla_logits(model_bf16, tokens)}
                        try:
                            logits["fla_f32"] = fla_logits(model, tokens)
                        except Exception as e:  # noqa: BLE001 - DeltaNet's chunked kernel refuses float32
                            logits["fla_f32_error"] = f"{type(e).__name__}: {e}"[:300]
                        mine, info = ours(folder, tokens.numpy())
                        row = measure({**logits, **mine, **info}, reference)
                        record({**case, **row, "seconds": round(time.time() - start, 1)})
                del model, model_bf16
            except Exception as e:  # noqa: BLE001 - recorded; the other models go on
                record({**case, "error": f"{type(e).__name__}: {e}"[:2000],
                        "traceback": traceback.format_exc()[-4000:], "passed": False})
            torch.cuda.empty_cache()


def run_dry(root, record):
    """Ours on the fixture directories under (or at) root against their stored fla logits."""
    folders = [root] if os.path.exists(os.path.join(root, "config.json")) else sorted(
        os.path.dirname(p) for p in glob.glob(os.path.join(root, "*", "config.json")))
    for folder in folders:
        paths = glob.glob(os.path.join(folder, "tokens_*.npy"))
        for t in sorted(int(p.rsplit("_", 1)[1].split(".")[0]) for p in paths):
            path = os.path.join(folder, f"tokens_{t}.npy")
            case = {"model": os.path.basename(folder), "size": "fixture", "T": t}
            try:
                mine, info = ours(folder, np.load(path))
                reference = np.load(os.path.join(folder, f"logits_{t}.npy"))
                record({**case, **measure({**mine, **info}, reference)})
            except Exception as e:  # noqa: BLE001 - recorded; the other models go on
                record({**case, "error": f"{type(e).__name__}: {e}"[:2000],
                        "traceback": traceback.format_exc()[-4000:], "passed": False})


def versions(dry):
    import jax

    found = {"jax": jax.__version__, "jax_device": str(jax.devices()[0].device_kind),
             "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    if not dry:
        import fla
        import torch
        import transformers
        import triton

        found.update(torch=torch.__version__, triton=triton.__version__, fla=fla.__version__,
                     transformers=transformers.__version__, gpu=torch.cuda.get_device_name(),
                     cuda=torch.version.cuda)
    return found


def cell(row, key):
    m = row.get(key)
    if not isinstance(m, dict):
        return "-"
    return f"{m['rel_rms']:.2e} / {m['max_abs']:.1e} / {100 * m['argmax_agree']:.1f}%"


def table(results):
    lines = [("| model | size | T | ours ran | ours f32 | fla f32 (default modes) | fla bf16 | "
              "ours bf16 | ratio | pass |"), "|" + "---|" * 10]
    for r in results["cases"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['size']} | {r.get('T', '-')} | error: "
                         f"{r['error'][:150]} |" + " |" * 5 + " FAIL |")
            continue
        ratio = f"{r['ratio']:.2f}" if "ratio" in r else "-"
        fla_f32 = cell(r, "fla_f32") if "fla_f32" in r else (
            "refused" if "fla_f32_error" in r else "-")
        lines.append(f"| {r['model']} | {r['size']} | {r['T']} | {r['ours_ran']} | "
                     f"{cell(r, 'ours_f32')} | {fla_f32} | {cell(r, 'fla_bf16')} | "
                     f"{cell(r, 'ours_bf16')} | {ratio} | {'ok' if r['passed'] else 'FAIL'} |")
    return (f"Cells: relative RMS error vs {results['reference']} / max abs difference / "
            "argmax agreement. Pass: ours f32 <= 1e-3, ours bf16 <= 2x fla bf16.\n\n"
            + "\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--dry-run-jax", metavar="DIR", help="ours only, on fixture dirs")
    parser.add_argument("--models", default="gla,gated_deltanet,kda,delta_net")
    parser.add_argument("--sizes", default="tiny,real")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {"versions": {}, "cases": [], "reference": (
        "the fixture's fla float32 logits" if args.dry_run_jax
        else "fla float32, mixers in fused_recurrent mode")}

    def write():
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(json.dumps(results["versions"]) + "\n\n" + table(results))

    def record(row):
        results["cases"].append(row)
        write()
        brief = {k: (v["rel_rms"] if isinstance(v, dict) and "rel_rms" in v else v)
                 for k, v in row.items() if k not in ("traceback", "fallbacks")}
        print(json.dumps(brief), flush=True)

    results["versions"] = versions(bool(args.dry_run_jax))
    if args.dry_run_jax:
        run_dry(args.dry_run_jax, record)
    else:
        run_fla(args.models.split(","), args.sizes.split(","), record)
    write()
    print(json.dumps(results["versions"]) + "\n\n" + table(results), flush=True)
    return 0 if results["cases"] and all(r["passed"] for r in results["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
