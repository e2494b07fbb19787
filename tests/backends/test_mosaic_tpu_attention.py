"""What is particular to the "mosaic_tpu" flash attention (tests/ops/test_attention.py checks its
numerics with every other backend; tests/backends/test_tpu_compile.py compiles it): block sizes,
their resolution against short sequences, the VMEM plan, and interpret parameters."""

from __future__ import annotations


import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

from gla_tpu.ops.attention.mosaic_tpu import BlockSizes
from gla_tpu.ops.attention.mosaic_tpu.plan import kernel_config, vmem_estimate_bytes
from gla_tpu.ops.attention.validation import AttentionProblem
from gla_tpu.testing.parity import check_attention_parity
from gla_tpu.testing.problems import AttentionCase

SMALL = BlockSizes(block_q=128, block_kv=128, block_q_dq=128, block_kv_dq=128,
                   block_q_dkv=128, block_kv_dkv=128)
C = AttentionCase


def test_interpret_params_instance_passes_through():
    params = pltpu.InterpretParams(uninitialized_memory="nan", dma_execution_mode="eager")
    check_attention_parity(C(1, 70, 90, 2, 1, 64, causal=True), backend="mosaic_tpu",
                           interpret=params, block_sizes=SMALL)


# Errors and capability.


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_q=100),
        dict(block_kv=0),
        dict(block_q_dkv=-128),
        dict(block_kv_dq=True),
        dict(block_q_dq=256.0),
        dict(block_kv=256, block_kv_compute=384),
        dict(block_kv_compute=64),
        dict(vmem_limit_bytes=-1),
        dict(row_sum_on_mxu=1),
    ],
)
def test_bad_block_sizes_raise_value_error(kwargs):
    with pytest.raises(ValueError, match="BlockSizes"):
        BlockSizes(**kwargs)


def test_default_block_sizes_clamp_to_short_sequences():
    problem_sizes = dict(batch=1, num_heads=2, num_kv_heads=1, head_dim=256, causal=True,
                         sm_scale=1.0, has_segments=False, dtype=jnp.dtype(jnp.bfloat16))
    cfg = kernel_config(AttentionProblem(q_len=300, kv_len=1000, **problem_sizes),
                                   None, False)
    assert (cfg.block_q, cfg.q_len_padded) == (512, 512)
    assert (cfg.block_kv, cfg.block_kv_compute, cfg.kv_len_padded) == (512, 256, 1024)
    cfg = kernel_config(AttentionProblem(q_len=5, kv_len=130, **problem_sizes),
                                   SMALL, False)
    assert (cfg.block_q, cfg.q_len_padded, cfg.block_kv, cfg.kv_len_padded) == (128, 128, 128, 256)


def test_row_sums_on_the_mxu_refuse_float32():
    problem = AttentionProblem(batch=1, q_len=128, kv_len=128, num_heads=1, num_kv_heads=1,
                               head_dim=128, causal=False, sm_scale=1.0, has_segments=False,
                               dtype=jnp.dtype(jnp.float32))
    with pytest.raises(ValueError, match="row_sum_on_mxu=True needs bfloat16 inputs; got float32"):
        kernel_config(problem, BlockSizes(row_sum_on_mxu=True), False)
    assert not kernel_config(problem, None, False).row_sum_on_mxu


@pytest.mark.parametrize("d", (64, 128, 256))
def test_default_blocks_fit_the_smallest_default_vmem_limit(d):
    bs = BlockSizes.default(d)
    for kind, bq, bkv in (("fwd", bs.block_q, bs.block_kv), ("dq", bs.block_q_dq, bs.block_kv_dq),
                          ("dkv", bs.block_q_dkv, bs.block_kv_dkv)):
        est = vmem_estimate_bytes(kind, bq, bkv, d, 4, block_kv_compute=bs.block_kv_compute,
                                  segments=True)
        assert est <= 12 * 2**20, (kind, est)
