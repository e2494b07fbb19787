"""The optimizer the layers train with: optax's AdamW after global-norm clipping, weight decay on
leaves of rank >= 2 only (matrices and embeddings; not norms and biases).

optax comes with the `train` extra (also in `test` and `bench`); it is imported when `adamw` is
called, so `import gla_tpu.layers` does not need it.

    tx = training.adamw(3e-3)                 # or a schedule: step -> rate
    opt_state = tx.init(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
"""

from __future__ import annotations

import jax


def decay_mask(params):
    """True on the leaves that get weight decay: those of rank >= 2."""
    return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)


def adamw(learning_rate, *, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
          weight_decay: float = 0.1, clip_norm: float | None = 1.0):
    """optax.chain(clip_by_global_norm(clip_norm), adamw(..., mask=decay_mask)); clip_norm None
    leaves the gradients unclipped. `learning_rate` is a float or an optax schedule."""
    try:
        import optax
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("gla_tpu.layers.training needs optax: "
                          "pip install 'gla_tpu[train]'.") from e
    for name, value in (("b1", b1), ("b2", b2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1); got {value!r}.")
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"clip_norm must be None or positive; got {clip_norm!r}.")
    opt = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                      mask=decay_mask)
    if clip_norm is None:
        return opt
    return optax.chain(optax.clip_by_global_norm(clip_norm), opt)
