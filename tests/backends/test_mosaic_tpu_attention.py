"""What is particular to the "mosaic_tpu" flash attention (tests/ops/test_attention.py checks its
numerics with every other backend; tests/backends/test_tpu_compile.py compiles it): block sizes,
their resolution against short sequences, the VMEM plan, and interpret parameters."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

from gla_tpu import ops
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


# The backward's sub-block loop (plan.backward_sub_block: a dq key block or a dk/dv query block
# wider than the sub-block, taken by a loop), made to run at small shapes by a sub-block of 128:
# full and causal, segment ids, T != S; in the one-kernel backward (one dq tile per sub-block)
# and in the two kernels. The default run takes each case in one of the two backwards (the
# segment ids in the two kernels, T != S in the one kernel); --full, each in both.
@pytest.mark.parametrize("case,fused", [
    pytest.param(C(1, 256, 256, 2, 1, 128, causal=False, segments="pair"), True,
                 marks=pytest.mark.full, id="full-segments-one_kernel"),
    pytest.param(C(1, 256, 256, 2, 1, 128, causal=False, segments="pair"), False,
                 id="full-segments-two_kernels"),
    pytest.param(C(1, 200, 300, 2, 2, 128, causal=True), True, id="causal-T200-S300-one_kernel"),
    pytest.param(C(1, 200, 300, 2, 2, 128, causal=True), False, marks=pytest.mark.full,
                 id="causal-T200-S300-two_kernels"),
])
def test_backward_sub_block_loop(case, fused, monkeypatch):
    from gla_tpu.ops.attention.mosaic_tpu import plan

    monkeypatch.setattr(plan, "BACKWARD_SUB_BLOCK", 128)
    sizes = BlockSizes(block_q=128, block_kv=128, block_q_dq=128, block_kv_dq=256,
                       block_q_dkv=256, block_kv_dkv=128, fused_backward=fused)
    check_attention_parity(case, backend="mosaic_tpu", interpret=True, block_sizes=sizes)


# The two-kernel backward (dq; dk and dv), which runs where the one-kernel backward's dq does not
# fit VMEM and on a chip not known; interpret mode takes the one kernel by default, as every case
# of tests/ops/test_attention.py does. GQA with T != S, segment ids at D = 64 (--full only: the
# two kernels take segment ids in test_backward_sub_block_loop[full-segments-two_kernels]), a
# window with a soft cap.
@pytest.mark.parametrize("case", [
    C(1, 200, 300, 4, 2, 128, causal=True),
    pytest.param(C(2, 256, 256, 2, 1, 64, causal=True, segments="pair"), marks=pytest.mark.full),
    C(1, 384, 384, 2, 2, 128, causal=True, window=(100, 0), soft_cap=20.0),
], ids=str)
def test_two_kernel_backward_interpret_parity(case):
    sizes = dataclasses.replace(SMALL, fused_backward=False)
    check_attention_parity(case, backend="mosaic_tpu", interpret=True, block_sizes=sizes)


def test_interpret_mode_takes_the_one_kernel_backward(monkeypatch):
    """By default (BlockSizes.fused_backward None) interpret mode runs flash_dqkv, not the two
    kernels (a shape of its own, so that no cached trace answers)."""
    from gla_tpu.ops.attention.mosaic_tpu import vjp

    called = []
    original = vjp.flash_dqkv

    def counted(*args, **kwargs):
        called.append(True)
        return original(*args, **kwargs)

    def refused(*args, **kwargs):
        raise RuntimeError("the two-kernel backward ran")

    monkeypatch.setattr(vjp, "flash_dqkv", counted)
    monkeypatch.setattr(vjp, "flash_dq", refused)
    monkeypatch.setattr(vjp, "flash_dkv", refused)
    check_attention_parity(C(1, 131, 131, 2, 1, 64, causal=True), backend="mosaic_tpu",
                           interpret=True, block_sizes=SMALL)
    assert called


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
        dict(fused_backward="yes"),
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


# The model against the smallest default scoped limit (16 MiB, v4 and v5e), with a margin: 12 MiB
# for 16-bit inputs; float32 at D = 256 models 12.1 MiB for the dk/dv kernel's 512 x 512 tiles
# and compiles on v4 and v5e (test_tpu_compile.py, float32 D = 256), so 80% of the limit there.
@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("itemsize,bound", [(2, 12 * 2**20), (4, int(0.8 * 16 * 2**20))])
def test_default_blocks_fit_the_smallest_default_vmem_limit(d, itemsize, bound):
    bs = BlockSizes.default(d)
    for kind, bq, bkv in (("fwd", bs.block_q, bs.block_kv), ("dq", bs.block_q_dq, bs.block_kv_dq),
                          ("dkv", bs.block_q_dkv, bs.block_kv_dkv)):
        est = vmem_estimate_bytes(kind, bq, bkv, d, itemsize,
                                  block_kv_compute=bs.block_kv_compute, segments=True)
        assert est <= bound, (kind, est)


def test_d256_forward_tiles_follow_the_chips_vmem():
    """On 128-wide MXUs the D = 256 forward takes 1024 x 1024 tiles where the chip has 64 MiB of
    VMEM or more (v5e, v5p), 512 x 512 on v4's 16 MiB; the backward and D <= 128 keep theirs."""
    mib = 2**20
    small, large = BlockSizes.default(256, 128, 16 * mib), BlockSizes.default(256, 128, 64 * mib)
    assert (small.block_q, small.block_kv, small.block_kv_compute) == (512, 512, 256)
    assert (large.block_q, large.block_kv, large.block_kv_compute) == (1024, 1024, 256)
    assert (large.block_q_dq, large.block_kv_dq, large.block_q_dkv, large.block_kv_dkv) == (
        512, 512, 512, 512)
    assert BlockSizes.default(128, 128, 128 * mib) == BlockSizes.default(128)
    # 13.2 MiB in float32 with segment ids, under the 16 MiB default scoped limit of v5e and v5p
    # (it compiles there: test_tpu_compile.py, float32 D = 256)
    est = vmem_estimate_bytes("fwd", 1024, 1024, 256, 4, block_kv_compute=256, segments=True)
    assert est <= int(0.85 * 16 * mib), est


