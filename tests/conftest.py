"""A strict test environment: CPU only, rank promotion raises, warnings are errors (setup.cfg).

Hypothesis runs one deterministic profile, "ci" (derandomized, a fixed example budget per test),
unless asked otherwise: with `--full`, "ci-full" (the same, with the larger budgets that
`strategies.budget` names for it); `pytest --hypothesis-profile=explore` draws new random
examples on every run, with a larger budget (docs/testing.md).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# pytest-xdist workers each load libtpu for the TPU compile tests; without this the second
# process fails on libtpu's single-process lockfile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Several host devices let sharding tests run on a CPU machine. Test programs run once or twice,
# so the CPU backend compiles them without LLVM's optimizations: the suite takes half the time, and
# the TPU compile tests produce the same executables with or without these flags
# (docs/testing.md).
TEST_XLA_FLAGS = ("--xla_force_host_platform_device_count=8",
                  "--xla_backend_optimization_level=0",
                  "--xla_llvm_disable_expensive_passes=true")
_flags = os.environ.get("XLA_FLAGS", "").split()
_set = {f.split("=")[0] for f in _flags}
_missing = [f for f in TEST_XLA_FLAGS if f.split("=")[0] not in _set]
os.environ["XLA_FLAGS"] = " ".join(_flags + _missing)

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

settings.register_profile("ci", derandomize=True, deadline=None, database=None, print_blob=True)
settings.register_profile("ci-full", parent=settings.get_profile("ci"))
settings.register_profile("explore", derandomize=False, deadline=None, max_examples=50,
                          print_blob=True)
settings.load_profile("ci")


def pytest_addoption(parser):
    parser.addoption(
        "--full", action="store_true", default=False,
        help="also run the tests marked `full`: the rest of the sweeps (every TPU generation for "
             "every compiled configuration, every parametrization); docs/testing.md")


def pytest_configure(config):
    # --full: the hypothesis tests' --full budgets too (strategies.budget); the test modules, whose
    # decorators read the loaded profile, are imported after this
    if config.getoption("--full") and settings.get_current_profile_name() == "ci":
        settings.load_profile("ci-full")


def pytest_collection_modifyitems(config, items):
    _group_for_xdist(config, items)
    skip_full = pytest.mark.skip(reason="part of the full sweep: run with --full (docs/testing.md)")
    run_full = config.getoption("--full")
    has_gpu = (any(d.platform == "gpu" for d in jax.devices())
               if os.environ.get("JAX_PLATFORMS") != "cpu" else False)
    # this file defaults JAX_PLATFORMS to cpu: on a GPU machine the gpu tests need it set
    skip_gpu = pytest.mark.skip(
        reason="needs a CUDA GPU and JAX_PLATFORMS=cuda (run on the lent H100/H200)")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        elif item.get_closest_marker("full") is not None and not run_full:
            item.add_marker(skip_full)


def _group_for_xdist(config, items):
    """`--dist loadgroup` on an xdist worker: each item marked `xdist_group(name)` gets the node id
    suffix "@name" by which the scheduler sends a group's tests to one worker (so a case's baseline
    and reference are computed once, docs/testing.md). pytest-xdist 3.8 writes the suffix to
    `item._nodeid`, which pytest 9.2 no longer reads (its node ids derive from `item._id`), so
    without this every test was scheduled on its own; where xdist's suffix did take, nothing
    changes."""
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import NodeId

    for item in items:
        groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})
        if groups and "@" not in item.nodeid.rpartition("]")[2]:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")
