"""AOT compilation of the "mosaic_tpu" flash attention for real TPU generations through libtpu.

Each test lowers the PUBLIC API `gla_tpu.ops.flash_attention(..., backend="mosaic_tpu")` on abstract
bfloat16 inputs placed on one core of a TPU generation and runs the whole Mosaic compiler (VMEM
budget included): the forward, and jax.grad of a scalar loss (forward with residuals + dq + dk/dv).
docs/attention_mosaic_tpu.md claims exactly the configurations compiled here.

Default run: the three documented configurations forward and forward+backward on every generation,
plus one ragged GQA problem with segments, plus the issue's sweep (T in {2048, 8192, 32768}, D in
{64, 128, 256}, causal and not, GQA 8:1) forward+backward on every generation; the forward kernel
is part of every forward+backward executable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from gla_tpu import ops
from gla_tpu.testing.tpu_compile import TPU_GENERATIONS, compile_for_tpu, libtpu_available

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.skipif(not libtpu_available(), reason="libtpu is not installed"),
]

# (B, T, S, H, Hkv, D, causal, segments)
DOC_CONFIGS = {
    "b1_t8192_h16_d128_causal": (1, 8192, 8192, 16, 16, 128, True, False),
    "b2_t4096_h8_hkv2_d64": (2, 4096, 4096, 8, 2, 64, False, False),
    "b1_t4096_h8_d256_causal": (1, 4096, 4096, 8, 8, 256, True, False),
}
RAGGED_CONFIG = (2, 1000, 1300, 8, 1, 64, True, True)
SWEEP = [
    pytest.param((2 if t == 2048 else 1, t, t, 8, 1, d, causal, False),
                 id=f"t{t}_d{d}_{'causal' if causal else 'full'}_gqa8")
    for t in (2048, 8192, 32768) for d in (64, 128, 256) for causal in (True, False)
]


def _compile(config, generation: str, *, backward: bool):
    b, t, s, h, hkv, d, causal, segments = config
    dtype = jnp.bfloat16
    args = [jax.ShapeDtypeStruct((b, t, h, d), dtype), jax.ShapeDtypeStruct((b, s, hkv, d), dtype),
            jax.ShapeDtypeStruct((b, s, hkv, d), dtype)]
    if segments:
        args += [jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b, s), jnp.int32)]

    def forward(q, k, v, *seg):
        return ops.flash_attention(q, k, v, causal=causal, segment_ids=tuple(seg) or None,
                                   backend="mosaic_tpu")

    def loss(q, k, v, *seg):
        return jnp.sum(forward(q, k, v, *seg).astype(jnp.float32))

    fn = jax.grad(loss, argnums=(0, 1, 2)) if backward else forward
    return compile_for_tpu(fn, *args, generation=generation)


@pytest.mark.parametrize("generation", TPU_GENERATIONS)
@pytest.mark.parametrize("name", list(DOC_CONFIGS))
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd_bwd"])
def test_documented_configs_compile(name, generation, backward):
    assert _compile(DOC_CONFIGS[name], generation, backward=backward) is not None


@pytest.mark.parametrize("generation", TPU_GENERATIONS)
def test_ragged_gqa_segments_compile(generation):
    assert _compile(RAGGED_CONFIG, generation, backward=True) is not None


@pytest.mark.parametrize("generation", TPU_GENERATIONS)
@pytest.mark.parametrize("config", SWEEP)
def test_sweep_compiles(config, generation):
    assert _compile(config, generation, backward=True) is not None