# The forward on the API's layout (plan.forward_reads_rows, kernels.flash_forward_rows).


def _problem(h, hkv, d, dtype, **kw):
    return AttentionProblem(batch=1, q_len=300, kv_len=300, num_heads=h, num_kv_heads=hkv,
                            head_dim=d, causal=True, sm_scale=1.0, has_segments=False,
                            dtype=jnp.dtype(dtype), **kw)


@pytest.mark.parametrize("h,hkv,d,dtype,expected", [
    (4, 2, 128, jnp.bfloat16, True),
    (8, 1, 128, jnp.bfloat16, True),  # one kv head: plain rows
    (3, 1, 128, jnp.bfloat16, False),  # an odd head count: bfloat16 rows come in word pairs
    (6, 3, 128, jnp.bfloat16, False),
    (3, 3, 128, jnp.float32, True),  # 32-bit rows read strided at any head count
    (4, 2, 64, jnp.bfloat16, False),  # rows of 128 lanes only
    (4, 2, 256, jnp.float32, False),
])
def test_forward_reads_rows_where_it_applies(h, hkv, d, dtype, expected):
    problem = _problem(h, hkv, d, dtype)
    assert kernel_config(problem, None, True).forward_reads_rows is expected
    assert kernel_config(problem, BlockSizes(forward_reads_rows=True), True).forward_reads_rows \
        is expected
    assert not kernel_config(problem, BlockSizes(forward_reads_rows=False), True) \
        .forward_reads_rows
    ring_block = kernel_config(problem, None, True, rows_kernels=False)
    assert not ring_block.forward_reads_rows


def test_bad_reads_rows_raises_value_error():
    with pytest.raises(ValueError, match="BlockSizes.forward_reads_rows must be None, True or "
                                         "False; got 'yes'"):
        BlockSizes(forward_reads_rows="yes")


