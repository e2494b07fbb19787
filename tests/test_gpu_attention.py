"""The "pallas_gpu" flash attention: parity on a CUDA GPU (marker gpu), plus CPU checks that run
the Triton kernels in interpret mode and lower them to Triton IR for a Hopper target."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from gla_tpu import ops
from gla_tpu.ops.attention.pallas_gpu import BlockSizes, default_block_sizes
from gla_tpu.testing.gpu_lowering import hopper_target
from gla_tpu.testing.parity import check_attention_parity
from gla_tpu.testing.problems import AttentionCase

SMALL_BLOCKS = BlockSizes(32, 16, 32, 16, 16, 32)

# jax 0.11.2 deprecates the Pallas Triton lowering (docs/gpu_backend.md says why we still use it);
# the warning is raised at every lowering, which this strict environment would turn into errors.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


@pytest.mark.parametrize("case", [
    AttentionCase(1, 100, 70, 4, 2, 32, causal=True),
    AttentionCase(1, 70, 100, 4, 2, 16, causal=False, segments="pair"),
], ids=str)
def test_interpret_parity(case):
    check_attention_parity(case, jax.random.key(1), dtype=jnp.float32, backend="pallas_gpu",
                           interpret=True, block_sizes=SMALL_BLOCKS)


@pytest.mark.parametrize("head_dim,causal,segments", [(64, True, True), (128, False, False),
                                                      (256, True, False)])
def test_lowers_to_triton_fwd_and_bwd(head_dim, causal, segments):
    q = jax.ShapeDtypeStruct((2, 200, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, head_dim), jnp.bfloat16)
    seg_q = jax.ShapeDtypeStruct((2, 200), jnp.int32)
    seg_kv = jax.ShapeDtypeStruct((2, 256), jnp.int32)

    def loss(q, k, v, sq, skv):
        o = ops.flash_attention(q, k, v, causal=causal, segment_ids=(sq, skv) if segments else None,
                                backend="pallas_gpu")
        return jnp.sum(o.astype(jnp.float32))

    with hopper_target():
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
            q, kv, kv, seg_q, seg_kv).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("xla.gpu.triton") == 3  # forward, dq, dkv


def test_unsupported_head_dim_raises():
    q = jnp.zeros((1, 16, 1, 96), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="head dims"):
        ops.flash_attention(q, q, q, backend="pallas_gpu")


def test_block_sizes_validate():
    with pytest.raises(ValueError, match="block_q"):
        BlockSizes(block_q=48)


GPU_CASES = [
    AttentionCase(2, 4096, 4096, 8, 8, 128, causal=True),
    AttentionCase(2, 4096, 4096, 8, 2, 128, causal=False),
    AttentionCase(1, 2048, 2048, 8, 8, 64, causal=True),
    AttentionCase(1, 2048, 2048, 4, 4, 256, causal=True),
    AttentionCase(1, 2048, 2048, 4, 4, 256, causal=False),
    AttentionCase(2, 1000, 1500, 4, 1, 128, causal=True),
    AttentionCase(2, 1500, 1000, 4, 2, 64, causal=True),
    AttentionCase(2, 1024, 1024, 4, 2, 128, causal=True, segments="shared"),
    AttentionCase(1, 777, 1029, 4, 4, 64, causal=False, segments="pair"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_parity_bf16(case):
    # the Triton forward, forced: on Hopper "auto" takes the Mosaic GPU forward at D 64 / 128
    # without segments, which tests/test_gpu_attention_mosaic.py checks at the same shapes
    sizes = dataclasses.replace(default_block_sizes(case.head_dim, jnp.bfloat16),
                                forward_kernel="triton")
    check_attention_parity(case, jax.random.key(2), dtype=jnp.bfloat16, backend="pallas_gpu",
                           block_sizes=sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_parity_dtypes(dtype, head_dim):
    case = AttentionCase(1, 1024, 1024, 4, 2, head_dim, causal=True)
    check_attention_parity(case, jax.random.key(3), dtype=dtype, backend="pallas_gpu")
