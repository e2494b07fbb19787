"""What is particular to the "pallas_gpu" GLA (tests/ops/test_gla.py checks its numerics with every
other backend): both paths of the intra-chunk products under weak to very strong gates, the
few-token (decode) kernel on its own, lowering to Triton IR for a Hopper target; parity on a CUDA
GPU under marker gpu."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gla_tpu import ops
from gla_tpu.testing.parity import check_gla_parity
from gla_tpu.ops.common.chunk_cumsum import chunk_local_cumsum
from gla_tpu.ops.common.padding import pad_time
from gla_tpu.ops.gla.pallas_gpu import BlockSizes
from gla_tpu.ops.gla.pallas_gpu import kernels_intra as kernels
from gla_tpu.ops.gla.pallas_gpu import plan, time_split
from gla_tpu.ops.gla.pallas_gpu.kernels_recurrent import block_v, recurrent_forward
from gla_tpu.ops.gla.reference import gla_recurrent_reference
from gla_tpu.testing.gpu_lowering import gla_lowered_kernels, hopper_target
from gla_tpu.testing.problems import GLACase, make_gla_inputs
from gla_tpu.testing.tolerance import relative_rms_error

# jax 0.11.2 deprecates the Pallas Triton lowering (docs/gpu_gla.md says where it still runs);
# the warning is raised at every lowering, which this strict environment would turn into errors.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


# The two paths of the intra-chunk products (kernels_intra.py), per chunk: gate strength 16
# (fla's GLA layer default, about -0.05 a token) keeps every chunk bounded (one product per chunk),
# 1 (fla's benchmark draw, about -0.8) mixes both at T = 200 (the full chunks decay past the bound,
# the last one, 8 tokens and padding, does not; checked below), 1e-3 (about -800 a token, where
# every pair but a token with itself underflows) takes the exact one everywhere; with segments,
# an initial state and a partial last chunk. Strength 16 alone (every chunk bounded, the per-chunk
# grids) and strength 16 in float32 (1 too with --full) run in the matrix of tests/ops/test_gla.py.
# Per-head gates take a path of their own (one program per chunk for any strength): strength
# 1e-3 here with --full only, 1 and 16 in the matrix (the same path at every strength).
@pytest.mark.parametrize("gate_strength,dtype,gate", [
    (1.0, jnp.bfloat16, "key"), (1e-3, jnp.bfloat16, "key"),
    pytest.param(1e-3, jnp.float32, "key", marks=pytest.mark.full),  # --full only
    pytest.param(1e-3, jnp.bfloat16, "head", marks=pytest.mark.full)])
def test_interpret_parity_any_gate(gate_strength, dtype, gate):
    case = GLACase(1, 200, 2, 64, 64, gate=gate, initial_state=True, segments=True,
                   gate_strength=gate_strength)
    check_gla_parity(case, jax.random.key(5), dtype=dtype, backend="pallas_gpu",
                     interpret=True)


@pytest.mark.parametrize("gate_strength,expected", [(16.0, "all"), (1.0, "mixed"), (1e-3, "none")])
def test_gate_strengths_reach_the_paths(gate_strength, expected):
    case = GLACase(1, 200, 2, 64, 64, gate="key", gate_strength=gate_strength)
    g = pad_time(make_gla_inputs(case, jax.random.key(5))["g"], 64)
    flags = kernels.bounded_chunks(chunk_local_cumsum(g, 64), 64)  # [1, 2, 4]
    by_chunk = {"all": [1, 1, 1, 1], "mixed": [0, 0, 0, 1], "none": [0, 0, 0, 0]}[expected]
    assert flags[0].tolist() == [by_chunk] * 2


# forward: state pass, intra scores (per-key gates: per chunk and per sub-chunk, one chosen at
# run time), output; backward: reverse state pass, dA, dq/dk (both ways for per-key gates), dv
@pytest.mark.parametrize("key_dim,value_dim,segments,gate,kernels", [
    (128, 128, False, "key", 9), (64, 512, True, "key", 9), (128, 128, True, "head", 7)])
def test_lowers_to_triton_fwd_and_bwd(key_dim, value_dim, segments, gate, kernels):
    q = jax.ShapeDtypeStruct((2, 200, 2, key_dim), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, 200, 2, value_dim), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((2, 200, 2, key_dim) if gate == "key" else (2, 200, 2),
                             jnp.float32)
    s0 = jax.ShapeDtypeStruct((2, 2, key_dim, value_dim), jnp.float32)
    seg = jax.ShapeDtypeStruct((2, 200), jnp.int32)

    def loss(q, k, v, g, s0, seg):
        o, final = ops.gla(q, k, v, g, initial_state=s0, output_final_state=True,
                           segment_ids=seg if segments else None, backend="pallas_gpu")
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

    with hopper_target():
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(
            q, q, v, g, s0, seg).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("xla.gpu.triton") == kernels


# The Mosaic GPU forward (per-head gates, not differentiated) in GPU interpret mode: T split in
# two segments (forward_mosaic.py: the states-only pass, the scan, the outputs) and padded to
# whole ones, a partial last chunk, an initial state, padded K and V (100 -> 128, 192 -> 256:
# several value tiles), float16. On the GPU: test_gpu_mosaic_forward_parity, split and not.
MOSAIC = BlockSizes(forward_kernel="mosaic_gpu")


def test_mosaic_forward_interpret_parity():
    case = GLACase(1, 300, 1, 100, 192, gate="head", initial_state=True, gate_strength=4.0)
    sizes = BlockSizes(forward_kernel="mosaic_gpu", mosaic_time_splits=2)
    check_gla_parity(case, jax.random.key(3), dtype=jnp.float16, backend="pallas_gpu",
                     interpret=True, block_sizes=sizes, grads=False)


@pytest.mark.parametrize("blocks,chunks,expected", [(128, 64, 1), (32, 256, 4), (4, 64, 16),
                                                    (4, 6, 1), (66, 8, 2)])
def test_mosaic_time_splits_fill_one_wave(monkeypatch, blocks, chunks, expected):
    monkeypatch.setattr(plan, "gpu_sm_count", lambda: 132)
    assert plan.mosaic_time_splits(blocks, chunks) == expected


# The scan that joins the segments of a time split (time_split.segment_starts), forward and
# reversed, per-key and per-head decays, against the recurrence in float64; written out segment by
# segment, it lowers to no loop (a `lax.scan` there cost the forward 46 µs of 482 on an H200).
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed"])
@pytest.mark.parametrize("decay_keys", [3, 1], ids=["per_key", "per_head"])
def test_segment_starts_follow_the_recurrence(reverse, decay_keys):
    b, splits, h, kd, vd = 2, 4, 2, 3, 5
    keys = iter(jax.random.split(jax.random.key(14), 3))
    local = jax.random.normal(next(keys), (b * splits, h, kd, vd))
    decay = jax.random.uniform(next(keys), (b, splits, h, decay_keys))
    start = jax.random.normal(next(keys), (b, h, kd, vd))
    got = time_split.segment_starts(local, decay, start, reverse=reverse)
    local64, decay64 = (np.asarray(x, np.float64) for x in (local, decay))
    local64 = local64.reshape(b, splits, h, kd, vd)
    want = np.zeros_like(local64)
    state = np.asarray(start, np.float64)
    for p in (reversed(range(splits)) if reverse else range(splits)):
        want[:, p] = state
        state = decay64[:, p, :, :, None] * state + local64[:, p]
    np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want, rtol=1e-6, atol=1e-6)
    hlo = jax.jit(functools.partial(time_split.segment_starts, reverse=reverse)).lower(
        local, decay, start).as_text()
    assert "while" not in hlo


# one kernel; with T split, two (the segments' end states, then the outputs)
@pytest.mark.parametrize("splits,kernels", [(1, 1), (4, 2)])
def test_mosaic_forward_lowers_to_mosaic_and_training_to_triton(splits, kernels):
    sizes = BlockSizes(forward_kernel="mosaic_gpu", mosaic_time_splits=splits)
    q = jax.ShapeDtypeStruct((2, 1000, 2, 128), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((2, 1000, 2), jnp.float32)
    s0 = jax.ShapeDtypeStruct((2, 2, 128, 128), jnp.float32)
    assert gla_lowered_kernels(sizes, q, q, g, s0) == ((kernels, 0), (0, 7))


@pytest.mark.parametrize("gate,key_dim,dtype,segments,match", [
    ("key", 64, jnp.bfloat16, False, "per-key gates"),
    ("head", 256, jnp.bfloat16, False, "padded K = 256"),
    ("head", 64, jnp.float32, False, "float32"),
    ("head", 64, jnp.bfloat16, True, "segment_ids")])
def test_forced_mosaic_forward_refuses_what_it_cannot_take(gate, key_dim, dtype, segments, match):
    x = jnp.ones((1, 64, 1, key_dim), dtype)
    g = jnp.full((1, 64, 1, key_dim) if gate == "key" else (1, 64, 1), -0.1)
    seg = jnp.zeros((1, 64), jnp.int32) if segments else None
    with pytest.raises(NotImplementedError, match=match):
        ops.gla(x, x, x, g, segment_ids=seg, backend="pallas_gpu", interpret=True,
                block_sizes=MOSAIC)
    with pytest.raises(ValueError, match="forward_kernel"):
        BlockSizes(forward_kernel="cuda")
    with pytest.raises(ValueError, match="mosaic_time_splits"):
        BlockSizes(mosaic_time_splits=3)


# Gate strengths 1 (fla's benchmark draw), 16 (fla's GLA layer default) and 1e-3 (about -800 a
# token) at T = 4096 and at K, V = 256, 512; per-head gates at strengths 1 and 1e-3.
GPU_CASES = [
    GLACase(1, 4096, 2, 64, 64, gate="key"),
    GLACase(1, 4096, 2, 128, 128, gate="key", gate_strength=16.0, initial_state=True),
    GLACase(1, 4096, 2, 128, 128, gate="key", gate_strength=1e-3, segments=True),
    GLACase(1, 1024, 2, 256, 512, gate="key", gate_strength=1e-3, initial_state=True),
    GLACase(2, 1024, 4, 128, 128, gate="key", initial_state=True),
    GLACase(1, 1024, 2, 256, 512, gate="key"),
    GLACase(1, 1024, 2, 64, 192, gate="key", gate_strength=0.1, initial_state=True),
    GLACase(2, 1000, 2, 128, 64, gate="key", segments=True, initial_state=True),
    GLACase(2, 1024, 4, 128, 128, gate="head", initial_state=True, segments=True),
    GLACase(1, 4096, 2, 128, 128, gate="head", gate_strength=1e-3, segments=True),
    GLACase(1, 1024, 2, 256, 512, gate="head", initial_state=True),
    GLACase(2, 777, 2, 64, 128, gate="none", initial_state=True),
    GLACase(1, 1024, 2, 64, 64, gate="key", gate_strength=0.01),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_parity_bf16(case):
    check_gla_parity(case, jax.random.key(2), dtype=jnp.bfloat16, mode="chunk",
                     backend="pallas_gpu")


# "auto" runs the pair-level Mosaic GPU kernels on Hopper wherever they apply; the chunked Triton
# kernels (other GPUs, segment ids, float32) at both intra-chunk paths and K, V = 256, 512.
@pytest.mark.gpu
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[3], GPU_CASES[6]], ids=str)
def test_gpu_triton_parity_bf16(case):
    check_gla_parity(case, jax.random.key(2), dtype=jnp.bfloat16, mode="chunk",
                     backend="pallas_gpu", block_sizes=BlockSizes(chunk_kernel="triton"))


# The Mosaic GPU forward ("auto" takes it on Hopper for a call that is not differentiated) at every
# gate distribution of docs/gpu_gla.md, T up to 4096 and not a multiple of the chunk, K 64 and
# 128, V up to 512, float16, initial states. These shapes have few blocks, so "auto" splits T
# (forward_mosaic.py); splits=1 runs the one kernel alone.
MOSAIC_GPU_CASES = [
    (GLACase(1, 4096, 2, 128, 128, gate="head"), jnp.bfloat16, None),
    (GLACase(1, 4096, 2, 128, 128, gate="head"), jnp.bfloat16, 1),
    (GLACase(1, 4096, 2, 128, 128, gate="head", gate_strength=16.0, initial_state=True),
     jnp.bfloat16, None),
    (GLACase(1, 4096, 2, 128, 128, gate="head", gate_strength=1e-3), jnp.bfloat16, None),
    (GLACase(2, 1000, 3, 64, 512, gate="head", initial_state=True), jnp.float16, None),
    (GLACase(2, 777, 2, 100, 64, gate="none", initial_state=True), jnp.bfloat16, None),
    (GLACase(2, 777, 2, 100, 64, gate="head", initial_state=True), jnp.float16, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype,splits", MOSAIC_GPU_CASES, ids=str)
def test_gpu_mosaic_forward_parity(case, dtype, splits):
    sizes = BlockSizes(mosaic_time_splits=splits)
    check_gla_parity(case, jax.random.key(6), dtype=dtype, backend="pallas_gpu", grads=False,
                     block_sizes=sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fused_recurrent", "fused_chunk"])
def test_gpu_parity_other_modes_f32(mode):
    case = GLACase(1, 256, 2, 64, 64, gate="key", initial_state=True, segments=True)
    check_gla_parity(case, jax.random.key(3), dtype=jnp.float32, mode=mode,
                     backend="pallas_gpu")


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", [1, 3])
def test_gpu_decode_few_tokens(seq_len):
    case = GLACase(4, seq_len, 2, 128, 128, gate="key", initial_state=True)
    check_gla_parity(case, jax.random.key(4), dtype=jnp.bfloat16, mode="fused_recurrent",
                     backend="pallas_gpu")


# The few-token (decode) forward kernel on its own.


def _inputs(key, bsz, tokens, heads, key_dim, value_dim, *, dtype, strength, initial_state):
    """Fresh random q, k, v (dtype), log gates log_sigmoid(normal) / strength (f32) and s0."""
    kq, kk, kv, kg, ks = jax.random.split(key, 5)
    q = jax.random.normal(kq, (bsz, tokens, heads, key_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (bsz, tokens, heads, key_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (bsz, tokens, heads, value_dim), jnp.float32).astype(dtype)
    g = jax.nn.log_sigmoid(jax.random.normal(kg, (bsz, tokens, heads, key_dim))) / strength
    s0 = (jax.random.normal(ks, (bsz, heads, key_dim, value_dim), jnp.float32)
          if initial_state else None)
    return q, k, v, g, s0


def _check(key, bsz, tokens, heads, key_dim, value_dim, *, dtype, strength, initial_state,
           interpret, tol):
    q, k, v, g, s0 = _inputs(key, bsz, tokens, heads, key_dim, value_dim, dtype=dtype,
                             strength=strength, initial_state=initial_state)
    scale = key_dim ** -0.5
    fn = jax.jit(functools.partial(recurrent_forward, scale=scale, interpret=interpret))
    o, final = fn(q, k, v, g, s0)
    assert o.shape == v.shape and o.dtype == v.dtype
    assert final.shape == (bsz, heads, key_dim, value_dim) and final.dtype == jnp.float32
    want_o, want_final = gla_recurrent_reference(  # float64, on the dtype-rounded inputs
        q, k, v, g, scale=scale, initial_state=s0, output_final_state=True)
    err_o, err_final = relative_rms_error(o, want_o), relative_rms_error(final, want_final)
    assert err_o <= tol, f"o: relative RMS error {err_o:.3g} > {tol}"
    assert err_final <= tol, f"final: relative RMS error {err_final:.3g} > {tol}"


DIMS = [(64, 64), (128, 128), (256, 64), (64, 512)]


# Every token count x head dims; initial state and gate strength alternate over the product.
# --full only: 3 tokens (the tokens unrolled up to 16, kernels_recurrent.MAX_UNROLL: 1 and 16
# keep every head dims).
@pytest.mark.parametrize("index,tokens,dims", [
    pytest.param(i, tokens, dims, marks=pytest.mark.full if tokens == 3 else ())
    for i, (tokens, dims) in enumerate(itertools.product((1, 3, 16), DIMS))])
def test_decode_kernel_interpret_parity(index, tokens, dims):
    key_dim, value_dim = dims
    _check(jax.random.key(index), 2, tokens, 2, key_dim, value_dim, dtype=jnp.float32,
           strength=(1.0, 0.1)[index % 2], initial_state=index % 4 < 2, interpret=True, tol=1e-5)


def test_decode_kernel_interpret_parity_fori_loop():
    """More than 16 tokens take the fori_loop path."""
    _check(jax.random.key(7), 1, 20, 2, 128, 64, dtype=jnp.float32, strength=1.0,
           initial_state=True, interpret=True, tol=1e-5)


def test_decode_kernel_block_v():
    assert [block_v(kd, 512) for kd in (64, 128, 256, 512)] == [128, 64, 32, 16]
    assert block_v(64, 64) == 64


@pytest.mark.parametrize("bad", [(96, 64), (64, 32), (1024, 64), (128, 192)])
def test_decode_kernel_refuses_unpadded_dims(bad):
    key_dim, value_dim = bad
    q = jnp.zeros((1, 1, 1, key_dim), jnp.float32)
    v = jnp.zeros((1, 1, 1, value_dim), jnp.float32)
    with pytest.raises(ValueError, match="recurrent_forward takes"):
        recurrent_forward(q, q, v, q, None, scale=1.0, interpret=True)


@pytest.mark.parametrize("tokens,key_dim,value_dim,dtype,initial_state", [
    (1, 128, 128, jnp.bfloat16, True),
    (1, 512, 512, jnp.float16, True),
    (3, 64, 512, jnp.float32, False),
    (16, 256, 64, jnp.bfloat16, True),
    (20, 128, 128, jnp.bfloat16, True),
])
def test_decode_kernel_lowers_to_triton(tokens, key_dim, value_dim, dtype, initial_state):
    q = jax.ShapeDtypeStruct((2, tokens, 2, key_dim), dtype)
    v = jax.ShapeDtypeStruct((2, tokens, 2, value_dim), dtype)
    g = jax.ShapeDtypeStruct((2, tokens, 2, key_dim), jnp.float32)
    s0 = jax.ShapeDtypeStruct((2, 2, key_dim, value_dim), jnp.float32) if initial_state else None
    fn = functools.partial(recurrent_forward, scale=key_dim ** -0.5, interpret=False)
    with hopper_target():
        lowered = jax.jit(fn).trace(q, q, v, g, s0).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("xla.gpu.triton") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)], ids=str)
@pytest.mark.parametrize("tokens", [1, 16])
@pytest.mark.parametrize("strength", [1.0, 0.1])
def test_gpu_decode_kernel_parity(tokens, dtype, tol, strength):
    _check(jax.random.key(tokens + int(10 * strength)), 4, tokens, 4, 128, 128, dtype=dtype,
           strength=strength, initial_state=True, interpret=False, tol=tol)


def _check_states_passes(gate, segments, splits, t, interpret):
    """Context parallelism's two states-only passes on the pair-level kernels (ops/gla/
    context_parallel.py) against the closed forms they replace (B2 H2 K=64 V=128)."""
    from gla_tpu.ops.gla import context_parallel
    from gla_tpu.ops.gla.pallas_gpu import entry
    from gla_tpu.ops.gla.validation import validate_gla

    b, h, kd, vd = 2, 2, 64, 128
    keys = jax.random.split(jax.random.key(11), 6)
    q, k = (jax.random.normal(x, (b, t, h, kd)).astype(jnp.bfloat16) for x in keys[:2])
    v, do = (jax.random.normal(x, (b, t, h, vd)).astype(jnp.bfloat16) for x in keys[2:4])
    g = None if gate == "none" else jax.nn.log_sigmoid(
        jax.random.normal(keys[4], (b, t, h, kd) if gate == "key" else (b, t, h)))
    seg = (jnp.cumsum(jax.random.bernoulli(keys[5], 0.02, (b, t)), axis=1) if segments
           else None)
    problem, _, seg = validate_gla(q, k, v, g, scale=None, initial_state=None,
                                   output_final_state=False, segment_ids=seg, mode="chunk",
                                   chunk_size=None)
    options = dict(problem=problem.with_chunk_size(64), segment_ids=seg, interpret=interpret,
                   block_sizes=BlockSizes(chunk_kernel="mosaic_gpu", mosaic_time_splits=splits))
    state = entry.block_zero_state(k, v, g, **options)
    entering = entry.block_entering_cotangent(q, do, g, **options)
    want_state = context_parallel.zero_state_of_block(k, v, g, seg)[0]
    want_entering = context_parallel.entering_cotangent_of_block(q, do, g, seg, problem.scale)
    assert relative_rms_error(state, want_state) < 3e-3
    assert relative_rms_error(entering, want_entering) < 3e-3


# In GPU interpret mode outside shard_map: the Mosaic GPU interpreter does not run under it
# (docs/scale_out.md), so the sharded composition itself is tested with the closed forms
# (tests/ops/test_sharding.py) and on two GPUs below.
@pytest.mark.parametrize("gate,segments,splits", [
    ("key", True, 1), pytest.param("head", False, 2, marks=pytest.mark.full),
    pytest.param("none", True, 2, marks=pytest.mark.full)])
def test_context_parallel_states_passes_match_the_closed_forms(gate, segments, splits):
    _check_states_passes(gate, segments, splits, t=200, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("gate,segments,splits", [("key", True, None), ("head", False, 2)])
def test_gpu_context_parallel_states_passes_match_the_closed_forms(gate, segments, splits):
    _check_states_passes(gate, segments, splits, t=4096, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    GLACase(1, 4096, 4, 128, 128, gate="key", initial_state=True, segments=True),
    GLACase(2, 2048, 2, 64, 128, gate="head", initial_state=True)], ids=str)
def test_gpu_context_parallel_gla_on_two_gpus(case):
    """T over 2 GPUs on the pair-level kernels (the states-only passes and the backward's own
    rule): outputs, final state and every gradient under the pass rule."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if jax.device_count() < 2:
        pytest.skip("needs 2 GPUs (nvidia-h200-x2)")
    mesh = Mesh(np.array(jax.devices()[:2]), ("seq",))
    check_gla_parity(case, jax.random.key(9), dtype=jnp.bfloat16, backend="pallas_gpu",
                     sharding=NamedSharding(mesh, P(None, "seq")))


