"""The ops on a device mesh: the `sharding` argument, resolved, and a call of the single-device op
per device under `jax.shard_map`, with the custom_vjp outside the shard_map.

XLA's SPMD partitioner cannot split a `pallas_call`: under `jax.jit` with sharded inputs it
gathers every operand to every device (GPU), or refuses outright (Mosaic TPU: "Mosaic kernels
cannot be automatically partitioned"). The batch and head axes need no communication at all, so
each device runs the op on its own block. docs/scale_out.md has the design.

Autodiff: `sharded_call` is a `jax.custom_vjp` whose forward runs `jax.vjp` of the local op inside
one shard_map and hands the pullback's residuals out, one slot per device (a leading axis over
every mesh axis, so no residual moves between devices), and whose backward runs the pullback
inside a second shard_map. Differentiating through the shard_map instead would leave the
transpose to shard_map's replication analysis; this way the backward's collectives are the
transposes of those the local function itself runs (context-parallel GLA's all-gathers) and the
sums a caller asks for (`grad_psum_axes`: kv heads replicated over the head axes, an initial state
read on every time shard).

Each shard_map's body is jitted: called eagerly (as in a notebook), a shard_map runs its body one
primitive at a time, and XLA's CPU compiler (jax 0.11.2) crashes the process with a segmentation
fault on some of those one-primitive programs, e.g. a concatenate with a zero-size operand
(docs/scale_out.md has the reproduction). Jitting the whole call instead breaks eager gradients
on a second mesh (jax 0.11.2 compiles the backward with the first mesh's shardings). Under an
outer `jax.jit` the inner one is inlined.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# [B, T, H, D]: which axis of q each spec entry shards.
BATCH, TIME, HEADS, HEAD_DIM = range(4)


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """A resolved `sharding`: the mesh and the mesh axes over q's batch and head dims."""

    mesh: object  # jax.sharding.Mesh or AbstractMesh
    batch_axes: tuple[str, ...]
    head_axes: tuple[str, ...]
    time_axes: tuple[str, ...] = ()

    def size(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)

    @property
    def batch_shards(self) -> int:
        return self.size(self.batch_axes)

    @property
    def head_shards(self) -> int:
        return self.size(self.head_axes)

    @property
    def time_shards(self) -> int:
        return self.size(self.time_axes)

    def spec(self, *dims: str | None) -> P:
        """A PartitionSpec from dim roles: "batch", "heads", "time" or None (not split)."""
        axes = {"batch": self.batch_axes, "heads": self.head_axes, "time": self.time_axes}
        return P(*(_spec_entry(axes[d]) if d else None for d in dims))

    @property
    def explicit(self) -> bool:
        """Whether the mesh has Explicit axes (sharding in the arrays' types)."""
        return any(t == jax.sharding.AxisType.Explicit
                   for t in getattr(self.mesh, "axis_types", ()))

    @property
    def every_axis(self) -> P:
        """A spec that gives each device its own slot along a leading axis."""
        return P(tuple(self.mesh.axis_names))


def _spec_entry(axes: tuple[str, ...]):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _entry_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _explicit_sharding(q):
    """q's sharding when its type carries explicit mesh axes that split it; else None."""
    try:
        sharding = jax.typeof(q).sharding
    except (AttributeError, TypeError):
        return None
    if not isinstance(sharding, NamedSharding):
        return None
    explicit = any(t == jax.sharding.AxisType.Explicit
                   for t in getattr(sharding.mesh, "axis_types", ()))
    if not explicit or all(e is None for e in sharding.spec):
        return None
    return sharding


def resolve_sharding(op_name: str, sharding, q, *, batch: int, heads: int,
                     time: int | None = None) -> MeshLayout | None:
    """The mesh layout of a call, or None for a single-device call.

    Args:
      op_name: the public op, for messages.
      sharding: the user's `sharding` argument: None or a NamedSharding for q's [B, T, H, D].
      q: the query array (its type may carry explicit mesh axes, used when sharding is None).
      batch, heads: B and H, which the batch and head mesh axes must divide.
      time: T where the op runs context parallel over a split time axis (which must divide it);
        None where it does not.
    Raises:
      ValueError: a sharding that is not a NamedSharding, a spec longer than q's rank, a split
        head dim, or mesh axes whose sizes do not divide B, H or T.
      NotImplementedError: a split time axis where the op has no context parallelism.
    """
    if sharding is None:
        sharding = _explicit_sharding(q)
        if sharding is None:
            return None
    if not isinstance(sharding, NamedSharding):
        raise ValueError(
            f"{op_name}: sharding must be None or a jax.sharding.NamedSharding for q's "
            f"[B, T, H, D] layout; got {sharding!r}.")
    spec = tuple(sharding.spec)
    if len(spec) > 4:
        raise ValueError(
            f"{op_name}: sharding's spec {sharding.spec} has {len(spec)} entries; q is "
            "[B, T, H, D] (at most 4).")
    spec = spec + (None,) * (4 - len(spec))
    if spec[HEAD_DIM] is not None:
        raise ValueError(
            f"{op_name}: sharding's spec {sharding.spec} splits the head dim over "
            f"{spec[HEAD_DIM]!r}; accepted: the batch and head axes (dims 0 and 2).")
    if spec[TIME] is not None and time is None:
        raise NotImplementedError(
            f"{op_name}: sharding's spec {sharding.spec} splits the time axis over "
            f"{spec[TIME]!r}: context parallelism is not implemented for {op_name} yet; shard "
            "the batch and head axes (dims 0 and 2).")
    layout = MeshLayout(sharding.mesh, _entry_axes(spec[BATCH]), _entry_axes(spec[HEADS]),
                        _entry_axes(spec[TIME]))
    for name, axes, size in (("batch", layout.batch_axes, batch),
                             ("heads", layout.head_axes, heads),
                             ("time", layout.time_axes, time)):
        shards = layout.size(axes)
        if axes and size % shards:
            raise ValueError(
                f"{op_name}: sharding's spec {sharding.spec} splits the {name} dim ({size}) "
                f"over mesh axes {axes} of {shards} devices, which does not divide it.")
    if layout.mesh.size == 1:
        return None
    return layout


