"""Outputs and every gradient through one scalar loss, for kernels and float64 references alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def random_cotangents(key, outputs, dtype=None):
    """A standard-normal cotangent for every array leaf of `outputs` (None leaves skipped), in
    float32. With `dtype` (the inputs' dtype), each value is first rounded to `dtype`: autodiff
    rounds the cotangent of a bfloat16 output to bfloat16 anyway, so the kernel, its same-dtype
    baseline and the float64 reference must all see that rounded cotangent (docs/testing.md)."""
    leaves, treedef = jax.tree_util.tree_flatten(outputs)
    keys = jax.random.split(key, max(len(leaves), 1))
    cts = [jax.random.normal(kk, x.shape, jnp.float32) for kk, x in zip(keys, leaves)]
    if dtype is not None:
        cts = [c.astype(dtype).astype(jnp.float32) for c in cts]
    return treedef.unflatten(cts)


def outputs_and_grads(fn, primals: dict, cotangent_key, *, float64: bool = False,
                      cotangent_dtype=None):
    """Runs `fn(**primals)` and the gradient of sum(outputs * cotangents) w.r.t. every primal,
    as one jitted program.

    Args:
      fn: a function of keyword arrays returning a pytree of arrays (None leaves allowed).
      primals: name -> array (None entries are passed through, not differentiated).
      cotangent_key: PRNG key for the cotangents; the same key gives the same cotangents for the
        kernel, the XLA baseline and the reference.
      float64: compute under jax.enable_x64 with inputs upcast to float64 (for references).
      cotangent_dtype: round the cotangents to this dtype (the inputs' dtype; see
        `random_cotangents`).
    Returns:
      (outputs, grads) as numpy pytrees; grads maps each non-None primal's name to its gradient.
    """
    names = [n for n, x in primals.items() if x is not None]
    fixed = {n: x for n, x in primals.items() if x is None}

    def run():
        args = {n: primals[n] for n in names}
        if float64:
            args = {n: jnp.asarray(np.asarray(x, np.float64)) for n, x in args.items()}

        def loss_fn(args):
            out = fn(**args, **fixed)
            cts = random_cotangents(cotangent_key, out, cotangent_dtype)
            terms = jax.tree_util.tree_map(
                lambda o, c: jnp.sum(o.astype(jnp.float64 if float64 else jnp.float32) * c),
                out, cts)
            return sum(jax.tree_util.tree_leaves(terms)), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(args)
        return jax.tree_util.tree_map(np.asarray, (out, grads))

    if float64:
        with jax.enable_x64(True):
            return run()
    return run()