def test_the_backend_module_offers_the_states_passes():
    """ops.gla finds context parallelism's passes on the backend module, as the package exports
    them (without them every sharded call silently takes the closed forms)."""
    from gla_tpu.ops.common.backends import backend_module
    from gla_tpu.ops.gla.pallas_gpu import entry

    module = backend_module("gla", "pallas_gpu")
    assert module.block_zero_state is entry.block_zero_state
    assert module.block_entering_cotangent is entry.block_entering_cotangent


def test_context_parallel_states_passes_lower_to_mosaic_gpu_kernels():
    """Each pass is prep and one states-only state pass through Mosaic GPU's lowering for CUDA,
    no Triton kernel (B2 T4096 H4 K=V=128, T split in two)."""
    from gla_tpu.ops.gla.pallas_gpu import entry
    from gla_tpu.ops.gla.validation import validate_gla

    x = jax.ShapeDtypeStruct((2, 4096, 4, 128), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((2, 4096, 4, 128), jnp.float32)
    problem, _, _ = validate_gla(x, x, x, g, scale=None, initial_state=None,
                                 output_final_state=False, segment_ids=None, mode="chunk",
                                 chunk_size=None)
    options = dict(problem=problem.with_chunk_size(64), segment_ids=None, interpret=False,
                   block_sizes=BlockSizes(chunk_kernel="mosaic_gpu", mosaic_time_splits=2))
    for fn in (entry.block_zero_state, entry.block_entering_cotangent):
        text = jax.jit(functools.partial(fn, **options)).trace(x, x, g).lower(
            lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 2, fn.__name__
        assert text.count("xla.gpu.triton") == 0
