"""Entry of the "pallas_gpu" delta-rule backend: what it takes, and the call.

Mode "fused_recurrent" for T <= 16 (decoding): GLA's token-by-token kernel with beta
(gla/pallas_gpu/kernels_recurrent.py, Triton lowering), the state read once and written once; its
backward is autodiff of "xla"'s token scan.
Mode "chunk" on a Hopper GPU (or the Mosaic GPU interpreter on CPU). The forward is two Mosaic GPU
kernels: the per-chunk WY operands (kernels_mosaic_operands.py: decayed scores, the inverse,
w and u0, q_in and k_out; every exponent a range sum <= 0), then GLA's state pass with
Pass.delta, which walks the chunks once with the state in registers and writes the outputs
(vjp.py). Under differentiation the operands kernel also writes each chunk's T, and the
operands' own backward (operands.py) takes the state passes' cotangents back to the inputs: a
Mosaic GPU kernel for per-head gates and none, and for per-key gates XLA's products through T
with the scores' pullback in GLA's pair-level backward kernel. Padding: T to a
multiple of 64 (tokens of beta = 0, g = 0), K to 64 or 128 and V to a multiple of 64 (operands
kernel) or of the value tile (zero keys and values: the state's padded rows and columns stay
zero). Segment starts are gates at the floor on every key, as in "xla".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gla_tpu.ops.common import backends
from gla_tpu.ops.common.capabilities import ANY_DIM, DELTA_RULE_FEATURES, Capabilities, Dims
from gla_tpu.ops.common.padding import pad_last, pad_time
from gla_tpu.ops.common.segments import segment_index, token_starts
from gla_tpu.ops.delta_rule import xla
from gla_tpu.ops.delta_rule.pallas_gpu import kernels_mosaic_operands, operands, vjp
from gla_tpu.ops.delta_rule.validation import GATE_KINDS
from gla_tpu.ops.gla.pallas_gpu import kernels_recurrent
from gla_tpu.ops.gla.pallas_gpu.plan import MAX_RECURRENT_T

CHUNK = 64
MAX_KEY_DIM = 128  # the state tile [K, block_v] float32 in one warpgroup's registers
RECURRENT_DIMS = kernels_recurrent.DIMS  # K and V as the token-by-token kernel takes them
# The token-by-token kernel's state tile: [K, 4096 / K] float32 over 8 warps. On an H200 at the
# decode shapes (B64 HV16 K=V=128; B256 HV32 K=V=64) it was the fastest of 1024-16384 elements
# over 1-8 warps (52 and 82 us); GLA's 8192 over 4 warps took 95 and 84 us (the delta rule holds
# the state's products as well as the state).
RECURRENT_TILE_ELEMENTS, RECURRENT_WARPS = 4096, 8

CAPABILITIES = Capabilities(
    op="delta_rule", backend="pallas_gpu",
    platform="CUDA GPU (Hopper: H100/H200; CPU with interpret=True)",
    dtypes=("bfloat16", "float16"), dims=(("K", Dims(high=MAX_KEY_DIM)), ("V", ANY_DIM)),
    features=DELTA_RULE_FEATURES, modes=("chunk", "fused_recurrent"), gates=GATE_KINDS,
    chunk_sizes=(CHUNK,),
    notes="fused_recurrent (T <= 16, V <= 512): a token-by-token kernel for decoding, the "
          "state read once and written once (Triton lowering); chunk: the per-chunk WY "
          "operands in a Mosaic GPU kernel, then one Mosaic GPU state pass over the chunks "
          "(state in registers, outputs fused), forward and reversed; the backward's "
          "per-chunk cotangents and the operands' backward in Mosaic GPU kernels (per-head "
          "and no gates, K and V up to 128; per-key gates: the scores' pullback in GLA's "
          "pair-level backward kernel, the rest in XLA)",
)


def check_supported(problem, block_sizes) -> None:
    CAPABILITIES.check(problem, block_sizes)
    if problem.mode == "fused_recurrent" and (problem.seq_len > MAX_RECURRENT_T
                                              or problem.value_dim > RECURRENT_DIMS[-1]):
        raise NotImplementedError(
            f"the 'pallas_gpu' delta_rule runs mode fused_recurrent for T <= {MAX_RECURRENT_T} "
            f"and V <= {RECURRENT_DIMS[-1]} (a token-by-token kernel for decoding; mode chunk "
            f"takes longer sequences); got T={problem.seq_len}, V={problem.value_dim}. "
            "backend='xla' takes it.")
    if backends.default_platform() == "gpu" and not backends.is_hopper():
        raise NotImplementedError(
            "the 'pallas_gpu' delta_rule runs Mosaic GPU kernels, which need a Hopper GPU "
            "(compute capability 9.x). backend='xla' takes it.")


def value_tile(batch: int, value_heads: int, value_dim: int) -> int:
    """Value columns per state-pass block: 32 where the 32-column blocks take one wave (at most
    one block per SM, the passes' occupancy), else 64 (fewer waves). On an H200 with 132 SMs, at
    128 blocks of 64 the tile of 64 was the faster (Gated DeltaNet (2, 8192, 16, 32, 128, 128)
    forward 0.916 against 1.057 ms), and at 64 blocks of 64 the tile of 32 (0.596 against 0.686
    at (1, 8192, 32, 32, 128, 128)); docs/delta_rule.md."""
    return 32 if batch * value_heads * -(-value_dim // 32) <= backends.gpu_sm_count() else 64


def delta_rule(q, k, v, beta, g, *, problem, initial_state, segment_ids, block_sizes, interpret):
    """The "pallas_gpu" delta rule; see `gla_tpu.ops.delta_rule` (arguments validated, g
    floored). Returns (o [B, T, HV, V] in v's dtype, final state [B, HV, K, V] float32 or None)."""
    del block_sizes
    if not interpret and not backends.is_hopper():
        raise NotImplementedError(
            "the 'pallas_gpu' delta_rule runs on a Hopper GPU, or on CPU with interpret=True. "
            "backend='xla' takes it.")
    starts = None if segment_ids is None else token_starts(segment_index(segment_ids))
    if problem.mode == "fused_recurrent":
        return _few_tokens(q, k, v, beta, g, initial_state, starts, problem=problem,
                           interpret=bool(interpret))
    return _chunked(q, k, v, beta, g, initial_state, starts, problem=problem,
                    interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("problem", "interpret"))
def _chunked(q, k, v, beta, g, initial_state, starts, *, problem, interpret):
    t, kd, vd = q.shape[1], problem.key_dim, problem.value_dim
    inputs = (*xla.grouped_inputs(q, k, v, beta, g, starts, problem), initial_state)
    with jax.named_scope("delta_rule_pallas_gpu_chunk"):
        if kernel_operands_take(problem):
            o, final = _operands_and_passes(*inputs, problem, bool(interpret))
        else:
            o, final = _passes_on_xla_operands(*inputs, problem, bool(interpret))
    o = o[:, :t, :, :vd].astype(v.dtype)
    return o, (final[:, :, :kd, :vd] if problem.output_final_state else None)


@functools.partial(jax.jit, static_argnames=("problem", "interpret"))
def _few_tokens(q, k, v, beta, g, initial_state, starts, *, problem, interpret):
    t = q.shape[1]
    inputs = (*xla.grouped_inputs(q, k, v, beta, g, starts, problem), initial_state)
    with jax.named_scope("delta_rule_pallas_gpu_fused_recurrent"):
        o, final = _recurrence(*inputs, problem, interpret)
    return (o[:, :t, :, :problem.value_dim].astype(v.dtype),
            final[:, :, :problem.key_dim, :problem.value_dim]
            if problem.output_final_state else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _recurrence(q, k, v_, beta, gates, initial_state, problem, interpret):
    """grouped inputs (`xla.grouped_inputs`, segment starts as floor gates) -> (o [B, Tp, HV, Vp]
    in the input dtype, final state [B, HV, Kp, Vp] float32), token by token in one kernel; T
    padded to a power of two with tokens of beta = 0 (they leave the state unchanged), K and V
    to the kernel's sizes with zeros."""
    b, t, h, kd = q.shape
    hv, vd = problem.num_value_heads, problem.value_dim
    kp, vp = (next(d for d in RECURRENT_DIMS if d >= x) for x in (kd, vd))
    tp = 1 << (t - 1).bit_length()

    def padded(x, width):  # [B, T, heads, D] -> [B, Tp, heads, width], zeros after
        return pad_last(pad_time(x, tp), width)

    if gates is None:
        gates_p = jnp.zeros((b, t, hv, kp), jnp.float32)
    else:  # a per-head gate is every key's
        gates_p = jnp.broadcast_to(gates, (*gates.shape[:-1], kd)).reshape(b, t, hv, kd)
    s0 = _padded_state(initial_state, kp, vp)
    return kernels_recurrent.recurrent_forward(
        padded(q, kp), padded(k, kp), padded(v_.reshape(b, t, hv, vd), vp).astype(problem.dtype),
        padded(gates_p.astype(jnp.float32), kp), s0, scale=problem.scale, interpret=interpret,
        beta=pad_time(beta.reshape(b, t, hv), tp), group=problem.group,
        tile_elements=RECURRENT_TILE_ELEMENTS, num_warps=RECURRENT_WARPS)


def _recurrence_fwd(q, k, v_, beta, gates, initial_state, problem, interpret):
    return (_recurrence(q, k, v_, beta, gates, initial_state, problem, interpret),
            (q, k, v_, beta, gates, initial_state))


def _recurrence_bwd(problem, interpret, residuals, cotangents):
    """Autodiff of "xla"'s token scan on the same inputs, float32 throughout."""
    q, k, v_, beta, gates, initial_state = residuals
    b, t, h, kd = q.shape
    hv, vd = problem.num_value_heads, problem.value_dim
    do, dfinal = cotangents
    kp, vp = dfinal.shape[-2:]

    def scan(q, k, v_, beta, gates, initial_state):
        s0 = None if initial_state is None else initial_state.reshape(b, h, problem.group, kd, vd)
        o, final = xla.token_scan(q, k, v_, beta, gates, s0, None, problem.scale)
        o = pad_last(jnp.pad(o.reshape(b, t, hv, vd), [(0, 0), (0, do.shape[1] - t), (0, 0),
                                                       (0, 0)]), vp)
        final = jnp.pad(final.reshape(b, hv, kd, vd), [(0, 0), (0, 0), (0, kp - kd),
                                                       (0, vp - vd)])
        return o.astype(do.dtype), final

    _, pullback = jax.vjp(scan, q, k, v_, beta, gates, initial_state)
    return pullback((do, dfinal))


_recurrence.defvjp(_recurrence_fwd, _recurrence_bwd)


def kernel_operands_take(problem) -> bool:
    """Whether the WY operands kernel takes the problem (its padded V at most 256)."""
    return operands.value_width(problem.value_dim) <= kernels_mosaic_operands.MAX_VALUE_DIM


def _operands_and_passes(q, k, v_, beta, gates, initial_state, problem, interpret):
    """grouped inputs (`xla.grouped_inputs`) -> (o [B, Tp, HV, V] in the input dtype, final
    state [B, HV, Kp, V] float32), the WY operands from the Mosaic GPU kernel, differentiated by
    their own backward (operands.py)."""
    wy = operands.wy_operands(q, k, v_, beta, gates, problem=problem, interpret=interpret)
    return _passes_on_kernel_operands(wy, initial_state, problem, interpret, q.shape[0])


def _passes_on_kernel_operands(wy, initial_state, problem, interpret, batch):
    """The state passes on the kernel's operands (scores, q_in, k_out, w_neg, u0, last)."""
    vd = problem.value_dim
    scores, q_in, k_out, w_neg, u0, last = wy
    s0 = _padded_state(initial_state, operands.key_width(problem.key_dim),
                       operands.value_width(vd))
    o, final = vjp.state_passes(k_out, u0, last, s0, q_in, scores, w_neg,
                                jnp.dtype(problem.dtype), _passes(batch, problem), interpret)
    return o[..., :vd], final[..., :vd]


def _passes(batch, problem):
    """The state passes of one call: the value tile by `value_tile`, fitted to shared memory
    (`vjp.Passes.fitted`); the per-chunk cotangents kernel unless the gates are per key; the
    reversed pass's state term only with gates."""
    passes = vjp.Passes(block_v=value_tile(batch, problem.num_value_heads, problem.value_dim),
                        cotangents_kernel=problem.gate_kind != "key",
                        state_term=problem.gate_kind != "none")
    return passes.fitted(operands.key_width(problem.key_dim), jnp.dtype(problem.dtype))


def _padded_state(initial_state, kp: int, vp: int):
    """[B, HV, K, V] -> [B, HV, kp, vp] float32 (zeros after), or None."""
    if initial_state is None:
        return None
    kd, vd = initial_state.shape[-2:]
    return jnp.pad(initial_state.astype(jnp.float32),
                   [(0, 0), (0, 0), (0, kp - kd), (0, vp - vd)])


def _passes_on_xla_operands(q, k, v_, beta, gates, initial_state, problem, interpret):
    """As `_operands_and_passes`, the WY operands from XLA (differentiable)."""
    operands, passes = kernel_operands(q, k, v_, beta, gates, initial_state, problem=problem)
    o, final = vjp.state_passes(*operands, passes, interpret)
    vd = problem.value_dim
    return o[..., :vd], final[..., :vd]


def kernel_operands(q, k, v_, beta, gates, initial_state, *, problem):
    """The state passes' operands (vjp.state_passes: k_out, u0, last, s0, q_in, scores, w_neg)
    from XLA, padded, and their vjp.Passes, for grouped inputs (`xla.grouped_inputs`)."""
    b, _, h, kd = q.shape
    grp, vd, hv = problem.group, problem.value_dim, problem.num_value_heads
    dtype = jnp.dtype(problem.dtype)
    f32 = jnp.float32
    q, k, v_, beta = (pad_time(x, CHUNK) for x in (q, k, v_, beta))
    gates = None if gates is None else pad_time(gates, CHUNK)
    tp = q.shape[1]
    n = tp // CHUNK
    ops = xla.chunk_operands(q, k, v_, beta, gates, CHUNK, dtype)
    kp = operands.key_width(kd)
    passes = _passes(b, problem)
    vp = -(-vd // passes.block_v) * passes.block_v  # every pass's tile divides it

    def tokens(x, width):  # [B, H, G|1, N, C, D] -> [B, Tp, HV, width] float32
        x = jnp.broadcast_to(x, (b, h, grp, n, CHUNK, x.shape[-1]))
        return pad_last(x.transpose(0, 3, 4, 1, 2, 5).reshape(b, tp, hv, x.shape[-1]), width)

    scale = problem.scale
    q_in, k_out, w_neg = (tokens(x, kp) for x in (ops.q_in * scale, ops.k_out, -ops.w))
    scores, u0 = tokens(ops.scores * scale, CHUNK), tokens(ops.u0, vp)
    if ops.last is None:
        last = jnp.zeros((b, n, hv, kp), f32)
    else:  # [B, H, G, N, Kg] -> [B, N, HV, Kp]
        last = jnp.broadcast_to(ops.last, (b, h, grp, n, kd)).transpose(0, 3, 1, 2, 4)
        last = pad_last(last.reshape(b, n, hv, kd), kp)
    s0 = _padded_state(initial_state, kp, vp)
    return (k_out, u0, last, s0, q_in, scores, w_neg, dtype), passes
