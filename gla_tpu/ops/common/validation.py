"""Input validation shared by every op: each check raises a ValueError that names the argument,
the value received and what is accepted."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np


def describe(x: Any) -> str:
    """A short description of an argument for error messages: shape and dtype, or the repr."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"array of shape {tuple(x.shape)} and dtype {np.dtype(x.dtype).name}"
    return repr(x)


def check_array(name: str, x: Any, *, rank: int, layout: str) -> None:
    """x must be an array of the given rank; `layout` names the dims, e.g. "[B, T, H, D]"."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise ValueError(f"{name} must be an array {layout}; got {describe(x)}.")
    if len(x.shape) != rank:
        raise ValueError(
            f"{name} must have rank {rank} ({layout}); got {describe(x)}."
        )


def check_floating(name: str, x: Any) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"{name} must have a floating dtype (bfloat16, float16, float32 or float64); "
            f"got {describe(x)}."
        )


def check_integer(name: str, x: Any) -> None:
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must have an integer dtype (e.g. int32); got {describe(x)}.")


def check_nonempty(name: str, x: Any) -> None:
    if any(d == 0 for d in x.shape):
        raise ValueError(f"{name} must have no zero-sized dimension; got {describe(x)}.")


def check_shape(name: str, x: Any, expected: tuple[int, ...], layout: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(
            f"{name} must have shape {layout} = {tuple(expected)}; got {describe(x)}."
        )


def check_choice(name: str, value: Any, accepted: tuple[Any, ...]) -> None:
    if isinstance(value, bool) or value not in accepted:
        raise ValueError(f"{name} must be one of {accepted}; got {value!r}.")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool; got {value!r}.")


def check_scale(name: str, value: Any) -> float | None:
    """A softmax / GLA scale: None (the default) or a finite positive Python or numpy number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(
            f"{name} must be None or a finite positive number (a Python float); got {value!r}."
        )
    value = float(value)
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite positive number; got {value!r}.")
    return value


class ChunkedProblem:
    """What the validated problems of the chunked ops (gla, delta_rule; frozen dataclasses with
    key_dim, value_dim and chunk_size fields) share."""

    def sizes(self) -> dict[str, int]:
        """The head dims a backend's capabilities constrain."""
        return {"K": self.key_dim, "V": self.value_dim}

    def with_chunk_size(self, default: int):
        """This problem with `default` as its chunk size where the caller gave none."""
        if self.chunk_size is not None:
            return self
        return dataclasses.replace(self, chunk_size=default)
