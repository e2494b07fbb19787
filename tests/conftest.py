"""A strict test environment: CPU only, rank promotion raises, warnings are errors (setup.cfg)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# pytest-xdist workers each load libtpu for the TPU compile tests; without this the second
# process fails on libtpu's single-process lockfile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# Several host devices let sharding tests run on a CPU machine.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

settings.register_profile("ci", derandomize=True, deadline=None, database=None, max_examples=10,
                          print_blob=True)
settings.load_profile("ci")


def pytest_collection_modifyitems(config, items):
    has_gpu = any(d.platform == "gpu" for d in jax.devices()) if os.environ.get("JAX_PLATFORMS") != "cpu" else False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the lent H100/H200)")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
