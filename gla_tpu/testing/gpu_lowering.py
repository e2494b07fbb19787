"""Lowering the Pallas Triton kernels without a GPU, for CPU checks of the GPU backend."""

from __future__ import annotations

import contextlib
import types


@contextlib.contextmanager
def hopper_target():
    """Lets the Pallas Triton lowering run without a GPU by naming compute capability 9.0 (the
    Triton IR is produced and checked; compiling it to PTX still needs the GPU machine)."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    saved = registration.gpu_info_lib
    registration.gpu_info_lib = types.SimpleNamespace(
        get_gpu_info=lambda: types.SimpleNamespace(compute_capability=90))
    try:
        yield
    finally:
        registration.gpu_info_lib = saved
