"""Ahead-of-time compilation for real TPU generations on a CPU host (needs libtpu installed).

`jax.experimental.topologies.get_topology_desc` describes a TPU slice without owning one; lowering
on abstract inputs placed on one of its devices and calling `.compile()` runs the whole Mosaic
compiler, VMEM budget included.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Several processes (parallel test workers) may each load libtpu to compile; libtpu otherwise
# takes a single-process lock.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# Generation -> topology name understood by libtpu.
TPU_TOPOLOGIES = {
    "v4": "v4:2x2x1",
    "v5e": "v5e:2x2",
    "v5p": "v5p:2x2x1",
    "v6e": "v6e:2x2",
    "7x": "tpu7x:2x2x1",
}
TPU_GENERATIONS = tuple(TPU_TOPOLOGIES)


def libtpu_available() -> bool:
    """Whether libtpu (the `test` extra) is installed, so TPU compilation can run here."""
    return importlib.util.find_spec("libtpu") is not None


@functools.cache
def _single_device_mesh(generation: str) -> Mesh:
    if generation not in TPU_TOPOLOGIES:
        raise ValueError(
            f"generation must be one of {TPU_GENERATIONS}; got {generation!r}."
        )
    topo = topologies.get_topology_desc(
        platform="tpu", topology_name=TPU_TOPOLOGIES[generation]
    )
    return Mesh(np.array(topo.devices[:1]), ("x",))


def _single_device_sharding(generation: str) -> NamedSharding:
    return NamedSharding(_single_device_mesh(generation), PartitionSpec())


def abstract(shape, dtype, generation: str = "v5e") -> jax.ShapeDtypeStruct:
    """A ShapeDtypeStruct placed on one core of `generation`."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=_single_device_sharding(generation))


def compile_for_tpu(fn, *abstract_args, generation: str = "v5e", static_kwargs=None):
    """AOT-compiles `fn(*abstract_args, **static_kwargs)` for one core of a TPU generation.

    Args:
      fn: a JAX function of arrays.
      abstract_args: pytrees of jax.ShapeDtypeStruct (their shardings are replaced by one core of
        `generation`) or None.
      generation: one of "v4", "v5e", "v5p", "v6e", "7x".
      static_kwargs: keyword arguments closed over (not traced).
    Returns:
      the compiled executable (`.memory_analysis()` gives its buffer sizes).

    Example:
      >>> import jax.numpy as jnp
      >>> x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
      >>> compiled = compile_for_tpu(lambda a: a * 2, x, generation="v6e")
    """
    sharding = _single_device_sharding(generation)
    placed = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), abstract_args
    )
    kwargs = static_kwargs or {}
    with targeting(generation):
        return jax.jit(lambda *args: fn(*args, **kwargs)).lower(*placed).compile()


def targeting(generation: str):
    """A context in which code that queries the chip (`pltpu.get_tpu_info`, e.g. the kernels'
    default tiles) sees one core of `generation`, not the CPU host: an abstract mesh of it."""
    return jax.sharding.use_abstract_mesh(_single_device_mesh(generation).abstract_mesh)


@functools.cache
def tpu_slice_mesh(generation: str, shape: tuple[int, ...], axis_names: tuple[str, ...]) -> Mesh:
    """A mesh over the chips of `generation`'s 4-chip topology (TPU_TOPOLOGIES), for deviceless
    compiles of sharded programs: e.g. tpu_slice_mesh("v5e", (2, 2), ("data", "model"))."""
    if generation not in TPU_TOPOLOGIES:
        raise ValueError(
            f"generation must be one of {TPU_GENERATIONS}; got {generation!r}."
        )
    topo = topologies.get_topology_desc(
        platform="tpu", topology_name=TPU_TOPOLOGIES[generation]
    )
    count = int(np.prod(shape))
    if count > len(topo.devices):
        raise ValueError(
            f"mesh shape {shape} needs {count} devices; {TPU_TOPOLOGIES[generation]} has "
            f"{len(topo.devices)}."
        )
    return Mesh(np.array(topo.devices[:count]).reshape(shape), axis_names)


def compile_sharded_for_tpu(fn, mesh: Mesh, *abstract_args, static_kwargs=None):
    """AOT-compiles `fn` for the chips of `mesh` (from `tpu_slice_mesh`); abstract_args are
    ShapeDtypeStructs whose shardings name that mesh (or None). Returns the executable
    (`.as_text()` gives the partitioned HLO)."""
    kwargs = static_kwargs or {}
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return jax.jit(lambda *args: fn(*args, **kwargs)).lower(*abstract_args).compile()



_SCOPED_USED = re.compile(r'"used_scoped_memory_configs":\[\{[^\]]*?"size":"(\d+)"')
_SCOPED_LIMIT = re.compile(r'"scoped_memory_configs":\[\{"memory_space":"1"'
                           r'(?:,"offset":"(\d+)")?,"size":"(\d+)"')


def scoped_vmem_bytes(compiled) -> dict:
    """{kernel name: (bytes of scoped VMEM the compiler allocated to it, the scoped limit it
    requested or None for the chip's default)} for the Pallas TPU kernels of a compiled program,
    from its optimized HLO (the used region ends at `size`, counted from the start of VMEM; a
    requested limit's region starts at its `offset`)."""
    out = {}
    for line in compiled.as_text().splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line or "custom-call(" not in line:
            continue
        name = line.split("=", 1)[0].strip().removeprefix("ROOT ").lstrip("%")
        used, limit = _SCOPED_USED.search(line), _SCOPED_LIMIT.search(line)
        if used:
            offset = int(limit.group(1) or 0) if limit else 0
            out[name] = (int(used.group(1)) - offset, int(limit.group(2)) if limit else None)
    return out