def sharded_call(local_fn: Callable, layout: MeshLayout, args: Sequence, in_specs: Sequence,
                 out_specs, *, grad_psum_axes: Sequence[tuple[str, ...]] | None = None):
    """`local_fn(*args)` on each device's block of `args`, as one differentiable function.

    Args:
      local_fn: the single-device op on local blocks; returns a pytree of arrays (None leaves
        allowed).
      layout: the resolved mesh layout.
      args: arrays or None; floating ones are differentiated, integer ones are not.
      in_specs: a PartitionSpec per arg (None for a None arg).
      out_specs: PartitionSpecs matching local_fn's output pytree.
      grad_psum_axes: per arg, the mesh axes to sum its gradient over (an input replicated over
        axes the local computations differ along), or () / None.
    """
    args = tuple(args)
    in_specs = tuple(in_specs)
    psum_axes = tuple(grad_psum_axes or ((),) * len(args))
    differentiable = tuple(a is not None and jnp.issubdtype(a.dtype, jnp.floating) for a in args)

    def shmap(fn, ins, outs):
        # The body jitted: an eager shard_map then runs it as one program, never one primitive
        # at a time (the module docstring says why).
        return jax.shard_map(jax.jit(fn), mesh=layout.mesh, in_specs=ins, out_specs=outs,
                             check_vma=False)

    def split(xs):
        return ([x for x, d in zip(xs, differentiable) if d],
                [x for x, d in zip(xs, differentiable) if not d])

    def merge(floats, others):
        floats, others = iter(floats), iter(others)
        return [next(floats) if d else next(others) for d in differentiable]

    if layout.explicit:
        # Explicit mesh axes are part of the arrays' types: bring each input to its spec first
        # (shard_map refuses a mismatch there, where it reshards silently on an Auto mesh).
        args = tuple(None if a is None else jax.reshard(a, NamedSharding(layout.mesh, spec))
                     for a, spec in zip(args, in_specs))

    @jax.custom_vjp
    def call(*xs):
        return shmap(local_fn, in_specs, out_specs)(*xs)

    pullback_tree = []

    def call_fwd(*xs):
        def local_fwd(*local):
            floats, others = split(local)
            out, pullback = jax.vjp(lambda *f: local_fn(*merge(f, others)), *floats)
            leaves, tree = jax.tree.flatten(pullback)
            pullback_tree[:] = [tree]
            return out, [leaf[None] for leaf in leaves]

        out, residuals = shmap(local_fwd, in_specs, (out_specs, layout.every_axis))(*xs)
        return out, residuals

    def call_bwd(residuals, cotangent):
        float_specs, other_specs = split(in_specs)
        float_psums, _ = split(psum_axes)

        def local_bwd(local_residuals, local_cotangent):
            pullback = jax.tree.unflatten(pullback_tree[0], [r[0] for r in local_residuals])
            grads = list(pullback(local_cotangent))
            for i, axes in enumerate(float_psums):
                if axes:
                    grads[i] = jax.lax.psum(grads[i], axes)
            return grads

        float_grads = shmap(local_bwd, (layout.every_axis, out_specs),
                            list(float_specs))(residuals, cotangent)
        return tuple(merge(float_grads, [None] * len(other_specs)))

    call.defvjp(call_fwd, call_bwd)
    return call(*args)


def kv_for_local_heads(x, layout: MeshLayout, local_heads: int, group: int):
    """The kv heads that this device's `local_heads` query heads read, from all of them.

    x: [B, S, Hkv, D], replicated over the head axes (Hkv is not a multiple of their size).
    Query head h reads kv head h // group. Where the device's query heads share one kv head
    (group a multiple of local_heads) that head is sliced out; otherwise the kv heads are repeated
    to one per query head first. Returns [B, S, Hkv_local, D].
    """
    first = jax.lax.axis_index(layout.head_axes) * local_heads  # first local query head
    if group % local_heads == 0:
        return jax.lax.dynamic_slice_in_dim(x, first // group, 1, axis=2)
    return jax.lax.dynamic_slice_in_dim(jnp.repeat(x, group, axis=2), first, local_heads, axis=2)
