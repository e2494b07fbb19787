"""Backend names and "auto" resolution.

"auto" picks the Pallas kernel of the default device's platform and falls back to "xla" for a
problem the kernel cannot take (its `check_supported` raised NotImplementedError), warning once per
distinct reason. A backend named explicitly never falls back: its NotImplementedError propagates.
An op family whose kernels are planned but not written (FAMILY_BACKENDS) is the same case: "auto"
falls back to "xla" with a one-time warning on that platform, and naming the backend raises.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import warnings
from typing import Callable

import jax

MOSAIC_TPU = "mosaic_tpu"
PALLAS_GPU = "pallas_gpu"
XLA = "xla"
BACKENDS = ("auto", MOSAIC_TPU, PALLAS_GPU, XLA)

_PLATFORM_KERNEL = {"tpu": MOSAIC_TPU, "gpu": PALLAS_GPU, "cuda": PALLAS_GPU}

# The concrete backends each op family implements, each the module
# gla_tpu.ops.<family>.<backend> with `CAPABILITIES` and `check_supported`. A backend of BACKENDS
# missing here is not yet available for that family.
FAMILY_BACKENDS = {
    "attention": (MOSAIC_TPU, PALLAS_GPU, XLA),
    "gla": (MOSAIC_TPU, PALLAS_GPU, XLA),
    "delta_rule": (MOSAIC_TPU, PALLAS_GPU, XLA),
}

_warned: set[str] = set()
_warned_lock = threading.Lock()
_recorders: list[list[str]] = []  # open `record_fallbacks` contexts


class BackendFallbackWarning(UserWarning):
    """Emitted once per reason when backend="auto" falls back to "xla"."""


def default_platform() -> str:
    return jax.devices()[0].platform


def is_hopper() -> bool:
    """Whether the first local GPU is a Hopper (compute capability 9.x), where the Mosaic GPU
    kernels run by default."""
    try:
        device = jax.local_devices(backend="gpu")[0]
    except RuntimeError:  # no GPU backend
        return False
    return str(getattr(device, "compute_capability", "")).startswith("9.")


def gpu_sm_count(default: int = 132) -> int:
    """Streaming multiprocessors of the first local GPU (an H100 SXM's 132 without one)."""
    try:
        return int(getattr(jax.local_devices(backend="gpu")[0], "core_count", default))
    except RuntimeError:  # no GPU backend
        return default


def mosaic_gpu_selected(kernel: str, reason: str | None, interpret: bool,
                        field: str = "forward_kernel") -> bool:
    """Whether a "pallas_gpu" op runs its Mosaic GPU kernel, by the BlockSizes choice `kernel`
    (held in the field named `field`): "triton" never; "mosaic_gpu" always, refusing with
    NotImplementedError what the kernel cannot take (`reason`, None when it can); "auto" on a
    Hopper GPU where it applies, and not in interpret mode (where the Triton kernels' CPU
    interpreter is the tested default)."""
    if kernel == "triton":
        return False
    if kernel == "mosaic_gpu":
        if reason is not None:
            raise NotImplementedError(
                f"BlockSizes({field}='mosaic_gpu') cannot take {reason}; "
                f"{field}='auto' or 'triton' can.")
        return True
    return reason is None and not interpret and is_hopper()


def kernel_backend_for_platform(platform: str) -> str:
    """The Pallas backend "auto" tries first on `platform` ("xla" where there is none)."""
    return _PLATFORM_KERNEL.get(platform, XLA)


@contextlib.contextmanager
def record_fallbacks():
    """Yields a list that receives the message of every "auto" fallback resolved inside the
    context, also those already warned about earlier in the process (what a benchmark records
    beside each of its results)."""
    messages: list[str] = []
    with _warned_lock:
        _recorders.append(messages)
    try:
        yield messages
    finally:
        with _warned_lock:
            _recorders.remove(messages)


def warn_once(message: str) -> None:
    with _warned_lock:
        for messages in _recorders:
            messages.append(message)
        if message in _warned:
            return
        _warned.add(message)
    warnings.warn(message, BackendFallbackWarning, stacklevel=4)


def resolve_backend(op_name: str, backend: str, check_supported: Callable[[str], None]) -> str:
    """Returns the backend to run.

    Args:
      op_name: the public op's name, for messages.
      backend: the user's `backend` argument (already validated against BACKENDS).
      check_supported: called with a concrete backend name; raises NotImplementedError when that
        backend cannot take the problem.
    """
    if backend != "auto":
        check_supported(backend)
        return backend
    candidate = kernel_backend_for_platform(default_platform())
    if candidate == XLA:
        return XLA
    try:
        check_supported(candidate)
    except NotImplementedError as e:
        warn_once(f"{op_name}: backend='auto' falls back from {candidate!r} to 'xla': {e}")
        return XLA
    return candidate


def dispatch(op_family: str, op_name: str, backend: str, problem, block_sizes):
    """Validates `backend`, resolves it for `problem` (running the support check once) and returns
    (the backend module, the block sizes it takes); a fallback from "auto" to "xla" drops the
    block sizes, which tune kernels the fallback does not have (the warning says why)."""
    from gla_tpu.ops.common.validation import check_choice

    check_choice("backend", backend, BACKENDS)

    def check_supported(name: str) -> None:
        if name not in FAMILY_BACKENDS[op_family]:
            raise NotImplementedError(
                f"the {name!r} backend is not yet available for {op_name}; backend='xla' "
                "takes it.")
        backend_module(op_family, name).check_supported(problem, block_sizes)

    chosen = resolve_backend(op_name, backend, check_supported)
    if chosen == XLA and backend == "auto":
        block_sizes = None
    return backend_module(op_family, chosen), block_sizes


def backend_module(op_family: str, backend: str):
    """The module of a concrete backend: gla_tpu.ops.<op_family>.<backend> (a family of
    FAMILY_BACKENDS).

    Imported on first use, so a Pallas backend costs nothing until it is picked.
    """
    return importlib.import_module(f"gla_tpu.ops.{op_family}.{backend}")


def capabilities(op_family: str) -> list:
    """The Capabilities of every backend `op_family` implements, in BACKENDS order."""
    return [backend_module(op_family, name).CAPABILITIES for name in FAMILY_BACKENDS[op_family]]
