"""The chunk-serial part of the delta rule on Mosaic GPU, as a jax.custom_vjp.

Forward: GLA's state pass with Pass.delta (kernels_mosaic_state.py) walks the chunks with the
state in registers: u = u0 - w S, o = q_in S + M u, S <- exp(b_last) S + k_out^T u; under
differentiation it also stores u and each chunk's entering state (two 16-bit parts).
Backward: the reversed pass gives du = M^T do + k_out dS' and dS <- exp(b_last) dS' + q_in^T do
- w^T du per chunk (dS' stored per chunk, two 16-bit parts), the state term of d b_last and
d initial_state; the rest is per chunk in parallel (the cotangents of the state pass's inputs,
docs/delta_rule_math.md "Backward"; the products in kernels_mosaic_cotangents.py where it takes
the problem and `Passes.cotangents_kernel` asks for it, else in XLA):

    d q_in = do S^T,   d k_out = u dS'^T,   d w = -du S^T,   d u0 = du,   d M = do u^T,
    d b_last = exp(b_last) sum_V S dS'

Every array is token-major [B, Tp, HV, .] (per chunk: [B, N, HV, .]); M, q_in carry the scale.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from gla_tpu.ops.delta_rule.pallas_gpu import kernels_mosaic_cotangents
from gla_tpu.ops.gla.pallas_gpu.kernels_mosaic_state import BLOCK_VS, Pass, fits, state_pass

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Passes:
    """The three state passes of one call (static)."""

    block_v: int = 64
    out_parts: int = 2  # 16-bit parts of S in u = u0 - w S and q_in S (2: float32-accurate)
    # the per-chunk cotangents in a Mosaic GPU kernel where it takes K and V (else XLA). Per-key
    # gates keep XLA's: on an H200 the kernel made KDA's forward+backward slower (46.9 -> 52.8 ms
    # at (2, 8192, 32, 32, 128, 128)) while Gated DeltaNet's went 7.91 -> 6.75 ms, when KDA's
    # operands were differentiated by autodiff of XLA's; not re-measured since they have their
    # own backward (operands.key_gate_backward).
    cotangents_kernel: bool = True
    # the reversed pass's value tile where it differs from block_v (`fitted`)
    reversed_block_v: int | None = None
    # the reversed pass's state term (sum_V S dS' per chunk, the cotangent of b_last); without
    # gates nothing takes it, and the pass then neither computes it nor reads S
    state_term: bool = True
    # 16-bit parts of the forward's S the state term reads: 2 (hi and lo), or 1 (hi, with the
    # first chunk's state exact, as GLA's default), which `fitted` takes where two parts would
    # halve the reversed pass's value tile
    term_parts: int = 2

    def fitted(self, key_dim: int, dtype) -> Passes:
        """These passes as they fit a Hopper block's shared memory at key width key_dim: the
        reversed pass's state term from one part of S where two do not fit its tile (at K = 128
        and a tile of 64: 244 KiB with two parts, 212 KiB with one), else a tile of 32 for each
        pass whose tile does not fit."""
        small = min(BLOCK_VS)
        passes = self
        if not fits(passes.forward(training=True), key_dim, dtype):
            passes = dataclasses.replace(passes, block_v=small)
        if not fits(passes.reversed(), key_dim, dtype):
            one_part = dataclasses.replace(passes, term_parts=1)
            if passes.state_term and fits(one_part.reversed(), key_dim, dtype):
                passes = one_part
            else:
                passes = dataclasses.replace(passes, reversed_block_v=small)
        return passes

    def forward(self, training: bool) -> Pass:
        return Pass(reverse=False, outputs=True, store_parts=2 if training else 0,
                    state_term=False, delta=True, block_v=self.block_v,
                    out_parts=self.out_parts)

    def reversed(self) -> Pass:
        return Pass(reverse=True, outputs=True, store_parts=2, state_term=self.state_term,
                    delta=True, block_v=self.reversed_block_v or self.block_v, out_parts=1,
                    term_parts=self.term_parts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def state_passes(k_out, u0, last, s0, q_in, scores, w_neg, dtype, passes: Passes, interpret):
    """k_out, q_in, w_neg (= -w) [B, Tp, HV, K], u0 [B, Tp, HV, V], scores [B, Tp, HV, C] (the
    rows of each chunk's M), float32, which the kernels read rounded to the 16-bit `dtype` (their
    cotangents stay float32); last [B, N, HV, K] float32 (b_last); s0 [B, HV, K, V] float32 or
    None -> (o [B, Tp, HV, V] in `dtype`, final state [B, HV, K, V] float32)."""
    k_out, u0, q_in, scores, w_neg = (x.astype(dtype) for x in (k_out, u0, q_in, scores, w_neg))
    o, _, final = state_pass(k_out, u0, last, s0, w=q_in, a=scores, w_neg=w_neg,
                             p=passes.forward(training=False), interpret=interpret)
    return o, final


def _fwd(k_out, u0, last, s0, q_in, scores, w_neg, dtype, passes, interpret):
    primals = custom_vjp_primal_tree_values((k_out, u0, last, s0, q_in, scores, w_neg))
    return training_forward(*primals, dtype, passes, interpret)


def training_forward(k_out, u0, last, s0, q_in, scores, w_neg, dtype, passes, interpret):
    """The forward state pass that also stores u and each chunk's entering state: ((o, final),
    the residuals of the backward)."""
    k_out, u0, q_in, scores, w_neg = (x.astype(dtype) for x in (k_out, u0, q_in, scores, w_neg))
    o, u, hi, lo, final = state_pass(k_out, u0, last, s0, w=q_in, a=scores, w_neg=w_neg,
                                     p=passes.forward(training=True), interpret=interpret)
    return (o, final), (k_out, last, s0, q_in, scores, w_neg, u, hi, lo)


def _bwd(dtype, passes, interpret, residuals, cotangents):
    """The cotangents of `state_passes`' inputs (float32) from the training forward's residuals
    and the cotangents of o and of the final state."""
    do, dfinal = cotangents
    k_out, last, s0, q_in, scores, w_neg, u, hi, lo = residuals
    do = jnp.zeros(u.shape, dtype) if isinstance(do, SymbolicZero) else do.astype(dtype)
    dfinal = None if isinstance(dfinal, SymbolicZero) else dfinal.astype(F32)
    du, dh_hi, dh_lo, term, ds0 = reversed_pass(residuals, do, dfinal, passes, interpret)
    d_k_out, du, d_last, d_q_in, d_scores, d_w_neg = chunk_cotangents(
        do, u, du, (hi, lo), (dh_hi, dh_lo), last, term, interpret=interpret,
        kernel=passes.cotangents_kernel)
    return d_k_out, du, d_last, None if s0 is None else ds0, d_q_in, d_scores, d_w_neg


def reversed_pass(residuals, do, dfinal, passes: Passes, interpret):
    """The reversed state pass: (du [B, Tp, HV, V], dS' per chunk as two 16-bit parts
    [B, N, HV, K, V], the state term of d b_last (None without `passes.state_term`),
    d initial_state) for the output cotangent do (in the input dtype) and that of the final state
    (float32 or None)."""
    k_out, last, s0, q_in, scores, w_neg, _, hi, lo = residuals
    p = passes.reversed()
    outs = state_pass(q_in, do, last, dfinal, w=k_out, a=scores, w_neg=w_neg,
                      h_parts=(hi, lo)[:p.term_parts], h_first=s0, p=p, interpret=interpret)
    if not p.state_term:
        du, dh_hi, dh_lo, ds0 = outs
        return du, dh_hi, dh_lo, None, ds0
    return outs


def chunk_cotangents(do, u, du, h_parts, dh_parts, last, term, *, interpret, kernel=True):
    """Per chunk, in parallel: the cotangents of the state pass's inputs (d k_out, d u0,
    d b_last, d q_in, d scores, d w_neg) from do, u, du [B, Tp, HV, V] and the states entering
    (h_parts) and the cotangents leaving (dh_parts) each chunk: with `kernel`, a Mosaic GPU kernel
    (kernels_mosaic_cotangents.py) where it takes K and V, else XLA. XLA's are float32; the
    kernel's d u0 (du itself) and d w_neg are in the 16-bit dtype, as the operands' backward
    (operands.py), the kernel's only consumer, takes them (products' 16-bit operands), and the
    rest float32. term None (no gates: b_last is constant): d b_last is zero."""
    d_last = (jnp.zeros(last.shape, F32) if term is None
              else jnp.exp(last) * jnp.sum(term, axis=3))  # [B, N, HV, K]
    if kernel and kernels_mosaic_cotangents.takes(h_parts[0].shape[3], u.shape[3]):
        d_q_in, d_k_out, d_w_neg, d_scores = kernels_mosaic_cotangents.chunk_cotangents(
            do, u, du, h_parts, dh_parts, interpret=interpret)
        return d_k_out, du, d_last, d_q_in, d_scores, d_w_neg
    b, tp, hv, _ = u.shape
    n = last.shape[1]
    c = tp // n

    def chunks(x):  # [B, Tp, HV, D] -> [B, N, C, HV, D]
        return x.reshape(b, n, c, hv, x.shape[-1])

    def tokens(x):  # [B, N, C, HV, D] -> [B, Tp, HV, D]
        return x.reshape(b, tp, hv, x.shape[-1])

    def times_state_t(x, parts):
        """Per chunk x [C, V] @ S^T, S [K, V] given as 16-bit parts (hi + lo: float32-accurate),
        [B, N, HV, K, V] each; 16-bit products, float32 sums."""
        return tokens(sum(jnp.einsum("bnchv,bnhkv->bnchk", chunks(x), part,
                                     preferred_element_type=F32) for part in parts))

    d_q_in = times_state_t(do, h_parts)  # the state entering each chunk
    d_k_out = times_state_t(u, dh_parts)  # the cotangent of the state leaving it
    d_w_neg = times_state_t(du, h_parts)
    d_scores = tokens(jnp.einsum("bnihv,bnjhv->bnihj", chunks(do), chunks(u),
                                 preferred_element_type=F32))
    return d_k_out, du.astype(F32), d_last, d_q_in, d_scores, d_w_neg


state_passes.defvjp(_fwd, _bwd, symbolic_zeros=True)