def test_rows_blocks_shrink_to_fit_the_vmem():
    """On a chip, the rows forward halves its blocks until every head's fit the VMEM budget,
    and falls back to head-major copies below 512."""
    from gla_tpu.ops.attention.mosaic_tpu import plan

    problem = _problem(16, 16, 128, jnp.bfloat16)
    need = lambda bq, bkv: plan.rows_vmem_bytes(bq, bkv, bkv, 16, 16, 128, 2, True)  # noqa
    fit = lambda budget: plan._fit_rows_blocks(  # noqa: E731
        problem, 1024, 1024, 1024, row_sums=True, budget=budget)
    assert fit(need(1024, 1024)) == (1024, 1024, 1024)
    assert fit(need(512, 1024)) == (512, 1024, 1024)
    assert fit(need(512, 512)) == (512, 512, 512)
    assert fit(need(512, 512) - 1) is None


def test_halves_to_rows_reads_the_word_halves_as_tpu_packs_them():
    """bfloat16 rows 2r and 2r + 1 share a 32-bit word, 2r in the low half (the packing that
    JAX's ragged paged attention also reads): each half comes back exactly."""
    import numpy as np

    from gla_tpu.ops.attention.mosaic_tpu.rows import halves_to_rows

    rows = np.asarray(jnp.asarray(np.random.default_rng(0).normal(size=(16, 128)),
                                  jnp.bfloat16).view(jnp.uint16)).astype(np.uint32)
    words = jnp.asarray(rows[0::2] | (rows[1::2] << 16), jnp.uint32)  # [8, 128]
    expected = np.asarray(jnp.asarray(rows.astype(np.uint16)).view(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(halves_to_rows(words, 0, jnp.bfloat16)),
                                  expected[0::2])
    np.testing.assert_array_equal(np.asarray(halves_to_rows(words, 1, jnp.bfloat16)),
                                  expected[1::2])


# Default run: the bfloat16 GQA case with the rows forward's blocks fetched within each q block
# (two cores); --full adds them fetched across q blocks (one core, in order: interpret mode's own
# order, plan._one_core_in_order, which the mosaic_tpu cases of tests/ops/test_attention.py that
# take the rows forward run under the pass rule), T > S, float32 with segments and MQA (the pass
# rule in tests/ops/test_attention.py covers the rows kernels in both tiers).
@pytest.mark.parametrize("across_rows", [pytest.param(True, marks=pytest.mark.full), False],
                         ids=["across_rows", "within_rows"])
@pytest.mark.parametrize("case,dtype", [
    (C(2, 300, 300, 4, 2, 128, causal=True), jnp.bfloat16),
    pytest.param(C(1, 520, 200, 4, 4, 128, causal=True), jnp.bfloat16, marks=pytest.mark.full),
    pytest.param(C(1, 200, 330, 3, 1, 128, causal=True, segments="pair"), jnp.float32,
                 marks=pytest.mark.full),
    pytest.param(C(1, 130, 260, 2, 1, 128), jnp.bfloat16, marks=pytest.mark.full),
])
def test_rows_forward_equals_the_head_major_forward(case, dtype, across_rows, monkeypatch):
    """Same blocks, same arithmetic: with the rows forward the outputs and the gradients (the
    backward is head-major either way) equal those of the head-major forward bit for bit. o's
    store loop is capped at 384 rows here, which does not divide bq * H = 512: it must take
    chunks that do (128 rows, four steps), as bq = 128, H = 6 takes 256 of 512 in use."""
    import dataclasses

    import jax
    import numpy as np

    from gla_tpu.ops.attention.mosaic_tpu import kernels, plan
    from gla_tpu.testing.problems import make_attention_inputs

    monkeypatch.setattr(plan, "_one_core_in_order", lambda info, interpret: across_rows)
    monkeypatch.setattr(kernels, "_O_STORE_ROWS", 384)

    inputs = make_attention_inputs(case, jax.random.key(7), dtype)
    q, k, v, segment_ids = (inputs[n] for n in ("q", "k", "v", "segment_ids"))

    def run(reads_rows):
        sizes = dataclasses.replace(SMALL, forward_reads_rows=reads_rows)

        def loss(q, k, v):
            o = ops.flash_attention(q, k, v, causal=case.causal, segment_ids=segment_ids,
                                    backend="mosaic_tpu", interpret=True, block_sizes=sizes)
            return jnp.sum(o.astype(jnp.float32) ** 2), o

        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    (dq, dk, dv), o = run(True)
    (dq0, dk0, dv0), o0 = run(False)
    for a, b in ((o, o0), (dq, dq0), (dk, dk0), (dv, dv0)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
