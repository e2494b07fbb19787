"""Lowering the GPU kernels (Pallas Triton and Mosaic GPU) without a GPU, for CPU checks of the GPU
backend."""

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


def gla_lowered_kernels(block_sizes, q, v, g, s0) -> tuple[tuple[int, int], tuple[int, int]]:
    """(Mosaic GPU, Triton) kernel counts in the CUDA lowering of a "pallas_gpu" GLA call with an
    initial and a final state, for the forward and for the gradient of every input; q, v, g, s0
    are abstract (jax.ShapeDtypeStruct), k takes q's."""
    import jax
    import jax.numpy as jnp

    from gla_tpu import ops

    def forward(q, k, v, g, s0):
        return ops.gla(q, k, v, g, initial_state=s0, output_final_state=True,
                       backend="pallas_gpu", block_sizes=block_sizes)

    def loss(*args):
        o, final = forward(*args)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

    def counts(fn):
        with hopper_target():
            text = jax.jit(fn).trace(q, q, v, g, s0).lower(lowering_platforms=("cuda",)).as_text()
        return text.count("custom_call @mosaic_gpu"), text.count("xla.gpu.triton")

    return counts(forward), counts(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
