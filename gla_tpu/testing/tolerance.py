"""The pass rule (docs/testing.md), used by every parity test.

error(x) = ||x - ref||_2 / ||ref||_2 against the float64 reference (relative RMS error).
A kernel passes when, for every output and gradient,
    error(kernel) <= 2 * error(same computation in the input dtype through XLA) + floor(dtype)
where for float32 inputs the bound is at least 1e-5 (the float32 criterion: accumulation
order alone moves float32 errors by more than 2x at the 1e-7 level). NaN or inf anywhere fails.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

FLOAT32_MAX_RELATIVE_RMS = 1e-5


def floor_for(dtype) -> float:
    """The absolute floor of the rule: an eighth of the dtype's machine epsilon."""
    return float(jnp.finfo(dtype).eps) / 8.0


def relative_rms_error(actual, reference) -> float:
    actual = np.asarray(actual, np.float64)
    reference = np.asarray(reference, np.float64)
    if actual.shape != reference.shape:
        raise ValueError(f"shape mismatch: {actual.shape} vs reference {reference.shape}")
    if not np.all(np.isfinite(actual)):
        return float("inf")
    denom = np.linalg.norm(reference)
    err = np.linalg.norm(actual - reference)
    return float(err / denom) if denom > 0 else float(err)


@dataclasses.dataclass(frozen=True)
class Comparison:
    name: str
    kernel_error: float
    baseline_error: float
    bound: float

    @property
    def passed(self) -> bool:
        return self.kernel_error <= self.bound

    def __str__(self) -> str:
        status = "ok" if self.passed else "FAIL"
        return (f"{self.name}: kernel {self.kernel_error:.3e} vs bound {self.bound:.3e} "
                f"(xla {self.baseline_error:.3e}) {status}")


def compare(name, kernel, baseline, reference, *, dtype,
            float32_bound=FLOAT32_MAX_RELATIVE_RMS) -> Comparison:
    """Applies the pass rule to one array."""
    k_err = relative_rms_error(kernel, reference)
    b_err = relative_rms_error(baseline, reference)
    bound = 2.0 * b_err + floor_for(dtype)
    if np.dtype(dtype) == np.float32:
        # float32 errors (~1e-7) move by accumulation order alone; the float32 criterion
        # is a relative RMS error of at most 1e-5 (XLA_FLOAT32_STRONG_GATE_DG for one output).
        bound = max(bound, float32_bound)
    return Comparison(name, k_err, b_err, bound)


# Largest relative RMS error the "xla" backend itself may show against the float64 reference
# (its parity has no baseline below it): float32 per the float32 criterion; half precision a few
# epsilon, since outputs round once and gradients accumulate a few rounded matmuls.
XLA_MAX_RELATIVE_RMS = {"float32": 1e-5, "bfloat16": 3e-2, "float16": 4e-3}
# The one exception, dg of the chunked forms in float32 under gates of logsigmoid(x) / 0.1 (about
# -7 per step): they take exp of differences of chunk-local gate sums of magnitude ~450, whose
# float32 rounding alone costs ~3e-5 (docs/testing.md, "Strong gates in float32").
XLA_FLOAT32_STRONG_GATE_DG = 1e-4


def _top_key(path):
    """The dict key a leaf sits under at the top of its pytree (None for a bare array)."""
    return getattr(path[0], "key", None) if path else None


def assert_accuracy(actual, reference, *, dtype, names=None, bounds=None) -> list[float]:
    """Checks every leaf of `actual` against the reference within XLA_MAX_RELATIVE_RMS[dtype], or
    within bounds[top-level key] for the leaves under a key of `bounds`."""
    default = XLA_MAX_RELATIVE_RMS[jnp.dtype(dtype).name]
    paths_leaves = jax.tree_util.tree_flatten_with_path(actual)[0]
    a_leaves, treedef = jax.tree_util.tree_flatten(actual)
    r_leaves = treedef.flatten_up_to(reference)
    if names is None:
        names = [jax.tree_util.keystr(p) for p, _ in paths_leaves]
    limits = [(bounds or {}).get(_top_key(p), default) for p, _ in paths_leaves]
    errors = [relative_rms_error(a, r) for a, r in zip(a_leaves, r_leaves)]
    if not all(e <= b for e, b in zip(errors, limits)):
        lines = [f"{n}: {e:.3e} (bound {b:.1e})" for n, e, b in zip(names, errors, limits)]
        raise AssertionError("accuracy check failed:\n  " + "\n  ".join(lines))
    return errors


def assert_pass_rule(kernel, baseline, reference, *, dtype, names=None,
                     float32_bounds=None) -> list[Comparison]:
    """Checks every leaf of the pytrees `kernel`, `baseline`, `reference` (same structure).

    `float32_bounds` maps a top-level key to its float32 criterion where it is not
    FLOAT32_MAX_RELATIVE_RMS. Raises AssertionError listing every leaf's errors when one fails;
    returns the comparisons.
    """
    paths_leaves = jax.tree_util.tree_flatten_with_path(kernel)[0]
    k_leaves, treedef = jax.tree_util.tree_flatten(kernel)
    b_leaves = treedef.flatten_up_to(baseline)
    r_leaves = treedef.flatten_up_to(reference)
    if names is None:
        names = [jax.tree_util.keystr(p) for p, _ in paths_leaves]
    limits = [(float32_bounds or {}).get(_top_key(p), FLOAT32_MAX_RELATIVE_RMS)
              for p, _ in paths_leaves]
    results = [
        compare(n, k, b, r, dtype=dtype, float32_bound=f)
        for n, k, b, r, f in zip(names, k_leaves, b_leaves, r_leaves, limits)
    ]
    if not all(c.passed for c in results):
        raise AssertionError("pass rule failed:\n  " + "\n  ".join(map(str, results)))
    return results
